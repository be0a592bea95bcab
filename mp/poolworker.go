package mp

import (
	"bytes"
	"context"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// The calls a task's Call field names besides a Pool call's number, which
// is larger.
const (
	stopCall = 0 // the worker returns
	initCall = 1 // the pool's initializer: its error ends the worker
)

// task is a chunk of a call, from the pool to one worker. Its first three
// fields are read before the function's types are known (see peekTask).
type task[A any] struct {
	//lint:ignore U1000 msgpack reads its tag: encoded as an array
	_msgpack struct{} `msgpack:",as_array"`
	Call     uint64
	Start    int // the chunk's first item's index in the call
	Fn       string
	Items    []A
}

// reply is a worker's answer to a task, or, with Call 0, the pool's own
// note that worker Rank's process Gen has exited. Its first four fields
// are read before the result type is known (see peekReply).
type reply[R any] struct {
	//lint:ignore U1000 msgpack reads its tag: encoded as an array
	_msgpack struct{} `msgpack:",as_array"`
	Call     uint64
	Start    int
	Rank     int
	Gen      int
	Failed   bool
	At       int // with Failed, the failing item's index
	Err      string
	Items    []R
}

// peekTask reads a task's call, start and function name.
func peekTask(data []byte) (call uint64, start int, fn string, err error) {
	dec := msgpack.NewDecoder(bytes.NewReader(data))
	if n, err := dec.DecodeArrayLen(); err != nil || n < 4 {
		return 0, 0, "", fmt.Errorf("%w: not a pool task", ErrMalformed)
	}
	if call, err = dec.DecodeUint64(); err == nil {
		if start, err = dec.DecodeInt(); err == nil {
			fn, err = dec.DecodeString()
		}
	}
	if err != nil {
		return 0, 0, "", fmt.Errorf("%w: a pool task's header: %v", ErrMalformed, err)
	}
	return call, start, fn, nil
}

// peekReply reads a reply's call, start, rank and generation.
func peekReply(data []byte) (call uint64, start, rank, gen int, err error) {
	dec := msgpack.NewDecoder(bytes.NewReader(data))
	if n, err := dec.DecodeArrayLen(); err != nil || n < 8 {
		return 0, 0, 0, 0, fmt.Errorf("%w: not a pool reply", ErrMalformed)
	}
	if call, err = dec.DecodeUint64(); err == nil {
		if start, err = dec.DecodeInt(); err == nil {
			if rank, err = dec.DecodeInt(); err == nil {
				gen, err = dec.DecodeInt()
			}
		}
	}
	if err != nil {
		return 0, 0, 0, 0, fmt.Errorf("%w: a pool reply's header: %v", ErrMalformed, err)
	}
	return call, start, rank, gen, nil
}

// poolWorkerName is the name pool workers are registered under.
const poolWorkerName = "tensormp.pool"

func init() { Register(poolWorkerName, poolWorker) }

// poolArgs is what a pool worker is spawned with.
type poolArgs struct {
	Rank, Gen int
	Tasks     *Queue // this process's own
	Results   *Queue // every worker's, read by the pool
}

// poolWorker is a pool worker process's main: it runs the tasks on its
// queue until told to stop, replying to each.
func poolWorker(ctx context.Context, w *Worker) error {
	var a poolArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	defer a.Tasks.Close()
	defer a.Results.Close()
	for {
		m, err := a.Tasks.take(ctx, true)
		if err != nil {
			if ctx.Err() != nil {
				return nil // the pool was terminated
			}
			return fmt.Errorf("taking a task: %w", err)
		}
		call, start, name, err := peekTask(m.Data)
		if err != nil {
			m.Done() // closes what the task held
			w.Logger().Error("dropping a task", "error", err)
			continue
		}
		if call == stopCall {
			m.Done()
			return nil
		}
		var rep any
		if f, ok := poolFuncs.Load(name); ok {
			rep, err = f.(*poolFunc).run(ctx, a.Rank, a.Gen, m)
		} else {
			err = fmt.Errorf("no function is registered as %q in the worker (RegisterFunc before Init)", name)
			rep = &reply[struct{}]{Call: call, Start: start, Rank: a.Rank, Gen: a.Gen, Failed: true, At: start, Err: err.Error()}
		}
		m.Done()
		if call == initCall {
			if err != nil {
				return fmt.Errorf("the pool's initializer %q: %w", name, err)
			}
			continue
		}
		if err := a.Results.Put(ctx, rep); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("replying to call %d: %w", call, err)
		}
	}
}

package mp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"iter"
	"slices"
	"sync"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/fd"
)

// Func is a function registered with RegisterFunc that a Pool's workers
// can run: it takes an A and returns an R, either of which may hold
// tensors, queues and pipes.
type Func[A, R any] struct {
	name string
}

// Name returns the name f was registered under.
func (f *Func[A, R]) Name() string { return f.name }

// poolFunc is a registered function as a pool worker runs it: run decodes
// a task message of its argument type, calls the function on each item
// and returns the reply to send, from the worker of rank and gen, and the
// failing item's error if one failed.
type poolFunc struct {
	run func(ctx context.Context, rank, gen int, data []byte, fds []int) (any, error)
}

var poolFuncs sync.Map // name -> *poolFunc

// RegisterFunc makes fn available to Pool workers under name and returns
// the handle that Map, Imap, ImapUnordered and Apply take. Like Register,
// call it in every process of the program before Init (a package-level
// variable is the natural place); registering a name twice panics.
//
// fn runs in a worker process, under the worker's context, once per item;
// a panic in it is the item's error, and the worker goes on.
func RegisterFunc[A, R any](name string, fn func(ctx context.Context, arg A) (R, error)) *Func[A, R] {
	pf := &poolFunc{run: func(ctx context.Context, rank, gen int, data []byte, fds []int) (any, error) {
		var t task[A]
		if err := decode(data, fds, &t); err != nil {
			return &reply[R]{Call: t.Call, Start: t.Start, Rank: rank, Gen: gen, Failed: true, At: t.Start, Err: err.Error()}, err
		}
		out := &reply[R]{Call: t.Call, Start: t.Start, Rank: rank, Gen: gen, Items: make([]R, 0, len(t.Items))}
		for i, a := range t.Items {
			r, err := recovered(func() (R, error) { return fn(ctx, a) })
			if err != nil {
				out.Failed, out.At, out.Err, out.Items = true, t.Start+i, err.Error(), nil
				return out, err
			}
			out.Items = append(out.Items, r)
		}
		return out, nil
	}}
	if _, dup := poolFuncs.LoadOrStore(name, pf); dup {
		panic(fmt.Sprintf("mp: RegisterFunc: %q registered twice", name))
	}
	return &Func[A, R]{name: name}
}

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

// ItemError is the failure of an item of a Pool call: the function
// returned an error or panicked on it, or the worker holding it died.
type ItemError struct {
	Index int // the item's index in the call's input
	Rank  int // the pool worker's rank
	// Err is the function's error, as its text, or, for a worker that
	// died, the worker's *ExitError or *WorkerError.
	Err error
}

func (e *ItemError) Error() string {
	return fmt.Sprintf("mp: pool item %d (worker %d): %v", e.Index, e.Rank, e.Err)
}

func (e *ItemError) Unwrap() error { return e.Err }

// PoolOption configures NewPool.
type PoolOption func(*poolOptions)

type poolOptions struct {
	spawn    []Option
	initName string
	initArg  any
	maxTasks int
}

// WithSpawnOptions passes opts to the Spawn that starts each worker:
// WithEnv, WithOutput, WithGrace, and WithPlace, which is given the pool
// rank. WithArgs and WithRankArgs are the pool's own and are ignored.
func WithSpawnOptions(opts ...Option) PoolOption {
	return func(o *poolOptions) { o.spawn = append(o.spawn, opts...) }
}

// WithInitializer has every worker, the ones that replace dead workers
// too, run f(arg) before its first task (torch's initializer and
// initargs). An error ends that worker; a pool whose new workers fail
// three times running, before finishing any task, is broken.
func WithInitializer[A, R any](f *Func[A, R], arg A) PoolOption {
	return func(o *poolOptions) { o.initName, o.initArg = f.name, arg }
}

// WithMaxTasks replaces each worker by a new process after it has run n
// chunks (torch's maxtasksperchild). The default, 0, keeps workers for
// the pool's life.
func WithMaxTasks(n int) PoolOption { return func(o *poolOptions) { o.maxTasks = n } }

// CallOption configures a Map, Imap, ImapUnordered or Apply call.
type CallOption func(*callOptions)

type callOptions struct{ chunk int }

// ChunkSize sends items to workers n at a time (torch's chunksize): fewer,
// larger messages for many small items. Map's default spreads the items
// over about four chunks per worker; Imap's and ImapUnordered's is 1.
func ChunkSize(n int) CallOption { return func(o *callOptions) { o.chunk = n } }

// ErrPoolBroken wraps the error that made a Pool give up: its new workers
// kept failing before finishing any task.
var ErrPoolBroken = errors.New("mp: pool broken")

const (
	poolWorkerName = "tensormp.pool"
	perWorker      = 2 // chunks a worker holds at once: one running, one waiting
	maxStartFails  = 3
)

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
		data, fds, done, err := a.Tasks.take(ctx, true)
		if err != nil {
			if ctx.Err() != nil {
				return nil // the pool was terminated
			}
			return fmt.Errorf("taking a task: %w", err)
		}
		call, start, name, err := peekTask(data)
		if err != nil {
			fd.CloseAll(fds)
			done()
			w.Logger().Error("dropping a task", "error", err)
			continue
		}
		if call == stopCall {
			fd.CloseAll(fds)
			done()
			return nil
		}
		var rep any
		if f, ok := poolFuncs.Load(name); ok {
			rep, err = f.(*poolFunc).run(ctx, a.Rank, a.Gen, data, fds)
		} else {
			fd.CloseAll(fds)
			err = fmt.Errorf("no function is registered as %q in the worker (RegisterFunc before Init)", name)
			rep = &reply[struct{}]{Call: call, Start: start, Rank: a.Rank, Gen: a.Gen, Failed: true, At: start, Err: err.Error()}
		}
		done()
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

// Pool is a set of persistent worker processes that run registered
// functions over items (torch.multiprocessing.Pool). Its calls — Map,
// Imap, ImapUnordered, Apply — may run at once from many goroutines; each
// item's argument and result travel as Queue values do, tensors without
// copying.
//
// A worker that dies (killed, or a native crash) fails the items it was
// running with an *ItemError wrapping its *ExitError, gives back the
// chunks it had not begun to other workers, and is replaced by a new
// process. The Pool owns its workers and queues; Close or Terminate
// releases them.
type Pool struct {
	n       int
	opts    poolOptions
	results *Queue // every worker replies here; so do the exit notes
	ctx     context.Context
	cancel  context.CancelFunc
	procs   sync.WaitGroup // watchers of worker processes, and starters
	loop    sync.WaitGroup // the reply loop

	released sync.Once

	mu       sync.Mutex
	idle     *sync.Cond // signalled when a call ends
	workers  []*poolSlot
	pending  []*chunk // not yet given to a worker, oldest first
	calls    map[uint64]*poolCall
	next     uint64
	closing  bool  // no new calls
	stopping bool  // workers are told to stop, and not replaced
	broken   error // ErrPoolBroken, or ErrClosed once terminated
	fails    int   // new workers that failed before finishing a task, in a row

	stopAfter func() bool // unhooks terminating when ctx ends
}

// poolSlot is one of the pool's ranks and the process serving it now.
type poolSlot struct {
	rank, gen int
	g         *Group   // nil while a replacement starts
	tasks     *Queue   // the process's task queue, with g
	held      []*chunk // given to this process, not yet answered
	sent      int      // chunks given to this process
	retiring  bool     // sent its stop: takes nothing more
	worked    bool     // answered a task
}

// chunk is items [start, start+n) of a call.
type chunk struct {
	call     *poolCall
	start, n int
	put      func(ctx context.Context, q *Queue) error
	done     bool // answered or failed: under the pool's mu
}

// poolCall is one Map, Imap, ImapUnordered or Apply in progress.
type poolCall struct {
	id uint64
	// deliver decodes a reply to one of the call's chunks and hands it
	// to the caller; fail hands the caller a chunk's error. Neither
	// blocks: the caller's channel has room for every chunk in flight.
	deliver func(c *chunk, data []byte, fds []int)
	fail    func(c *chunk, err error)
	ended   bool // the caller has gone: replies are dropped
}

// work is a message for one worker process: a chunk, or its stop.
type work struct {
	s     *poolSlot
	tasks *Queue
	c     *chunk // nil: stop
}

// NewPool starts n worker processes (torch's Pool(processes=n)), without
// waiting for them to be ready. Cancelling ctx terminates the pool.
func NewPool(ctx context.Context, n int, opts ...PoolOption) (*Pool, error) {
	checkInit("mp.NewPool")
	if n < 1 {
		return nil, fmt.Errorf("mp: a pool of %d workers", n)
	}
	p := &Pool{n: n, calls: make(map[uint64]*poolCall), next: initCall + 1}
	for _, opt := range opts {
		opt(&p.opts)
	}
	p.idle = sync.NewCond(&p.mu)
	var err error
	if p.results, err = NewQueue(); err != nil {
		return nil, fmt.Errorf("mp: new pool: %w", err)
	}
	p.ctx, p.cancel = context.WithCancel(ctx)
	p.workers = make([]*poolSlot, n)
	for rank := range n {
		p.workers[rank] = &poolSlot{rank: rank, gen: -1}
	}
	p.loop.Add(1)
	go p.replies()
	for rank := range n {
		if err := p.start(rank); err != nil {
			_ = p.Terminate()
			return nil, fmt.Errorf("mp: new pool: starting worker %d: %w", rank, err)
		}
	}
	stop := context.AfterFunc(p.ctx, func() { _ = p.terminate(fmt.Errorf("%w: %w", ErrClosed, context.Cause(p.ctx))) })
	p.mu.Lock()
	p.stopAfter = stop
	p.mu.Unlock()
	return p, nil
}

// Size returns the number of workers.
func (p *Pool) Size() int { return p.n }

// start starts a new process for rank and watches it. Its initializer's
// task goes first on its task queue.
func (p *Pool) start(rank int) error {
	tasks, err := NewQueue()
	if err != nil {
		return err
	}
	if p.opts.initName != "" {
		if err := tasks.Put(p.ctx, &task[any]{Call: initCall, Fn: p.opts.initName, Items: []any{p.opts.initArg}}); err != nil {
			_ = tasks.Close()
			return fmt.Errorf("sending the initializer's argument: %w", err)
		}
	}
	p.mu.Lock()
	s := p.workers[rank]
	s.gen++
	gen := s.gen
	p.mu.Unlock()
	opts := append(slices.Clone(p.opts.spawn), func(o *options) {
		o.args, o.rankArgs = poolArgs{Rank: rank, Gen: gen, Tasks: tasks, Results: p.results}, nil
		if f := o.place; f != nil {
			o.place = func(int) device.Place { return f(rank) }
		}
	})
	g, err := Spawn(p.ctx, poolWorkerName, 1, opts...)
	if err != nil {
		_ = tasks.Close()
		return err
	}
	p.mu.Lock()
	s.g, s.tasks, s.held, s.sent, s.retiring, s.worked = g, tasks, nil, 0, false, false
	var ws []work
	if p.stopping {
		s.retiring = true
		ws = append(ws, work{s: s, tasks: tasks})
	} else {
		ws = p.assignLocked()
	}
	p.mu.Unlock()
	p.procs.Add(1)
	go func() {
		defer p.procs.Done()
		<-g.Done()
		// Behind everything the process sent: the reply loop takes its
		// exit after its last reply.
		_ = p.results.Put(context.Background(), &reply[struct{}]{Call: stopCall, Rank: rank, Gen: gen})
	}()
	p.send(ws)
	return nil
}

// assignLocked gives pending chunks, oldest first, to the least busy
// processes with room, and returns the messages to send.
func (p *Pool) assignLocked() []work {
	var ws []work
	for len(p.pending) > 0 && p.broken == nil {
		var best *poolSlot
		for _, s := range p.workers {
			if s.g != nil && !s.retiring && len(s.held) < perWorker && (best == nil || len(s.held) < len(best.held)) {
				best = s
			}
		}
		if best == nil {
			break
		}
		c := p.pending[0]
		p.pending = p.pending[1:]
		best.held = append(best.held, c)
		best.sent++
		ws = append(ws, work{s: best, tasks: best.tasks, c: c})
		if p.opts.maxTasks > 0 && best.sent >= p.opts.maxTasks {
			best.retiring = true
			ws = append(ws, work{s: best, tasks: best.tasks})
		}
	}
	return ws
}

// send sends what assignLocked decided, in order. A chunk that cannot be
// sent fails.
func (p *Pool) send(ws []work) {
	for _, w := range ws {
		if w.c == nil {
			_ = w.tasks.Put(p.ctx, &task[struct{}]{Call: stopCall})
			continue
		}
		if err := w.c.put(p.ctx, w.tasks); err != nil {
			p.mu.Lock()
			p.failLocked(w.c, w.s, &ItemError{Index: w.c.start, Rank: w.s.rank, Err: fmt.Errorf("sending the item: %w", err)})
			more := p.assignLocked()
			p.mu.Unlock()
			p.send(more)
		}
	}
}

// failLocked ends c with err, unless it has ended.
func (p *Pool) failLocked(c *chunk, s *poolSlot, err error) {
	if c.done {
		return
	}
	c.done = true
	if s != nil {
		s.held = slices.DeleteFunc(s.held, func(h *chunk) bool { return h == c })
	}
	c.call.fail(c, err)
}

// replies is the pool's reply loop: it hands each reply to its call and
// each worker's exit to exited, in the order they were sent, until the
// results queue is closed.
func (p *Pool) replies() {
	defer p.loop.Done()
	for {
		data, fds, done, err := p.results.take(context.Background(), true)
		if err != nil {
			if !errors.Is(err, ErrClosed) {
				Logger().Error("pool: receiving a reply", "error", err)
			}
			return
		}
		call, start, rank, gen, err := peekReply(data)
		if err != nil || call == stopCall || rank < 0 || rank >= p.n {
			fd.CloseAll(fds)
			done()
			if err != nil {
				Logger().Error("pool: dropping a reply", "error", err)
			} else if call == stopCall && rank >= 0 && rank < p.n {
				p.exited(rank, gen)
			}
			continue
		}
		p.mu.Lock()
		s := p.workers[rank]
		var c *chunk
		if s.gen == gen {
			i := slices.IndexFunc(s.held, func(h *chunk) bool { return h.call.id == call && h.start == start })
			if i >= 0 {
				c = s.held[i]
				s.held = slices.Delete(s.held, i, i+1)
				c.done, s.worked, p.fails = true, true, 0
			}
		}
		deliver := c != nil && !c.call.ended
		ws := p.assignLocked()
		p.mu.Unlock()
		if deliver {
			c.call.deliver(c, data, fds)
		} else {
			fd.CloseAll(fds) // what the reply held goes back
		}
		done()
		p.send(ws)
	}
}

// exited handles the exit of rank's process gen: the chunks it never took
// go back to the pending, the ones it held fail, and a new process takes
// its place unless the pool is stopping.
func (p *Pool) exited(rank, gen int) {
	p.mu.Lock()
	s := p.workers[rank]
	if s.gen != gen || s.g == nil {
		p.mu.Unlock()
		return
	}
	g, tasks, held, worked := s.g, s.tasks, s.held, s.worked
	s.g, s.tasks, s.held = nil, nil, nil
	p.mu.Unlock()

	// What is still in its queue it never took.
	type key struct {
		call  uint64
		start int
	}
	untaken := map[key]bool{}
	for {
		data, fds, done, err := tasks.take(context.Background(), false)
		if err != nil {
			break
		}
		call, start, _, err := peekTask(data)
		fd.CloseAll(fds)
		done()
		if err == nil {
			untaken[key{call, start}] = true
		}
	}
	_ = tasks.Close()

	cause := g.Err()
	var ee *ExitError
	var we *WorkerError
	switch {
	case errors.As(cause, &ee):
		e := *ee
		e.Rank = rank
		cause = &e
	case errors.As(cause, &we):
		e := *we
		e.Rank = rank
		cause = &e
	case cause == nil:
		cause = errors.New("the worker exited")
	}

	p.mu.Lock()
	var back []*chunk
	for _, c := range held {
		if c.done {
			continue
		}
		if untaken[key{c.call.id, c.start}] {
			back = append(back, c)
			continue
		}
		p.failLocked(c, nil, &ItemError{Index: c.start, Rank: rank, Err: cause})
	}
	p.pending = append(back, p.pending...)
	failed := g.Err() != nil && !worked
	if failed {
		p.fails++
	}
	if p.fails >= maxStartFails && p.broken == nil {
		p.breakLocked(fmt.Errorf("%w: %d new workers in a row failed before finishing a task; the last: %w", ErrPoolBroken, p.fails, cause))
	}
	replace := !p.stopping && p.broken == nil
	if replace {
		p.procs.Add(1)
	}
	p.mu.Unlock()
	if replace {
		go func() {
			defer p.procs.Done()
			if err := p.start(rank); err != nil {
				p.mu.Lock()
				if p.broken == nil {
					p.breakLocked(fmt.Errorf("%w: replacing worker %d: %w", ErrPoolBroken, rank, err))
				}
				p.mu.Unlock()
			}
		}()
	}
}

// breakLocked makes err the pool's failure: every chunk not yet answered
// fails with it, and so does every new call.
func (p *Pool) breakLocked(err error) {
	p.broken = err
	for _, c := range p.pending {
		p.failLocked(c, nil, err)
	}
	p.pending = nil
	for _, s := range p.workers {
		for _, c := range slices.Clone(s.held) {
			p.failLocked(c, s, err)
		}
	}
}

// Close waits for the calls in progress to end, then stops the workers
// once they have finished, and releases the pool (torch's close then
// join). New calls fail with ErrClosed.
func (p *Pool) Close() error {
	p.mu.Lock()
	p.closing = true
	for len(p.calls) > 0 {
		p.idle.Wait()
	}
	if p.stopping {
		p.mu.Unlock()
		p.procs.Wait()
		return nil
	}
	p.stopping = true
	var ws []work
	for _, s := range p.workers {
		if s.g != nil && !s.retiring {
			s.retiring = true
			ws = append(ws, work{s: s, tasks: s.tasks})
		}
	}
	p.mu.Unlock()
	p.send(ws)
	p.release()
	return nil
}

// Terminate stops the workers now (torch's terminate): calls in progress
// fail with ErrClosed; workers get SIGTERM, and die of it after the grace
// period.
func (p *Pool) Terminate() error { return p.terminate(ErrClosed) }

func (p *Pool) terminate(err error) error {
	p.mu.Lock()
	if p.stopping && p.broken != nil {
		p.mu.Unlock()
		p.procs.Wait()
		return nil
	}
	p.closing, p.stopping = true, true
	if p.broken == nil {
		p.breakLocked(err)
	}
	var gs []*Group
	for _, s := range p.workers {
		if s.g != nil {
			gs = append(gs, s.g)
		}
	}
	p.mu.Unlock()
	for _, g := range gs {
		g.Stop(err)
	}
	p.release()
	return nil
}

// release waits for every worker process to exit, then closes the
// results queue, ends the reply loop and closes what is left.
func (p *Pool) release() {
	p.procs.Wait()
	p.released.Do(p.releaseOnce)
}

func (p *Pool) releaseOnce() {
	p.mu.Lock()
	stop := p.stopAfter
	p.mu.Unlock()
	if stop != nil {
		stop()
	}
	_ = p.results.Close()
	p.loop.Wait()
	p.mu.Lock()
	for _, s := range p.workers {
		if s.tasks != nil {
			_ = s.tasks.Close()
			s.tasks, s.g = nil, nil
		}
	}
	p.mu.Unlock()
	p.cancel()
}

// begin registers a new call, unless the pool is closing or broken.
func (p *Pool) begin(pc *poolCall) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.broken != nil:
		return p.broken
	case p.closing:
		return ErrClosed
	}
	pc.id = p.next
	p.next++
	p.calls[pc.id] = pc
	return nil
}

// end unregisters a call: its chunks not yet given out are dropped, and
// replies to the others are let go of as they come.
func (p *Pool) end(pc *poolCall) {
	p.mu.Lock()
	pc.ended = true
	p.pending = slices.DeleteFunc(p.pending, func(c *chunk) bool { return c.call == pc })
	delete(p.calls, pc.id)
	p.idle.Broadcast()
	p.mu.Unlock()
}

// submit queues a chunk for the workers.
func (p *Pool) submit(c *chunk) {
	p.mu.Lock()
	if p.broken != nil {
		p.failLocked(c, nil, p.broken)
		p.mu.Unlock()
		return
	}
	p.pending = append(p.pending, c)
	ws := p.assignLocked()
	p.mu.Unlock()
	p.send(ws)
}

// chunkResult is a chunk's outcome as its caller receives it.
type chunkResult[R any] struct {
	start int
	items []R
	err   error
}

// runCall runs f over items in chunks of size, at most window chunks in
// flight, and hands each chunk's outcome to handle as it arrives; handle
// returns how many chunks it has finished with (window room it gives
// back) and whether to go on.
func runCall[A, R any](ctx context.Context, p *Pool, f *Func[A, R], items iter.Seq[A], size int, handle func(chunkResult[R]) (freed int, more bool)) error {
	window := 2 * p.n
	out := make(chan chunkResult[R], window)
	pc := &poolCall{
		deliver: func(c *chunk, data []byte, fds []int) {
			var r reply[R]
			switch err := decode(data, fds, &r); {
			case err != nil:
				out <- chunkResult[R]{start: c.start, err: &ItemError{Index: c.start, Rank: r.Rank, Err: err}}
			case r.Failed:
				out <- chunkResult[R]{start: c.start, err: &ItemError{Index: r.At, Rank: r.Rank, Err: errors.New(r.Err)}}
			case len(r.Items) != c.n:
				out <- chunkResult[R]{start: c.start, err: &ItemError{Index: c.start, Rank: r.Rank,
					Err: fmt.Errorf("%w: %d results for %d items", ErrMalformed, len(r.Items), c.n)}}
			default:
				out <- chunkResult[R]{start: c.start, items: r.Items}
			}
		},
		fail: func(c *chunk, err error) { out <- chunkResult[R]{start: c.start, err: err} },
	}
	if err := p.begin(pc); err != nil {
		return err
	}
	defer p.end(pc)
	next, stop := iter.Pull(items)
	defer stop()
	inflight, start, more := 0, 0, true
	for {
		for more && inflight < window {
			part := make([]A, 0, size)
			for len(part) < size {
				a, ok := next()
				if !ok {
					more = false
					break
				}
				part = append(part, a)
			}
			if len(part) == 0 {
				break
			}
			c := &chunk{call: pc, start: start, n: len(part)}
			c.put = func(ctx context.Context, q *Queue) error {
				return q.Put(ctx, &task[A]{Call: pc.id, Start: c.start, Fn: f.name, Items: part})
			}
			start += len(part)
			inflight++
			p.submit(c)
		}
		if inflight == 0 {
			return nil
		}
		select {
		case r := <-out:
			freed, goOn := handle(r)
			inflight -= freed
			if !goOn {
				return nil
			}
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

func callChunk(opts []CallOption, def int) int {
	o := callOptions{chunk: def}
	for _, opt := range opts {
		opt(&o)
	}
	return max(o.chunk, 1)
}

// Map runs f on every item on the pool's workers and returns the results
// in the items' order (torch's Pool.map). The first failure is returned
// as an *ItemError; the items still running are let go.
func Map[A, R any](ctx context.Context, p *Pool, f *Func[A, R], items []A, opts ...CallOption) ([]R, error) {
	size := callChunk(opts, (len(items)+4*p.n-1)/(4*p.n))
	out := make([]R, len(items))
	var failed error
	err := runCall(ctx, p, f, slices.Values(items), size, func(r chunkResult[R]) (int, bool) {
		if r.err != nil {
			failed = r.err
			return 1, false
		}
		copy(out[r.start:], r.items)
		return 1, true
	})
	if err == nil {
		err = failed
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Apply runs f on arg on one of the pool's workers (torch's
// Pool.apply).
func Apply[A, R any](ctx context.Context, p *Pool, f *Func[A, R], arg A) (R, error) {
	rs, err := Map(ctx, p, f, []A{arg})
	if err != nil {
		var zero R
		return zero, err
	}
	return rs[0], nil
}

// Imap runs f on the items as the iteration asks for them, a few chunks
// ahead, and yields the results in the items' order (torch's
// Pool.imap). A failure is yielded as an *ItemError, and ends the
// iteration; so does ctx ending. Stopping the iteration early lets go of
// the items still running.
func Imap[A, R any](ctx context.Context, p *Pool, f *Func[A, R], items iter.Seq[A], opts ...CallOption) iter.Seq2[R, error] {
	size := callChunk(opts, 1)
	return func(yield func(R, error) bool) {
		held := map[int]chunkResult[R]{}
		want := 0
		stopped := false
		err := runCall(ctx, p, f, items, size, func(r chunkResult[R]) (int, bool) {
			held[r.start] = r
			freed := 0
			for {
				r, ok := held[want]
				if !ok {
					return freed, true
				}
				delete(held, want)
				freed++
				if r.err != nil {
					var zero R
					stopped = true
					yield(zero, r.err)
					return freed, false
				}
				for _, v := range r.items {
					if !yield(v, nil) {
						stopped = true
						return freed, false
					}
				}
				want += len(r.items)
			}
		})
		if err != nil && !stopped {
			var zero R
			yield(zero, err)
		}
	}
}

// ImapUnordered is Imap yielding each chunk's results as soon as they
// come (torch's Pool.imap_unordered).
func ImapUnordered[A, R any](ctx context.Context, p *Pool, f *Func[A, R], items iter.Seq[A], opts ...CallOption) iter.Seq2[R, error] {
	size := callChunk(opts, 1)
	return func(yield func(R, error) bool) {
		stopped := false
		err := runCall(ctx, p, f, items, size, func(r chunkResult[R]) (int, bool) {
			if r.err != nil {
				var zero R
				stopped = true
				yield(zero, r.err)
				return 1, false
			}
			for _, v := range r.items {
				if !yield(v, nil) {
					stopped = true
					return 1, false
				}
			}
			return 1, true
		})
		if err != nil && !stopped {
			var zero R
			yield(zero, err)
		}
	}
}

//go:build cgo && linux

package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// GPU tensors in device slabs across real processes, on the stand-in
// driver in CI (every process of these programs, and of their workers,
// inherits it) and on the machine's GPU under tests/gpu.sh. Each program
// prints "ok" once what it checks holds, else "error ...".

type slabArgs struct {
	In, Out, Ack *mp.Queue
	N            int
	Value        float32 // every element of what gpufd.hold takes
}

func init() {
	reexec.Register("program.gpufd", programGPUFD)
	mp.Register("gpufd.put", slabWorker(gpufdPut))
	mp.Register("gpufd.hold", slabWorker(gpufdHold))
	mp.Register("gpufd.idle", slabWorker(gpufdIdle))
	mp.Register("gpufd.late", slabWorker(gpufdLate))
	mp.Register("gpufd.own", slabWorker(gpufdOwn))
	mp.Register("gpufd.forward", slabWorker(gpufdForward))
	mp.Register("gpufd.write", slabWorker(gpufdWrite))
}

// gpufdPut puts a GPU tensor of 1 MiB of sevens on Out and exits, or,
// with Ack, waits for a word first: the producer of the cases
// sender-exits-first and the killed-producer ones.
func gpufdPut(ctx context.Context, a slabArgs) error {
	x, err := tensor.On(device.GPU(0)).Full(tensor.Float32, 7, 1<<18)
	if err != nil {
		return err
	}
	if err := a.Out.Put(ctx, x); err != nil {
		return err
	}
	if err := x.Release(); err != nil {
		return err
	}
	if a.Ack != nil {
		return a.Ack.Get(ctx, new(string))
	}
	return nil
}

// gpufdHold takes N GPU tensors of Value from In, checks that each is
// on the GPU and whole, holds them, says so with the number of
// descriptors it holds more than when it started, and waits to be
// killed or told to let go: the receiver of the cases killed-receiver,
// zeros-arrive and many. The number is leakcheck.Count's, without those
// a package keeps for the process's life (sock's waiting, from the
// first Get), which spawn bench's count of a receiver's includes.
func gpufdHold(ctx context.Context, a slabArgs) error {
	before := leakcheck.Count()
	var held []*tensor.Tensor
	for len(held) < a.N {
		var err error
		if held, err = mp.GetMany(ctx, a.In, held); err != nil {
			return err
		}
	}
	for i, x := range held {
		if err := checkAll(x, a.Value); err != nil {
			return fmt.Errorf("tensor %d: %w", i, err)
		}
	}
	if err := a.Out.Put(ctx, leakcheck.Count()-before); err != nil {
		return err
	}
	if err := a.Ack.Get(ctx, new(string)); err != nil {
		return err
	}
	for _, x := range held {
		if err := x.Release(); err != nil {
			return err
		}
	}
	return nil
}

// gpufdIdle says its pid on Out and waits for a word on Ack: the worker
// of the case spawn-after-export.
func gpufdIdle(ctx context.Context, a slabArgs) error {
	if err := a.Out.Put(ctx, os.Getpid()); err != nil {
		return err
	}
	return a.Ack.Get(ctx, new(string))
}

// gpufdLate takes a GPU tensor from In, queues a copy of nines into it
// on a slow device (the stand-in's work lands 200 ms after it is queued
// here), lets go of the tensor at once, and says so on Out: the receiver
// of the case recycled-block.
func gpufdLate(ctx context.Context, a slabArgs) error {
	var x *tensor.Tensor
	if err := a.In.Get(ctx, &x); err != nil {
		return err
	}
	nines, err := tensor.On(device.GPU(0)).Full(tensor.Float32, 9, x.Numel())
	if err != nil {
		return err
	}
	defer nines.Release()
	if cudastub.Active() {
		cudastub.SetDelay(200 * time.Millisecond)
	}
	dst := x.Storage().Backing().(tensor.DeviceCopier)
	if _, err := dst.CopyFrom(nines.Storage().Backing().(tensor.Buffer), 0, x.Storage().Size()); err != nil {
		return err
	}
	if err := x.Release(); err != nil {
		return err
	}
	if err := a.Out.Put(ctx, "released"); err != nil {
		return err
	}
	return a.Ack.Get(ctx, new(string))
}

// gpufdOwn takes a GPU tensor of sevens from In, checks that it is on
// this process's gpu:0 (its only device), writes a one into its first
// element, and sends it back on Out: the worker of the case
// visible-devices.
func gpufdOwn(ctx context.Context, a slabArgs) error {
	var x *tensor.Tensor
	if err := a.In.Get(ctx, &x); err != nil {
		return err
	}
	defer x.Release()
	if x.Place() != device.GPU(0) {
		return fmt.Errorf("received on %s", x.Place())
	}
	if err := checkSevens(x); err != nil {
		return err
	}
	if err := writeOne(x); err != nil {
		return err
	}
	return a.Out.Put(ctx, x)
}

// gpufdForward takes a GPU tensor from In and puts it on Out: the
// second process of the case third-process.
func gpufdForward(ctx context.Context, a slabArgs) error {
	var x *tensor.Tensor
	if err := a.In.Get(ctx, &x); err != nil {
		return err
	}
	defer x.Release()
	return a.Out.Put(ctx, x)
}

// gpufdWrite takes a GPU tensor of sevens from In, checks it, and writes
// a one into its first element: the third process of the case
// third-process.
func gpufdWrite(ctx context.Context, a slabArgs) error {
	var x *tensor.Tensor
	if err := a.In.Get(ctx, &x); err != nil {
		return err
	}
	defer x.Release()
	if err := checkSevens(x); err != nil {
		return err
	}
	return writeOne(x)
}

// slabWorker is a worker that runs fn with its slabArgs.
func slabWorker(fn func(ctx context.Context, a slabArgs) error) mp.WorkerFunc {
	return func(ctx context.Context, w *mp.Worker) error {
		var a slabArgs
		if err := w.Args(&a); err != nil {
			return err
		}
		return fn(ctx, a)
	}
}

// writeOne writes a one into the first element of float32 GPU tensor x,
// through its device memory.
func writeOne(x *tensor.Tensor) error {
	return x.Storage().Backing().(tensor.Buffer).Write([]byte{0, 0, 0x80, 0x3f}, 0) // float32 1
}

// firstIsOne checks that the first element of float32 GPU tensor x is 1.
func firstIsOne(x *tensor.Tensor) error {
	host, err := x.To(device.CPU())
	if err != nil {
		return err
	}
	if v, err := tensor.At[float32](host, 0); err != nil || v != 1 {
		return fmt.Errorf("the first element is %v, not 1 (%v)", v, err)
	}
	return nil
}

// checkSevens checks that every element of GPU tensor x is 7.
func checkSevens(x *tensor.Tensor) error { return checkAll(x, 7) }

// checkAll checks that every element of GPU tensor x is v.
func checkAll(x *tensor.Tensor, v float32) error {
	if !x.Place().IsGPU() {
		return fmt.Errorf("received a tensor on %s", x.Place())
	}
	host, err := x.To(device.CPU())
	if err != nil {
		return err
	}
	vals, err := tensor.Values[float32](host)
	if err != nil {
		return err
	}
	if i := slices.IndexFunc(vals, func(e float32) bool { return e != v }); i >= 0 {
		return fmt.Errorf("element %d of %d is %v, not %v", i, len(vals), vals[i], v)
	}
	return nil
}

// programGPUFD runs the case GPUFD_CASE names.
func programGPUFD() int {
	defer tensor.CloseBackends() // as a program that sends GPU tensors ends (README, GPUs)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cases := map[string]func(context.Context) error{
		"sender-exits-first":      gpufdSenderExitsFirst,
		"killed-producer":         gpufdKilledProducer,
		"killed-producer-idle":    gpufdKilledProducerIdle,
		"killed-producer-waiting": gpufdKilledProducerWaiting,
		"killed-receiver":         gpufdKilledReceiver,
		"never-taken":             gpufdNeverTaken,
		"third-process":           gpufdThirdProcess,
		"spawn-after-export":      gpufdSpawnAfterExport,
		"recycled-block":          gpufdRecycledBlock,
		"visible-devices":         gpufdVisibleDevices,
		"zeros-arrive":            gpufdZerosArrive,
		"many":                    gpufdMany,
		"lane-stream":             gpulaneStream,
		"lane-killed-reader":      gpulaneKilledReader,
		"lane-killed-writer":      gpulaneKilledWriter,
	}
	run, ok := cases[os.Getenv("GPUFD_CASE")]
	if !ok {
		fmt.Println("error no case", os.Getenv("GPUFD_CASE"))
		return 2
	}
	if err := run(ctx); err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("ok")
	return 0
}

// letGo checks that x, a GPU tensor of sevens, is whole, releases it, and
// waits for this process to hold no device memory.
func letGo(x *tensor.Tensor) error {
	if err := checkSevens(x); err != nil {
		return err
	}
	if err := x.Release(); err != nil {
		return err
	}
	return noDeviceMemory()
}

// noDeviceMemory waits up to comeBack for this process to hold no
// device memory once what it keeps for reuse is trimmed.
func noDeviceMemory() error {
	rt, err := cuda.Default()
	if err != nil {
		return err
	}
	deadline := time.Now().Add(comeBack)
	for {
		shm.Trim()
		rt.CollectLimbo() // what the legacy path keeps for others
		held := heldDeviceMemory(os.Getpid())
		if held <= 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("this process holds %d bytes of device memory %v after letting go", held, comeBack)
		}
		time.Sleep(time.Millisecond)
	}
}

// The producer puts its tensor and exits, reaped before the tensor is
// taken: the memory lives in the message, and then in this process, and
// goes when this process lets go.
func gpufdSenderExitsFirst(ctx context.Context) error {
	qs, err := newQueues(1)
	if err != nil {
		return err
	}
	if err := mp.Run(ctx, "gpufd.put", 1, mp.WithArgs(slabArgs{Out: qs[0]})); err != nil {
		return err
	}
	var x *tensor.Tensor
	if err := qs[0].Get(ctx, &x); err != nil {
		return err
	}
	return letGo(x)
}

// The producer is SIGKILLed once its tensor is here: the tensor stays
// whole, and its memory goes when this process lets go.
func gpufdKilledProducer(ctx context.Context) error { return killedProducer(ctx, 0) }

// The same, with the producer killed only once this process, receiving
// nothing more, has let go of its queue's lane: a pin of the producer's
// slab, if its receive took one, goes without another receive.
func gpufdKilledProducerIdle(ctx context.Context) error { return killedProducer(ctx, time.Second) }

// The same, with this process waiting in its next Get as the producer is
// killed, and while it lets go: the pin goes within the wait.
func gpufdKilledProducerWaiting(ctx context.Context) error {
	return killedProducerWhile(ctx, func(q *mp.Queue) (stop func() error) {
		wait, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- q.Get(wait, new(*tensor.Tensor)) }()
		return func() error {
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				return fmt.Errorf("the waiting Get: %v", err)
			}
			return nil
		}
	})
}

// killedProducer has a producer put a GPU tensor, waits for idle once
// the tensor came, SIGKILLs the producer, and then lets go of the tensor
// with its queues open.
func killedProducer(ctx context.Context, idle time.Duration) error {
	return killedProducerWhile(ctx, func(*mp.Queue) func() error {
		time.Sleep(idle)
		return func() error { return nil }
	})
}

// killedProducerWhile is killedProducer that calls during, with the
// queue the tensor came on, once the tensor came and before the kill; and
// the func during returns once this process has let go of the tensor.
func killedProducerWhile(ctx context.Context, during func(*mp.Queue) (after func() error)) error {
	qs, err := newQueues(2)
	if err != nil {
		return err
	}
	g, err := mp.Spawn(ctx, "gpufd.put", 1, mp.WithArgs(slabArgs{Out: qs[0], Ack: qs[1]}))
	if err != nil {
		return err
	}
	var x *tensor.Tensor
	if err := qs[0].Get(ctx, &x); err != nil {
		return err
	}
	after := during(qs[0])
	if err := syscall.Kill(g.Pids()[0], syscall.SIGKILL); err != nil {
		return err
	}
	var xe *mp.ExitError
	if err := g.Join(); !errors.As(err, &xe) || xe.Signal != syscall.SIGKILL {
		return fmt.Errorf("the producer's end: %v", err)
	}
	if err := letGo(x); err != nil {
		return fmt.Errorf("after the producer's death: %w", err)
	}
	return after()
}

// A receiver holding tensors is SIGKILLed: this process gets every block
// back, and its memory goes when this process lets go of its own.
func gpufdKilledReceiver(ctx context.Context) error {
	qs, err := newQueues(3)
	if err != nil {
		return err
	}
	g, err := mp.Spawn(ctx, "gpufd.hold", 1, mp.WithArgs(slabArgs{In: qs[0], Out: qs[1], Ack: qs[2], N: 8, Value: 7}))
	if err != nil {
		return err
	}
	var xs []*tensor.Tensor
	for range 8 {
		x, err := tensor.On(device.GPU(0)).Full(tensor.Float32, 7, 1024)
		if err != nil {
			return err
		}
		xs = append(xs, x)
	}
	if err := mp.PutMany(ctx, qs[0], xs); err != nil {
		return err
	}
	if err := qs[1].Get(ctx, new(int)); err != nil {
		return err
	}
	for _, x := range xs {
		if err := x.Release(); err != nil {
			return err
		}
	}
	if held := heldDeviceMemory(g.Pids()[0]); held == 0 {
		return errors.New("the receiver holds no device memory")
	}
	if err := syscall.Kill(g.Pids()[0], syscall.SIGKILL); err != nil {
		return err
	}
	_ = g.Join()
	return noDeviceMemory()
}

// Tensors put on a queue nobody reads, which is then closed, are let go
// of with it.
func gpufdNeverTaken(ctx context.Context) error {
	qs, err := newQueues(1)
	if err != nil {
		return err
	}
	for range 4 {
		x, err := tensor.On(device.GPU(0)).Full(tensor.Float32, 7, 1024)
		if err != nil {
			return err
		}
		if err := qs[0].Put(ctx, x); err != nil {
			return err
		}
		if err := x.Release(); err != nil {
			return err
		}
	}
	if err := shm.DropIdle(); err != nil {
		return err
	}
	shm.Trim()
	if heldDeviceMemory(os.Getpid()) == 0 {
		return errors.New("the messages in flight hold no device memory")
	}
	if err := qs[0].Close(); err != nil {
		return err
	}
	return noDeviceMemory()
}

// A received GPU tensor is sent on to a third process, which writes to
// it: the write is seen here.
func gpufdThirdProcess(ctx context.Context) error {
	qs, err := newQueues(2)
	if err != nil {
		return err
	}
	x, err := tensor.On(device.GPU(0)).Full(tensor.Float32, 7, 1<<16)
	if err != nil {
		return err
	}
	defer x.Release()
	fwd, err := mp.Spawn(ctx, "gpufd.forward", 1, mp.WithArgs(slabArgs{In: qs[0], Out: qs[1]}))
	if err != nil {
		return err
	}
	wr, err := mp.Spawn(ctx, "gpufd.write", 1, mp.WithArgs(slabArgs{In: qs[1]}))
	if err != nil {
		return err
	}
	if err := qs[0].Put(ctx, x); err != nil {
		return err
	}
	if err := errors.Join(fwd.Join(), wr.Join()); err != nil {
		return err
	}
	if err := firstIsOne(x); err != nil {
		return fmt.Errorf("the third process's write: %w", err)
	}
	return nil
}

// A worker spawned after this process made, and so exported, a slab
// holds none of its memory: the exported descriptor is close-on-exec,
// whatever the driver made it.
func gpufdSpawnAfterExport(ctx context.Context) error {
	x, err := tensor.On(device.GPU(0)).Full(tensor.Float32, 7, 1024)
	if err != nil {
		return err
	}
	defer x.Release()
	qs, err := newQueues(2)
	if err != nil {
		return err
	}
	g, err := mp.Spawn(ctx, "gpufd.idle", 1, mp.WithArgs(slabArgs{Out: qs[0], Ack: qs[1]}))
	if err != nil {
		return err
	}
	var pid int
	if err := qs[0].Get(ctx, &pid); err != nil {
		return err
	}
	held := heldDeviceMemory(pid)
	if err := qs[1].Put(ctx, "done"); err != nil {
		return err
	}
	if err := g.Join(); err != nil {
		return err
	}
	if held > 0 {
		return fmt.Errorf("a worker spawned after an export holds %d bytes of its device memory", held)
	}
	return nil
}

// A block a receiver let go of with its own work on it still queued is
// reused only after that work: the producer's next tensor in it holds
// zeros, and still does once the receiver's work would have landed.
func gpufdRecycledBlock(ctx context.Context) error {
	qs, err := newQueues(3)
	if err != nil {
		return err
	}
	g, err := mp.Spawn(ctx, "gpufd.late", 1, mp.WithArgs(slabArgs{In: qs[0], Out: qs[1], Ack: qs[2]}))
	if err != nil {
		return err
	}
	x, err := tensor.On(device.GPU(0)).Full(tensor.Float32, 7, 1024)
	if err != nil {
		return err
	}
	ptr := func(t *tensor.Tensor) cuda.DevicePtr {
		return t.Storage().Backing().(interface{ Ptr() cuda.DevicePtr }).Ptr()
	}
	at := ptr(x)
	// The rest of x's slab, 2 MiB of 4 KiB blocks, is taken here, so
	// that the pool's next block is one it takes back.
	var fillers []*tensor.Tensor
	defer func() { leakcheck.Free(fillers) }()
	for range 2<<20/4096 - 1 {
		f, err := tensor.On(device.GPU(0)).Zeros(tensor.Float32, 1024)
		if err != nil {
			return err
		}
		fillers = append(fillers, f)
		if d := ptr(f) - at; d >= 2<<20 {
			return fmt.Errorf("a block %#x past the first of its slab: x is not its slab's first", uint64(d))
		}
	}
	if err := qs[0].Put(ctx, x); err != nil {
		return err
	}
	if err := x.Release(); err != nil {
		return err
	}
	if err := qs[1].Get(ctx, new(string)); err != nil {
		return err
	}
	// The holds of the message settle on timers of both processes (see
	// shm.Ticket), some 10 ms each, later under load. A block handed out
	// before then is from a new slab: it goes back, and the slab with it
	// (shm.Trim), so that the next allocation asks about x's block again.
	var z *tensor.Tensor
	for deadline := time.Now().Add(comeBack); ; {
		time.Sleep(10 * time.Millisecond)
		if z, err = tensor.On(device.GPU(0)).Zeros(tensor.Float32, 1024); err != nil {
			return err
		}
		if ptr(z) == at {
			break
		}
		_ = z.Release()
		shm.Trim()
		if time.Now().After(deadline) {
			return errors.New("the block the receiver let go of was not taken back")
		}
	}
	defer z.Release()
	for range 2 {
		if err := checkAll(z, 0); err != nil {
			return fmt.Errorf("the reused block: %w", err)
		}
		time.Sleep(250 * time.Millisecond) // past the receiver's queued work
	}
	if err := qs[2].Put(ctx, "done"); err != nil {
		return err
	}
	return g.Join()
}

// On a machine of two GPUs, a worker that sees only the second
// (CUDA_VISIBLE_DEVICES=1, as a launcher gives each worker its own)
// calls it gpu:0: a tensor sent from this process's gpu:1 arrives there,
// on the same memory, and comes back on gpu:1.
func gpufdVisibleDevices(ctx context.Context) error {
	x, err := tensor.On(device.GPU(1)).Full(tensor.Float32, 7, 1024)
	if err != nil {
		return err
	}
	defer x.Release()
	qs, err := newQueues(2)
	if err != nil {
		return err
	}
	g, err := mp.Spawn(ctx, "gpufd.own", 1, mp.WithArgs(slabArgs{In: qs[0], Out: qs[1]}), mp.WithEnv("CUDA_VISIBLE_DEVICES=1"))
	if err != nil {
		return err
	}
	joined := joinLater(ctx, g)
	if err := qs[0].Put(ctx, x); err != nil {
		return err
	}
	var back *tensor.Tensor
	if err := qs[1].Get(joined.ctx, &back); err != nil {
		return errors.Join(err, joined.wait())
	}
	defer back.Release()
	if err := joined.wait(); err != nil {
		return err
	}
	if back.Place() != device.GPU(1) || back.Storage() != x.Storage() {
		return fmt.Errorf("came back on %s, not as the tensor sent from gpu:1", back.Place())
	}
	if err := firstIsOne(x); err != nil {
		return fmt.Errorf("the worker's write: %w", err)
	}
	return nil
}

// A new tensor sent at once, its clearing still queued on a slow device,
// arrives cleared: the send waits for the work queued on the device.
func gpufdZerosArrive(ctx context.Context) error {
	qs, err := newQueues(3)
	if err != nil {
		return err
	}
	g, err := mp.Spawn(ctx, "gpufd.hold", 1, mp.WithArgs(slabArgs{In: qs[0], Out: qs[1], Ack: qs[2], N: 1, Value: 0}))
	if err != nil {
		return err
	}
	if cudastub.Active() {
		cudastub.SetDelay(100 * time.Millisecond) // this process's work lands late
	}
	x, err := tensor.On(device.GPU(0)).Zeros(tensor.Float32, 1<<18)
	if err != nil {
		return err
	}
	defer x.Release()
	joined := joinLater(ctx, g)
	if err := qs[0].Put(ctx, x); err != nil {
		return err
	}
	if err := qs[1].Get(joined.ctx, new(int)); err != nil {
		return errors.Join(err, joined.wait())
	}
	if err := qs[2].Put(ctx, "let go"); err != nil {
		return err
	}
	return joined.wait()
}

// joining is a group joined in the background: its ctx ends when the
// group fails, so that a wait for what a failed worker never sends ends.
// Not when it succeeds: a worker that puts its answer and returns may be
// joined before the answer is taken, and a Get whose context is done
// takes nothing, even with a message waiting.
type joining struct {
	ctx  context.Context
	stop context.CancelFunc
	done chan error
}

func joinLater(ctx context.Context, g *mp.Group) *joining {
	j := &joining{done: make(chan error, 1)}
	j.ctx, j.stop = context.WithCancel(ctx)
	go func() {
		err := g.Join()
		if err != nil {
			j.stop()
		}
		j.done <- err
	}()
	return j
}

// wait returns the group's Join, once it has returned, and ends ctx.
func (j *joining) wait() error {
	defer j.stop()
	return <-j.done
}

// A receiver holding 10,000 received GPU tensors of 4 KiB holds few
// descriptors: one per slab and per slab's segment.
func gpufdMany(ctx context.Context) error {
	const n, batch = 10_000, 100
	qs, err := newQueues(3)
	if err != nil {
		return err
	}
	g, err := mp.Spawn(ctx, "gpufd.hold", 1, mp.WithArgs(slabArgs{In: qs[0], Out: qs[1], Ack: qs[2], N: n}))
	if err != nil {
		return err
	}
	var xs []*tensor.Tensor
	for i := range n {
		x, err := tensor.On(device.GPU(0)).Zeros(tensor.Float32, 1024)
		if err != nil {
			return err
		}
		xs = append(xs, x)
		if len(xs) == batch || i == n-1 {
			if err := mp.PutMany(ctx, qs[0], xs); err != nil {
				return err
			}
			for _, x := range xs {
				_ = x.Release()
			}
			xs = xs[:0]
		}
	}
	var fds int
	if err := qs[1].Get(ctx, &fds); err != nil {
		return err
	}
	fmt.Println("fds", fds)
	if err := qs[2].Put(ctx, "let go"); err != nil {
		return err
	}
	return g.Join()
}

// legacyIPC reports whether this run shares GPU memory by legacy CUDA
// IPC on every device (tests/gpu.sh and CI run the GPU tests so a second
// time).
func legacyIPC() bool { return os.Getenv(cuda.EnvLegacy) == "1" }

// TestGPUSlabsAcrossProcesses runs each case in a program of its own.
func TestGPUSlabsAcrossProcesses(t *testing.T) {
	for _, c := range []string{"sender-exits-first", "killed-producer", "killed-producer-idle", "killed-producer-waiting", "killed-receiver", "never-taken", "third-process", "spawn-after-export", "recycled-block", "visible-devices", "zeros-arrive"} {
		t.Run(c, func(t *testing.T) {
			if legacyIPC() {
				switch c {
				case "sender-exits-first":
					t.Skip("on the legacy IPC path the producer must outlive its consumers (README, GPUs)")
				case "recycled-block":
					t.Skip("on the legacy IPC path memory is not pooled")
				}
			}
			leakcheck.Check(t)
			env := []string{"GPUFD_CASE=" + c}
			if c == "visible-devices" {
				if cudastub.Active() {
					env = append(env, cudastub.EnvDevices+"=2") // the stand-in plays two
				} else if x, err := tensor.On(device.GPU(1)).Zeros(tensor.Uint8, 1); err != nil {
					t.Skipf("needs a machine of two GPUs: %v", err)
				} else {
					require.NoError(t, x.Release())
				}
			}
			p := startProgramIn(t, newSession(), "program.gpufd", strategy.FileDescriptor, false, env...)
			assert.Equal(t, "", p.waitLine(t, "ok"))
			assert.Equal(t, 0, p.wait(t))
			p.expectGone(t)
		})
	}
}

// 10,000 live received GPU tensors of 4 KiB hold fewer than 64
// descriptors in their receiver.
func TestTenThousandReceivedGPUTensors(t *testing.T) {
	if legacyIPC() {
		t.Skip("on the legacy IPC path each tensor is an allocation of its own: few descriptors is the slabs' promise")
	}
	leakcheck.Check(t)
	p := startProgramIn(t, newSession(), "program.gpufd", strategy.FileDescriptor, false, "GPUFD_CASE=many")
	fds, err := strconv.Atoi(p.waitLine(t, "fds"))
	require.NoError(t, err)
	t.Logf("the receiver holds %d more descriptors for 10,000 GPU tensors", fds)
	assert.Less(t, fds, 64)
	assert.Equal(t, "", p.waitLine(t, "ok"))
	assert.Equal(t, 0, p.wait(t))
	p.expectGone(t)
}

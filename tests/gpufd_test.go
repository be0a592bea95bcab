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
	// gpufd.put puts a GPU tensor of 1 MiB of sevens on Out and exits,
	// or, with Ack, waits for a word first.
	mp.Register("gpufd.put", slabWorker(func(ctx context.Context, a slabArgs) error {
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
	}))
	// gpufd.hold takes N GPU tensors of Value from In, checks that each
	// is on the GPU and whole, holds them, says so with the number of
	// descriptors it holds more than when it started, and waits to be
	// killed or told to let go.
	mp.Register("gpufd.hold", slabWorker(func(ctx context.Context, a slabArgs) error {
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
	}))
	// gpufd.forward takes a GPU tensor from In and puts it on Out.
	mp.Register("gpufd.forward", slabWorker(func(ctx context.Context, a slabArgs) error {
		var x *tensor.Tensor
		if err := a.In.Get(ctx, &x); err != nil {
			return err
		}
		defer x.Release()
		return a.Out.Put(ctx, x)
	}))
	// gpufd.write takes a GPU tensor of sevens from In, checks it, and
	// writes a one into its first element.
	mp.Register("gpufd.write", slabWorker(func(ctx context.Context, a slabArgs) error {
		var x *tensor.Tensor
		if err := a.In.Get(ctx, &x); err != nil {
			return err
		}
		defer x.Release()
		if err := checkSevens(x); err != nil {
			return err
		}
		return x.Storage().Backing().(tensor.Buffer).Write([]byte{0, 0, 0x80, 0x3f}, 0) // float32 1
	}))
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
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cases := map[string]func(context.Context) error{
		"sender-exits-first": gpufdSenderExitsFirst,
		"killed-producer":    gpufdKilledProducer,
		"killed-receiver":    gpufdKilledReceiver,
		"never-taken":        gpufdNeverTaken,
		"third-process":      gpufdThirdProcess,
		"many":               gpufdMany,
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

// queues makes n queues.
func newQueues(n int) ([]*mp.Queue, error) {
	qs := make([]*mp.Queue, n)
	for i := range qs {
		var err error
		if qs[i], err = mp.NewQueue(); err != nil {
			return nil, err
		}
	}
	return qs, nil
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

// heldDeviceMemory returns how many bytes of device memory the processes
// pids hold between them, or -1 where that cannot be told: the stand-in
// driver counts it per process, a real one only per device.
func heldDeviceMemory(pids ...int) int64 {
	if !cudastub.Active() {
		return -1
	}
	return cudastub.Held(pids...)
}

// noDeviceMemory waits up to a second for this process to hold no device
// memory once what it keeps for reuse is trimmed.
func noDeviceMemory() error {
	deadline := time.Now().Add(time.Second)
	for {
		shm.Trim()
		held := heldDeviceMemory(os.Getpid())
		if held <= 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("this process holds %d bytes of device memory a second after letting go", held)
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
func gpufdKilledProducer(ctx context.Context) error {
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
	return nil
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
	first, err := x.To(device.CPU())
	if err != nil {
		return err
	}
	if v, err := tensor.At[float32](first, 0); err != nil || v != 1 {
		return fmt.Errorf("the third process's write: %v, %v", v, err)
	}
	return nil
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

// TestGPUSlabsAcrossProcesses runs each case in a program of its own.
func TestGPUSlabsAcrossProcesses(t *testing.T) {
	for _, c := range []string{"sender-exits-first", "killed-producer", "killed-receiver", "never-taken", "third-process"} {
		t.Run(c, func(t *testing.T) {
			leakcheck.Check(t)
			p := startProgramIn(t, newSession(), "program.gpufd", strategy.FileDescriptor, false, "GPUFD_CASE="+c)
			assert.Equal(t, "", p.waitLine(t, "ok"))
			assert.Equal(t, 0, p.wait(t))
			p.expectGone(t)
		})
	}
}

// 10,000 live received GPU tensors of 4 KiB hold fewer than 64
// descriptors in their receiver.
func TestTenThousandReceivedGPUTensors(t *testing.T) {
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

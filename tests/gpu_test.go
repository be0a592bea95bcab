package tests

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/cudashm"
	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
	"golang.org/x/sys/unix"
)

// GPU tests run on the machine's driver where tests/gpu.sh asks for it
// (TENSORMP_REQUIRE_GPU), else on the stand-in (see TestMain).

func requireGPU(t *testing.T) *cuda.Runtime {
	t.Helper()
	rt, err := cuda.Default()
	require.NoError(t, err, "no CUDA driver")
	require.True(t, cuda.Available(), "the CUDA driver reports no device")
	warmDriver.Do(func() { warmDriver.err = warmUp() })
	require.NoError(t, warmDriver.err, "warming the driver up")
	return rt
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

// newQueues makes n queues.
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

// requireTorchGPU is requireGPU for a test whose Python side makes or
// takes PyTorch CUDA tensors: those need a real GPU, which tests/gpu.sh
// runs it on.
func requireTorchGPU(t *testing.T) *cuda.Runtime {
	t.Helper()
	if cudastub.Active() {
		t.Skip("PyTorch's CUDA tensors need a real GPU: tests/gpu.sh runs this there")
	}
	return requireGPU(t)
}

// warmDriver makes the driver open, once per process, the descriptors it
// keeps for the process's life (its context's, and its interprocess-event
// file's once something was exported), so that the tests' leak checks
// see only what tensormp opens.
var warmDriver struct {
	sync.Once
	err error
}

func warmUp() error {
	x, err := tensor.On(device.GPU(0)).Zeros(tensor.Uint8, 16)
	if err != nil {
		return err
	}
	defer x.Release()
	_, fds, err := reduction.Marshal(x) // as a send does, by either path
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
	return err
}

// fdShared reports whether GPU 0 shares its memory in slabs, as
// descriptors, rather than by legacy CUDA IPC.
func fdShared(t *testing.T, rt *cuda.Runtime) bool {
	t.Helper()
	ok, err := rt.FDShared(0)
	require.NoError(t, err)
	return ok
}

// driverFiles returns the files the CUDA driver keeps in /dev/shm.
func driverFiles(t *testing.T) []string {
	t.Helper()
	names, err := filepath.Glob(filepath.Join(cudashm.Dir, "cuda.shm.*"))
	require.NoError(t, err)
	return names
}

type gpuArgs struct {
	Tensor *tensor.Tensor
	Status *mp.Queue
	Ack    *mp.Queue
}

func init() {
	mp.Register("gpu.make", gpuMake)
	mp.Register("gpu.write", gpuWrite)
}

// gpuMake makes a GPU tensor, puts it on Status, and holds its memory
// until told on Ack: TestGPUWorkerLeavesNoDriverFiles' worker.
func gpuMake(ctx context.Context, w *mp.Worker) error {
	var a gpuArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	x, err := tensor.On(device.GPU(0)).Arange(tensor.Int32, 1<<10)
	if err != nil {
		return err
	}
	if err := a.Status.Put(ctx, x); err != nil {
		return err
	}
	_ = x.Release()
	var ack string
	return a.Ack.Get(ctx, &ack) // hold the memory until the parent has looked
}

// gpuWrite checks that the GPU tensor it was given arrived on the GPU
// with its values, writes 4242 into its first element, says so on
// Status, and waits for a word on Ack: TestGPUWorkerWritesParentSees'
// worker.
func gpuWrite(ctx context.Context, w *mp.Worker) error {
	var a gpuArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	if !a.Tensor.Place().IsGPU() {
		return a.Status.Put(ctx, "arrived on "+a.Tensor.Place().String())
	}
	host, err := a.Tensor.To(device.CPU())
	if err != nil {
		return err
	}
	vals, err := tensor.Data[int32](host)
	if err != nil {
		return err
	}
	if vals[0] != 0 || vals[len(vals)-1] != int32(len(vals)-1) {
		return a.Status.Put(ctx, "values differ")
	}
	var word [4]byte
	binary.LittleEndian.PutUint32(word[:], 4242)
	if err := a.Tensor.Storage().Backing().(tensor.Buffer).Write(word[:], 0); err != nil {
		return err
	}
	if err := a.Status.Put(ctx, "written"); err != nil {
		return err
	}
	var ack string
	return a.Ack.Get(ctx, &ack) // hold the memory until the parent has looked
}

func TestGPUAllocationAndCopies(t *testing.T) {
	requireGPU(t)
	x, err := tensor.On(device.GPU(0)).Arange(tensor.Float64, 1<<20)
	require.NoError(t, err)
	defer x.Release()
	back, err := x.To(device.CPU())
	require.NoError(t, err)
	want, err := tensor.Arange(tensor.Float64, 1<<20)
	require.NoError(t, err)
	assert.True(t, tensor.Equal(back, want), "host -> device -> host")
	c, err := x.Clone()
	require.NoError(t, err)
	defer c.Release()
	assert.True(t, tensor.Equal(c, want), "device -> device")
}

func TestGPUWorkerWritesParentSees(t *testing.T) {
	rt := requireGPU(t)
	leakcheck.Check(t)
	status, ack := testQueues(t)
	x, err := tensor.On(device.GPU(0)).Arange(tensor.Int32, 1<<16)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	g, err := mp.Spawn(ctx, "gpu.write", 1, mp.WithArgs(gpuArgs{Tensor: x, Status: status, Ack: ack}))
	require.NoError(t, err)
	var s string
	require.NoError(t, status.Get(ctx, &s))
	require.Equal(t, "written", s)
	host, err := x.To(device.CPU())
	require.NoError(t, err)
	first, err := tensor.At[int32](host, 0)
	require.NoError(t, err)
	assert.Equal(t, int32(4242), first, "the parent sees the worker's write to its GPU memory")

	require.NoError(t, x.Release())
	if !fdShared(t, rt) {
		assert.Equal(t, 1, rt.Limbo(), "the worker still holds the memory")
	}
	require.NoError(t, ack.Put(ctx, "seen"))
	require.NoError(t, g.Join())
	rt.CollectLimbo()
	assert.Equal(t, 0, rt.Limbo(), "the worker is gone: the memory is freed")
}

// A worker that sent GPU memory leaves no driver file in /dev/shm. In
// slabs it makes none. By legacy CUDA IPC, one whose function returns
// gives its context back, so the driver removes the interprocess-event
// file it made for the export (a plain exit would leave it); one that is
// killed has its file removed by its parent. What it sent stays readable
// here until it is released.
func TestGPUWorkerLeavesNoDriverFiles(t *testing.T) {
	rt := requireGPU(t)
	slabs := fdShared(t, rt)
	for _, killed := range []bool{false, true} {
		t.Run(map[bool]string{false: "returns", true: "killed"}[killed], func(t *testing.T) {
			leakcheck.Check(t)
			before := driverFiles(t)
			status, ack := testQueues(t)

			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			g, err := mp.Spawn(ctx, "gpu.make", 1, mp.WithArgs(gpuArgs{Status: status, Ack: ack}))
			require.NoError(t, err)
			var x *tensor.Tensor
			require.NoError(t, status.Get(ctx, &x))
			assert.True(t, x.Place().IsGPU())
			pid := g.Pids()[0]
			if slabs {
				require.Empty(t, cudashm.Of(pid), "memory sent in a slab makes no driver file")
			} else {
				require.NotEmpty(t, cudashm.Of(pid), "the worker's export made a driver file of its own")
			}
			if killed {
				killWorker(t, g)
			}
			host, err := x.To(device.CPU())
			require.NoError(t, err)
			last, err := tensor.At[int32](host, 1<<10-1)
			require.NoError(t, err)
			assert.Equal(t, int32(1<<10-1), last)
			require.NoError(t, x.Release())
			if !killed {
				require.NoError(t, ack.Put(ctx, "seen"))
				require.NoError(t, g.Join())
			}
			assert.Equal(t, before, driverFiles(t), "the worker's driver file is gone")
		})
	}
}

// killWorker SIGKILLs g's one worker and checks that Join reports the
// kill.
func killWorker(t *testing.T, g *mp.Group) {
	t.Helper()
	pids := g.Pids()
	require.Len(t, pids, 1)
	require.NoError(t, syscall.Kill(pids[0], syscall.SIGKILL))
	var xe *mp.ExitError
	require.ErrorAs(t, g.Join(), &xe)
	assert.Equal(t, syscall.SIGKILL, xe.Signal)
}

func init() {
	reexec.Register("program.gpu-stream", programGPUStream)
	mp.Register("gpustream.produce", gpuStreamProduce)
	mp.Register("gpustream.consume", gpuStreamConsume)
}

// gpuStreamProduce puts new GPU tensors on Out until told to check (on
// Ctl); then it lets go of everything and waits for every block it made
// to come back, from the consumer too, dead or alive. It is the producer
// of program.gpu-stream, which TestGPUKilledAtRandom runs.
func gpuStreamProduce(ctx context.Context, w *mp.Worker) error {
	var a streamArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	run, stop := context.WithCancel(ctx)
	go func() { _ = a.Ctl.Get(ctx, new(string)); stop() }()
	for i := 0; run.Err() == nil; i++ {
		n := 1 << 10
		if i%16 == 0 {
			n = 1 << 18 // 1 MiB now and then: a slab of another class
		}
		x, err := tensor.On(device.GPU(0)).Full(tensor.Float32, float64(i%251), n)
		if err != nil {
			return err
		}
		if err := a.Out.Put(run, x); err != nil && run.Err() == nil {
			return err
		}
		if err := x.Release(); err != nil {
			return err
		}
	}
	rt, err := cuda.Default()
	if err != nil {
		return err
	}
	if err := within(comeBack, func() bool { shm.Trim(); return rt.InUse(0) == 0 }); err != nil {
		return a.Status.Put(ctx, fmt.Sprintf("%d blocks still in use: %v", rt.InUse(0), err))
	}
	if err := a.Status.Put(ctx, "checked"); err != nil {
		return err
	}
	return a.Ctl.Get(ctx, new(string))
}

// gpuStreamConsume takes GPU tensors from In, holds the last 64, and
// tells Status when it has its first. Told to check (on Ctl), it checks
// every tensor it holds, lets go of them, and waits for its device
// memory to be given back. It is the consumer of program.gpu-stream,
// which TestGPUKilledAtRandom runs.
func gpuStreamConsume(ctx context.Context, w *mp.Worker) error {
	var a streamArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	run, stop := context.WithCancel(ctx)
	go func() { _ = a.Ctl.Get(ctx, new(string)); stop() }()
	var held []*tensor.Tensor
	for run.Err() == nil {
		var x *tensor.Tensor
		if err := a.In.Get(run, &x); err != nil {
			break
		}
		if held = append(held, x); len(held) == 1 {
			if err := a.Status.Put(ctx, "first"); err != nil {
				return err
			}
		}
		if len(held) > 64 {
			_ = held[0].Release()
			held = held[1:]
		}
	}
	for i, x := range held {
		host, err := x.To(device.CPU())
		if err != nil {
			return err
		}
		vals, err := tensor.Values[float32](host)
		if err != nil {
			return err
		}
		if j := slices.IndexFunc(vals, func(v float32) bool { return v != vals[0] }); j >= 0 {
			return a.Status.Put(ctx, fmt.Sprintf("held tensor %d: element %d is %v, element 0 %v", i, j, vals[j], vals[0]))
		}
		if err := x.Release(); err != nil {
			return err
		}
	}
	if err := within(comeBack, func() bool { shm.Trim(); return heldDeviceMemory(os.Getpid()) <= 0 }); err != nil {
		return a.Status.Put(ctx, fmt.Sprintf("%d bytes of device memory held after letting go: %v", heldDeviceMemory(os.Getpid()), err))
	}
	if err := a.Status.Put(ctx, "checked"); err != nil {
		return err
	}
	return a.Ctl.Get(ctx, new(string))
}

type streamArgs struct {
	In, Out     *mp.Queue // the stream
	Status, Ctl *mp.Queue // to the program, from it
}

// comeBack is how long the GPU tests wait for what a process let go of,
// or held when it was killed, to come back: milliseconds on an idle
// machine, more on a loaded one. What they check is that it comes back;
// the wait only bounds a hang.
const comeBack = 10 * time.Second

// within waits up to d for ok, and says so if it never held.
func within(d time.Duration, ok func() bool) error {
	for deadline := time.Now().Add(d); !ok(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %v", d)
		}
	}
	return nil
}

// programGPUStream runs a producer and a consumer of GPU tensors, and
// once the consumer has its first tensor, SIGKILLs the one GPU_VICTIM
// names (producer, consumer or both) at a random moment within 50 ms.
// Then it has the survivor check what it holds, let go of it and see its
// memory come back, and prints "ok", else "error ...".
func programGPUStream() int {
	defer tensor.CloseBackends() // as a program that sends GPU tensors ends (README, GPUs)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := gpuStream(ctx, os.Getenv("GPU_VICTIM")); err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("ok")
	return 0
}

func gpuStream(ctx context.Context, victim string) error {
	q, err := mp.NewQueue(mp.WithCapacity(256))
	if err != nil {
		return err
	}
	qs, err := newQueues(4)
	if err != nil {
		return err
	}
	prodStatus, prodCtl, consStatus, consCtl := qs[0], qs[1], qs[2], qs[3]
	prod, err := mp.Spawn(ctx, "gpustream.produce", 1, mp.WithArgs(streamArgs{Out: q, Status: prodStatus, Ctl: prodCtl}))
	if err != nil {
		return err
	}
	cons, err := mp.Spawn(ctx, "gpustream.consume", 1, mp.WithArgs(streamArgs{In: q, Status: consStatus, Ctl: consCtl}))
	if err != nil {
		return err
	}
	var first string
	if err := consStatus.Get(ctx, &first); err != nil || first != "first" {
		return fmt.Errorf("the consumer's first tensor: %q, %v", first, err)
	}
	time.Sleep(time.Duration(rand.Int64N(int64(50 * time.Millisecond))))
	type side struct {
		g           *mp.Group
		status, ctl *mp.Queue
	}
	sides := map[string]side{"producer": {prod, prodStatus, prodCtl}, "consumer": {cons, consStatus, consCtl}}
	for name, s := range sides {
		if victim == name || victim == "both" {
			if err := syscall.Kill(s.g.Pids()[0], syscall.SIGKILL); err != nil {
				return err
			}
			_ = s.g.Join()
			delete(sides, name)
		}
	}
	for name, s := range sides {
		if err := s.ctl.Put(ctx, "check"); err != nil {
			return err
		}
		// What is still in the stream holds blocks too: with the
		// consumer dead, this program takes and lets go of it while the
		// producer waits for its blocks.
		var got string
		for {
			short, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
			err := s.status.Get(short, &got)
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) {
				if err != nil || got != "checked" {
					return fmt.Errorf("the surviving %s: %q, %v", name, got, err)
				}
				break
			}
			if name == "producer" {
				short, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
				var x *tensor.Tensor
				if q.Get(short, &x) == nil {
					_ = x.Release()
				}
				cancel()
			}
		}
		if err := s.ctl.Put(ctx, "exit"); err != nil {
			return err
		}
		if err := s.g.Join(); err != nil {
			return fmt.Errorf("the surviving %s: %w", name, err)
		}
	}
	return nil
}

// TestGPUKilledAtRandom SIGKILLs the producer, the consumer or both of a
// stream of GPU tensors at a random moment once tensors flow, many times
// (TENSORMP_GPU_KILL_RUNS; 100 on a GPU, 12 on the stand-in): the
// survivor reads whole tensors and gets every block and byte back once
// it lets go, the device has every byte back within a second of the
// program's end, and nothing of the program is left in /dev/shm.
func TestGPUKilledAtRandom(t *testing.T) {
	rt := requireGPU(t)
	runs := 100
	if cudastub.Active() {
		runs = 12
	}
	if n, err := strconv.Atoi(os.Getenv("TENSORMP_GPU_KILL_RUNS")); err == nil {
		runs = n
	}
	leakcheck.Check(t)
	free := func() int64 {
		f, _, err := rt.MemInfo(0)
		require.NoError(t, err)
		return f
	}
	before := free()
	for i := range runs {
		victims := []string{"producer", "consumer", "both"}[i%3]
		p := startProgramIn(t, newSession(), "program.gpu-stream", strategy.FileDescriptor, false, "GPU_VICTIM="+victims)
		assert.Equal(t, "", p.waitLine(t, "ok"), "run %d (%s killed)", i, victims)
		require.Equal(t, 0, p.wait(t), "run %d (%s killed)", i, victims)
		ended := time.Now()
		var now int64
		for now = free(); now < before && time.Since(ended) < comeBack; now = free() {
			time.Sleep(10 * time.Millisecond)
		}
		require.GreaterOrEqual(t, now, before, "run %d (%s killed): device memory %v after the program's end", i, victims, comeBack)
		p.expectGone(t)
		assert.Empty(t, cudashm.Of(p.cmd.Process.Pid), "run %d: driver files", i)
	}
}

package tests

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
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
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
	"golang.org/x/sys/unix"
)

// GPU tests run on the real driver and skip where there is none.

func requireGPU(t *testing.T) *cuda.Runtime {
	t.Helper()
	skip := t.Skipf
	if os.Getenv(requireGPUEnv) != "" {
		skip = t.Fatalf
	}
	if _, err := cuda.Load(); err != nil {
		skip("no CUDA driver here: %v", err)
	}
	if !cuda.Available() {
		skip("the CUDA driver reports no device")
	}
	rt, err := cuda.Default()
	require.NoError(t, err)
	warmDriver.Do(func() { warmDriver.err = warmUp() })
	require.NoError(t, warmDriver.err, "warming the driver up")
	return rt
}

// requireGPUEnv, when set, makes a missing GPU fail the GPU tests instead
// of skipping them (tests/gpu.sh sets it).
const requireGPUEnv = "TENSORMP_REQUIRE_GPU"

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
	mp.Register("gpu.make", func(ctx context.Context, w *mp.Worker) error {
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
	})
	mp.Register("gpu.write", func(ctx context.Context, w *mp.Worker) error {
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
	})
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

// GPU work leaves the calling thread's current context as it found it:
// none here, or whatever another library in the process had made current.
func TestGPUWorkLeavesTheThreadsContext(t *testing.T) {
	requireGPU(t)
	drv, err := cuda.Load()
	require.NoError(t, err)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	require.NoError(t, drv.SetCurrent(0))
	x, err := tensor.On(device.GPU(0)).Arange(tensor.Int32, 1<<10) // allocates and copies here
	require.NoError(t, err)
	c, err := drv.Current()
	require.NoError(t, err)
	assert.Zero(t, c, "no context is left current on a thread that had none")

	own, err := drv.RetainPrimaryContext(0)
	require.NoError(t, err)
	defer drv.ReleasePrimaryContext(0)
	require.NoError(t, drv.SetCurrent(own))
	defer drv.SetCurrent(0)
	host, err := x.To(device.CPU())
	require.NoError(t, err)
	assert.Equal(t, int32(1<<10-1), must(tensor.At[int32](host, 1<<10-1)))
	require.NoError(t, x.Release())
	c, err = drv.Current()
	require.NoError(t, err)
	assert.Equal(t, own, c, "the context another library made current stays current")
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
	// gpustream.produce puts new GPU tensors on its queue until killed.
	mp.Register("gpustream.produce", func(ctx context.Context, w *mp.Worker) error {
		var q *mp.Queue
		if err := w.Args(&q); err != nil {
			return err
		}
		for i := 0; ctx.Err() == nil; i++ {
			n := 1 << 10
			if i%16 == 0 {
				n = 1 << 18 // 1 MiB now and then: a slab of another class
			}
			x, err := tensor.On(device.GPU(0)).Full(tensor.Float32, float64(i), n)
			if err != nil {
				return err
			}
			if err := q.Put(ctx, x); err != nil {
				return err
			}
			_ = x.Release()
		}
		return ctx.Err()
	})
	// gpustream.consume takes GPU tensors and holds the last 64.
	mp.Register("gpustream.consume", func(ctx context.Context, w *mp.Worker) error {
		var q *mp.Queue
		if err := w.Args(&q); err != nil {
			return err
		}
		var held []*tensor.Tensor
		for {
			var x *tensor.Tensor
			if err := q.Get(ctx, &x); err != nil {
				return err
			}
			if held = append(held, x); len(held) > 64 {
				_ = held[0].Release()
				held = held[1:]
			}
		}
	})
}

// programGPUStream runs a producer and a consumer of GPU tensors, prints
// their pids, and waits to be killed.
func programGPUStream() int {
	ctx := context.Background()
	q, err := mp.NewQueue(mp.WithCapacity(256))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	prod, err := mp.Spawn(ctx, "gpustream.produce", 1, mp.WithArgs(q))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	cons, err := mp.Spawn(ctx, "gpustream.consume", 1, mp.WithArgs(q))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("pids", prod.Pids()[0], cons.Pids()[0])
	select {}
}

// TestGPUKilledAtRandom SIGKILLs the producer, the consumer or both of a
// stream of GPU tensors at a random moment, then the program, a hundred
// times (TENSORMP_GPU_KILL_RUNS): each time, within a second of the last
// death the device has every byte back that it had before, and nothing
// of the program is left in /dev/shm.
func TestGPUKilledAtRandom(t *testing.T) {
	rt := requireGPU(t)
	runs := 100
	if n, err := strconv.Atoi(os.Getenv("TENSORMP_GPU_KILL_RUNS")); err == nil {
		runs = n
	}
	leakcheck.Check(t)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 0))
	free := func() int64 {
		f, _, err := rt.MemInfo(0)
		require.NoError(t, err)
		return f
	}
	before := free()
	for i := range runs {
		victims := []string{"producer", "consumer", "both"}[i%3]
		p := startProgram(t, "program.gpu-stream", strategy.FileDescriptor, false)
		pids := pidsFrom(t, p.waitLine(t, "pids"))
		require.Len(t, pids, 2)
		started := []procStart{startOf(pids[0]), startOf(pids[1])}
		time.Sleep(time.Duration(rng.Int64N(int64(300 * time.Millisecond))))
		switch victims {
		case "producer":
			_ = syscall.Kill(pids[0], syscall.SIGKILL)
		case "consumer":
			_ = syscall.Kill(pids[1], syscall.SIGKILL)
		default:
			_ = syscall.Kill(pids[0], syscall.SIGKILL)
			_ = syscall.Kill(pids[1], syscall.SIGKILL)
		}
		require.NoError(t, p.cmd.Process.Signal(syscall.SIGKILL))
		p.wait(t)
		for i, pid := range pids {
			for alive(pid) && startOf(pid) == started[i] {
				time.Sleep(time.Millisecond)
			}
		}
		dead := time.Now()
		var now int64
		for now = free(); now < before && time.Since(dead) < time.Second; now = free() {
			time.Sleep(10 * time.Millisecond)
		}
		require.GreaterOrEqual(t, now, before, "run %d (%s killed): device memory a second after the last death", i, victims)
		p.expectGone(t)
		for _, pid := range append(pids, p.cmd.Process.Pid) {
			assert.Empty(t, cudashm.Of(pid), "run %d: driver files of %d", i, pid)
		}
	}
}

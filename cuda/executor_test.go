//go:build cgo && linux

package cuda

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// testDriver is the process's driver: the stand-in's in the tests (see
// TestMain).
func testDriver(t testing.TB) driver {
	t.Helper()
	d, err := load()
	require.NoError(t, err)
	return d
}

// Do runs work on the caller's thread with the device's context current,
// from many goroutines at once, and leaves the thread's context as it
// found it: none, or another device's.
func TestExecutorMakesItsContextCurrent(t *testing.T) {
	drv := testDriver(t)
	e, err := newExecutor(drv, 0)
	require.NoError(t, err)
	defer e.Stop()
	own, err := drv.RetainPrimaryContext(0)
	require.NoError(t, err)
	defer drv.ReleasePrimaryContext(0)
	other, err := drv.RetainPrimaryContext(1)
	require.NoError(t, err)
	defer drv.ReleasePrimaryContext(1)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			before := cuContext(0)
			if g%2 == 1 {
				before = other // a thread another library set up
			}
			assert.NoError(t, drv.SetCurrent(before))
			defer drv.SetCurrent(0)
			for range 50 {
				assert.NoError(t, e.Do(func() error {
					if c, _ := drv.Current(); c != own {
						return fmt.Errorf("context %v current inside Do, not device 0's %v", c, own)
					}
					p, err := drv.MemAlloc(16) // needs the context current here
					if err != nil {
						return err
					}
					return drv.MemFree(p)
				}))
				c, err := drv.Current()
				assert.NoError(t, err)
				assert.Equal(t, before, c, "the thread's context is back as it was")
			}
		})
	}
	wg.Wait()
}

func TestExecutorReentrantCallRunsInline(t *testing.T) {
	drv := testDriver(t)
	e, err := newExecutor(drv, 1)
	require.NoError(t, err)
	defer e.Stop()
	done := make(chan error, 1)
	go func() {
		done <- e.Do(func() error {
			outer := unix.Gettid()
			return e.Do(func() error {
				if unix.Gettid() != outer {
					return errors.New("the inner call left the outer call's thread")
				}
				if c, _ := drv.Current(); c == 0 {
					return errors.New("the inner call has no context current")
				}
				return nil
			})
		})
	}()
	select {
	case err := <-done:
		assert.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("a call from inside a call deadlocked")
	}
}

// Stop waits for a call under way before it gives the context back.
func TestExecutorStopWaitsForCalls(t *testing.T) {
	drv := testDriver(t)
	e, err := newExecutor(drv, 0)
	require.NoError(t, err)
	held := cudastub.Contexts(0)
	inside, release := make(chan struct{}), make(chan struct{})
	called := make(chan error, 1)
	go func() {
		called <- e.Do(func() error {
			close(inside)
			<-release
			p, err := drv.MemAlloc(16) // the context is still there
			if err == nil {
				err = drv.MemFree(p)
			}
			return err
		})
	}()
	<-inside
	stopped := make(chan struct{})
	go func() { e.Stop(); close(stopped) }()
	require.Eventually(t, func() bool { return errors.Is(e.Do(func() error { return nil }), ErrStopped) },
		10*time.Second, time.Millisecond, "Stop refuses new calls at once")
	assert.Equal(t, held, cudastub.Contexts(0), "the context stays retained while a call is under way")
	close(release)
	<-stopped
	assert.NoError(t, <-called)
	assert.Equal(t, held-1, cudastub.Contexts(0), "Stop released the context")
}

func TestExecutorPanicAndStop(t *testing.T) {
	e, err := newExecutor(testDriver(t), 0)
	require.NoError(t, err)
	err = e.Do(func() error { panic("kaboom") })
	assert.ErrorContains(t, err, "kaboom")
	assert.NoError(t, e.Do(func() error { return nil }), "the executor survives a panic")
	before := cudastub.Contexts(0)
	e.Stop()
	e.Stop() // twice is fine
	assert.ErrorIs(t, e.Do(func() error { return nil }), ErrStopped)
	assert.Equal(t, before-1, cudastub.Contexts(0), "Stop releases the primary context")
}

func TestExecutorsStartLazilyOncePerDevice(t *testing.T) {
	x := newExecutors(testDriver(t))
	defer x.Stop()
	a, err := x.Get(1)
	require.NoError(t, err)
	b, err := x.Get(1)
	require.NoError(t, err)
	assert.Same(t, a, b)
	c, err := x.Get(0)
	require.NoError(t, err)
	assert.NotSame(t, a, c)
	_, err = x.Get(2)
	assert.ErrorContains(t, err, "device 2 does not exist")
}

func init() {
	// cuda.exclusive asks for a context on device 1 and prints the error.
	reexec.Register("cuda.exclusive", func() int {
		d, err := load()
		if err == nil {
			var e *executor
			if e, err = newExecutor(d, 1); err == nil {
				e.Stop()
			}
		}
		fmt.Println(err)
		return 0
	})
}

func init() {
	// cuda.nopeer copies sevens from gpu:0 to gpu:1 on a machine whose
	// GPUs cannot reach each other's memory, and prints what happened.
	reexec.Register("cuda.nopeer", func() int {
		err := copyAcross()
		fmt.Println("result", err, cudastub.Sticky(0), cudastub.Sticky(1))
		return 0
	})
}

// copyAcross checks that a device-to-device copy between the devices is
// declined, and that a tensor's To, which then copies through the host,
// moves the bytes.
func copyAcross() error {
	r := newRuntime(mustLoad())
	defer r.Close()
	src, err := r.Alloc(0, 4096)
	if err != nil {
		return err
	}
	defer src.Release()
	dst, err := r.Alloc(1, 4096)
	if err != nil {
		return err
	}
	defer dst.Release()
	if done, err := dst.CopyFrom(src, 0, 4096); done || err != nil {
		return fmt.Errorf("a copy gpu:1 cannot make on the device: done %v, %v", done, err)
	}
	x, err := tensor.On(device.GPU(0)).Full(tensor.Uint8, 7, 4096)
	if err != nil {
		return err
	}
	defer x.Release()
	y, err := x.To(device.GPU(1))
	if err != nil {
		return err
	}
	defer y.Release()
	host, err := y.To(device.CPU())
	if err != nil {
		return err
	}
	got, err := tensor.Data[uint8](host)
	if err != nil {
		return err
	}
	if !bytes.Equal(got, bytes.Repeat([]byte{7}, 4096)) {
		return errors.New("gpu:1 does not hold gpu:0's bytes")
	}
	return nil
}

func mustLoad() driver {
	d, err := load()
	if err != nil {
		panic(err)
	}
	return d
}

// On a machine whose GPUs cannot reach each other's memory, a slab is
// mapped for its own device only (the driver refuses more), and a copy
// between devices is declined on the device and goes through the host
// instead of faulting.
func TestNoPeerAccess(t *testing.T) {
	cmd, err := reexec.Command(context.Background(), "cuda.nopeer")
	require.NoError(t, err)
	cmd.Env = append(cmd.Env, cudastub.EnvNoPeer+"=1")
	out, err := cmd.Output()
	require.NoError(t, err)
	assert.Equal(t, "result <nil> 0 0\n", string(out))
}

// A device in exclusive-process compute mode that another process holds
// refuses a context, and the error says why.
func TestExclusiveProcessModeIsNamed(t *testing.T) {
	drv := testDriver(t)
	e, err := newExecutor(drv, 1) // this process holds device 1
	require.NoError(t, err)
	defer e.Stop()
	cudastub.SetComputeMode(cudastub.Physical(1), 3)
	defer cudastub.SetComputeMode(cudastub.Physical(1), 0)
	cmd, err := reexec.Command(context.Background(), "cuda.exclusive")
	require.NoError(t, err)
	out, err := cmd.Output()
	require.NoError(t, err)
	assert.Contains(t, string(out), "CUDA_ERROR_DEVICE_UNAVAILABLE")
	assert.Contains(t, string(out), "exclusive-process compute mode")
	assert.Equal(t, "", contextHint(drv, 0), "device 0 is in the default mode")
}

// CopyIn copies a range that spans two mappings of one reservation, as a
// PyTorch tensor in an expandable segment does: the driver reports each
// mapping's range alone. A gap between them is an error.
func TestCopyInAcrossMappings(t *testing.T) {
	drv := testDriver(t)
	r := newRuntime(drv)
	defer r.Close()
	b, err := r.Alloc(0, 64)
	require.NoError(t, err)
	defer b.Release()
	e, g, err := r.slabDevice(0)
	require.NoError(t, err)
	var base DevicePtr
	var hs []memHandle
	err = e.Do(func() error {
		var err error
		if base, err = drv.MemAddressReserve(3*g, g); err != nil {
			return err
		}
		for i := range int64(3) {
			if i == 2 {
				break // the third chunk is left unmapped: a gap
			}
			h, err := drv.MemCreate(0, g)
			if err != nil {
				return err
			}
			hs = append(hs, h)
			p := base + DevicePtr(i*g)
			if err := drv.MemMap(p, g, h); err != nil {
				return err
			}
			if err := drv.MemSetAccess(p, g, []int{0}); err != nil {
				return err
			}
			if err := drv.MemsetD8(p, g); err != nil {
				return err
			}
		}
		return drv.Synchronize()
	})
	require.NoError(t, err)
	defer e.Do(func() error {
		for i, h := range hs {
			_ = drv.MemUnmap(base+DevicePtr(int64(i)*g), g)
			_ = drv.MemRelease(h)
		}
		return drv.MemAddressFree(base, 3*g)
	})
	require.NoError(t, b.CopyIn(base+DevicePtr(g-32), 64), "32 bytes of each chunk")
	assert.ErrorContains(t, b.CopyIn(base+DevicePtr(2*g-32), 64), "the memory there ends at")
	assert.Zero(t, cudastub.Sticky(0))
}

// A slab is unmapped only once the work queued on it is done, work that
// another library queued on a stream of its own (PyTorch's kernel, which
// the default stream is not ordered with) included: a block given back
// with such work pending closes its slab (it is larger than what the
// pool keeps), and the context survives.
func TestSlabCloseWaitsForForeignWork(t *testing.T) {
	drv := testDriver(t)
	r := newRuntime(drv)
	defer r.Close()
	b, err := r.Alloc(0, 300<<20)
	require.NoError(t, err)
	require.NoError(t, b.Sync())
	e, err := b.exec()
	require.NoError(t, err)
	require.NoError(t, e.Do(func() error { return sideMemset(b.ptr, b.size) }), "another library's work")
	require.NoError(t, b.Release())
	shm.Trim() // the slab's close, on a goroutine of its own, is done
	assert.Zero(t, cudastub.Sticky(0), "the unmap waited for the work")
	small, err := r.Alloc(0, 16)
	require.NoError(t, err)
	require.NoError(t, small.Release())
}

// A slab is closed outside the pool's lock: while its close waits for
// the device's work, the pool goes on allocating.
func TestSlabCloseLeavesThePoolFree(t *testing.T) {
	drv := testDriver(t)
	r := newRuntime(drv)
	defer r.Close()
	first, err := r.Alloc(0, 64)
	require.NoError(t, err)
	defer first.Release()
	big, err := r.Alloc(0, 300<<20)
	require.NoError(t, err)
	require.NoError(t, big.Sync())
	cudastub.SetDelay(2 * time.Second) // a long kernel
	defer cudastub.SetDelay(cudastub.DefaultDelay)
	e, err := big.exec()
	require.NoError(t, err)
	require.NoError(t, e.Do(func() error { return sideMemset(big.ptr, 4096) }), "another library's work")
	mappings := cudastub.Mappings()
	require.NoError(t, big.Release()) // over the pool's 256 MiB: its slab closes
	next, err := r.Alloc(0, 64)
	require.NoError(t, err)
	assert.Equal(t, mappings, cudastub.Mappings(), "allocated while the big slab's close waits for the work")
	shm.Trim()
	assert.Equal(t, mappings-1, cudastub.Mappings(), "Trim waits for the close")
	require.NoError(t, next.Release())
	assert.Zero(t, cudastub.Sticky(0))
}

// sideMemset queues a memset on a non-blocking stream of another
// library's in the context current here (inside an executor's Do).
func sideMemset(p DevicePtr, n int64) error {
	if r := cudastub.SideMemset(uint64(p), n, 0x5a); r != 0 {
		return fmt.Errorf("a memset on another stream: CUresult %d", r)
	}
	return nil
}

// A slab given back and closed on its own goroutine (behind another
// library's work) leaves no room on the device until its close is done:
// the next allocation that needs the room waits for it, out of room,
// before it tries again.
func TestAllocWaitsForAClosingSlabsRoom(t *testing.T) {
	drv := testDriver(t)
	r := newRuntime(drv)
	defer r.Close()
	free, total, err := r.MemInfo(0)
	require.NoError(t, err)
	cudastub.SetMemory(total - free + 400<<20) // room for one 300 MiB slab
	defer cudastub.SetMemory(total)
	big, err := r.Alloc(0, 300<<20)
	require.NoError(t, err)
	require.NoError(t, big.Sync())
	cudastub.SetDelay(300 * time.Millisecond)
	defer cudastub.SetDelay(cudastub.DefaultDelay)
	e, err := big.exec()
	require.NoError(t, err)
	require.NoError(t, e.Do(func() error { return sideMemset(big.ptr, 4096) }))
	require.NoError(t, big.Release()) // its slab's close waits 300 ms
	again, err := r.Alloc(0, 300<<20)
	require.NoError(t, err, "the retry waited for the close")
	require.NoError(t, again.Release())
	require.Zero(t, cudastub.Sticky(0))
}

// BenchmarkExecutorDo is the cost Do adds to a driver call, on the
// stand-in driver (whose context calls each take a lock).
func BenchmarkExecutorDo(b *testing.B) {
	e, err := newExecutor(testDriver(b), 0)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Stop()
	for b.Loop() {
		if err := e.Do(func() error { return nil }); err != nil {
			b.Fatal(err)
		}
	}
}

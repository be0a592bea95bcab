package cuda_test

import (
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

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/cudafake"
	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/tensor"
)

// fake is the driver of the tests that use the Default Runtime: its
// devices cannot export descriptors, so buffers are allocated one by one
// and travel by legacy CUDA IPC. slab_test.go tests device slabs on
// fakes of their own.
var fake = func() *cudafake.Driver {
	d := cudafake.New(2)
	d.SetFDExport(0, false)
	d.SetFDExport(1, false)
	return d
}()

func TestMain(m *testing.M) {
	cuda.UseDriver(fake) // every test here runs on the fake driver
	testmain.Run(m)
}

// Do runs work on the caller's thread with the device's context current,
// from many goroutines at once, and leaves the thread's context as it
// found it: none, or another device's.
func TestExecutorMakesItsContextCurrent(t *testing.T) {
	e, err := cuda.NewExecutor(fake, 0)
	require.NoError(t, err)
	defer e.Stop()
	own, err := fake.RetainPrimaryContext(0)
	require.NoError(t, err)
	defer fake.ReleasePrimaryContext(0)
	other, err := fake.RetainPrimaryContext(1)
	require.NoError(t, err)
	defer fake.ReleasePrimaryContext(1)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			before := cuda.Context(0)
			if g%2 == 1 {
				before = other // a thread another library set up
			}
			assert.NoError(t, fake.SetCurrent(before))
			defer fake.SetCurrent(0)
			for range 50 {
				assert.NoError(t, e.Do(func() error {
					if c, _ := fake.Current(); c != own {
						return fmt.Errorf("context %v current inside Do, not device 0's %v", c, own)
					}
					p, err := fake.MemAlloc(16) // needs the context current here
					if err != nil {
						return err
					}
					return fake.MemFree(p)
				}))
				c, err := fake.Current()
				assert.NoError(t, err)
				assert.Equal(t, before, c, "the thread's context is back as it was")
			}
		})
	}
	wg.Wait()
}

func TestExecutorReentrantCallRunsInline(t *testing.T) {
	e, err := cuda.NewExecutor(fake, 1)
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
				if c, _ := fake.Current(); c == 0 {
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
	e, err := cuda.NewExecutor(fake, 0)
	require.NoError(t, err)
	held := fake.Contexts(0)
	inside, release := make(chan struct{}), make(chan struct{})
	called := make(chan error, 1)
	go func() {
		called <- e.Do(func() error {
			close(inside)
			<-release
			_, err := fake.MemAlloc(16) // the context is still there
			return err
		})
	}()
	<-inside
	stopped := make(chan struct{})
	go func() { e.Stop(); close(stopped) }()
	require.Eventually(t, func() bool { return errors.Is(e.Do(func() error { return nil }), cuda.ErrStopped) },
		10*time.Second, time.Millisecond, "Stop refuses new calls at once")
	assert.Equal(t, held, fake.Contexts(0), "the context stays retained while a call is under way")
	close(release)
	<-stopped
	assert.NoError(t, <-called)
	assert.Equal(t, held-1, fake.Contexts(0), "Stop released the context")
}

func TestExecutorPanicAndStop(t *testing.T) {
	e, err := cuda.NewExecutor(fake, 0)
	require.NoError(t, err)
	err = e.Do(func() error { panic("kaboom") })
	assert.ErrorContains(t, err, "kaboom")
	assert.NoError(t, e.Do(func() error { return nil }), "the executor survives a panic")
	before := fake.Contexts(0)
	e.Stop()
	e.Stop() // twice is fine
	assert.ErrorIs(t, e.Do(func() error { return nil }), cuda.ErrStopped)
	assert.Equal(t, before-1, fake.Contexts(0), "Stop releases the primary context")
}

func TestExecutorsStartLazilyOncePerDevice(t *testing.T) {
	x := cuda.NewExecutors(fake)
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

func TestTensorsOnGPU(t *testing.T) {
	leakcheck.Check(t)
	live := fake.Live()
	x, err := tensor.On(device.GPU(0)).Arange(tensor.Float32, 6)
	require.NoError(t, err)
	assert.Equal(t, device.GPU(0), x.Place())
	m, err := x.Reshape(2, 3)
	require.NoError(t, err)
	tr, err := m.Transpose(0, 1)
	require.NoError(t, err)

	back, err := tr.To(device.CPU())
	require.NoError(t, err)
	vals, err := tensor.Values[float32](back)
	require.NoError(t, err)
	assert.Equal(t, []float32{0, 3, 1, 4, 2, 5}, vals, "host -> device -> host, through a view")

	y, err := x.To(device.GPU(1)) // device to device
	require.NoError(t, err)
	assert.Equal(t, device.GPU(1), y.Place())
	assert.True(t, tensor.Equal(x, y))
	assert.NotEmpty(t, fake.Threads[1], "device 1's work ran with device 1's context current")

	ctx := device.With(context.Background(), device.GPU(1))
	z, err := tensor.In(ctx).Zeros(tensor.Int8, 3)
	require.NoError(t, err)
	assert.Equal(t, device.GPU(1), z.Place(), "new tensors follow the context's place")
	zh, err := z.To(device.CPU())
	require.NoError(t, err)
	zv, err := tensor.Data[int8](zh)
	require.NoError(t, err)
	assert.Equal(t, []int8{0, 0, 0}, zv, "new device memory is zeroed")

	require.NoError(t, x.Release())
	require.NoError(t, y.Release())
	require.NoError(t, z.Release())
	assert.Equal(t, live, fake.Live(), "Release frees device memory")
}

// TestIPCKeepsMemoryWhileConsumersHoldIt plays producer and consumer in
// one process (the fake lets a process open its own handles): the
// producer's memory lives exactly as long as a consumer uses it.
func TestIPCKeepsMemoryWhileConsumersHoldIt(t *testing.T) {
	leakcheck.Check(t)
	rt, err := cuda.Default()
	require.NoError(t, err)
	live := fake.Live()

	buf, err := rt.Alloc(0, 1024)
	require.NoError(t, err)
	require.NoError(t, buf.Write([]byte("weights"), 100))
	h1, err := buf.Export()
	require.NoError(t, err)
	h2, err := buf.Export() // a second message
	require.NoError(t, err)
	assert.Equal(t, h1.Mem, h2.Mem)
	assert.True(t, h1.Token.Busy(), "two messages hold the token")

	c1, err := rt.Import(received(t, h1))
	require.NoError(t, err)
	c2, err := rt.Import(received(t, h2))
	require.NoError(t, err)
	assert.Equal(t, 1, rt.Opened(), "a handle is opened once per process")
	got := make([]byte, 7)
	require.NoError(t, c1.Read(got, 100))
	assert.Equal(t, "weights", string(got))
	require.NoError(t, c2.Write([]byte("W"), 100))
	require.NoError(t, buf.Read(got[:1], 100))
	assert.Equal(t, "W", string(got[:1]), "the producer sees the consumer's write")

	// A received buffer can be sent on to a third process.
	h3, err := c1.Export()
	require.NoError(t, err)
	assert.Equal(t, h1.Mem, h3.Mem, "the third process opens the original allocation")
	c3, err := rt.Import(received(t, h3))
	require.NoError(t, err)

	require.NoError(t, buf.Release())
	assert.Equal(t, 1, rt.Limbo(), "freed by the producer, still used by consumers")
	assert.Equal(t, live+1, fake.Live())
	require.NoError(t, c1.Release())
	require.NoError(t, c3.Release())
	rt.CollectLimbo()
	assert.Equal(t, 1, rt.Limbo(), "one consumer still holds it")
	require.NoError(t, c2.Release())
	assert.Equal(t, 0, rt.Opened(), "the last consumer closes the handle")
	// The consumer that sent it on keeps a ticket description for a few
	// milliseconds after it let go (see shm.Ticket).
	assert.Eventually(t, func() bool {
		rt.CollectLimbo()
		return rt.Limbo() == 0
	}, time.Second, 5*time.Millisecond, "collected once nobody holds it")
	assert.Equal(t, live, fake.Live(), "collected: the memory is freed")
}

func TestUnsentExportAndOOMCollectLimbo(t *testing.T) {
	leakcheck.Check(t)
	rt, err := cuda.Default()
	require.NoError(t, err)
	live := fake.Live()

	a, err := rt.Alloc(0, 4096)
	require.NoError(t, err)
	h, err := a.Export()
	require.NoError(t, err)
	h.Ticket.Discard() // the message was never sent
	require.NoError(t, a.Release())
	assert.Equal(t, live, fake.Live(), "nobody else held it: freed at once")

	fake.SetLimit(8 << 10)
	defer fake.SetLimit(0)
	b, err := rt.Alloc(0, 4096)
	require.NoError(t, err)
	h, err = b.Export()
	require.NoError(t, err)
	c, err := rt.Import(received(t, h))
	require.NoError(t, err)
	require.NoError(t, b.Release())
	assert.Equal(t, 1, rt.Limbo())
	// The consumer lets go, but nothing has looked at the limbo since.
	require.NoError(t, c.Release())
	big, err := rt.Alloc(0, 6<<10)
	require.NoError(t, err, "out of memory: the limbo was collected and the allocation retried")
	assert.Equal(t, 0, rt.Limbo())
	require.NoError(t, big.Release())
	assert.Equal(t, live, fake.Live())
}

// received is what a receiving process makes of h: the same description,
// with a token block of its own attached through the ticket's descriptor,
// the one the message carries; then the message is done.
func received(t *testing.T, h gpushare.Handle) gpushare.Handle {
	t.Helper()
	seg := h.Token.Segment()
	tok, err := shm.AttachBlock(h.Ticket.FD(), statOf(t, h.Ticket.FD()), false, seg.Size(), h.Token.Offset(), 8, h.Token.Gen())
	require.NoError(t, err)
	h.Ticket.Done()
	h.Token, h.Ticket = tok, nil
	return h
}

func TestBadRanges(t *testing.T) {
	rt, err := cuda.Default()
	require.NoError(t, err)
	b, err := rt.Alloc(0, 16)
	require.NoError(t, err)
	defer b.Release()
	assert.Error(t, b.Write(make([]byte, 17), 0))
	assert.Error(t, b.Read(make([]byte, 4), 13))
	assert.Error(t, b.Read(make([]byte, 4), -1))
	_, err = rt.Import(gpushare.Handle{Size: 16})
	assert.ErrorContains(t, err, "without a reference token")

	for _, bad := range []struct{ off, size int64 }{{0, 17}, {8, 9}, {16, 1}} {
		h, err := b.Export() // each try is a message of its own
		require.NoError(t, err)
		r := received(t, h)
		r.Offset, r.Size = bad.off, bad.size
		_, err = rt.Import(r)
		assert.ErrorContains(t, err, "from an allocation of 16", "offset %d size %d", bad.off, bad.size)
		require.NoError(t, r.Token.Release())
	}
	assert.Equal(t, 0, rt.Opened(), "a refused import closes what it opened")
	_, err = rt.Alloc(5, 16)
	assert.ErrorContains(t, err, "does not exist")
}

// statOf is shm.StatFile for a descriptor the test knows is good.
func statOf(t *testing.T, fd int) shm.FileStat {
	t.Helper()
	st, err := shm.StatFile(fd)
	require.NoError(t, err)
	return st
}

// TestCloseIsFinal: a closed Runtime gives its contexts back and never
// makes new ones, so nothing touches memory of the closed contexts.
func TestCloseIsFinal(t *testing.T) {
	drv := cudafake.New(1)
	drv.SetFDExport(0, false) // buffers allocated one by one
	rt := cuda.NewRuntime(drv)
	live, ctxs := drv.Live(), drv.Contexts(0)
	kept, err := rt.Alloc(0, 64)
	require.NoError(t, err)
	gone, err := rt.Alloc(0, 64)
	require.NoError(t, err)
	require.NoError(t, gone.Release())
	assert.Equal(t, ctxs+1, drv.Contexts(0))

	rt.Close()
	assert.Equal(t, ctxs, drv.Contexts(0), "Close gives the context back")
	_, err = rt.Alloc(0, 64)
	assert.ErrorIs(t, err, cuda.ErrStopped)
	assert.ErrorIs(t, kept.Write([]byte{1}, 0), cuda.ErrStopped)
	assert.ErrorIs(t, kept.Release(), cuda.ErrStopped, "a buffer of a closed context is not freed in a new one")
	assert.Equal(t, ctxs, drv.Contexts(0), "no context is made again")
	assert.Equal(t, live+1, drv.Live(), "what the closed context held goes with the process")
}

// TestCopyIn: memory another library allocated is copied in whole, and
// waited for; a range that leaves its allocation, or an address the
// driver does not know, copies nothing.
func TestCopyIn(t *testing.T) {
	rt, err := cuda.Default()
	require.NoError(t, err)
	foreign, err := rt.Alloc(0, 32) // stands for another library's allocation
	require.NoError(t, err)
	defer foreign.Release()
	src := make([]byte, 32)
	for i := range src {
		src[i] = byte(i + 1)
	}
	require.NoError(t, foreign.Write(src, 0))
	b, err := rt.Alloc(0, 16)
	require.NoError(t, err)
	defer b.Release()

	syncs := fake.Syncs()
	require.NoError(t, b.CopyIn(foreign.Ptr()+8, 16))
	assert.Greater(t, fake.Syncs(), syncs, "CopyIn waits for its copy")
	got := make([]byte, 16)
	require.NoError(t, b.Read(got, 0))
	assert.Equal(t, src[8:24], got)

	require.NoError(t, b.Write(make([]byte, 16), 0))
	assert.ErrorContains(t, b.CopyIn(foreign.Ptr()+20, 16), "the memory there ends at")
	assert.ErrorContains(t, b.CopyIn(1<<20, 16), "CUDA_ERROR_INVALID_VALUE")
	assert.ErrorContains(t, b.CopyIn(foreign.Ptr(), 17), "outside a buffer of 16 bytes")
	require.NoError(t, b.Read(got, 0))
	assert.Equal(t, make([]byte, 16), got, "a refused copy copies nothing")

	require.NoError(t, b.Sync())
	require.NoError(t, foreign.Release())
	assert.ErrorContains(t, foreign.Sync(), "freed")
}

// BenchmarkExecutorDo is the cost Do adds to a driver call, on the fake
// driver (whose context calls each take a lock and a gettid).
func BenchmarkExecutorDo(b *testing.B) {
	e, err := cuda.NewExecutor(fake, 0)
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

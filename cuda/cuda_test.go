//go:build cgo && linux

package cuda_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/tensor"
)

// Every test here runs on the stand-in driver, through the real binding,
// on a machine of two GPUs that export their memory as descriptors.
func TestMain(m *testing.M) {
	testmain.Run(m, testmain.WithStandInGPU(cudastub.Config{Devices: 2}))
}

func TestTensorsOnGPU(t *testing.T) {
	leakcheck.Check(t)
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

	ops := cudastub.Ops(1)
	y, err := x.To(device.GPU(1)) // device to device: gpu:1 reads gpu:0's slab
	require.NoError(t, err)
	assert.Equal(t, device.GPU(1), y.Place())
	assert.True(t, tensor.Equal(x, y))
	assert.Greater(t, cudastub.Ops(1), ops, "device 1's work ran with device 1's context current")
	assert.Zero(t, cudastub.Sticky(0))
	assert.Zero(t, cudastub.Sticky(1))

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
}

// A buffer given back with its clearing still queued, whose slab then
// closes at once (the pool keeps less than it), leaves the context whole:
// Release waits for the buffer's own work, and the slab's close for the
// context's (each alone suffices here; TestSlabCloseWaitsForForeignWork
// and the recycled-block case of tests/gpufd_test.go tell them apart).
func TestReleaseWaitsForQueuedWork(t *testing.T) {
	leakcheck.Check(t)
	rt := cuda.NewTestRuntime(t, false)
	for range 3 {
		b, err := rt.Alloc(0, 300<<20) // over the pool's 256 MiB: its slab goes with it
		require.NoError(t, err)
		require.NoError(t, b.Release())
	}
	shm.Trim() // the slabs' closes, on goroutines of their own, are done
	handles := cudastub.Handles()
	small, err := rt.Alloc(0, 16)
	require.NoError(t, err, "the context survived")
	require.NoError(t, small.Release())
	assert.Zero(t, cudastub.Sticky(0))
	rt.Close()
	assert.LessOrEqual(t, cudastub.Handles(), handles)
}

// On the legacy path, a process that receives its own export back does
// not open it (the driver refuses a process its own handles): it reaches
// the allocation directly, which lives, in the limbo, while the message's
// hold does.
func TestOwnIPCHandleComesBack(t *testing.T) {
	leakcheck.Check(t)
	rt := cuda.NewTestRuntime(t, true)
	allocs := cudastub.Allocs()
	buf, err := rt.Alloc(0, 1024)
	require.NoError(t, err)
	require.NoError(t, buf.Write([]byte("weights"), 100))
	h, err := buf.Export()
	require.NoError(t, err)
	back, err := rt.Import(received(t, h))
	require.NoError(t, err)
	assert.Zero(t, cudastub.IPCOpened(), "nothing opened")
	got := make([]byte, 7)
	require.NoError(t, back.Read(got, 100))
	assert.Equal(t, "weights", string(got))

	require.NoError(t, buf.Release())
	assert.Equal(t, 1, rt.Limbo(), "the received buffer still holds it")
	require.NoError(t, back.Read(got, 100))
	assert.Equal(t, "weights", string(got))
	require.NoError(t, back.Release())
	assert.Eventually(t, func() bool {
		rt.CollectLimbo()
		return rt.Limbo() == 0
	}, time.Second, 5*time.Millisecond, "collected once nobody holds it")
	assert.Equal(t, allocs, cudastub.Allocs(), "freed")
}

func TestUnsentExportAndOOMCollectLimbo(t *testing.T) {
	leakcheck.Check(t)
	rt := cuda.NewTestRuntime(t, true)
	allocs := cudastub.Allocs()

	a, err := rt.Alloc(0, 4096)
	require.NoError(t, err)
	h, err := a.Export()
	require.NoError(t, err)
	h.Ticket.Discard() // the message was never sent
	require.NoError(t, a.Release())
	assert.Equal(t, allocs, cudastub.Allocs(), "nobody else held it: freed at once")

	free, total, err := rt.MemInfo(0)
	require.NoError(t, err)
	cudastub.SetMemory(total - free + 12<<10) // three pages left
	defer cudastub.SetMemory(total)
	b, err := rt.Alloc(0, 4096)
	require.NoError(t, err)
	h, err = b.Export()
	require.NoError(t, err)
	c, err := rt.Import(received(t, h))
	require.NoError(t, err)
	require.NoError(t, b.Release())
	assert.Equal(t, 1, rt.Limbo())
	// The receiver lets go, but nothing has looked at the limbo since.
	require.NoError(t, c.Release())
	big, err := rt.Alloc(0, 12<<10)
	require.NoError(t, err, "out of memory: the limbo was collected and the allocation retried")
	assert.Equal(t, 0, rt.Limbo())
	require.NoError(t, big.Release())
	assert.Equal(t, allocs, cudastub.Allocs())
}

// received is what a receiving process makes of h: the same description,
// with a token block of its own attached through the ticket's descriptor,
// the one the message carries; then the message is done.
func received(t *testing.T, h gpushare.Handle) gpushare.Handle {
	t.Helper()
	seg := h.Token.Segment()
	tok, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, h.Ticket.FD()).ID, Size: seg.Size()}, Offset: h.Token.Offset(), Size: 8, Gen: h.Token.Gen(), Ticket: h.Ticket.FD()})
	require.NoError(t, err)
	h.Ticket.Done()
	h.Token, h.Ticket = tok, nil
	return h
}

func TestBadRanges(t *testing.T) {
	rt := cuda.NewTestRuntime(t, true)
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

// statOf is shm.Stat for a descriptor the test knows is good.
func statOf(t *testing.T, fd int) shm.SegmentRef {
	t.Helper()
	st, err := shm.Stat(fd)
	require.NoError(t, err)
	return st
}

// TestCloseIsFinal: a closed Runtime gives its contexts back and never
// makes new ones, so nothing touches memory of the closed contexts.
func TestCloseIsFinal(t *testing.T) {
	rt := cuda.NewTestRuntime(t, true) // buffers allocated one by one
	ctxs := cudastub.Contexts(0)
	kept, err := rt.Alloc(0, 64)
	require.NoError(t, err)
	gone, err := rt.Alloc(0, 64)
	require.NoError(t, err)
	require.NoError(t, gone.Release())
	assert.Equal(t, ctxs+1, cudastub.Contexts(0))

	rt.Close()
	assert.Equal(t, ctxs, cudastub.Contexts(0), "Close gives the context back")
	_, err = rt.Alloc(0, 64)
	assert.ErrorIs(t, err, cuda.ErrStopped)
	assert.ErrorIs(t, kept.Write([]byte{1}, 0), cuda.ErrStopped)
	assert.ErrorIs(t, kept.Release(), cuda.ErrStopped, "a buffer of a closed context is not freed in a new one")
	assert.Equal(t, ctxs, cudastub.Contexts(0), "no context is made again")
}

// A Runtime closed while a slab is still in use elsewhere keeps the
// device's context until the slab goes: the slab is unmapped inside it.
func TestCloseKeepsTheContextForLiveSlabs(t *testing.T) {
	leakcheck.Check(t)
	ctxs, handles := cudastub.Contexts(0), cudastub.Handles()
	rt := cuda.NewTestRuntime(t, false)
	b, err := rt.Alloc(0, 64)
	require.NoError(t, err)
	rt.Close()
	assert.Equal(t, ctxs+1, cudastub.Contexts(0), "a slab in use keeps the context")
	require.NoError(t, b.Release())
	shm.Trim()
	assert.Equal(t, ctxs, cudastub.Contexts(0), "the last slab gives the context back")
	assert.Equal(t, handles, cudastub.Handles(), "and its memory, inside the context")
}

// TestCopyIn: memory another library allocated is copied in whole, and
// waited for; a range that leaves its allocation, or an address the
// driver does not know, copies nothing.
func TestCopyIn(t *testing.T) {
	rt := cuda.NewTestRuntime(t, true)
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

	syncs := cudastub.Syncs()
	require.NoError(t, b.CopyIn(foreign.Ptr()+8, 16))
	assert.Greater(t, cudastub.Syncs(), syncs, "CopyIn waits for its copy")
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

// A copy to another device reads its source on that device's stream:
// the source given back at once (its slab closed, being larger than what
// the pool keeps) must not be unmapped under it, and the copy holds the
// source's bytes.
func TestCopyToAnotherDeviceBeforeTheSourceGoes(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.On(device.GPU(0)).Full(tensor.Uint8, 7, 300<<20)
	require.NoError(t, err)
	y, err := x.To(device.GPU(1))
	require.NoError(t, err)
	defer y.Release()
	require.NoError(t, x.Release())
	shm.Trim()
	assert.Zero(t, cudastub.Sticky(1), "gpu:1's copy did not fault")
	head, err := y.Narrow(0, 0, 4096)
	require.NoError(t, err)
	host, err := head.To(device.CPU())
	require.NoError(t, err)
	vals, err := tensor.Data[uint8](host)
	require.NoError(t, err)
	assert.Equal(t, bytes.Repeat([]byte{7}, 4096), vals)
}

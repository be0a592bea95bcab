//go:build linux

package reduction

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// returnMeta is a lane message's metadata that returns b, a block of
// this process's pool, by identity: 4096 bytes.
func returnMeta(b *shm.Block) Meta {
	seg := b.Segment()
	m := validMeta(seg.ID())
	m.FDIndex, m.Shape, m.Strides, m.DType = -1, []int{4096}, []int{1}, tensor.Uint8
	m.SegmentSize, m.BlockOffset, m.Gen = seg.Size(), b.Offset(), b.Gen()
	return m
}

// inLane keeps the return m names as a lane's reader's scanner does for
// an untaken message (see shm.RegisterReturns), until the test ends: a
// reclaim of the pool meanwhile (a trim of a pool over its limit, at any
// release) keeps the slot for the message, not for reuse.
func inLane(t *testing.T, m Meta) {
	ref := shm.ReturnRef{ID: m.segmentID(), Offset: m.BlockOffset, Gen: m.Gen}
	t.Cleanup(shm.RegisterReturns(func(yield func(shm.ReturnRef)) { yield(ref) }))
}

// A lane's message that returns a block this process made gives the
// storage that holds it, or, that storage released, the block itself,
// taken back from the pool; one taken while another goroutine releases
// that storage waits for the release and gets the block.
func TestLaneReturnFindsItsBlock(t *testing.T) {
	leakcheck.Check(t)
	pool := shm.DefaultPool()
	decode := func(m Meta) (*tensor.Tensor, error) {
		var fds fd.Set
		var x *tensor.Tensor
		err := carry.DecodeFrom(extMessage(t, m), &fds, &x, pinnedLane{}, true)
		return x, err
	}

	b, err := pool.Alloc(4096)
	require.NoError(t, err)
	s, err := tensor.NewStorage(device.CPU(), b)
	require.NoError(t, err)
	registerBlock(s, b)
	m := returnMeta(b)
	inLane(t, m)
	x, err := decode(m)
	require.NoError(t, err)
	assert.Same(t, s, x.Storage(), "the storage that holds it")

	type decoded struct {
		x   *tensor.Tensor
		err error
	}
	got := make(chan decoded, 1)
	s.OnRelease(func() {
		// Taken on another goroutine while this Release is under way:
		// the storage is released, its block not yet.
		go func() {
			x, err := decode(m)
			got <- decoded{x, err}
		}()
		time.Sleep(200 * time.Microsecond)
	})
	require.NoError(t, s.Release())
	d := <-got
	require.NoError(t, d.err, "the block, once the release is done")
	y, ok := d.x.Storage().Backing().(*shm.Block)
	require.True(t, ok)
	assert.Same(t, b, y, "the same block, taken back")
	again, err := decode(m)
	require.NoError(t, err)
	assert.Same(t, d.x.Storage(), again.Storage(), "the message's storage holds it now")
	require.NoError(t, d.x.Release())

	// A block of a segment this process did not make, nor pins for the
	// lane, is not the lane's.
	seg, err := shm.Create(1<<20, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	defer seg.Release()
	other := validMeta(seg.ID())
	other.FDIndex, other.SegmentSize, other.BlockOffset, other.Gen = -1, 1<<20, 4096, 1
	_, err = decode(other)
	assert.ErrorIs(t, err, shm.ErrNotMapped)
	assert.ErrorIs(t, err, ErrMalformed)
}

// Two messages that return one block, decoded at once, give the same
// storage: one takes the block back, the other finds it.
func TestLaneReturnsOfOneBlockAtOnce(t *testing.T) {
	leakcheck.Check(t)
	b, err := shm.DefaultPool().Alloc(4096)
	require.NoError(t, err)
	m := returnMeta(b)
	inLane(t, m)
	require.NoError(t, b.Release())
	for range 50 {
		got := make(chan *tensor.Tensor, 2)
		for range 2 {
			go func() {
				var fds fd.Set
				var x *tensor.Tensor
				err := carry.DecodeFrom(extMessage(t, m), &fds, &x, pinnedLane{}, true)
				assert.NoError(t, err)
				got <- x
			}()
		}
		x, y := <-got, <-got
		require.NotNil(t, x)
		require.NotNil(t, y)
		assert.Same(t, x.Storage(), y.Storage())
		require.NoError(t, x.Release())
	}
}

// A reclaim of the pool between a return's release and its message's
// decode (a trim of a pool over its limit, which any release may run)
// keeps the slot that a lane's untaken message names: the decode takes
// the block back.
func TestLaneReturnOutlivesAReclaim(t *testing.T) {
	leakcheck.Check(t)
	pool := shm.DefaultPool()
	b, err := pool.Alloc(4096)
	require.NoError(t, err)
	m := returnMeta(b)
	inLane(t, m)
	require.NoError(t, b.Release())
	pool.InUse() // reclaims every class
	var fds fd.Set
	var x *tensor.Tensor
	require.NoError(t, carry.DecodeFrom(extMessage(t, m), &fds, &x, pinnedLane{}, true))
	y, ok := x.Storage().Backing().(*shm.Block)
	require.True(t, ok)
	assert.Same(t, b, y, "the same block, taken back")
	require.NoError(t, x.Release())
}

// A batch that returns blocks of this process's pool, by a lane that
// pins their segment (this process maps it a second time, as where a
// block of it came back by descriptor), takes each block back from its
// pool: no lock call, none ahead for the batch on that second mapping.
func TestLaneBatchOfReturnsTakesNoLock(t *testing.T) {
	leakcheck.Check(t)
	pool := shm.DefaultPool()
	const n = 8
	bs := make([]*shm.Block, n)
	ms := make([]Meta, n)
	for i := range bs {
		b, err := pool.Alloc(4096)
		require.NoError(t, err)
		bs[i], ms[i] = b, returnMeta(b)
		inLane(t, ms[i])
	}
	require.Equal(t, bs[0].Segment().ID(), bs[n-1].Segment().ID(), "one segment")
	tk, err := bs[0].Ticket()
	require.NoError(t, err)
	second, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: bs[0].Segment().ID(), Size: bs[0].Segment().Size()}, Offset: bs[0].Offset(), Size: 4096, Gen: bs[0].Gen(), Ticket: tk.FD()})
	tk.Done()
	require.NoError(t, err)
	require.NoError(t, second.Release())
	unpin, _, ok := shm.Pin(bs[0].Segment().ID())
	require.True(t, ok, "this process maps its own segment a second time")
	defer unpin()
	for _, b := range bs {
		require.NoError(t, b.Release())
	}

	before := shm.AttachLocks()
	var fds fd.Set
	var xs []*tensor.Tensor
	require.NoError(t, carry.DecodeFrom(batchMessage(t, ms...), &fds, &xs, pinnedLane{bs[0].Segment().ID(): true}, true))
	assert.Equal(t, before, shm.AttachLocks(), "no lock call")
	require.Len(t, xs, n)
	for i, x := range xs {
		y, ok := x.Storage().Backing().(*shm.Block)
		require.True(t, ok)
		assert.Same(t, bs[i], y, "block %d taken back", i)
		require.NoError(t, x.Release())
	}
}

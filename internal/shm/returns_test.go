//go:build linux

package shm_test

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
)

// small is a block size that slabs pack, many to a segment.
const small = 4 << 10

// returnOf names b as a message that returns it names it.
func returnOf(b *shm.Block) shm.ReturnRef {
	return shm.ReturnRef{ID: b.Segment().ID(), Offset: b.Offset(), Gen: b.Gen()}
}

// A block released by its producer, waiting in its pool, is taken back by
// Revive for a message that returns it: the same block, in use again.
// One in use, reused since, of another size, or of no pool of this
// process is not.
func TestReviveTakesBackAReleasedBlock(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, small)
	ref := returnOf(a)
	_, err := shm.Revive(ref, small)
	assert.ErrorIs(t, err, shm.ErrInUse, "in use")
	a.Bytes()[0] = 42
	require.NoError(t, a.Release())

	_, err = shm.Revive(ref, small-1)
	assert.ErrorIs(t, err, shm.ErrStaleBlock, "another size")
	b, err := shm.Revive(ref, small)
	require.NoError(t, err)
	assert.Same(t, a, b)
	assert.Equal(t, byte(42), b.Bytes()[0])
	assert.Equal(t, 1, p.InUse(), "in use again")
	c := mustAlloc(t, p, small)
	assert.False(t, c.Segment() == b.Segment() && c.Offset() == b.Offset(), "not handed out while revived")
	_, err = shm.Revive(ref, small)
	assert.ErrorIs(t, err, shm.ErrStaleBlock, "revived once")
	require.NoError(t, c.Release())
	require.NoError(t, b.Release()) // the warmer

	assert.Zero(t, p.InUse(), "taken back by the reclaim")
	_, err = shm.Revive(ref, small)
	assert.ErrorIs(t, err, shm.ErrStaleBlock, "free, its generation bumped")
	_, err = shm.Revive(shm.ReturnRef{ID: ref.ID, Offset: ref.Offset, Gen: b.Gen()}, small)
	assert.ErrorIs(t, err, shm.ErrStaleBlock, "free, of the generation it is handed out with next (a peer that guessed it)")
	assert.NotErrorIs(t, err, shm.ErrInUse, "free, not on its way to the pool")
	d := mustAlloc(t, p, small)
	require.True(t, d.Segment() == a.Segment() && d.Offset() == ref.Offset, "the warmest slot is handed out first")
	assert.Greater(t, d.Gen(), ref.Gen)
	_, err = shm.Revive(ref, small)
	assert.ErrorIs(t, err, shm.ErrStaleBlock, "reused")
	require.NoError(t, d.Release())
	_, err = shm.Revive(ref, small)
	assert.ErrorIs(t, err, shm.ErrStaleBlock, "released again, waiting in the pool, but of a later generation")
	assert.NotErrorIs(t, err, shm.ErrInUse)
	e, err := shm.Revive(returnOf(d), small)
	require.NoError(t, err, "its own generation's message takes it back")
	require.NoError(t, e.Release())

	_, err = shm.Revive(shm.ReturnRef{ID: shm.ID{Dev: 1, Ino: 1}, Offset: ref.Offset, Gen: 1}, small)
	assert.ErrorIs(t, err, shm.ErrNotReturnable)
	_, err = shm.Revive(shm.ReturnRef{ID: ref.ID, Offset: ref.Offset + 1, Gen: ref.Gen}, small)
	assert.ErrorIs(t, err, shm.ErrNotReturnable, "no slot starts there")
}

// A block of a pool whose data lies in an extent (a device's) is not a
// CPU block any message may return.
func TestReviveRefusesExtentBlocks(t *testing.T) {
	leakcheck.Check(t)
	var made extents
	p := shm.NewExtentPool(1<<30, made.make)
	defer p.Trim(0)
	b := mustAlloc(t, p, small)
	ref := returnOf(b)
	require.NoError(t, b.Release())
	_, err := shm.Revive(ref, small)
	assert.ErrorIs(t, err, shm.ErrNotReturnable)
}

// A block released while lent (parked) is revived too, and stays in use
// when its loans come back.
func TestReviveTakesBackAParkedBlock(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, small)
	require.NoError(t, a.Lend())
	require.NoError(t, a.Release())
	b, err := shm.Revive(returnOf(a), small)
	require.NoError(t, err)
	a.Return()
	assert.Equal(t, 1, p.InUse(), "the loan's return does not put back a revived block")
	c := mustAlloc(t, p, small)
	assert.False(t, c.Segment() == b.Segment() && c.Offset() == b.Offset())
	require.NoError(t, b.Release())
	require.NoError(t, c.Release())
	assert.Zero(t, p.InUse())
}

// A pool does not reuse a released slot that a registered scanner names
// (a message returns it), though no description holds it; once no scanner
// names it, it does.
func TestReclaimKeepsReturnedSlots(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, small)
	b := mustAlloc(t, p, small)
	ref := returnOf(a)
	unregister := shm.RegisterReturns(func(yield func(shm.ReturnRef)) { yield(ref) })
	defer unregister()
	require.NoError(t, a.Release())
	require.NoError(t, b.Release())
	assert.Equal(t, 1, p.InUse(), "the returned block is kept, the other taken back")
	c := mustAlloc(t, p, small)
	assert.False(t, c.Segment() == a.Segment() && c.Offset() == ref.Offset, "a returned block is not reused")
	back, err := shm.Revive(ref, small)
	require.NoError(t, err, "and is taken back by the message")
	require.NoError(t, back.Release())
	assert.Equal(t, 2, p.InUse(), "c, and the returned block, named still")
	unregister()
	assert.Equal(t, 1, p.InUse(), "named no more: taken back")
	require.NoError(t, c.Release())

	// A scanner names a block by its generation: a later one of the slot is
	// not kept for it.
	unregister = shm.RegisterReturns(func(yield func(shm.ReturnRef)) { yield(ref) })
	defer unregister()
	d := mustAlloc(t, p, small)
	require.True(t, d.Segment() == a.Segment() && d.Offset() == ref.Offset, "the warmest slot is handed out first")
	require.NoError(t, d.Release())
	assert.Zero(t, p.InUse())

	// A scanner that stops naming a block (its message was taken) lets
	// it go at the next reclaim.
	var naming atomic.Bool
	naming.Store(true)
	e := mustAlloc(t, p, small)
	later := returnOf(e)
	unregisterLater := shm.RegisterReturns(func(yield func(shm.ReturnRef)) {
		if naming.Load() {
			yield(later)
		}
	})
	defer unregisterLater()
	require.NoError(t, e.Release())
	assert.Equal(t, 1, p.InUse(), "named")
	naming.Store(false)
	assert.Zero(t, p.InUse(), "named no more")
}

// A slot another description holds keeps its generation through a
// reclaim that asks the scanners too: the holder's later return of it
// is taken back.
func TestReclaimLeavesHeldSlotsToTheirHolders(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, small)
	ref := returnOf(a)
	msg := send(t, a)
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: a.Segment().Size()}, Offset: a.Offset(), Size: small, Gen: a.Gen(), Ticket: msg})
	require.NoError(t, err)
	require.NoError(t, unix.Close(msg))
	unregister := shm.RegisterReturns(func(yield func(shm.ReturnRef)) { yield(shm.ReturnRef{ID: ref.ID, Offset: ref.Offset + small, Gen: 1}) })
	defer unregister()
	require.NoError(t, a.Release())
	p.Trim(1 << 30) // the ticket description goes: the receiver's lock alone holds the slot
	assert.Equal(t, 1, p.InUse(), "held by the receiver")
	back, err := shm.Revive(ref, small)
	require.NoError(t, err, "its generation unchanged")
	require.NoError(t, r.Release())
	require.NoError(t, back.Release())
}

// Produced lists, and Returnable answers for, only segments whose blocks
// a message may return by identity: a named pool's are not among them
// (a lane's writer never names their blocks so), an unnamed pool's are.
func TestProducedListsNoNamedSegment(t *testing.T) {
	p := testPool(t)
	shm.EnableNamedPool()
	t.Cleanup(func() { shm.Trim() }) // the named pool's names go, whatever the test's end
	named := mustAlloc(t, shm.NamedPool(), small)
	defer named.Release()
	require.NotEmpty(t, named.Segment().Name())
	b := mustAlloc(t, p, small)
	defer b.Release()

	ids, _ := shm.Produced(nil, 1<<20)
	assert.Contains(t, ids, b.Segment().ID())
	assert.True(t, shm.Returnable(b.Segment().ID()))
	assert.NotContains(t, ids, named.Segment().ID(), "a named segment is listed as returnable")
	assert.False(t, shm.Returnable(named.Segment().ID()), "a named segment")
}

// Blocks a reclaim found held by a lane's returns, and that the returns
// then took back, no longer count as held: the class reclaims again once
// reclaimBatch blocks came back, not once as many as it thought held did.
func TestRevivedBlocksLeaveTheReclaimsOnTime(t *testing.T) {
	p := testPool(t)
	const size, burst, named, stream = 4 << 10, 6000, 2000, 3000
	var bs []*shm.Block
	for range burst { // free blocks enough for the stream without a reclaim
		bs = append(bs, mustAlloc(t, p, size))
	}
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
	require.Zero(t, p.InUse())
	var refs []shm.ReturnRef
	bs = bs[:0]
	for range named {
		b := mustAlloc(t, p, size)
		bs = append(bs, b)
		refs = append(refs, returnOf(b))
	}
	unregister := shm.RegisterReturns(func(yield func(shm.ReturnRef)) {
		for _, r := range refs {
			yield(r)
		}
	})
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
	require.Equal(t, named, p.InUse(), "held for the messages that return them")
	unregister()
	for i, r := range refs {
		b, err := shm.Revive(r, size)
		require.NoError(t, err)
		bs[i] = b
	}
	before := shm.Reclaims(p, size)
	for range stream {
		require.NoError(t, mustAlloc(t, p, size).Release())
	}
	assert.GreaterOrEqual(t, shm.Reclaims(p, size)-before, stream/shm.ReclaimBatch,
		"reclaims over %d blocks released after %d held ones were taken back", stream, named)
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
}

//go:build linux

package shm

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// askInRuns answers for each block, in any order and across segments,
// whether another description holds its slot, and leaves no mark behind:
// a block it was asked about once is not asked about, nor answered for,
// at its next call.
func TestAskInRunsAnswersEachBlockOnce(t *testing.T) {
	p := newPool(1 << 30)
	t.Cleanup(func() { p.Trim(0) })
	var bs []*Block
	for len(bs) == 0 || bs[len(bs)-1].seg == bs[0].seg {
		b, err := p.Alloc(4 << 10)
		require.NoError(t, err)
		bs = append(bs, b)
	}
	odd, err := p.Alloc(80 << 10) // a slab whose slots are not a multiple of 64
	require.NoError(t, err)
	require.NotZero(t, odd.seg.nslots%64)
	bs = append(bs, odd)
	t.Cleanup(func() {
		for _, b := range bs {
			_ = b.Release()
		}
	})
	first, second := bs[0].seg, bs[len(bs)-2].seg
	require.NotSame(t, first, second, "the blocks span two slabs")
	held := map[*Block]bool{bs[0]: true, bs[7]: true, bs[8]: true, bs[100]: true, bs[len(bs)-3]: true}
	var slots []int
	for b := range held {
		slots = append(slots, b.slot)
	}
	release, err := HoldSlots(bs[0], slots...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = release() })

	var room runRoom
	ask := append([]*Block(nil), bs...)
	rand.Shuffle(len(ask), func(i, j int) { ask[i], ask[j] = ask[j], ask[i] })
	for _, b := range ask {
		b.held = !held[b]
	}
	askInRuns(ask, &room)
	for _, b := range bs {
		assert.Equal(t, held[b], b.held, "slot %d of %v", b.slot, b.seg.alloc)
	}
	for _, s := range []*segment{first, second, odd.seg} {
		assert.False(t, s.marked)
		assert.Equal(t, make([]uint64, len(s.marks)), s.marks, "no slot stays marked")
	}

	// Asked about one block, it answers for that one alone.
	for _, b := range bs {
		b.held = false
	}
	askInRuns([]*Block{bs[9]}, &room)
	for _, b := range bs {
		assert.False(t, b.held, "slot %d, not asked about, is answered for", b.slot)
	}
}

// A message that returns a block whose Release is under way on another
// goroutine (marked released, not yet in its pool) is told to wait
// (ErrInUse), not that the block is gone; once the Release has put it in
// its pool, Revive takes it back, off the pending list, in use again. A
// slot never handed out is no block to take back, whatever the message
// says of it.
func TestReviveWaitsOutARelease(t *testing.T) {
	p := newPool(1 << 30)
	t.Cleanup(func() { p.Trim(0) })
	b, err := p.Alloc(4 << 10)
	require.NoError(t, err)
	ref := ReturnRef{ID: b.seg.alloc.ID(), Offset: b.Offset(), Gen: b.gen}
	require.True(t, b.released.CompareAndSwap(false, true)) // Release's first step
	_, err = Revive(ref, 4<<10)
	require.ErrorIs(t, err, ErrInUse, "released, not yet in its pool")
	p.put(b) // Release's last
	got, err := Revive(ref, 4<<10)
	require.NoError(t, err)
	require.Same(t, b, got)
	assert.False(t, got.released.Load(), "in use again")
	p.mu.Lock()
	assert.NotContains(t, b.seg.class.pending, b, "not pending: never handed out twice")
	assert.False(t, b.free)
	p.mu.Unlock()

	next := b.seg.blocks[b.slot+1]
	_, err = Revive(ReturnRef{ID: ref.ID, Offset: next.Offset(), Gen: next.gen}, 0)
	assert.ErrorIs(t, err, ErrStaleBlock, "a slot never handed out")
	assert.NotErrorIs(t, err, ErrInUse, "which no Release will put in the pool")
	require.NoError(t, got.Release())
}

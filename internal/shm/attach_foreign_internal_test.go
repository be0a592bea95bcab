//go:build linux

package shm

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// foreignSlot is receivedSegment with the producer's segment taken off
// the list of this process's own, as a segment another process made is:
// an attach by identity then has no look at a pool's record, and its
// hold and its look at the slot table's generation are all there is. It
// returns the received segment, a free slot of it that no block of this
// process holds or locks, a lane's ref of that slot at its generation
// (no ticket), and b, the block locked ahead, whose segment is the
// producer's.
func foreignSlot(t *testing.T) (seg *segment, slot int, ref BlockRef, b *Block) {
	t.Helper()
	got, seg, _, b := receivedSegment(t)
	t.Cleanup(func() {
		require.NoError(t, got.Release())
		require.NoError(t, DropIdle())
	})
	require.True(t, b.Busy()) // the producer's ticket description, which locks every slot, retired
	produced.remove(b.seg)
	t.Cleanup(func() { produced.add(b.seg) })
	slot = b.slot + 1
	attached.mu.Lock()
	gen := seg.gen(slot).Load()
	attached.mu.Unlock()
	ref = BlockRef{Seg: SegmentRef{ID: seg.alloc.ID(), Size: seg.alloc.Size()}, Offset: seg.slotOffset(slot), Size: 4 << 10, Gen: gen, Ticket: -1}
	return seg, slot, ref, b
}

// producerSees reports whether the producer of b's segment finds slot
// locked by a receiver.
func producerSees(t *testing.T, b *Block, slot int) bool {
	t.Helper()
	_, _, held, err := lockInWay(b.seg.alloc.fd(), slotByte(slot), 1)
	require.NoError(t, err)
	return held
}

// An attach by identity of a block of a segment another process made, at
// a generation its slot no longer has, is ErrStaleBlock: the look at the
// slot table's generation after the lock is the only one such a block
// has. The lock taken for it goes, and the slot is not counted as locked,
// so the attach at the slot's generation locks it afresh: the producer
// finds it held while the block is in use, and free once it is released.
func TestStaleAttachOfAnotherProcessesSlot(t *testing.T) {
	seg, slot, ref, b := foreignSlot(t)
	stale := ref
	stale.Gen++
	_, err := Attach(stale)
	require.ErrorIs(t, err, ErrStaleBlock, "a generation the slot does not have")
	assert.False(t, Locked(ref), "the stale attach's lock is not kept")
	assert.False(t, producerSees(t, b, slot), "the stale attach left the slot locked")

	x, err := Attach(ref)
	require.NoError(t, err)
	assert.True(t, producerSees(t, b, slot), "the block in use holds its slot against the producer")
	require.NoError(t, x.Release())
	attached.mu.Lock()
	require.NoError(t, seg.transferLocked())
	attached.mu.Unlock()
	assert.False(t, producerSees(t, b, slot), "let go of, the slot's lock goes at the transfer")
}

// A slot another description write-locks cannot be locked by a receiver
// (a look at whether a segment is abandoned write-locks every lock byte
// of it, the slots' included, for a moment): LockAhead leaves it
// unlocked and not counted as locked, and an attach by identity of a
// block of it, at the generation it has, is ErrStaleBlock, not a block
// with no lock under it, which its producer could hand out again. Once
// the write lock goes, it attaches.
func TestWriteLockedSlotIsNotHeld(t *testing.T) {
	_, slot, ref, b := foreignSlot(t)
	ok, err := lockWrite(b.seg.alloc.fd(), slotByte(slot), 1)
	require.NoError(t, err)
	require.True(t, ok)
	locked := true
	defer func() {
		if locked {
			_ = unlock(b.seg.alloc.fd(), slotByte(slot), 1)
		}
	}()
	LockAhead([]BlockRef{ref})
	assert.False(t, Locked(ref), "LockAhead could not lock the slot")
	_, err = Attach(ref)
	require.ErrorIs(t, err, ErrStaleBlock, "a write-locked slot")
	assert.False(t, Locked(ref))

	require.NoError(t, unlock(b.seg.alloc.fd(), slotByte(slot), 1))
	locked = false
	x, err := Attach(ref)
	require.NoError(t, err)
	assert.True(t, producerSees(t, b, slot))
	require.NoError(t, x.Release())
}

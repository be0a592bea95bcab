//go:build linux

package shm

import (
	"encoding/binary"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// receivedSegment makes a pool with blocks a and b of one segment, and
// has this process receive a as another's would be (by its ticket), b
// locked ahead: it returns the block received, the received segment and
// the number of its description. The test's end gives back the rest.
func receivedSegment(t *testing.T) (got *Block, seg *segment, num int, b *Block) {
	t.Helper()
	p := newPool(1 << 30)
	t.Cleanup(func() { p.Trim(0) })
	a, err := p.Alloc(4 << 10)
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Release() })
	b, err = p.Alloc(4 << 10)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Release() })
	tk, err := a.Ticket()
	require.NoError(t, err)
	st, err := Stat(tk.FD())
	require.NoError(t, err)
	ref := func(x *Block) BlockRef {
		return BlockRef{Seg: SegmentRef{ID: st.ID, Size: x.seg.alloc.Size()}, Offset: x.Offset(), Size: x.size, Gen: x.Gen(), Ticket: -1}
	}
	ra := ref(a)
	ra.Ticket = tk.FD()
	got, err = Attach(ra)
	tk.Done()
	require.NoError(t, err)
	LockAhead([]BlockRef{ref(b)})
	require.True(t, Locked(ref(b)))
	attached.mu.Lock()
	seg = attached.m[st.ID]
	num = seg.alloc.fd()
	attached.mu.Unlock()
	return got, seg, num, b
}

// lockedElsewhere puts another file at descriptor number num, read-locked
// at slot's byte through that description, and returns a check that the
// lock is still there.
func lockedElsewhere(t *testing.T, num, slot int) (held func() bool) {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "other")
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	require.NoError(t, f.Truncate(1<<20))
	if int(f.Fd()) != num { // else it has the number already
		require.NoError(t, unix.Dup3(int(f.Fd()), num, unix.O_CLOEXEC))
		t.Cleanup(func() { _ = unix.Close(num) })
	}
	ok, err := lockRead(num, slotByte(slot), 1)
	require.NoError(t, err)
	require.True(t, ok)
	return func() bool {
		probe, err := os.OpenFile(f.Name(), os.O_RDWR, 0)
		require.NoError(t, err)
		defer probe.Close()
		ok, err := lockWrite(int(probe.Fd()), slotByte(slot), 1)
		require.NoError(t, err)
		return !ok
	}
}

// A received segment dropped while slots it locked ahead keep their locks
// leaves no transfer behind: its locks went with its description, and a
// file given that descriptor's number afterwards keeps its own locks.
func TestDroppedSegmentLeavesNoTransfer(t *testing.T) {
	got, _, num, b := receivedSegment(t)
	require.NoError(t, got.Release())
	require.NoError(t, DropIdle()) // unmaps the segment, b's lock kept ahead
	held := lockedElsewhere(t, num, b.slot)
	time.Sleep(aheadKeep + 5*transferDelay) // the transfers, were any left
	assert.True(t, held(), "the other file's lock was dropped by a transfer of the dropped segment")
}

// A received segment dropped between the two halves of a rotation of its
// ticket descriptions (the timer's: the rotation, then the settle) is left
// alone by the second half: it does nothing through the number its
// description had.
func TestDroppedSegmentLeftAloneByRotation(t *testing.T) {
	got, seg, num, _ := receivedSegment(t)
	tk, err := got.Ticket() // this process forwards the block it received
	require.NoError(t, err)
	tk.Done()
	require.True(t, seg.tickets.rotate()) // the rotation's first half
	require.NoError(t, got.Release())
	require.NoError(t, DropIdle())
	held := lockedElsewhere(t, num, 3)
	seg.afterTicketsRotated() // its second half
	assert.True(t, held(), "the other file's lock was dropped through the dropped segment's number")
}

// A lock taken ahead and then taken up by an attach is that block's: let
// go of, it goes at the next transfer, young as it is.
func TestLockTakenUpGoesAtTransfer(t *testing.T) {
	got, seg, _, b := receivedSegment(t)
	x, err := Attach(BlockRef{Seg: SegmentRef{ID: seg.alloc.ID(), Size: seg.alloc.Size()}, Offset: b.Offset(), Size: b.size, Gen: b.Gen(), Ticket: -1})
	require.NoError(t, err)
	require.NoError(t, x.Release())
	attached.mu.Lock()
	require.NoError(t, seg.transferLocked())
	st := seg.slots.get(b.slot)
	attached.mu.Unlock()
	assert.False(t, st.onFD, "the lock stayed past the transfer")
	require.NoError(t, got.Release())
	require.NoError(t, DropIdle())
}

// A slot table that says it has more slots than any slab has is refused
// before anything is sized by it: what a receiver keeps per slot is not
// a peer's to size. One of as many as a slab may have is taken, and
// costs its receiver a page index of a thousand entries.
func TestReadSlabRefusesTooManySlots(t *testing.T) {
	most := int64(0)
	for c := int64(smallMin); c <= packMax; c = classCap(c + 1) {
		for n := range 12 {
			most = max(most, slabSlots(c, n))
		}
	}
	require.EqualValues(t, maxSlabSlots, most, "the most slots a producer's slab has")

	for _, nslots := range []int64{maxSlabSlots, maxSlabSlots + 1, 1 << 40} {
		a, err := Create(slabLayout(maxSlabSlots+1), KeepFD|Unlink|sparse)
		require.NoError(t, err)
		*(*slabHdr)(ptrAt(a.mapping, 0)) = slabHdr{magic: slabMagic, version: slabVersion, cap: smallMin, nslots: nslots}
		seg, err := readSlab(a)
		if nslots <= maxSlabSlots {
			require.NoError(t, err)
			assert.Len(t, seg.slots.pages, maxSlabSlots/slotPage)
		} else {
			assert.ErrorContains(t, err, "more than any slab has", "%d slots", nslots)
			assert.Nil(t, seg)
		}
		require.NoError(t, a.Release())
	}
}

// An attach whose generation is stale gives up the lock it took for it:
// the slot is not counted as locked, and the next attach of the slot
// locks it afresh.
func TestStaleAttachLeavesNoLock(t *testing.T) {
	got, seg, _, b := receivedSegment(t)
	defer func() {
		require.NoError(t, got.Release())
		require.NoError(t, DropIdle())
	}()
	require.True(t, b.Busy()) // the producer's ticket description, which locks every slot, retired
	slot := b.slot + 1
	ref := BlockRef{Seg: SegmentRef{ID: seg.alloc.ID(), Size: seg.alloc.Size()}, Offset: seg.slotOffset(slot), Size: 4 << 10, Ticket: -1}
	attached.mu.Lock()
	locked := seg.slots.locked
	ref.Gen = seg.gen(slot).Load() + 1
	attached.mu.Unlock()
	_, err := Attach(ref)
	require.ErrorIs(t, err, ErrStaleBlock)
	attached.mu.Lock()
	st := seg.slots.get(slot)
	assert.Equal(t, locked, seg.slots.locked)
	attached.mu.Unlock()
	assert.False(t, st.onFD, "the stale attach's lock is not kept")
	assert.False(t, Locked(ref))
	_, _, held, err := lockInWay(b.seg.alloc.fd(), slotByte(slot), 1)
	require.NoError(t, err)
	assert.False(t, held, "the producer finds the slot locked")
}

// A transfer that moves a hold to the segment's own description and
// drops the locks of slots let go of on both sides of it keeps the lock
// it took: the runs it unlocks are joined across a slot never locked
// here, not across that one, and the producer finds it held, and the
// others free.
func TestTransferKeepsTheLockItTakes(t *testing.T) {
	HoldTransfers(t)
	p := newPool(1 << 30)
	t.Cleanup(func() { p.Trim(0) })
	var bs [6]*Block
	for i := range bs {
		b, err := p.Alloc(4 << 10)
		require.NoError(t, err)
		bs[i] = b
		if i > 0 {
			require.Equal(t, bs[i-1].slot+1, b.slot)
		}
	}
	defer bs[0].Release()
	tk, err := bs[0].Ticket()
	require.NoError(t, err)
	st, err := Stat(tk.FD())
	require.NoError(t, err)
	ref := func(x *Block, ticket int) BlockRef {
		return BlockRef{Seg: SegmentRef{ID: st.ID, Size: x.seg.alloc.Size()}, Offset: x.Offset(), Size: x.size, Gen: x.Gen(), Ticket: ticket}
	}
	first, err := Attach(ref(bs[0], tk.FD())) // mapped as a receiver's, its slot locked here
	tk.Discard()                              // its description goes
	require.NoError(t, err)
	defer func() {
		require.NoError(t, first.Release())
		require.NoError(t, DropIdle())
	}()
	for _, i := range []int{1, 3, 5} { // let go of: locked until the transfer
		x, err := Attach(ref(bs[i], -1))
		require.NoError(t, err)
		require.NoError(t, x.Release())
	}
	tk, err = bs[2].Ticket() // held through a message's ticket, until the transfer
	require.NoError(t, err)
	msg, err := unix.Dup(tk.FD())
	require.NoError(t, err)
	tk.Discard()
	r := ref(bs[2], msg)
	r.Covers = func(ID) bool { return true }
	held, err := Attach(r)
	require.NoError(t, err)
	defer held.Release()
	AdoptTicket(msg, st.ID)
	for _, b := range bs[1:] {
		require.NoError(t, b.Release())
	}

	attached.mu.Lock()
	seg := attached.m[st.ID]
	before := unlockCalls.Load()
	err = seg.transferLocked()
	calls := unlockCalls.Load() - before
	state := seg.slots.get(bs[2].slot)
	locked := seg.slots.locked
	attached.mu.Unlock()
	require.NoError(t, err)
	assert.Equal(t, uint64(2), calls, "one run on each side of the slot locked, the second across the slot never locked")
	assert.True(t, state.onFD)
	assert.Equal(t, 2, locked, "the first block's slot and the held one, as the table counts")
	for i, want := range []bool{true, false, true, false, false, false} {
		_, _, locked, err := lockInWay(bs[0].seg.alloc.fd(), slotByte(bs[i].slot), 1)
		require.NoError(t, err)
		assert.Equal(t, want, locked, "slot of block %d", i)
	}
}

// halvedOwnSegment makes a pool with blocks a0 and a1 of 8 KiB, slots 0
// and 1 of one segment, and returns them with a peer's descriptor of the
// segment (ownPeer) and the peer's writable mapping of its slot table,
// whose slot size it has halved (as many slots, over the same data).
// The test's end gives everything back.
func halvedOwnSegment(t *testing.T) (a0, a1 *Block, peer int, hdr []byte) {
	t.Helper()
	p := newPool(1 << 30)
	t.Cleanup(func() { p.Trim(0) })
	a0, err := p.Alloc(8192)
	require.NoError(t, err)
	a1, err = p.Alloc(8192)
	require.NoError(t, err)
	t.Cleanup(func() { _ = a0.Release(); _ = a1.Release() })
	peer = ownPeer(t, a1)
	hdr, err = unix.Mmap(peer, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(hdr) })
	binary.LittleEndian.PutUint64(hdr[8:], 4096) // half the slot size
	return a0, a1, peer, hdr
}

// ownPeer returns a descriptor of b's segment through a description of
// its own, which holds nothing: what a peer that reopens a message's
// descriptor has. The test's end closes it.
func ownPeer(t *testing.T, b *Block) int {
	t.Helper()
	peer, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", b.seg.alloc.fd()), unix.O_RDWR|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Close(peer) })
	return peer
}

// A named segment's file is in Dir as soon as its pool makes it, before
// the pool lists it as its own. An attach whose first look found the
// segment no pool's of this process, whose hold a peer's ticket may
// cover, is refused once the pool lists it, even where the pool has
// handed the slot out since, at the generation named: the first look's
// guarantee is missing.
func TestOwnSegmentListedAsItIsAttached(t *testing.T) {
	for _, all := range []bool{false, true} {
		t.Run(map[bool]string{false: "Attach", true: "AttachAll"}[all], func(t *testing.T) {
			p := newPool(1 << 30)
			p.named = true
			t.Cleanup(func() { p.Trim(0) })
			a, err := p.Alloc(4096)
			require.NoError(t, err)
			keep, err := p.Alloc(4096)
			require.NoError(t, err)
			t.Cleanup(func() { _ = keep.Release() })
			seg, off := a.seg, a.Offset()
			peer := ownPeer(t, a)
			produced.remove(seg) // as between its making and its listing (growLocked)
			t.Cleanup(func() { produced.add(seg) })
			ref := BlockRef{Seg: SegmentRef{Name: seg.alloc.Name(), Size: seg.alloc.Size()}, Offset: keep.Offset(), Size: 4096, Gen: keep.gen, Ticket: peer}
			mapped, err := Attach(ref) // this process maps it as any receiver, now
			require.NoError(t, err)
			require.NoError(t, mapped.Release())
			require.NoError(t, a.Release())
			p.InUse() // free now
			// Beside a block of another segment of this process's,
			// whose pool lists it all along, for AttachAll.
			other := newPool(1 << 30)
			t.Cleanup(func() { other.Trim(0) })
			x, err := other.Alloc(4096)
			require.NoError(t, err)
			t.Cleanup(func() { _ = x.Release() })
			byID := BlockRef{Seg: SegmentRef{ID: x.seg.alloc.ID(), Size: x.seg.alloc.Size()}, Offset: x.Offset(), Size: 4096, Gen: x.gen, Ticket: ownPeer(t, x)}
			mapped, err = Attach(byID)
			require.NoError(t, err)
			require.NoError(t, mapped.Release())
			byID.Ticket = -1
			var again *Block
			f := func() {
				if again == nil {
					produced.add(seg)
					again, err = p.Alloc(4096)
					require.NoError(t, err)
				}
			}
			afterLook.Store(&f)
			t.Cleanup(func() { afterLook.Store(nil) })
			ref = BlockRef{Seg: SegmentRef{Name: seg.alloc.Name(), Size: seg.alloc.Size()}, Offset: off, Size: 4096, Gen: a.gen, Ticket: peer, Covers: func(ID) bool { return true }}
			if all {
				ref.Seg, ref.Ticket = SegmentRef{ID: seg.alloc.ID(), Size: seg.alloc.Size()}, -1
				_, err = AttachAll([]BlockRef{byID, ref})
			} else {
				_, err = Attach(ref)
			}
			require.NotNil(t, again)
			require.True(t, again.seg == seg && again.Offset() == off && again.gen == ref.Gen, "handed out between the looks, at the generation named")
			require.ErrorIs(t, err, ErrStaleBlock)
			require.NoError(t, again.Release())
		})
	}
}

// A mapping of a segment made before its pool listed it as this
// process's own skipped readSlab's check of its slot table, which a peer
// may have rewritten (half the slot size here, as many slots, over the
// same data). An attach by that mapping once the pool lists the segment
// is refused: its slots are not the pool's.
func TestOwnSegmentMappedBeforeItWasListed(t *testing.T) {
	a0, a1, peer, _ := halvedOwnSegment(t)
	seg := a1.seg
	produced.remove(seg) // as between its making and its listing
	b, err := Attach(BlockRef{Seg: SegmentRef{ID: seg.alloc.ID(), Size: seg.alloc.Size()}, Offset: a0.Offset(), Size: 4096, Gen: 1, Ticket: peer})
	produced.add(seg)
	require.NoError(t, err, "mapped while no pool of this process listed it")
	require.NoError(t, b.Release())
	_, err = Attach(BlockRef{Seg: SegmentRef{ID: seg.alloc.ID(), Size: seg.alloc.Size()}, Offset: a1.Offset(), Size: 4096, Gen: a1.Gen(), Ticket: -1})
	require.ErrorContains(t, err, "not this process's pool's")
	_, err = AttachAll([]BlockRef{{Seg: SegmentRef{ID: seg.alloc.ID(), Size: seg.alloc.Size()}, Offset: a1.Offset(), Size: 4096, Gen: a1.Gen(), Ticket: -1}})
	require.ErrorContains(t, err, "not this process's pool's")
}

// An attach made wholly while a pool makes a segment, its file in Dir
// (or in /proc) but not yet listed as the pool's (both looks find it no
// pool's), keeps its hold: the pool, which would hand the held slot out
// without asking anybody, gives that segment up and makes another.
func TestOwnSegmentAttachedBeforeItWasListedIsGivenUp(t *testing.T) {
	for _, covered := range []bool{false, true} {
		t.Run(map[bool]string{false: "locked", true: "covered"}[covered], func(t *testing.T) {
			p := newPool(1 << 30)
			p.named = true
			t.Cleanup(func() { p.Trim(0) })
			var held *Block
			f := func(seg *segment) {
				if held != nil {
					return
				}
				peer, err := unix.Open(seg.alloc.path, unix.O_RDWR|unix.O_CLOEXEC, 0) // by its name in Dir
				require.NoError(t, err)
				t.Cleanup(func() { _ = unix.Close(peer) })
				ref := BlockRef{Seg: SegmentRef{Name: seg.alloc.Name(), Size: seg.alloc.Size()}, Offset: seg.dataOff, Size: 4096, Gen: 1, Ticket: peer}
				if covered {
					ref.Covers = func(ID) bool { return true }
				}
				held, err = Attach(ref)
				require.NoError(t, err, "no pool of this process lists it yet")
				t.Cleanup(func() { _ = held.Release() })
			}
			beforeListing.Store(&f)
			t.Cleanup(func() { beforeListing.Store(nil) })
			b, err := p.Alloc(4096)
			require.NoError(t, err)
			t.Cleanup(func() { _ = b.Release() })
			require.NotNil(t, held)
			assert.NotEqual(t, held.seg.alloc.ID(), b.seg.alloc.ID(), "a block of the segment given up")
			b.Bytes()[0] = 0x5a
			assert.NotEqual(t, byte(0x5a), held.Bytes()[0])
		})
	}
}

// A mapping of this process's own segment whose slot table a peer
// rewrote is not kept: once the peer writes the table back, this
// process's own blocks of the segment are attached again.
func TestOwnSegmentRewrittenMappingIsNotKept(t *testing.T) {
	_, a1, peer, hdr := halvedOwnSegment(t)
	seg := a1.seg
	ref := BlockRef{Seg: SegmentRef{ID: seg.alloc.ID(), Size: seg.alloc.Size()}, Offset: a1.Offset(), Size: 4096, Gen: a1.Gen(), Ticket: peer}
	_, err := Attach(ref)
	require.ErrorContains(t, err, "not this process's pool's")
	binary.LittleEndian.PutUint64(hdr[8:], 8192) // written back
	b, err := Attach(ref)
	require.NoError(t, err)
	require.NoError(t, b.Release())
}

// An attach that starts once the pool lists a new segment, before the
// pool looks for a receiver's mapping of it, finds the segment the
// pool's (it waits for the pool to be done with it): a free slot of it
// is refused. Were the pool to look before it lists the segment, the
// attach would find it nobody's, and keep its hold.
func TestOwnSegmentAttachedAsItIsListedIsRefused(t *testing.T) {
	p := newPool(1 << 30)
	t.Cleanup(func() { p.Trim(0) })
	done := make(chan error, 1)
	started := false
	f := func(seg *segment) {
		if started {
			return
		}
		started = true
		peer, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", seg.alloc.fd()), unix.O_RDWR|unix.O_CLOEXEC, 0)
		require.NoError(t, err)
		t.Cleanup(func() { _ = unix.Close(peer) })
		// Slot 1: the Alloc hands out slot 0, and slot 1 stays free.
		ref := BlockRef{Seg: SegmentRef{ID: seg.alloc.ID(), Size: seg.alloc.Size()}, Offset: seg.dataOff + seg.cap, Size: 4096, Gen: 1, Ticket: peer, Covers: func(ID) bool { return true }}
		go func() {
			held, err := Attach(ref)
			if err == nil {
				_ = held.Release()
			}
			done <- err
		}()
		select { // an attach of a segment the pool lists waits for its lock
		case err := <-done:
			done <- err
		case <-time.After(100 * time.Millisecond):
		}
	}
	afterListing.Store(&f)
	t.Cleanup(func() { afterListing.Store(nil) })
	b, err := p.Alloc(4096)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Release() })
	require.True(t, started)
	require.ErrorIs(t, <-done, ErrStaleBlock)
}

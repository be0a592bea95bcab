//go:build linux

package shm_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
)

func TestPoolPacksSmallBlocks(t *testing.T) {
	p := testPool(t)
	var blocks []*shm.Block
	for i := range 100 {
		b, err := p.Alloc(4 << 10)
		require.NoError(t, err)
		b.Bytes()[0] = byte(i)
		blocks = append(blocks, b)
	}
	segs, _, _ := p.Stats()
	assert.Equal(t, 1, segs, "100 blocks of 4 KiB share one slab")
	for i, b := range blocks {
		assert.Equal(t, byte(i), b.Bytes()[0], "blocks do not overlap")
		assert.Len(t, b.Bytes(), 4<<10)
		require.NoError(t, b.Release())
	}
	big := mustAlloc(t, p, large)
	assert.GreaterOrEqual(t, int64(len(big.Bytes())), int64(large))
	segs, _, _ = p.Stats()
	assert.Equal(t, 2, segs, "a large block gets a segment of its own")
	require.NoError(t, big.Release())
}

// large is past the largest packed block: such a block gets a segment of
// its own.
const large = 17 << 20

func TestPoolPacksMediumBlocksInGrowingSlabs(t *testing.T) {
	p := testPool(t)
	var blocks []*shm.Block
	defer func() {
		for _, b := range blocks {
			require.NoError(t, b.Release())
		}
	}()
	segSizes := map[*shm.Allocation]int64{}
	for i := range 1000 {
		b, err := p.Alloc(80 << 10)
		require.NoError(t, err)
		b.Bytes()[0], b.Bytes()[80<<10-1] = byte(i), byte(i>>8)
		blocks = append(blocks, b)
		segSizes[b.Segment()] = b.Segment().Size()
	}
	for i, b := range blocks {
		require.Equal(t, byte(i), b.Bytes()[0], "blocks do not overlap")
		require.Equal(t, byte(i>>8), b.Bytes()[80<<10-1], "blocks do not overlap")
	}
	segs, _, _ := p.Stats()
	assert.Equal(t, 6, segs, "1,000 blocks of 80 KiB in slabs of 2, 4, 8, 16, 32 and 64 MiB")
	var sizes []int64
	for _, n := range segSizes {
		sizes = append(sizes, n)
	}
	slices.Sort(sizes)
	for i := 1; i < len(sizes); i++ {
		assert.Greater(t, sizes[i], sizes[i-1]*3/2, "each slab of a class is about twice the last")
	}
	assert.LessOrEqual(t, sizes[len(sizes)-1], int64(65<<20), "a slab grows to 64 MiB at most")
	var total, used int64
	for a, size := range segSizes {
		var st unix.Stat_t
		require.NoError(t, unix.Fstat(a.FD(), &st))
		total += size
		used += st.Blocks * 512
	}
	assert.Greater(t, total, int64(120<<20))
	assert.Less(t, used, int64(1000*80<<10+6*(256<<10+4<<10)),
		"slabs take memory as their slots are used: %d MiB of %d MiB", used>>20, total>>20)
}

// testPool returns a new pool with a 1 GiB cache, trimmed when the test
// ends, and checks that the test leaves nothing behind.
func testPool(t *testing.T) *shm.Pool {
	t.Helper()
	leakcheck.Check(t)
	p := shm.NewPool(1 << 30)
	t.Cleanup(func() { p.Trim(0) })
	return p
}

// mustAlloc returns a block of size bytes from p, failing the test if it
// cannot.
func mustAlloc(t *testing.T, p *shm.Pool, size int64) *shm.Block {
	t.Helper()
	b, err := p.Alloc(size)
	require.NoError(t, err)
	return b
}

// send stands for a message carrying b: it takes a ticket and returns a
// duplicate of its descriptor, as sendmsg would put one in flight.
func send(t *testing.T, b *shm.Block) int {
	t.Helper()
	tk, err := b.Ticket()
	require.NoError(t, err)
	defer tk.Done()
	raw, err := fd.Dup(tk.FD())
	require.NoError(t, err)
	return raw
}

func TestPoolRecyclesOnlyWhenNobodyHolds(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, large)
	seg, off, gen := a.Segment(), a.Offset(), a.Gen()
	msg := send(t, a) // a message in flight
	require.NoError(t, a.Release())

	b := mustAlloc(t, p, large)
	assert.False(t, b.Segment() == seg && b.Offset() == off, "a block a message still refers to is not reused")
	assert.True(t, a.Busy(), "the message holds it")

	// The receiver takes its own hold, closes the message, and releases.
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: seg.Size()}, Offset: off, Size: large, Gen: gen, Ticket: msg})
	require.NoError(t, err)
	require.NoError(t, unix.Close(msg))
	require.NoError(t, r.Release())

	c := mustAlloc(t, p, large)
	assert.True(t, c.Segment() == seg && c.Offset() == off, "once nobody holds it, the block is reused")
	assert.Greater(t, c.Gen(), gen, "with a new generation")
	stale := send(t, c)
	_, err = shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, stale).ID, Size: seg.Size()}, Offset: off, Size: large, Gen: gen, Ticket: stale})
	assert.ErrorIs(t, err, shm.ErrStaleBlock)
	require.NoError(t, unix.Close(stale))
	require.NoError(t, b.Release())
	require.NoError(t, c.Release())
}

// A peer that holds a descriptor of a segment of this process's pool (a
// message's, reopened: a description that holds nothing) may name a slot
// the pool has free, with the generation the pool hands it out with next.
// Nothing locks a free slot and the generation matches, but a hold on it
// would alias the block the pool hands out next, which it hands out
// without asking anybody: the attach is ErrStaleBlock. A block the pool
// handed out with the generation named, in use or released and waiting
// for its holders, is attached as before: a process may send its own
// tensor to itself.
func TestAttachRefusesAFreeSlotOfThisProcess(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, small)
	keep := mustAlloc(t, p, small) // keeps the segment in the pool
	peer := peerOf(t, a)
	seg := a.Segment()
	ref := shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, peer).ID, Size: seg.Size()}, Offset: a.Offset(), Size: small, Gen: a.Gen(), Ticket: peer}

	r, err := shm.Attach(ref)
	require.NoError(t, err, "in use, with its generation")
	r.Bytes()[0] = 7
	assert.Equal(t, byte(7), a.Bytes()[0], "the same memory")
	require.NoError(t, a.Release())
	assert.Equal(t, 2, p.InUse(), "held by the attach")
	require.NoError(t, r.Release())
	require.Eventually(t, func() bool { return p.InUse() == 1 }, time.Second, time.Millisecond, "free once nobody holds it (the receiver's lock goes at its transfer)")

	next := ref
	next.Gen = a.Gen() // the pool's Block is the slot's: the generation it is handed out with next
	require.Greater(t, next.Gen, ref.Gen)
	_, err = shm.Attach(next)
	require.ErrorIs(t, err, shm.ErrStaleBlock, "free")
	_, err = shm.AttachAll([]shm.BlockRef{next})
	require.ErrorIs(t, err, shm.ErrStaleBlock, "free, by identity")
	_, err = shm.Attach(ref)
	require.ErrorIs(t, err, shm.ErrStaleBlock, "free, of the generation it had")

	d := mustAlloc(t, p, small)
	require.True(t, d.Segment() == seg && d.Offset() == a.Offset() && d.Gen() == next.Gen, "the warmest slot is handed out first, with the generation it carried free")
	d.Bytes()[0] = 9
	r, err = shm.Attach(next)
	require.NoError(t, err, "in use again, with its generation")
	assert.Equal(t, byte(9), r.Bytes()[0])
	require.NoError(t, r.Release())
	require.NoError(t, d.Release())
	require.NoError(t, keep.Release())
}

// A named pool's free slot is refused as well, its segment named by its
// own name or by another one, linked to it in Dir.
func TestAttachRefusesAFreeNamedSlotOfThisProcess(t *testing.T) {
	leakcheck.Check(t)
	shm.EnableNamedPool()
	p := shm.NamedPool()
	t.Cleanup(func() { shm.Trim() }) // its names go, whatever the test's end
	a := mustAlloc(t, p, small)
	keep := mustAlloc(t, p, small)
	t.Cleanup(func() { _ = keep.Release() })
	seg := a.Segment()
	require.NotEmpty(t, seg.Name())
	inUse := p.InUse()
	require.NoError(t, a.Release())
	require.Eventually(t, func() bool { return p.InUse() == inUse-1 }, time.Second, time.Millisecond, "free")
	next := shm.BlockRef{Seg: shm.SegmentRef{Name: seg.Name(), Size: seg.Size()}, Offset: a.Offset(), Size: small, Gen: a.Gen(), Ticket: peerOf(t, a)}
	_, err := shm.Attach(next)
	require.ErrorIs(t, err, shm.ErrStaleBlock)

	next.Seg.Name = shm.NamePrefix + shm.Session() + "_1_fedcba9876543210"
	link := filepath.Join(shm.Dir(), next.Seg.Name)
	require.NoError(t, os.Link(filepath.Join(shm.Dir(), seg.Name()), link))
	t.Cleanup(func() { _ = os.Remove(link) })
	_, err = shm.Attach(next)
	require.ErrorIs(t, err, shm.ErrStaleBlock, "by another name")
}

// The pool may take a released block back between the attach's first
// look at the pool and its lock on the slot, and hand it out again: a
// message that names the generation the slot gets then is refused all
// the same, since the look found the block at another one.
func TestAttachRefusesASlotFreedAfterTheLook(t *testing.T) {
	p, a := keptBlock(t)
	seg, off := a.Segment(), a.Offset()
	ref := shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: off, Size: small, Gen: a.Gen() + 1, Ticket: peerOf(t, a)}
	require.NoError(t, a.Release()) // waiting in the pool: no reclaim took it back yet
	var again *shm.Block
	shm.RaceAttach(t, func() {
		if again == nil {
			p.InUse()                      // a reclaim takes the block back,
			again = mustAlloc(t, p, small) // and the pool hands it out first, the warmest
		}
	})
	_, err := shm.Attach(ref)
	require.ErrorIs(t, err, shm.ErrStaleBlock)
	if again == nil { // the first look refused it, as it should: the guess was right all the same
		p.InUse()
		again = mustAlloc(t, p, small)
	}
	require.True(t, again.Segment() == seg && again.Offset() == off, "the slot, handed out again")
	require.Equal(t, ref.Gen, again.Gen(), "with the generation the message guessed")
	require.NoError(t, again.Release())
}

// A message names its segment by a name of its own, made up, with a
// descriptor of a segment of this process's pool: the segment attached is
// the descriptor's, whatever the name, and a free slot of it is refused
// as before. So is one of a named pool's segment linked under another
// name (TestAttachRefusesAFreeNamedSlotOfThisProcess).
func TestAttachRefusesAFreeSlotUnderAnotherName(t *testing.T) {
	p, a := keptBlock(t)
	peer := peerOf(t, a)
	seg := a.Segment()
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: a.Offset(), Size: small, Gen: a.Gen(), Ticket: peer})
	require.NoError(t, err, "in use: this process maps its segment a second time now")
	require.NoError(t, r.Release())
	require.NoError(t, a.Release())
	require.Eventually(t, func() bool { return p.InUse() == 1 }, time.Second, time.Millisecond, "free")
	made := shm.NamePrefix + shm.Session() + "_1_0123456789abcdef"
	_, err = shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{Name: made, Size: seg.Size()}, Offset: a.Offset(), Size: small, Gen: a.Gen(), Ticket: peer})
	require.ErrorIs(t, err, shm.ErrStaleBlock)
}

// A released block of this process's pool, waiting for its holders, is
// attached, even by a descriptor that holds nothing (a peer's, reopened)
// and that the caller says covers it: the hold is a lock of this
// process's own, and the pool does not hand the slot out while it lasts.
func TestAttachOfAWaitingSlotHoldsItAgainstThePool(t *testing.T) {
	p, a := keptBlock(t)
	seg, off := a.Segment(), a.Offset()
	ref := shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: off, Size: small, Gen: a.Gen(), Ticket: peerOf(t, a), Covers: covering}
	require.NoError(t, a.Release()) // waiting: no reclaim took it back yet
	x, err := shm.Attach(ref)
	require.NoError(t, err)
	require.Equal(t, 2, p.InUse(), "a reclaim finds the slot held")
	var more []*shm.Block
	for range 4 {
		d := mustAlloc(t, p, small)
		more = append(more, d)
		assert.False(t, d.Segment() == seg && d.Offset() == off, "the slot the attached block holds is handed out")
	}
	for _, d := range more {
		require.NoError(t, d.Release())
	}
	require.NoError(t, x.Release())
	require.Eventually(t, func() bool { return p.InUse() == 1 }, time.Second, time.Millisecond, "free once let go of")
}

// A peer that holds a writable descriptor of a segment of this process's
// pool can write its slot table, whose generations an attach checks once
// it holds the slot. Between the attach's first look at the pool and its
// lock, the block is released and freed (its generation bumped), and the
// peer writes the old generation back into the table: the attach looks
// at the pool again once it holds the slot, and refuses it, one block or
// several (AttachAll).
func TestAttachLooksAtThePoolAgainOnceItHolds(t *testing.T) {
	for name, attach := range map[string]func(shm.BlockRef) error{
		"Attach": func(ref shm.BlockRef) error {
			_, err := shm.Attach(ref)
			return err
		},
		"AttachAll": func(ref shm.BlockRef) error {
			ref.Ticket = -1
			_, err := shm.AttachAll([]shm.BlockRef{ref})
			return err
		},
	} {
		t.Run(name, func(t *testing.T) {
			p, a := keptBlock(t)
			peer := peerOf(t, a)
			seg, g := a.Segment(), a.Gen()
			table, err := unix.Mmap(peer, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
			require.NoError(t, err)
			defer unix.Munmap(table)
			word := (*atomic.Uint64)(unsafe.Pointer(&table[shm.GenOffset(shm.SlotOf(a))]))
			require.Equal(t, g, word.Load(), "the slot's generation in the table")
			ref := shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: a.Offset(), Size: small, Gen: g, Ticket: peer}
			r, err := shm.Attach(ref)
			require.NoError(t, err, "in use: this process maps its segment a second time now, and attaches by it next")
			require.NoError(t, r.Release())
			raced := false
			shm.RaceAttach(t, func() {
				if raced {
					return
				}
				raced = true
				assert.NoError(t, a.Release())
				assert.Equal(t, 1, p.InUse(), "freed")
				assert.Greater(t, word.Load(), g, "with a new generation")
				word.Store(g) // written back by the peer
			})
			require.ErrorIs(t, attach(ref), shm.ErrStaleBlock)
			require.True(t, raced)
			require.Eventually(t, func() bool { return p.InUse() == 1 }, time.Second, time.Millisecond, "the hold it took is let go of")
		})
	}
}

// A holder of a segment of this process's pool rewrites its slot table's
// header before this process maps the segment a second time: slots of
// another size over the same data, so that a block of the rewritten
// table spans a slot in use and the free one beside it, sits on a slot
// in use but takes another's lock, or starts where no slot of the pool
// does. The attach is refused: this process's own segment has its pool's
// slots.
func TestOwnSegmentWithARewrittenTableIsRefused(t *testing.T) {
	for _, c := range []struct {
		name        string
		cap, nslots uint64
		slot        int   // of the pool's, both in use: the block named starts there
		extra       int64 // bytes past that slot's start
		bytes       int64
		want        string // what refuses it: the mapping's table, or the look at the pool
	}{
		{"twice the slot size, half the slots", 16384, 128, 0, 0, 16384, "not this process's pool's"},
		{"half the slot size, as many slots", 4096, 256, 1, 0, 4096, "not this process's pool's"},
		{"a slot size that starts no slot of the pool's", 12288, 170, 1, 4096, 12288, "not a slot of this process's pool"},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := testPool(t)
			var bs [2]*shm.Block // a slab of 256 slots of 8 KiB, data at 4096
			for i := range bs {
				bs[i] = mustAlloc(t, p, 8192)
				t.Cleanup(func() { _ = bs[i].Release() })
				require.Equal(t, int64(4096+8192*i), bs[i].Offset())
			}
			b := bs[c.slot]
			peer := peerOf(t, b)
			hdr, err := unix.Mmap(peer, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
			require.NoError(t, err)
			defer unix.Munmap(hdr)
			require.Equal(t, uint64(8192), binary.LittleEndian.Uint64(hdr[8:]), "the slot size in the header")
			binary.LittleEndian.PutUint64(hdr[8:], c.cap)
			binary.LittleEndian.PutUint64(hdr[16:], c.nslots)
			seg := b.Segment()
			_, err = shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: b.Offset() + c.extra, Size: c.bytes, Gen: b.Gen(), Ticket: peer, Covers: covering})
			require.Error(t, err)
			assert.ErrorContains(t, err, c.want)
		})
	}
}

// TestAttachRefusesASlotFreedAfterTheLook, for several blocks at once.
func TestAttachAllRefusesASlotFreedAfterTheLook(t *testing.T) {
	p, a := keptBlock(t)
	seg, off := a.Segment(), a.Offset()
	ref := shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: off, Size: small, Gen: a.Gen(), Ticket: peerOf(t, a)}
	r, err := shm.Attach(ref) // maps the segment a second time, as a receiver
	require.NoError(t, err)
	require.NoError(t, r.Release())
	ref.Gen, ref.Ticket = a.Gen()+1, -1
	require.NoError(t, a.Release())
	var again *shm.Block
	shm.RaceAttach(t, func() {
		if again == nil {
			p.InUse()
			again = mustAlloc(t, p, small)
		}
	})
	_, err = shm.AttachAll([]shm.BlockRef{ref})
	require.ErrorIs(t, err, shm.ErrStaleBlock)
	if again == nil { // the first look refused it, as it should: the guess was right all the same
		p.InUse()
		again = mustAlloc(t, p, small)
	}
	require.True(t, again.Segment() == seg && again.Offset() == off && again.Gen() == ref.Gen, "the slot, handed out at the generation guessed")
	require.NoError(t, again.Release())
}

// A named segment of this process's pool that it maps already as a
// receiver (it attached one of its own blocks by name): a free slot of it
// is refused too.
func TestAttachRefusesAFreeSlotOfANamedSegmentItMaps(t *testing.T) {
	leakcheck.Check(t)
	shm.EnableNamedPool()
	p := shm.NamedPool()
	t.Cleanup(func() { shm.Trim() })
	a := mustAlloc(t, p, small)
	keep := mustAlloc(t, p, small)
	t.Cleanup(func() { _ = keep.Release() })
	seg := a.Segment()
	ref := shm.BlockRef{Seg: shm.SegmentRef{Name: seg.Name(), Size: seg.Size()}, Offset: a.Offset(), Size: small, Gen: a.Gen(), Ticket: peerOf(t, a), Covers: covering}
	r, err := shm.Attach(ref)
	require.NoError(t, err, "in use: mapped by name now")
	require.NoError(t, r.Release())
	inUse := p.InUse()
	require.NoError(t, a.Release())
	require.Eventually(t, func() bool { return p.InUse() == inUse-1 }, time.Second, time.Millisecond, "free")
	ref.Gen = a.Gen()
	_, err = shm.Attach(ref)
	require.ErrorIs(t, err, shm.ErrStaleBlock)
}

// The pool's generations are its own: a holder of the segment that
// writes an older generation into the slot table before the pool takes a
// slot back does not make the pool hand the slot out at a generation it
// was seen at before, so an attach that saw the block in use at that
// generation, and sees it in use again after its hold, is refused.
func TestPoolGenerationsIgnoreTheTable(t *testing.T) {
	p, a := keptBlock(t)
	peer := peerOf(t, a)
	seg, off, g := a.Segment(), a.Offset(), a.Gen()
	table, err := unix.Mmap(peer, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	defer unix.Munmap(table)
	word := (*atomic.Uint64)(unsafe.Pointer(&table[shm.GenOffset(shm.SlotOf(a))]))
	ref := shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: off, Size: small, Gen: g, Ticket: peer}
	var again *shm.Block
	shm.RaceAttach(t, func() {
		if again != nil {
			return
		}
		word.Store(g - 1) // the peer, before the pool takes the slot back
		assert.NoError(t, a.Release())
		p.InUse()
		again = mustAlloc(t, p, small)
	})
	_, err = shm.Attach(ref)
	require.NotNil(t, again)
	require.True(t, again.Segment() == seg && again.Offset() == off, "the slot, handed out again between the looks")
	assert.Greater(t, again.Gen(), g, "at a new generation, whatever the table said")
	assert.ErrorIs(t, err, shm.ErrStaleBlock)
	require.NoError(t, again.Release())
}

// keptBlock returns a test pool and a small block of it, beside another
// that keeps their segment in the pool until the test ends.
func keptBlock(t *testing.T) (*shm.Pool, *shm.Block) {
	t.Helper()
	p := testPool(t)
	a := mustAlloc(t, p, small)
	keep := mustAlloc(t, p, small)
	t.Cleanup(func() { _ = keep.Release() })
	return p, a
}

// peerOf returns a descriptor of b's segment through a description of its
// own, which holds nothing: what a peer that reopens a message's
// descriptor has. The test's end closes it.
func peerOf(t *testing.T, b *shm.Block) int {
	t.Helper()
	peer, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", b.Segment().FD()), unix.O_RDWR|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Close(peer) })
	return peer
}

func TestPoolReclaimsAroundHeldSlots(t *testing.T) {
	p := testPool(t)
	var blocks []*shm.Block
	for range 64 {
		b, err := p.Alloc(4 << 10)
		require.NoError(t, err)
		blocks = append(blocks, b)
	}
	segs, _, _ := p.Stats()
	require.Equal(t, 1, segs, "the blocks share one slab")
	// Slots held through another description, alone and in a run, at both
	// ends and between: the pool asks about runs of slots, and must find
	// each of these and only these.
	held := map[int]bool{}
	for _, i := range []int{0, 5, 6, 7, 20, 41, 63} {
		held[shm.SlotOf(blocks[i])] = true
	}
	release, err := shm.HoldSlots(blocks[0], slices.Collect(maps.Keys(held))...)
	require.NoError(t, err)
	msg := send(t, blocks[1]) // its ticket description holds every slot
	for _, b := range blocks {
		require.NoError(t, b.Release())
	}
	p.Trim(1 << 30) // retires this process's copy of the ticket description
	assert.Equal(t, 64, p.InUse(), "a message in flight holds every slot of its segment")
	require.NoError(t, unix.Close(msg))
	assert.Equal(t, len(held), p.InUse(), "once it is gone, only the slots held elsewhere stay taken")

	var again []*shm.Block
	for range 200 {
		b, err := p.Alloc(4 << 10)
		require.NoError(t, err)
		again = append(again, b)
		if b.Segment() == blocks[0].Segment() {
			assert.False(t, held[shm.SlotOf(b)], "slot %d is held elsewhere but was handed out", shm.SlotOf(b))
		}
	}
	require.NoError(t, release())
	for _, b := range again {
		require.NoError(t, b.Release())
	}
	assert.Equal(t, 0, p.InUse(), "with the holds gone, every slot comes back")
}

func TestTicketCoversItsSegment(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	b := mustAlloc(t, p, 4<<10)
	other := mustAlloc(t, p, large)
	require.Equal(t, a.Segment(), b.Segment())
	tk, err := a.Ticket()
	require.NoError(t, err)
	assert.True(t, tk.Covers(a))
	assert.True(t, tk.Covers(b), "a ticket locks every slot of its segment")
	assert.False(t, tk.Covers(other), "not a block of another segment")
	assert.False(t, (*shm.Ticket)(nil).Covers(a))

	// A message that carries tk for b holds b as a ticket of b's own would.
	msg, err := fd.Dup(tk.FD())
	require.NoError(t, err)
	tk.Done()
	require.NoError(t, b.Release())
	p.Trim(1 << 30) // retires this process's copy of the ticket description
	assert.True(t, b.Busy(), "the message holds b")
	require.NoError(t, unix.Close(msg))
	assert.False(t, b.Busy(), "nobody holds b once the message is gone")
	require.NoError(t, a.Release())
	require.NoError(t, other.Release())
}

func TestUnreceivedMessageDropsItsHold(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, large)
	seg, off := a.Segment(), a.Offset()
	msg := send(t, a)
	require.NoError(t, a.Release())
	assert.Equal(t, 1, p.InUse(), "the message holds the block")
	require.NoError(t, unix.Close(msg)) // lost in flight: the kernel closes it

	c := mustAlloc(t, p, large)
	assert.True(t, c.Segment() == seg && c.Offset() == off, "the lost message's hold went with its descriptor")
	require.NoError(t, c.Release())
}

func TestDiscardedTicketDropsItsHold(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, large)
	seg, off := a.Segment(), a.Offset()
	tk, err := a.Ticket()
	require.NoError(t, err)
	tk.Discard() // never sent
	require.NoError(t, a.Release())
	assert.False(t, a.Busy())
	c := mustAlloc(t, p, large)
	assert.True(t, c.Segment() == seg && c.Offset() == off)
	require.NoError(t, c.Release())
}

// A message delivered twice (or the same block received in two messages)
// gives the receiver two holds; letting go of one keeps the other.
func TestTwiceDeliveredKeepsItsHold(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, large)
	seg, off, gen := a.Segment(), a.Offset(), a.Gen()
	var got []*shm.Block
	for _, covered := range []bool{true, false} {
		msg := send(t, a)
		// As another process's receiver, whose ticket may cover its hold.
		r, err := shm.AttachAsAnother(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: seg.Size()}, Offset: off, Size: large, Gen: gen, Ticket: msg, Covers: coveredIf(covered)})
		require.NoError(t, err)
		if covered {
			shm.AdoptTicket(msg, statOf(t, msg).ID)
		} else {
			require.NoError(t, unix.Close(msg))
		}
		got = append(got, r)
	}
	require.NoError(t, a.Release())
	require.NoError(t, got[0].Release())
	assert.Equal(t, 1, p.InUse(), "the second delivery still holds the block")
	c := mustAlloc(t, p, large)
	assert.False(t, c.Segment() == seg && c.Offset() == off, "so it is not handed out")
	require.NoError(t, got[1].Release())
	require.Eventually(t, func() bool { return p.InUse() == 1 }, time.Second, 5*time.Millisecond, "only c is in use once both are let go of")
	require.NoError(t, c.Release())
}

// segmentAndItsDescriptors returns seg's identity, and a test of whether
// a descriptor is still one of seg's: not closed, nor reused.
func segmentAndItsDescriptors(t *testing.T, seg *shm.Allocation) (shm.ID, func(fd int) bool) {
	t.Helper()
	id := statOf(t, seg.FD()).ID
	return id, func(fd int) bool {
		got, err := shm.Stat(fd)
		return err == nil && got.ID == id
	}
}

// A receiver that lets go of every block it had of a segment keeps the
// descriptors of the messages that brought them until it has AdoptMax,
// then closes them all; fewer go within milliseconds. Either way the
// producer gets its blocks back.
func TestAdoptedTicketsCloseInBatches(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	seg, off, gen := a.Segment(), a.Offset(), a.Gen()
	id, open := segmentAndItsDescriptors(t, seg)
	receive := func() int {
		msg := send(t, a)
		// As another process's receiver: this process's own would take a
		// lock of its own for its own pool's block, whatever covers it.
		r, err := shm.AttachAsAnother(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: seg.Size()}, Offset: off, Size: 4 << 10, Gen: gen, Ticket: msg, Covers: covering})
		require.NoError(t, err)
		shm.AdoptTicket(msg, id)
		require.NoError(t, r.Release())
		return msg
	}

	// Kept a while: however slowly this test runs, the timers that
	// close them (the transfer's, 10 ms after the first adoption, and
	// the idle check's of a segment nobody uses, 20 ms after its last
	// block was let go of) do not fire until they are resumed below.
	resumeTransfers, resumeChecks := shm.HoldTransfers(t), shm.HoldIdleChecks(t)
	closedAtThe(t, shm.AdoptMax, receive, open)

	resumeTransfers()
	resumeChecks()
	few := []int{receive(), receive()}
	require.NoError(t, a.Release())
	require.Eventually(t, func() bool { return !open(few[0]) && !open(few[1]) }, time.Second, 5*time.Millisecond, "fewer go within milliseconds")
	require.Eventually(t, func() bool { return p.InUse() == 0 }, time.Second, 5*time.Millisecond, "and the block is free again")
}

// closedAtThe receives n messages: the descriptors of the first n-1 stay
// open, and the n-th receive closes them all, its own included.
func closedAtThe(t *testing.T, n int, receive func() int, open func(int) bool) {
	t.Helper()
	var kept []int
	for range n - 1 {
		kept = append(kept, receive())
	}
	for _, fd := range kept {
		assert.True(t, open(fd), "fewer than %d descriptors are kept", n)
	}
	last := receive()
	for _, fd := range append(kept, last) {
		assert.False(t, open(fd), "the %d-th closes them all", n)
	}
}

// A receiver that still holds the blocks that adopted descriptors cover
// keeps those descriptors until it has twice AdoptMax, with its timed
// transfers held off: then it moves its holds to its own description and
// closes them all at once. The blocks stay held for it.
func TestAdoptedTicketsOfHeldBlocksCloseAtTwiceAdoptMax(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	seg, off, gen := a.Segment(), a.Offset(), a.Gen()
	id, open := segmentAndItsDescriptors(t, seg)
	var held []*shm.Block
	receive := func() int {
		msg := send(t, a)
		// As another process's receiver, as in TestAdoptedTicketsCloseInBatches.
		r, err := shm.AttachAsAnother(shm.BlockRef{Seg: shm.SegmentRef{ID: id, Size: seg.Size()}, Offset: off, Size: 4 << 10, Gen: gen, Ticket: msg, Covers: covering})
		require.NoError(t, err)
		shm.AdoptTicket(msg, id)
		held = append(held, r)
		return msg
	}

	resume := shm.HoldTransfers(t)
	closedAtThe(t, 2*shm.AdoptMax, receive, open)
	assert.True(t, a.Busy(), "the receiver's own description holds the block now")

	resume()
	for _, r := range held {
		require.NoError(t, r.Release())
	}
	require.NoError(t, a.Release())
	require.Eventually(t, func() bool { return p.InUse() == 0 }, time.Second, 5*time.Millisecond, "the block is free once let go of")
}

// A receiver keeps at most an eighth of the descriptors it may have in
// idle mappings, each of which keeps one, once it has more than a few:
// under a low limit, fewer than idle mappings' own bound.
func TestIdleMappingsBoundedByTheDescriptorLimit(t *testing.T) {
	leakcheck.Check(t)
	var old unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &old))
	const limit = 128 // an eighth of it, 16, is fewer than the 20 segments below
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: limit, Max: old.Max}))
	t.Cleanup(func() { _ = unix.Setrlimit(unix.RLIMIT_NOFILE, &old) })
	t.Cleanup(func() { require.NoError(t, shm.DropIdle()) })
	shm.HoldIdleChecks(t) // the mappings are counted before any check
	for range 20 {        // a segment of a pool of its own each, whose producer lives
		p := shm.NewPool(1 << 30)
		t.Cleanup(func() { p.Trim(0) })
		b := mustAlloc(t, p, 4<<10)
		msg := send(t, b)
		r, err := shm.AttachAsAnother(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: b.Segment().Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: msg})
		require.NoError(t, unix.Close(msg))
		require.NoError(t, err)
		require.NoError(t, r.Release())
		require.NoError(t, b.Release())
	}
	assert.Equal(t, limit/8, shm.IdleSegments(), "the last ones let go of")
}

// A received segment used again is no longer idle: dropping the idle
// mappings leaves it, and the block in use, mapped.
func TestSegmentUsedAgainIsNotIdle(t *testing.T) {
	p := testPool(t)
	shm.HoldIdleChecks(t)
	a := mustAlloc(t, p, 4<<10)
	copy(a.Bytes(), "again")
	msg := send(t, a)
	defer unix.Close(msg)
	ref := shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: a.Segment().Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: msg}
	idle := shm.IdleSegments()
	r, err := shm.AttachAsAnother(ref)
	require.NoError(t, err)
	require.NoError(t, r.Release())
	require.Equal(t, idle+1, shm.IdleSegments(), "let go of: kept mapped, idle")
	r, err = shm.AttachAsAnother(ref)
	require.NoError(t, err)
	if assert.Equal(t, idle, shm.IdleSegments(), "in use again") {
		require.NoError(t, shm.DropIdle())
		assert.Equal(t, "again", string(r.Bytes()[:5]), "its mapping stays")
	}
	require.NoError(t, r.Release())
	require.NoError(t, a.Release())
}

// An attach that maps a segment and then finds its block stale leaves
// the mapping idle, as any other mapping no block uses, to be dropped
// with the others: not mapped for as long as the process lives.
func TestStaleAttachLeavesItsMappingIdle(t *testing.T) {
	p := testPool(t)
	shm.HoldIdleChecks(t)
	a := mustAlloc(t, p, 4<<10)
	msg := send(t, a)
	defer unix.Close(msg)
	idle := shm.IdleSegments()
	_, err := shm.AttachAsAnother(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: a.Segment().Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen() + 1, Ticket: msg})
	require.ErrorIs(t, err, shm.ErrStaleBlock)
	assert.Equal(t, idle+1, shm.IdleSegments(), "the mapping it made is idle")
	require.NoError(t, a.Release())
}

// A descriptor handed over for a segment this process does not map (the
// blocks it covered were let go of, and their segment dropped, before the
// message's decode handed it over) is closed at once: nothing would close
// it later, and its description, which locks every slot of the segment,
// would keep the producer's blocks as long as this process lives.
func TestTicketAdoptedForAnUnmappedSegmentIsClosed(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	id := statOf(t, a.Segment().FD()).ID
	msg := send(t, a)
	shm.AdoptTicket(msg, id) // no block of it attached here: this process maps none as a receiver
	got, err := shm.Stat(msg)
	assert.False(t, err == nil && got.ID == id, "closed at once")
	require.NoError(t, a.Release())
	require.Eventually(t, func() bool { return p.InUse() == 0 }, time.Second, 5*time.Millisecond, "and the block is free again")
}

func TestAttachBlock(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	b := mustAlloc(t, p, 4<<10)
	copy(a.Bytes(), "first")
	copy(b.Bytes(), "second")
	ma, mb := send(t, a), send(t, b)
	defer unix.Close(ma)
	defer unix.Close(mb)
	seg := a.Segment()

	before, err := leakcheck.Mappings()
	require.NoError(t, err)
	ra, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, ma).ID, Size: seg.Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: ma})
	require.NoError(t, err)
	rb, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, mb).ID, Size: seg.Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: mb})
	require.NoError(t, err)
	after, err := leakcheck.Mappings()
	require.NoError(t, err)
	assert.Equal(t, before+1, after, "two blocks of one segment: one mapping")
	assert.Equal(t, "first", string(ra.Bytes()[:5]))
	assert.Equal(t, "second", string(rb.Bytes()[:6]))
	rb.Bytes()[0] = 'S'
	assert.Equal(t, byte('S'), b.Bytes()[0])

	for name, f := range map[string]func() error{
		"offset past the segment": func() error {
			_, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, ma).ID, Size: seg.Size()}, Offset: seg.Size(), Size: 1, Gen: a.Gen(), Ticket: ma})
			return err
		},
		"offset in the slot table": func() error {
			_, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, ma).ID, Size: seg.Size()}, Offset: 0, Size: 16, Gen: a.Gen(), Ticket: ma})
			return err
		},
		"size past the segment": func() error {
			_, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, ma).ID, Size: seg.Size()}, Offset: a.Offset(), Size: seg.Size(), Gen: a.Gen(), Ticket: ma})
			return err
		},
		"not a slot": func() error {
			_, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, ma).ID, Size: seg.Size()}, Offset: a.Offset() + 64, Size: 16, Gen: a.Gen(), Ticket: ma})
			return err
		},
		"larger than the slot": func() error {
			_, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, ma).ID, Size: seg.Size()}, Offset: a.Offset(), Size: 8 << 10, Gen: a.Gen(), Ticket: ma})
			return err
		},
		"segment larger than the file": func() error {
			_, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, ma).ID, Size: seg.Size() * 2}, Offset: a.Offset(), Size: 16, Gen: a.Gen(), Ticket: ma})
			return err
		},
	} {
		assert.Error(t, f(), name)
	}
	require.NoError(t, ra.Release())
	require.NoError(t, rb.Release())
	require.NoError(t, a.Release())
	require.NoError(t, b.Release())
}

// A block of a segment the process maps already is found by the
// segment's identity: no descriptor, no new mapping. Its slot is held all
// the same, and its generation checked.
func TestAttachMappedBlock(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	b := mustAlloc(t, p, 4<<10)
	seg := a.Segment()
	require.Equal(t, seg.ID(), b.Segment().ID(), "one segment")

	_, err := shm.AttachMapped(shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: -1})
	require.ErrorIs(t, err, shm.ErrNotMapped, "its producer's pool is not a mapping received")

	ma := send(t, a)
	ra, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, ma).ID, Size: seg.Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: ma})
	require.NoError(t, err)
	before, err := leakcheck.Mappings()
	require.NoError(t, err)
	rb, err := shm.AttachMapped(shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: -1})
	require.NoError(t, err)
	after, err := leakcheck.Mappings()
	require.NoError(t, err)
	assert.Equal(t, before, after, "no new mapping")
	rb.Bytes()[0] = 'B'
	assert.Equal(t, byte('B'), b.Bytes()[0])

	_, err = shm.AttachMapped(shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size() * 2}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: -1})
	assert.ErrorIs(t, err, shm.ErrNotMapped, "a mapping too small for the segment claimed")
	_, err = shm.AttachMapped(shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen() + 1, Ticket: -1})
	assert.ErrorIs(t, err, shm.ErrStaleBlock)

	require.NoError(t, unix.Close(ma)) // no message holds anything now
	assert.True(t, b.Busy(), "the receiver holds the block it found by identity")
	require.NoError(t, rb.Release())
	require.NoError(t, ra.Release())
	require.NoError(t, a.Release())
	require.NoError(t, b.Release())
}

// A native library in a worker writes past the end of its tensor: the
// next tensor's bytes may suffer, its ownership may not.
func TestOverrunCannotChangeOwnership(t *testing.T) {
	p := testPool(t)
	x := mustAlloc(t, p, 4<<10)
	y := mustAlloc(t, p, 4<<10)
	writer, victim := x, y // the writer's slot comes first
	if y.Offset() < x.Offset() {
		writer, victim = y, x
	}
	require.Equal(t, writer.Offset()+4<<10, victim.Offset(), "neighbours")
	seg, off := victim.Segment(), victim.Offset()
	msg := send(t, victim)
	held, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: seg.Size()}, Offset: off, Size: 4 << 10, Gen: victim.Gen(), Ticket: msg})
	require.NoError(t, err)
	require.NoError(t, unix.Close(msg))
	require.NoError(t, victim.Release()) // only the receiver holds it now

	// 16 bytes past the end, then the whole next slot, with zeros and
	// with ones, the way a stray memset would.
	for _, fill := range []byte{0, 0xff} {
		for _, n := range []int{4<<10 + 16, 8 << 10} {
			over := unsafe.Slice(&writer.Bytes()[0], n)
			for i := range over {
				over[i] = fill
			}
		}
	}
	assert.True(t, held.Busy(), "the receiver still holds its block")
	var got []*shm.Block
	for range 1000 {
		c, err := p.Alloc(4 << 10)
		require.NoError(t, err)
		assert.False(t, c.Segment() == seg && c.Offset() == off, "a held block is never handed out again")
		got = append(got, c)
	}
	for _, c := range got {
		require.NoError(t, c.Release())
	}
	require.NoError(t, held.Release())
	require.NoError(t, writer.Release())

	c := mustAlloc(t, p, 4<<10)
	assert.NoError(t, c.Release(), "once let go, the slot serves again")
}

func TestSegmentsAreSealed(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	defer a.Release()
	msg := send(t, a)
	defer unix.Close(msg)
	assert.ErrorIs(t, unix.Ftruncate(msg, 0), unix.EPERM, "a holder cannot shrink the segment under the others")
	assert.ErrorIs(t, unix.Ftruncate(msg, a.Segment().Size()*2), unix.EPERM, "nor grow it")
	_, err := unix.FcntlInt(uintptr(msg), unix.F_ADD_SEALS, unix.F_SEAL_WRITE)
	assert.Error(t, err, "nor change the seals")

	// A descriptor of an unsealed file is refused before it is mapped.
	raw, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(raw, 1<<20))
	_, err = shm.OpenFD(fd.New(raw), 1<<20, 0)
	assert.ErrorIs(t, err, shm.ErrUnsealed)
}

func TestPoolTrimAndLimit(t *testing.T) {
	leakcheck.Check(t)
	p := shm.NewPool(3 * (20<<20 + 4<<10)) // three segments of 17 MiB blocks (a class of 20 MiB)
	var bs []*shm.Block
	for range 4 {
		b, err := p.Alloc(large)
		require.NoError(t, err)
		bs = append(bs, b)
	}
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
	_, bytes, _ := p.Stats()
	assert.LessOrEqual(t, bytes, int64(3*(20<<20+4<<10)), "released segments beyond the limit are closed")
	p.Trim(0)
	segs, bytes, free := p.Stats()
	assert.Zero(t, segs)
	assert.Zero(t, bytes)
	assert.Zero(t, free)
}

func TestPoolConcurrent(t *testing.T) {
	p := testPool(t)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				size := int64(512 << (i % 10))
				b, err := p.Alloc(size)
				if !assert.NoError(t, err) {
					return
				}
				b.Bytes()[0] = byte(g)
				b.Bytes()[size-1] = byte(g)
				if i%3 == 0 {
					tk, err := b.Ticket()
					if assert.NoError(t, err) {
						tk.Discard()
					}
				}
				assert.Equal(t, byte(g), b.Bytes()[0])
				assert.NoError(t, b.Release())
			}
		}()
	}
	wg.Wait()
}

func BenchmarkPoolAllocRelease(b *testing.B) {
	for _, size := range []int64{4 << 10, 64 << 20} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			p := shm.NewPool(1 << 30)
			defer p.Trim(0)
			warm, err := p.Alloc(size)
			require.NoError(b, err)
			require.NoError(b, warm.Release())
			b.ReportAllocs()
			for b.Loop() {
				blk, err := p.Alloc(size)
				if err != nil {
					b.Fatal(err)
				}
				if err := blk.Release(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func TestPoolHitAllocatesNothing(t *testing.T) {
	p := shm.NewPool(1 << 30)
	defer p.Trim(0)
	warm := mustAlloc(t, p, 4<<10)
	require.NoError(t, warm.Release())
	allocs := testing.AllocsPerRun(100, func() {
		b, err := p.Alloc(4 << 10)
		if err != nil {
			panic(err)
		}
		_ = b.Release()
	})
	assert.Zero(t, allocs, "taking a recycled block allocates nothing")
}

func TestNamedPool(t *testing.T) {
	leakcheck.Check(t)
	shm.EnableNamedPool()
	p := shm.NamedPool()
	require.NotNil(t, p)
	a := mustAlloc(t, p, 4<<10)
	seg := a.Segment()
	require.NotEmpty(t, seg.Name())
	assert.True(t, inDir(seg.Name()), "a named pool's segments keep their names")
	assert.True(t, a.Named(), "and travel by name")
	copy(a.Bytes(), "named")
	msg := send(t, a)

	other, err := shm.Create(4096, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	defer other.Release()
	_, err = shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{Name: seg.Name(), Size: seg.Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: other.FD()})
	assert.ErrorContains(t, err, "not the file", "the message's descriptor must be of the named segment")
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{Name: seg.Name(), Size: seg.Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: msg})
	require.NoError(t, err)
	assert.Equal(t, "named", string(r.Bytes()[:5]))
	_, err = shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{Name: "../" + seg.Name(), Size: seg.Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: msg})
	assert.ErrorIs(t, err, shm.ErrBadName)

	// Another block of the segment is found by its name, with no
	// descriptor and no new mapping.
	b := mustAlloc(t, p, 4<<10)
	require.Equal(t, seg.ID(), b.Segment().ID(), "one segment")
	var asked []shm.ID
	uncovered := func(id shm.ID) bool { asked = append(asked, id); return false }
	rb, err := shm.AttachMapped(shm.BlockRef{Seg: shm.SegmentRef{Name: seg.Name(), Size: seg.Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: -1, Covers: uncovered})
	require.NoError(t, err, "the receiver maps the segment")
	assert.Equal(t, []shm.ID{seg.ID()}, asked, "the segment's identity")
	assert.Same(t, r.Segment(), rb.Segment(), "one mapping")
	_, err = shm.AttachMapped(shm.BlockRef{Seg: shm.SegmentRef{Name: seg.Name() + "0", Size: seg.Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: -1, Covers: uncovered})
	assert.ErrorIs(t, err, shm.ErrNotMapped, "no segment of that name is mapped")
	require.NoError(t, rb.Release())
	require.NoError(t, b.Release())

	require.NoError(t, unix.Close(msg)) // the receiver holds it now
	require.NoError(t, r.Release())
	require.NoError(t, a.Release())

	shm.Trim()
	assert.False(t, inDir(seg.Name()), "trimming a named segment removes its name")
	_, err = shm.AttachMapped(shm.BlockRef{Seg: shm.SegmentRef{Name: seg.Name(), Size: seg.Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: -1, Covers: uncovered})
	assert.ErrorIs(t, err, shm.ErrNotMapped, "and its mapping")
}

// statOf is shm.Stat for a descriptor the test knows is good.
func statOf(t *testing.T, fd int) shm.SegmentRef {
	t.Helper()
	st, err := shm.Stat(fd)
	require.NoError(t, err)
	return st
}

// covering says that a message's ticket covers the block it names.
func covering(shm.ID) bool { return true }

// coveredIf says that a message's ticket covers the block it names if
// covered.
func coveredIf(covered bool) func(shm.ID) bool {
	return func(shm.ID) bool { return covered }
}

// A Block's registered user is found from the segment's identity (or
// name), offset and generation, by the producer and by a receiver; a live
// user is kept over a newcomer, a dead one replaced, and Release ends the
// registration.
func TestSlotUsers(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	seg := a.Segment()
	var users shm.Users[string]
	find := func(id shm.ID, off int64, gen uint64) *string {
		return users.Find(shm.BlockRef{Seg: shm.SegmentRef{ID: id}, Offset: off, Gen: gen})
	}
	producer, first, second := new(string), new(string), new(string)
	dead := map[*string]bool{}
	alive := func(u *string) bool { return !dead[u] }
	assert.Nil(t, find(seg.ID(), a.Offset(), a.Gen()))

	assert.Same(t, producer, users.Set(a, producer, alive))
	assert.Same(t, producer, find(seg.ID(), a.Offset(), a.Gen()))
	assert.Nil(t, find(seg.ID(), a.Offset(), a.Gen()+1), "another generation")
	assert.Nil(t, find(seg.ID(), a.Offset()+1, a.Gen()), "not a slot")
	assert.Nil(t, find(shm.ID{Ino: 1}, a.Offset(), a.Gen()), "another segment")

	msg := send(t, a)
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: seg.Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: msg})
	require.NoError(t, err)
	require.NoError(t, unix.Close(msg))
	assert.Same(t, first, users.Set(r, first, alive))
	r2, err := shm.AttachMapped(shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: -1})
	require.NoError(t, err)
	assert.Same(t, first, users.Set(r2, second, alive), "the live user stays")
	assert.Same(t, first, find(seg.ID(), a.Offset(), a.Gen()), "the receiver's mapping is asked first")
	dead[first] = true
	assert.Same(t, second, users.Set(r2, second, alive), "a dead user is replaced")
	require.NoError(t, r.Release())
	assert.Same(t, second, find(seg.ID(), a.Offset(), a.Gen()), "another Block's release leaves it")
	require.NoError(t, r2.Release())
	assert.Same(t, producer, find(seg.ID(), a.Offset(), a.Gen()), "then the producer's is found")
	require.NoError(t, a.Release())
	assert.Nil(t, find(seg.ID(), a.Offset(), a.Gen()))
}

// A block lent to a message that names it without a ticket (a lane's) is
// not reused while the loan lasts, though its producer released it; the
// last Return hands it back. Only a live block of this process's own
// pool can be lent.
func TestLentBlockIsKeptUntilReturned(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, large)
	seg, off := a.Segment(), a.Offset()
	require.NoError(t, a.Lend())
	require.NoError(t, a.Lend()) // two messages name it
	require.NoError(t, a.Release())
	assert.Equal(t, 1, p.InUse(), "the loans keep it")
	b := mustAlloc(t, p, large)
	assert.False(t, b.Segment() == seg && b.Offset() == off, "a lent block is not reused")
	a.Return()
	assert.Equal(t, 2, p.InUse(), "one loan is left")
	a.Return()
	a.Return() // more returns than loans do nothing
	assert.Equal(t, 1, p.InUse(), "the last return gives it back")
	c := mustAlloc(t, p, large)
	assert.True(t, c.Segment() == seg && c.Offset() == off, "and it is reused")

	// A block lent and returned before its release goes back at once.
	require.NoError(t, c.Lend())
	c.Return()
	require.NoError(t, c.Release())
	assert.ErrorIs(t, c.Lend(), shm.ErrReleased, "a released block cannot be lent")
	d := mustAlloc(t, p, large)
	assert.True(t, d.Segment() == seg && d.Offset() == off)

	// A received block is not this process's to lend.
	msg := send(t, b)
	defer unix.Close(msg)
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: b.Segment().Size()}, Offset: b.Offset(), Size: large, Gen: b.Gen(), Ticket: msg})
	require.NoError(t, err)
	assert.False(t, r.Produced())
	assert.True(t, b.Produced())
	assert.Error(t, r.Lend())
	require.NoError(t, r.Release())
	require.NoError(t, b.Release())
	require.NoError(t, d.Release())
}

// A pinned segment stays mapped, and its blocks found by identity alone,
// after every block of it is released and its producer has let go of it;
// once unpinned, it goes like any unused segment.
func TestPinnedSegmentStaysMapped(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	b := mustAlloc(t, p, 4<<10)
	seg := a.Segment()
	copy(b.Bytes(), "kept")
	ref := func(x *shm.Block) shm.BlockRef {
		return shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: x.Offset(), Size: 4 << 10, Gen: x.Gen(), Ticket: -1}
	}
	_, _, ok := shm.Pin(seg.ID())
	assert.False(t, ok, "a segment not received cannot be pinned")
	_, err := shm.Attach(ref(a))
	require.ErrorIs(t, err, shm.ErrNotMapped, "nor found by identity")

	r := receive(t, a)
	unpin, size, ok := shm.Pin(seg.ID())
	require.True(t, ok)
	assert.Equal(t, seg.Size(), size)
	assert.True(t, shm.Kept(seg.ID()), "its producer keeps it")
	require.NoError(t, r.Release())
	require.NoError(t, a.Release())
	require.NoError(t, b.Release())
	require.Eventually(t, func() bool {
		p.Trim(0)
		segs, _, _ := p.Stats()
		return segs == 0
	}, 5*time.Second, 10*time.Millisecond, "the producer lets go of the segment")
	assert.False(t, shm.Kept(seg.ID()), "its producer has let go of it")
	time.Sleep(100 * time.Millisecond) // past the idle checks of an unused segment
	rb, err := shm.Attach(ref(b))
	require.NoError(t, err, "the pinned segment is found by identity")
	assert.Equal(t, "kept", string(rb.Bytes()[:4]))
	require.NoError(t, rb.Release())

	unpin()
	unpin() // once only
	assert.Eventually(t, func() bool {
		x, err := shm.Attach(ref(b))
		if err == nil {
			_ = x.Release()
		}
		return errors.Is(err, shm.ErrNotMapped)
	}, 5*time.Second, 10*time.Millisecond, "unpinned, the abandoned segment goes")
}

// AttachAll attaches blocks by identity in segments this process maps,
// all or none: one that was recycled fails the lot, and leaves none
// held.
func TestAttachAllByIdentity(t *testing.T) {
	p := testPool(t)
	var bs []*shm.Block
	for range 4 {
		bs = append(bs, mustAlloc(t, p, 4<<10))
	}
	seg := bs[0].Segment()
	ref := func(b *shm.Block, gen uint64) shm.BlockRef {
		return shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: gen, Ticket: -1}
	}
	_, err := shm.AttachAll([]shm.BlockRef{ref(bs[0], bs[0].Gen())})
	require.ErrorIs(t, err, shm.ErrNotMapped, "a segment this process does not map")

	r0 := receive(t, bs[0])
	copy(bs[2].Bytes(), "two")

	_, err = shm.AttachAll([]shm.BlockRef{ref(bs[1], bs[1].Gen()), ref(bs[2], bs[2].Gen()+1)})
	require.ErrorIs(t, err, shm.ErrStaleBlock, "a generation not the slot's")
	require.NoError(t, r0.Release())
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
	p.Trim(1 << 30) // this process's ticket description
	assert.Eventually(t, func() bool { return p.InUse() == 0 }, 5*time.Second, time.Millisecond,
		"the failed attach holds nothing")

	again := mustAlloc(t, p, 4<<10)
	defer again.Release()
	more := mustAlloc(t, p, 4<<10)
	defer more.Release()
	copy(again.Bytes(), "again")
	r := receive(t, again)
	got, err := shm.AttachAll([]shm.BlockRef{ref(again, again.Gen()), ref(more, more.Gen()), ref(again, again.Gen())})
	require.NoError(t, err)
	require.Len(t, got, 3)
	assert.Equal(t, "again", string(got[0].Bytes()[:5]))
	assert.Equal(t, "again", string(got[2].Bytes()[:5]), "a block named twice is held twice")
	require.NoError(t, r.Release())
	for _, b := range got {
		require.NoError(t, b.Release())
	}
}

// A receiver that names a block by identity (no ticket holds it) may lock
// its slot after the producer's reclaim found it free and read its
// generation before the reclaim bumps it: the reclaim asks again after
// the bump, and the slot, held, is not handed out.
func TestReclaimAsksAgainAfterTheBump(t *testing.T) {
	p := testPool(t)
	keep := mustAlloc(t, p, 4<<10)
	a := mustAlloc(t, p, 4<<10)
	seg := keep.Segment()
	require.Equal(t, seg, a.Segment())
	r := receive(t, keep)
	keep.Busy() // retires the ticket description
	off, ref := a.Offset(), shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: a.Offset(), Size: 4 << 10, Gen: a.Gen(), Ticket: -1}
	copy(a.Bytes(), "mine")
	require.NoError(t, a.Release()) // pending

	var got *shm.Block
	var err error
	shm.RaceBump(t, func() {
		if got == nil {
			got, err = shm.AttachAsAnother(ref) // locks, then finds the old generation
		}
	})
	p.InUse() // reclaims
	require.NoError(t, err)
	require.NotNil(t, got)
	var again []*shm.Block
	for range 600 {
		b := mustAlloc(t, p, 4<<10)
		again = append(again, b)
		assert.False(t, b.Segment() == seg && b.Offset() == off, "a slot the receiver holds was handed out")
	}
	assert.Equal(t, "mine", string(got.Bytes()[:4]))
	for _, b := range again {
		require.NoError(t, b.Release())
	}
	require.NoError(t, got.Release())
	require.NoError(t, r.Release())
	require.NoError(t, keep.Release())
}

// LockAhead locks the slots of blocks not attached yet, one call per run
// of neighbouring slots, and those locks hold: until the next transfer the
// producer does not take such a block back, and attaching it costs no
// call, its generation checked all the same. Refs of a segment this
// process does not map, or of no slot, are passed over. A lock that no
// attach takes up goes at the next transfer, and the producer then takes
// its block back.
func TestLockAhead(t *testing.T) {
	p := testPool(t)
	resume := shm.HoldTransfers(t)
	var bs []*shm.Block
	for i := range 5 {
		bs = append(bs, mustAlloc(t, p, 4<<10))
		copy(bs[i].Bytes(), fmt.Sprint(i))
	}
	seg := bs[0].Segment()
	for i, b := range bs[1:] {
		require.Equal(t, seg, b.Segment())
		require.Equal(t, shm.SlotOf(bs[1])+i, shm.SlotOf(b), "the blocks are neighbours")
	}
	ref := func(b *shm.Block, gen uint64) shm.BlockRef {
		return shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: gen, Ticket: -1}
	}
	r := receive(t, bs[0]) // this process maps the segment, as a lane's reader
	keep := bs[0].Busy()   // and the ticket's description is closed
	require.True(t, keep)
	other, bad := ref(bs[1], bs[1].Gen()), ref(bs[1], bs[1].Gen())
	other.Seg.ID.Ino++
	bad.Offset += 64
	before := shm.AttachLocks()
	shm.LockAhead([]shm.BlockRef{ref(bs[1], bs[1].Gen()), other, ref(bs[2], bs[2].Gen()), bad,
		ref(bs[3], bs[3].Gen()), ref(bs[2], bs[2].Gen()), ref(bs[4], bs[4].Gen())})
	assert.Equal(t, uint64(1), shm.AttachLocks()-before, "one call for the run of four")
	for i, b := range bs[1:] {
		assert.True(t, shm.Locked(ref(b, b.Gen())), "block %d", i+1)
	}
	assert.False(t, shm.Locked(other), "a segment this process does not map")
	assert.False(t, shm.Locked(bad), "no slot")

	gen1 := bs[1].Gen()
	require.NoError(t, bs[1].Release()) // the producer's: pending, locked ahead
	var again []*shm.Block
	for range 600 {
		b := mustAlloc(t, p, 4<<10)
		again = append(again, b)
		assert.False(t, b.Segment() == seg && b.Offset() == bs[1].Offset(), "a slot locked ahead was handed out")
	}
	for _, b := range again {
		require.NoError(t, b.Release())
	}
	var got []*shm.Block
	for i, b := range bs[1:4] {
		gen := b.Gen()
		if i == 0 {
			gen = gen1
		}
		x, err := shm.Attach(ref(b, gen))
		require.NoError(t, err, "block %d", i+1)
		assert.Equal(t, fmt.Sprint(i+1), string(x.Bytes()[:1]))
		got = append(got, x)
	}
	_, err := shm.Attach(ref(bs[4], bs[4].Gen()+1))
	require.ErrorIs(t, err, shm.ErrStaleBlock, "the generation is checked")
	assert.Equal(t, uint64(1), shm.AttachLocks()-before, "the attaches made no call")

	for _, b := range bs[2:] {
		require.NoError(t, b.Release())
	}
	p.Trim(1 << 30)
	assert.Equal(t, 5, p.InUse(), "block 4's lock stays while no transfer runs")
	resume()
	require.Eventually(t, func() bool { p.Trim(1 << 30); return p.InUse() == 4 }, 5*time.Second, 5*time.Millisecond,
		"block 4, locked ahead and not attached, goes back once its lock goes; those held stay")
	for _, b := range append(got, r, bs[0]) {
		require.NoError(t, b.Release())
	}
	assert.Eventually(t, func() bool { return p.InUse() == 0 }, 5*time.Second, 5*time.Millisecond)
}

// A receiver that has let go of LetGoMax blocks of a segment unlocks
// their slots then, without waiting for the transfer, so that their
// producer takes them back at once. Fewer stay locked until the
// transfer, and a slot let go of and held again stays locked.
func TestLetGoUnlocks(t *testing.T) {
	p := testPool(t)
	resume := shm.HoldTransfers(t)
	n := shm.LetGoMax
	bs := make([]*shm.Block, n+2)
	refs := make([]shm.BlockRef, len(bs))
	for i := range bs {
		bs[i] = mustAlloc(t, p, 4<<10)
		seg := bs[i].Segment()
		refs[i] = shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: bs[i].Offset(), Size: 4 << 10, Gen: bs[i].Gen(), Ticket: -1}
		require.Equal(t, bs[0].Segment(), seg)
	}
	r := receive(t, bs[0])        // this process maps the segment, as a receiver
	require.True(t, bs[0].Busy()) // and the ticket's description is closed
	got := make([]*shm.Block, len(bs))
	for i := 1; i < len(bs); i++ {
		x, err := shm.Attach(refs[i])
		require.NoError(t, err)
		got[i] = x
		require.NoError(t, bs[i].Release()) // the producer's: pending while the receiver holds it
	}
	inUse := func() int { p.Trim(1 << 30); return p.InUse() }
	require.Equal(t, n+2, inUse())

	for _, x := range got[1:n] {
		require.NoError(t, x.Release())
	}
	assert.Equal(t, n+2, inUse(), "%d let go of: locked until the transfer", n-1)
	calls := shm.AttachLocks()
	again, err := shm.Attach(refs[1])
	require.NoError(t, err)
	assert.Equal(t, calls, shm.AttachLocks(), "held again through the lock it kept")
	require.NoError(t, got[n].Release())
	assert.Equal(t, 3, inUse(), "%d let go of: unlocked with no transfer, but for the one held again and the one still held", n)

	// A slot unlocked so is locked afresh when a block of it comes again.
	b := mustAlloc(t, p, 4<<10)
	require.Equal(t, bs[0].Segment(), b.Segment())
	require.Contains(t, []int64{refs[2].Offset, refs[n].Offset}, b.Offset(), "a slot let go of, handed out again")
	calls = shm.AttachLocks()
	x, err := shm.Attach(shm.BlockRef{Seg: refs[0].Seg, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: -1})
	require.NoError(t, err)
	assert.Equal(t, calls+1, shm.AttachLocks(), "its lock is taken again")
	require.NoError(t, b.Release())
	assert.Equal(t, 4, inUse(), "and holds it against the producer")
	require.NoError(t, x.Release())

	resume()
	for _, x := range []*shm.Block{again, got[n+1], r} {
		require.NoError(t, x.Release())
	}
	require.NoError(t, bs[0].Release())
	assert.Eventually(t, func() bool { return inUse() == 0 }, 5*time.Second, 5*time.Millisecond)
}

// Slots let go of here and there in a segment are unlocked in one call
// per stretch between the slots the receiver still locks, across the
// slots between them that it does not lock: the let-go slots come back
// to the producer, and a slot between them that the receiver still holds
// stays held.
func TestLetGoUnlocksAcrossGaps(t *testing.T) {
	p := testPool(t)
	resume := shm.HoldTransfers(t)
	n := shm.LetGoMax
	bs := make([]*shm.Block, 2*n+4)
	for i := range bs {
		bs[i] = mustAlloc(t, p, 4<<10)
		require.Equal(t, bs[0].Segment(), bs[i].Segment())
		if i > 0 {
			require.Greater(t, shm.SlotOf(bs[i]), shm.SlotOf(bs[i-1]))
		}
	}
	ref := func(b *shm.Block) shm.BlockRef {
		seg := b.Segment()
		return shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: b.Offset(), Size: b.Size(), Gen: b.Gen(), Ticket: -1}
	}
	r := receive(t, bs[0]) // this process maps the segment, as a receiver
	// Every other block, and one in the middle of them that stays held.
	var got []*shm.Block
	var kept *shm.Block
	for i := 2; i < len(bs); i += 2 {
		x, err := shm.Attach(ref(bs[i]))
		require.NoError(t, err)
		got = append(got, x)
		if i == n {
			kept = got[len(got)-1]
			got = got[:len(got)-1]
		}
	}
	require.Len(t, got, n)
	for _, b := range bs[1:] {
		require.NoError(t, b.Release()) // the producer's: pending while the receiver holds it
	}
	inUse := func() int { p.Trim(1 << 30); return p.InUse() }
	require.Equal(t, n+2, inUse(), "the received blocks, and the first, held by the receiver; the others free")

	before := shm.UnlockCalls()
	for _, x := range got {
		require.NoError(t, x.Release())
	}
	assert.Equal(t, uint64(2), shm.UnlockCalls()-before, "%d slots let go of, two stretches around the one held", n)
	for i := 2; i < len(bs); i += 2 {
		assert.Equal(t, i == n, shm.Locked(ref(bs[i])), "block %d, as the receiver's table has it", i)
	}
	assert.Equal(t, 2, inUse(), "the let-go slots come back; the held one and the first stay")

	resume()
	require.NoError(t, kept.Release())
	require.NoError(t, r.Release())
	require.NoError(t, bs[0].Release())
	assert.Eventually(t, func() bool { return inUse() == 0 }, 5*time.Second, 5*time.Millisecond)
}

// A lock LockAhead took outlives the transfers that run before AheadKeep
// has gone by, so that the attach that takes it up a few transfers later
// makes no call; one no attach takes up goes once AheadKeep has gone by,
// and its block comes back to its producer. Blocks of two segments,
// named in turn, are locked in one call per segment.
func TestLockAheadKeep(t *testing.T) {
	p := testPool(t)
	small := []*shm.Block{mustAlloc(t, p, 4<<10), mustAlloc(t, p, 4<<10), mustAlloc(t, p, 4<<10)}
	large := []*shm.Block{mustAlloc(t, p, 64<<10), mustAlloc(t, p, 64<<10)}
	require.NotEqual(t, small[0].Segment(), large[0].Segment())
	ref := func(b *shm.Block) shm.BlockRef {
		seg := b.Segment()
		return shm.BlockRef{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: b.Offset(), Size: b.Size(), Gen: b.Gen(), Ticket: -1}
	}
	rs, rl := receive(t, small[0]), receive(t, large[0]) // both segments mapped as a receiver's
	before := shm.AttachLocks()
	shm.LockAhead([]shm.BlockRef{ref(small[1]), ref(large[1]), ref(small[2])})
	locked := time.Now()
	assert.Equal(t, uint64(2), shm.AttachLocks()-before, "one call per segment")
	for _, b := range append(small[1:], large[1]) {
		assert.True(t, shm.Locked(ref(b)))
	}

	time.Sleep(2 * shm.TransferDelay) // a transfer runs, well within AheadKeep
	x, err := shm.Attach(ref(small[1]))
	require.NoError(t, err)
	y, err := shm.Attach(ref(large[1]))
	require.NoError(t, err)
	assert.Equal(t, uint64(2), shm.AttachLocks()-before, "the locks outlived the transfers")

	// small[2] is never attached: once its producer lets go of it, it
	// comes back after AheadKeep.
	require.NoError(t, small[2].Release())
	require.Eventually(t, func() bool { p.Trim(1 << 30); return p.InUse() == 4 }, 5*time.Second, time.Millisecond,
		"the block locked ahead and never attached comes back")
	assert.GreaterOrEqual(t, time.Since(locked), shm.AheadKeep-shm.TransferDelay, "not before its lock's time")
	for _, b := range []*shm.Block{x, y, rs, rl, small[0], small[1], large[0], large[1]} {
		require.NoError(t, b.Release())
	}
	assert.Eventually(t, func() bool { return p.InUse() == 0 }, 5*time.Second, 5*time.Millisecond)
}

// A block AttachAll attached is held by this process's own lock: its
// producer does not take it back.
func TestAttachAllHoldsAgainstReclaim(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	b := mustAlloc(t, p, 4<<10)
	seg := a.Segment()
	r := receive(t, a)
	got, err := shm.AttachAll([]shm.BlockRef{{Seg: shm.SegmentRef{ID: seg.ID(), Size: seg.Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: -1}})
	require.NoError(t, err)
	require.NoError(t, r.Release())
	require.NoError(t, a.Release())
	require.NoError(t, b.Release())
	p.Trim(1 << 30)
	time.Sleep(100 * time.Millisecond) // the receiver's transfers
	assert.Equal(t, 1, p.InUse(), "the block AttachAll holds is not taken back")
	require.NoError(t, got[0].Release())
	assert.Eventually(t, func() bool { return p.InUse() == 0 }, 5*time.Second, time.Millisecond)
}

// Each reclaim asks the kernel afresh: a slot a message in flight holds
// since the last reclaim, which found its segment held by nobody, keeps
// its generation, and its receiver gets it.
func TestReclaimAsksAfresh(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	c := mustAlloc(t, p, 4<<10)
	seg := a.Segment()
	require.Equal(t, seg, c.Segment())
	require.NoError(t, a.Release())
	p.InUse() // a reclaim that finds nobody holds anything of the segment
	msg := send(t, c)
	defer unix.Close(msg)
	gen := c.Gen() // what the message says; c is the pool's once released
	require.NoError(t, c.Release())
	p.InUse() // reclaims again
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: seg.Size()}, Offset: c.Offset(), Size: 4 << 10, Gen: gen, Ticket: msg})
	require.NoError(t, err, "the message's block was not recycled under it")
	require.NoError(t, r.Release())
}

// receive returns b as a receiver holds it: attached from a message that
// carried b's ticket, the message then closed.
func receive(t *testing.T, b *shm.Block) *shm.Block {
	t.Helper()
	msg := send(t, b)
	defer unix.Close(msg)
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: b.Segment().Size()}, Offset: b.Offset(), Size: b.Size(), Gen: b.Gen(), Ticket: msg})
	require.NoError(t, err)
	return r
}

// BenchmarkReturnable asks, from every goroutine at once, whether a
// segment is one of this process's pools': a lookup a receiver makes
// several times for each block a lane names.
func BenchmarkReturnable(b *testing.B) {
	blk, err := shm.DefaultPool().Alloc(4 << 10)
	require.NoError(b, err)
	defer blk.Release()
	id := blk.Segment().ID()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if !shm.Returnable(id) {
				b.Error("a segment of this process's pool is not returnable")
				return
			}
		}
	})
}

// AllocZeroed hands out blocks cleared of what their last user wrote:
// the pool's first segment, filled, written all over and released, is
// what it hands out next, each block cleared.
func TestAllocZeroedClears(t *testing.T) {
	p := testPool(t)
	const size = 4 << 10
	dirty := map[int64]bool{}
	var bs []*shm.Block
	for range shm.FirstSlabSlots(size) {
		b := mustAlloc(t, p, size)
		for i := range b.Bytes() {
			b.Bytes()[i] = 0xee
		}
		dirty[b.Offset()] = true
		bs = append(bs, b)
	}
	require.Len(t, dirty, len(bs))
	for _, b := range bs {
		require.Same(t, bs[0].Segment(), b.Segment(), "one segment")
		require.NoError(t, b.Release())
	}
	for range bs {
		b, err := p.AllocZeroed(size)
		require.NoError(t, err)
		defer b.Release()
		require.Same(t, bs[0].Segment(), b.Segment(), "a block of the released ones")
		require.True(t, dirty[b.Offset()])
		require.Len(t, b.Bytes(), size)
		require.False(t, slices.ContainsFunc(b.Bytes(), func(c byte) bool { return c != 0 }),
			"the block at %d holds its last user's bytes", b.Offset())
	}
}

// A block that AllocZeroed cannot clear, in a named segment that a peer
// cut short under the pool (a memfd's seals forbid that), is an error
// wrapping ErrFault, not a SIGBUS, and stays the pool's.
func TestAllocZeroedOfACutSegmentIsAnError(t *testing.T) {
	leakcheck.Check(t)
	shm.EnableNamedPool()
	p := shm.NamedPool()
	t.Cleanup(func() { shm.Trim() }) // the cut segment goes with its slots free
	const size = 4 << 10
	b := mustAlloc(t, p, size)
	seg := b.Segment()
	require.NoError(t, os.Truncate(filepath.Join(shm.Dir(), seg.Name()), b.Offset()))
	require.NoError(t, b.Release())
	for range 4096 { // until the pool hands out a block past the cut
		inUse := p.InUse()
		z, err := p.AllocZeroed(size)
		if err != nil {
			require.ErrorIs(t, err, shm.ErrFault)
			assert.Equal(t, inUse, p.InUse(), "the block that faulted is not held")
			return
		}
		defer z.Release()
		require.Equal(t, seg, z.Segment(), "a block of another segment before one past the cut")
	}
	t.Fatal("no block past the cut was handed out")
}

// A stream's producer, after a burst that grew its pool to thousands of
// blocks, hands out again the few hundred its consumers gave back last,
// still in its caches, not every block the burst made in turn.
func TestPoolHandsOutWhatCameBackLast(t *testing.T) {
	p := testPool(t)
	const size, burst, window = 4 << 10, 4000, 64
	var bs []*shm.Block
	for range burst {
		bs = append(bs, mustAlloc(t, p, size))
	}
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
	// Each block is released a window of blocks after it was taken.
	type at struct {
		seg *shm.Allocation
		off int64
	}
	seen := map[at]bool{}
	live := make([]*shm.Block, 0, window)
	for i := range 3 * burst {
		b := mustAlloc(t, p, size)
		if i >= burst {
			seen[at{b.Segment(), b.Offset()}] = true
		}
		live = append(live, b)
		if len(live) == window {
			require.NoError(t, live[0].Release())
			live = append(live[:0], live[1:]...)
		}
	}
	for _, b := range live {
		require.NoError(t, b.Release())
	}
	assert.LessOrEqual(t, len(seen), 2*(shm.ReclaimBatch+window),
		"blocks the stream went through, of the %d the burst made", burst)
}

// Blocks reclaimed together are handed out in slot order, whatever the
// order they were released in: a lane's reader locks a message's slots
// in one run only if they lie side by side.
func TestPoolHandsOutReclaimedBlocksInSlotOrder(t *testing.T) {
	p := testPool(t)
	const size = 4 << 10
	n := shm.FirstSlabSlots(size)
	var bs []*shm.Block
	for range n {
		bs = append(bs, mustAlloc(t, p, size))
	}
	for i := range bs { // 0, n-1, 1, n-2, ...: far from slot order
		k := i / 2
		if i%2 == 1 {
			k = n - 1 - k
		}
		require.NoError(t, bs[k].Release())
	}
	last := -1
	for range n {
		b := mustAlloc(t, p, size)
		defer b.Release()
		require.Same(t, bs[0].Segment(), b.Segment(), "a block of the released ones")
		require.Greater(t, shm.SlotOf(b), last, "handed out in slot order")
		last = shm.SlotOf(b)
	}
}

// A class whose released blocks another description holds for long asks
// about them again only once as many blocks again are released:
// a stream beside a consumer that keeps thousands of blocks costs a
// question or so per block released, not thousands per reclaimBatch.
func TestPoolAsksAboutHeldBlocksOnlyAsOftenAsTheyAreOutnumbered(t *testing.T) {
	p := testPool(t)
	const size, kept = 4 << 10, 2000
	var bs []*shm.Block
	for range kept {
		bs = append(bs, mustAlloc(t, p, size))
	}
	// Held elsewhere, segment by segment, as a consumer holds them.
	bySeg := map[*shm.Allocation][]int{}
	first := map[*shm.Allocation]*shm.Block{}
	for _, b := range bs {
		bySeg[b.Segment()] = append(bySeg[b.Segment()], shm.SlotOf(b))
		if first[b.Segment()] == nil {
			first[b.Segment()] = b
		}
	}
	for seg, slots := range bySeg {
		release, err := shm.HoldSlots(first[seg], slots...)
		require.NoError(t, err)
		defer release()
	}
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
	before := shm.Reclaims(p, size)
	const stream = 3000
	for range stream {
		b := mustAlloc(t, p, size)
		require.NoError(t, b.Release())
	}
	assert.LessOrEqual(t, shm.Reclaims(p, size)-before, stream/kept+1,
		"reclaims over %d blocks released beside %d held", stream, kept)
}

// A block is handed out once until it is released again, however its
// segment's slots were reclaimed before: half of a slab reclaimed and
// handed out again, then the other half.
func TestPoolHandsOutNoBlockTwice(t *testing.T) {
	p := testPool(t)
	const size = 4 << 10
	n := shm.FirstSlabSlots(size)
	out := map[*shm.Block]bool{}
	take := func() {
		b := mustAlloc(t, p, size)
		require.False(t, out[b], "slot %d handed out while it is out", shm.SlotOf(b))
		out[b] = true
	}
	for range n {
		take()
	}
	for _, half := range []int{0, 1} {
		var back []*shm.Block
		for b := range out {
			if shm.SlotOf(b)%2 == half {
				back = append(back, b)
			}
		}
		for _, b := range back {
			require.NoError(t, b.Release())
			delete(out, b)
		}
		for range back {
			take()
		}
	}
	for b := range out {
		require.NoError(t, b.Release())
	}
}

package shm

import (
	"errors"
	"fmt"
	"io"
	"math/bits"
	"sync/atomic"
	"unsafe"

	"github.com/tensormp/tensormp/internal/fd"
)

// Pooled segments.
//
// Making a segment costs a file, a fallocate, an mmap and a page fault per
// page, and a receiver pays an mmap for each one it is sent. So a producer
// keeps segments in a Pool and recycles their slots: storages up to
// packMax are packed many to a slab segment, larger ones get a segment
// each, and a released slot is reused once no process holds it any more.
//
// A class's first slab holds slabData bytes of slots; each further slab
// of the class holds twice its predecessor's, up to slabMax, so that a
// producer with many live blocks of one size, and every receiver of
// them, holds few descriptors and mappings (10,000 blocks of 80 KiB fit
// in 17 segments), while one block costs a small slab at most.
//
// A pooled segment starts with a slot table in pages of its own: magic,
// slot capacity, slot count, where the data starts, and one generation
// word per slot, bumped each time the pool takes the slot back (a free
// slot carries the generation it is handed out with next). The slots'
// data follows, page aligned, with nothing between them: no write inside
// or past a block's bytes can reach the table. A holder of the segment
// that means harm can write it all the same, through a mapping of its
// own: the producer keeps its own record of each slot, which is what
// counts for its own blocks (see ownLook).
//
// Who holds a slot is not written in the segment at all: it is kept by the
// kernel as OFD locks on the segment's file (see lock_linux.go).
//
//   - A producer's own storages are counted in the producer (Block.Release
//     puts the slot back on its pool's pending list).
//   - A receiver holds each block it rebuilt with a read lock on the slot's
//     lock byte, taken through a description of the segment that is its
//     own and never leaves the process.
//   - A message in flight holds the slot with a ticket: a read lock taken
//     through the sender's ticket description of the segment, whose
//     descriptor is the one the message carries. The receiver takes its own
//     lock before it closes the message's descriptor.
//
// The producer reuses a slot only when no description but its own holds a
// lock on it, and bumps the slot's generation when it does; a receiver takes
// its lock first and checks the generation second, so it either holds the
// block the message meant or gets ErrStaleBlock.

const (
	slabMagic   = 0x32424d54 // "TMB2" little-endian
	slabVersion = 1
	slabHdrSize = 32
	pageSize    = 4096

	// smallMax is the largest size class of powers of two; larger
	// classes step by quarters.
	smallMax = 64 << 10
	// smallMin is the smallest block size class.
	smallMin = 256
	// packMax is the largest block packed into slabs.
	packMax = 16 << 20
	// slabData is the data size of a class's first slab; slabMax, the
	// most a slab's data grows to.
	slabData = 2 << 20
	slabMax  = 64 << 20
)

// maxSlabSlots is the most slots a slab has (slabSlots): slabMax bytes of
// the smallest class. A receiver refuses a slot table of more, which no
// producer makes: what it keeps per slot would be a hostile peer's to
// size.
const maxSlabSlots = slabMax / smallMin

// slabSlots returns how many slots of capacity c the next slab of a class
// holds, when the class has n segments already.
func slabSlots(c int64, n int) int64 {
	if c > packMax {
		return 1
	}
	data := int64(slabMax)
	if n < bits.Len64(slabMax/slabData) {
		data = slabData << n
	}
	return max(1, data/c)
}

// slabHdr is the fixed part of a pooled segment's slot table; nslots
// generation words follow it.
type slabHdr struct {
	magic   uint32
	version uint32
	cap     int64 // bytes of each slot
	nslots  int64
	dataOff int64 // where slot 0's data starts
}

var _ [slabHdrSize - unsafe.Sizeof(slabHdr{})]byte

// slabLayout returns the offset of the data of a segment of nslots
// slots: the size of its slot table, in whole pages. A slab whose data
// lies in an extent is its table alone, and says so with a dataOff of 0.
func slabLayout(nslots int64) int64 {
	return (slabHdrSize + 8*nslots + pageSize - 1) &^ (pageSize - 1)
}

// Lock bytes (they lie beyond the file's end, which locks may):
//
//	lockBase + 0      the producer's pool keeps the segment (its own description)
//	lockBase + 1 + i  slot i is held
const lockBase = 1 << 40

func slotByte(slot int) int64 { return lockBase + 1 + int64(slot) }

// segment is one mapping of a pooled segment in this process, shared by
// the blocks that live in it. The mapping and the descriptor it keeps
// (alloc.fd) are this process's own: the producer's or, in a receiver, a
// description opened afresh, whose locks are the receiver's holds.
type segment struct {
	alloc   *Allocation
	cap     int64
	nslots  int
	dataOff int64
	named   bool // file_system: receivers open it by name
	// external: the slots' data lies in ext, not in the segment (see
	// NewExtentPool); dataOff is then 0.
	external bool
	ext      io.Closer // the producer's, or this process's attachment to it

	tickets   tickets
	slotUsers slotUsers // who uses each slot in this process (see Users)

	// producer side, guarded by pool.mu
	pool     *Pool
	class    *sizeClass
	inUse    int      // slots handed out or waiting in pending
	blocks   []*Block // each slot's Block, made once (see Revive)
	marks    []uint64 // a bitmap of slots (see runRoom.mark), empty between calls
	marked   bool     // runRoom.mark has marked slots of it
	reserved []uint64 // bit i: the segment's reserveChunk i has its pages
	held     int8     // reclaimLocked's answer of askWhole while it runs, else unasked

	// receiver side, guarded by attached.mu
	users   int       // live blocks of this process in it
	slots   slotTable // each slot's holds and locks in this process
	adopted []int     // message descriptors kept for the holds they carry
	dirty   bool      // holds and locks differ: a transfer has work to do
	// letGo: slots locked through alloc.fd that a block of this process
	// let go of since the last transfer, unlocked together once there
	// are letGoMax (a slot held again since is skipped then; one let go
	// of twice is listed twice)
	letGo []int
}

// reserveChunk is the unit in which a producer gives a slab its pages:
// a slab's memory is taken as its slots are first handed out, a chunk at
// a time, so that a large slab costs only what is used of it.
const reserveChunk = 256 << 10

// reserveLocked gives the segment's bytes [off, off+n) their pages, in
// whole chunks, unless they have them. The caller holds pool.mu.
func (s *segment) reserveLocked(off, n int64) error {
	has := func(c int64) bool { return s.reserved[c/64]&(1<<(c%64)) != 0 }
	last := (off + n - 1) / reserveChunk
	for c := off / reserveChunk; c <= last; {
		if has(c) {
			c++
			continue
		}
		end := c + 1 // the run of chunks without pages, reserved in one call
		for end <= last && !has(end) {
			end++
		}
		from, to := c*reserveChunk, min(s.alloc.Size(), end*reserveChunk)
		if err := s.alloc.Reserve(from, to-from); err != nil {
			return err
		}
		for ; c < end; c++ {
			s.reserved[c/64] |= 1 << (c % 64)
		}
	}
	return nil
}

func (s *segment) gen(slot int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&s.alloc.mapping[slabHdrSize+8*slot]))
}

// genIs reports whether slot's generation is gen; a segment cut short
// under its mapping has no generation to match.
func (s *segment) genIs(slot int, gen uint64) bool {
	var now uint64
	err := Guard(func() { now = s.gen(slot).Load() })
	return err == nil && now == gen
}

func (s *segment) slotOffset(slot int) int64 { return s.dataOff + int64(slot)*s.cap }

// Block is one storage's piece of a pooled segment. A Block holds its slot
// for its process until Release, once: a producer's Block is handed out
// again when its slot is reused, so it must not be touched after Release.
type Block struct {
	seg      *segment
	slot     int
	size     int64 // bytes the storage asked for
	gen      uint64
	pool     *Pool // the producer's pool; nil in a receiver
	released atomic.Bool
	held     bool // the pool's last reclaim found the slot held; guarded by pool.mu
	// lent counts the producer's loans of the block to messages that name
	// it without a ticket (see Lend); parked: it was released while lent,
	// and goes to its pool at the last Return. Guarded by pool.mu.
	lent   int
	parked bool
	// free: on its class's free list, handed out next (see Revive).
	// Guarded by pool.mu.
	free bool
}

// Bytes returns the block's data. It aliases memory shared with other
// processes and is invalid after Release. A block whose data lies in an
// extent (InExtent) has none here: Bytes returns nil.
func (b *Block) Bytes() []byte {
	if b.seg.external {
		return nil
	}
	start := b.seg.slotOffset(b.slot)
	return b.seg.alloc.mapping[start : start+b.size : start+b.size]
}

// Size returns the number of data bytes.
func (b *Block) Size() int64 { return b.size }

// Segment returns the segment the block lives in; the block keeps
// ownership.
func (b *Block) Segment() *Allocation { return b.seg.alloc }

// Named reports whether the block's segment is shared by name
// (file_system) rather than by descriptor.
func (b *Block) Named() bool { return b.seg.named }

// Sealed reports whether no holder of the block's segment can resize it
// under the others' mappings: a file_descriptor segment, a memfd sealed
// when it was made, is; a named segment is not.
func (b *Block) Sealed() bool { return !b.seg.named }

// Offset returns the offset of the block's data in its segment, or in
// its extent (see InExtent).
func (b *Block) Offset() int64 { return b.seg.slotOffset(b.slot) }

// Gen returns the block's generation: it changes each time the block is
// handed out.
func (b *Block) Gen() uint64 { return b.gen }

// Ticket takes a hold on the block for a message that carries it to
// another process, and returns the ticket whose descriptor the message
// must carry. The hold lasts while that descriptor is open anywhere: in
// flight, in the receiver until it has taken its own hold, and in this
// process until the ticket description is replaced (a few milliseconds
// after this process releases a block it sent). Call Done once the message
// is sent, or Discard if it never will be.
func (b *Block) Ticket() (*Ticket, error) {
	if b.released.Load() {
		return nil, ErrReleased
	}
	t, err := b.seg.tickets.take(b.seg)
	if fd.OutOfDescriptors(err) {
		_ = DropIdle() // each idle mapping keeps a descriptor
		t, err = b.seg.tickets.take(b.seg)
	}
	return t, err
}

// Busy reports whether some other process, or a message in flight, holds
// the block. It is meant for a producer deciding whether memory tied to a
// block may go. This process's own ticket description of the segment,
// which holds every slot, is retired first: messages already sent keep
// their holds through their own copies of it.
func (b *Block) Busy() bool {
	b.seg.tickets.rotate()
	_, _, busy, err := lockInWay(b.seg.alloc.fd(), slotByte(b.slot), 1)
	return busy || err != nil
}

// Release gives up this process's hold on the block. In the producer the
// slot returns to its pool once nobody else holds it; in a receiver the
// lock is dropped and the segment unmapped once no block of this process
// uses it (or kept mapped a while for the next block from it). Releasing
// twice returns nil.
func (b *Block) Release() error {
	if !b.released.CompareAndSwap(false, true) {
		return nil
	}
	b.forgetUser()
	if b.pool != nil {
		b.pool.put(b)
		return nil
	}
	return attached.detach(b)
}

// Produced reports whether b is a block of this process's own pool, as
// opposed to one received from another process.
func (b *Block) Produced() bool { return b.pool != nil }

// Lend keeps the slot of b, a block of this process's pool, from being
// reused for a message that names it by its segment's identity alone, with
// no ticket to hold it in flight (package sock's lanes): until Return, a
// Release of the block parks it instead of handing it back to its pool.
// The receiver, which keeps the segment mapped (see Pin), takes its own
// hold before the lender returns the loan; if this process dies first,
// nothing reuses the slot at all. Lend fails for a released block, or one
// this process did not produce.
func (b *Block) Lend() error {
	if b.pool == nil {
		return &Error{Op: "lend", Path: b.String(), Err: errors.New("not a block of this process's pool")}
	}
	b.pool.mu.Lock()
	defer b.pool.mu.Unlock()
	if b.released.Load() {
		return ErrReleased
	}
	b.lent++
	return nil
}

// Return ends one loan taken with Lend. The last one hands a block
// released meanwhile back to its pool.
func (b *Block) Return() {
	p := b.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if b.lent == 0 {
		return
	}
	b.lent--
	if b.lent == 0 && b.parked {
		b.parked = false
		p.putLocked(b)
	}
}

func (b *Block) String() string {
	return fmt.Sprintf("block %d+%d of %v", b.Offset(), b.size, b.seg.alloc)
}

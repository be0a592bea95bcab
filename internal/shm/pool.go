package shm

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tensormp/tensormp/internal/cacheline"
)

// sizeClass holds the free and pending blocks of one capacity. A
// producer's Block objects are made once per slot and handed out again at
// every reuse, so that taking a recycled block allocates nothing.
type sizeClass struct {
	cap      int64
	free     []*Block               // nobody holds them
	pending  []*Block               // released here, perhaps still held elsewhere
	asking   []*Block               // reclaimLocked's room
	again    []*Block               // and askAgain's
	runs     runRoom                // and askInRuns' and appendInSlotOrder's
	named    map[ReturnRef]struct{} // and the returns' (see Returns)
	kept     int                    // pending blocks the last reclaim found held (see reclaimDue)
	reclaims int                    // reclaims run, for tests
	segs     []*segment
	growing  bool // a goroutine makes a segment for the class, the pool's lock let go (see newSegment)
}

// Pool hands out blocks of pooled segments and recycles them (see
// Block). It owns every segment it made: it holds the segment's lock byte
// for the pool through its own description for as long as it keeps the
// segment, and closes the segment in Trim once no slot of it is in use.
// A Pool may be used from several goroutines.
type Pool struct {
	named   bool // file_system: segments keep their names, receivers open them by name
	mu      sync.Mutex
	classes map[int64]*sizeClass
	segs    map[*segment]struct{}
	cached  int64                            // bytes of segments the pool holds
	limit   int64                            // bytes of unused segments kept for reuse
	stuck   time.Time                        // last trim over the limit that could close nothing
	extent  func(n int64) (io.Closer, error) // makes the slabs' data, for an extent pool; else nil
	grown   *sync.Cond                       // on mu: a class's growth is over
}

// overLimitTrim is the least time between a trim of a pool over its limit
// that could close nothing and the next: segments that messages in flight
// hold cannot go, so trying at every release would only repeat the same
// system calls.
const overLimitTrim = 5 * time.Millisecond

// envCache names the environment variable that bounds, in bytes, the free
// shared memory a process keeps for reuse. The default is 1 GiB.
const envCache = "TENSORMP_SHM_CACHE"

// DefaultPool returns the process's pool of file_descriptor segments
// (sealed memfds), the one shared tensors use under that strategy.
func DefaultPool() *Pool { return defaultPool() }

// EnableNamedPool lets file_system storages come from a pool too. Named
// segments that a pool keeps for reuse would outlive a process that dies,
// so only a process whose session has a keeper to remove them at its end
// enables it; package mp does so for the program and every worker.
func EnableNamedPool() { namedEnabled.Store(true) }

// NamedPool returns the process's pool of file_system segments, or nil
// unless EnableNamedPool was called.
func NamedPool() *Pool {
	if !namedEnabled.Load() {
		return nil
	}
	return namedPool()
}

// newPool returns a pool of file_descriptor segments that keeps at most
// limit bytes of unused segments for reuse.
func newPool(limit int64) *Pool {
	p := &Pool{classes: map[int64]*sizeClass{}, segs: map[*segment]struct{}{}, limit: limit}
	p.grown = sync.NewCond(&p.mu)
	return p
}

// classCap returns the capacity of the class serving size: powers of two
// for small blocks, quarter steps between powers of two for large ones,
// so that no block wastes more than a quarter of itself (plus a page).
func classCap(size int64) int64 {
	if size <= smallMin {
		return smallMin
	}
	if size <= smallMax {
		return 1 << bits.Len64(uint64(size-1))
	}
	top := int64(1) << (bits.Len64(uint64(size-1)) - 1) // the power of two below
	step := top / 4
	c := (size + step - 1) / step * step
	return (c + pageSize - 1) &^ (pageSize - 1)
}

// Alloc returns a block of at least size bytes, zeroed only if new: a
// recycled block holds its last user's bytes, which callers overwrite.
func (p *Pool) Alloc(size int64) (*Block, error) {
	b, _, err := p.alloc(size, false)
	return b, err
}

// AllocZeroed is Alloc for a caller that needs the block's bytes zero,
// such as a tensor made by Zeros: it clears them, a fault doing so (a
// segment that a peer truncated, or whose page the system could not give)
// being an error wrapping ErrFault, with no block held. For a small
// block it then asks the processor for the lines of the block that the
// pool hands out next, without waiting for them: a program that makes
// one tensor after another clears that one next, and the block it gets
// back from a reader some thousand messages behind has left this CPU's
// caches. The lines then move while the caller uses the block it has,
// not at the next one's first stores, which would wait for them.
func (p *Pool) AllocZeroed(size int64) (*Block, error) {
	b, next, err := p.alloc(size, true)
	if err != nil {
		return nil, err
	}
	if err := Guard(func() { clear(b.Bytes()) }); err != nil {
		_ = b.Release()
		return nil, err
	}
	cacheline.WriteAhead(next) // after the clearing, whose lines would wait behind these
	return b, nil
}

// askAheadMax is the largest block whose successor AllocZeroed asks the
// processor for: 128 lines.
const askAheadMax = 8 << 10

// alloc is Alloc, which with ahead also returns the bytes of the block
// its class hands out next if the class's blocks are at most askAheadMax
// bytes: only an address to prefetch, which another goroutine may take,
// or a trim unmap, once the lock is let go.
func (p *Pool) alloc(size int64, ahead bool) (b *Block, next []byte, err error) {
	if size <= 0 {
		return nil, nil, &Error{Op: "alloc", Err: fmt.Errorf("block of %d bytes: size must be positive", size)}
	}
	capacity := classCap(size)
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.classes[capacity]
	if c == nil {
		c = &sizeClass{cap: capacity}
		p.classes[capacity] = c
	}
	if len(c.free) > 0 && c.reclaimDue() { // else the loop reclaims
		p.reclaimLocked(c)
	}
	for len(c.free) == 0 {
		if len(c.pending) > 0 {
			p.reclaimLocked(c)
			if len(c.free) == 0 && p.rotateLocked(c) {
				p.reclaimLocked(c)
			}
			if len(c.free) > 0 {
				break
			}
		}
		if c.growing {
			// Another goroutine makes a segment for the class, with the
			// lock let go: its blocks will do for this one too.
			p.grown.Wait()
			continue
		}
		if err := p.growOnce(c); err != nil {
			return nil, nil, err
		}
	}
	b = c.free[len(c.free)-1]
	if err := p.reserveLocked(b); err != nil {
		return nil, nil, err
	}
	c.free[len(c.free)-1] = nil
	c.free = c.free[:len(c.free)-1]
	b.free = false
	b.size = size // b.gen is the generation reclaim (or grow) gave the slot
	b.released.Store(false)
	b.seg.inUse++
	if k := len(c.free); ahead && k > 0 && c.cap <= askAheadMax && !c.free[k-1].seg.external {
		n := c.free[k-1]
		start := n.seg.slotOffset(n.slot)
		next = n.seg.alloc.mapping[start : start+c.cap]
	}
	return b, next, nil
}

// reserveLocked gives free block b its pages, unless it has them. Out of
// room, it takes back the slots nobody holds, closes the pool's unused
// segments (never b's) and tries once more; b stays free either way.
func (p *Pool) reserveLocked(b *Block) error {
	seg := b.seg
	if seg.external {
		return nil // its extent has its memory
	}
	off := seg.dataOff + int64(b.slot)*seg.cap
	err := seg.reserveLocked(off, seg.cap)
	if err == nil {
		return nil
	}
	seg.inUse++ // b's segment may have no block in use: keep it from the trim
	p.trimAllLocked(0)
	seg.inUse--
	return seg.reserveLocked(off, seg.cap)
}

// reclaimDue reports whether the class has had enough blocks released
// since its last reclaim to reclaim them before it hands out a free one:
// reclaimBatch, and at least as many as that reclaim found held, so that
// asking about the held ones again costs no more than a question per
// block released. A stream's producer so hands out the blocks its
// readers gave back last, still in its caches, and the free blocks of
// the segments it grew to during a burst stay unused, not cycled through
// (see reclaimBatch). Each such reclaim also runs the process's return
// scanners (see Returns), over the untaken entries of its lanes, once.
func (c *sizeClass) reclaimDue() bool {
	return len(c.pending)-c.kept >= max(reclaimBatch, c.kept)
}

// reclaimBatch is how many blocks a class takes released before it
// reclaims them with free blocks left (see reclaimDue): 1 MiB of 4 KiB
// tensors, which a stream's producer then clears out of its own cache
// rather than out of memory that the last burst's thousands of blocks
// pushed it out to, and enough neighbouring slots that the lane's reader
// locks them in a few runs.
const reclaimBatch = 256

// reclaimLocked moves the class's pending slots that no other description
// holds to its free list, bumping their generations. The kernel is asked
// once per segment about all its slots: the common answers, nobody holds
// any or a ticket description holds them all, settle every pending slot
// of the segment. A segment this process's own ticket description holds
// is not asked about, and only the pending slots of a segment held in
// part are asked about in runs (see askHeld).
func (p *Pool) reclaimLocked(c *sizeClass) {
	c.reclaims++
	ask := c.asking[:0]
	for _, b := range c.pending {
		seg := b.seg
		if seg.held == unasked {
			seg.held = seg.askWhole()
		}
		b.held = seg.held != heldNone
		if seg.held == heldPart {
			ask = append(ask, b)
		}
	}
	askInRuns(ask, &c.runs)
	clear(ask)
	c.asking = ask[:0]
	// A slot no description holds may be one a message returns to this
	// process by a lane, which holds it from here (see Returns): the
	// lanes are looked at after the kernel, since a sender publishes its
	// message before it lets go of its own lock.
	asked := false
	for _, b := range c.pending {
		if b.held {
			continue
		}
		if !asked {
			asked = true
			if c.named == nil {
				c.named = map[ReturnRef]struct{}{}
			}
			if !returnsNamed(c.named) {
				break
			}
		}
		_, b.held = c.named[ReturnRef{ID: b.seg.alloc.ID(), Offset: b.Offset(), Gen: b.gen}]
	}

	if hook := beforeBump.Load(); hook != nil {
		(*hook)()
	}
	// The slots found free get their new generations, and the kernel is
	// asked about them once more: a receiver that locked one after the
	// first question and read its old generation before the bump (one
	// that names a block by identity, with no ticket holding it: a lane's)
	// holds it now, and it stays pending, with its new generation; one
	// that reads the new generation gives up the lock as stale.
	kept := c.pending[:0]
	bumped := c.asking[:0]
	for _, b := range c.pending {
		b.seg.held = unasked // for the next reclaim
		if b.held {
			kept = append(kept, b)
			continue
		}
		// The pool's own record gives the new generation, not the
		// table, which any holder of the segment can write: a peer
		// cannot make the pool hand a slot out at a generation it was
		// seen at before (see ownLook).
		seg, next := b.seg, b.gen+1
		if Guard(func() { seg.gen(b.slot).Store(next) }) != nil {
			kept = append(kept, b) // cut short under us: never handed out again
			continue
		}
		b.gen = next
		bumped = append(bumped, b)
	}
	c.again = askAgain(bumped, c.again[:0], &c.runs)
	free := bumped[:0]
	for _, b := range bumped {
		b.seg.held = unasked
		if b.held {
			kept = append(kept, b)
			continue
		}
		b.seg.inUse--
		b.free = true
		free = append(free, b)
	}
	c.free = appendInSlotOrder(c.free, free, &c.runs)
	clear(bumped)
	c.asking = bumped[:0]
	clear(c.pending[len(kept):])
	c.pending = kept
	c.kept = len(kept)
}

// appendInSlotOrder appends bs to free so that they are handed out
// (from free's end) in slot order, segment by segment: a stream's blocks
// then lie side by side, and its reader locks each message's slots in
// one run, not one a block (see LockAhead). Like askInRuns, it marks the
// blocks in their segments' bitmaps rather than sorting; r is its room,
// left empty.
func appendInSlotOrder(free, bs []*Block, r *runRoom) []*Block {
	segs := r.mark(bs)
	for _, s := range segs {
		for w := len(s.marks) - 1; w >= 0; w-- {
			for word := s.marks[w]; word != 0; {
				top := 63 - bits.LeadingZeros64(word)
				free = append(free, s.blocks[w*64+top])
				word &^= 1 << top
			}
			s.marks[w] = 0
		}
		s.marked = false
	}
	clear(segs)
	r.segs = segs[:0]
	return free
}

// beforeBump, if set, runs in a reclaim between its first question to
// the kernel and the generations' bump: tests set it to race the bump.
var beforeBump atomic.Pointer[func()]

// askAgain sets held for each of bs, blocks whose generations were just
// bumped, in the order they were released, to whether a description other
// than their segment's own holds its slot: once per segment, and about
// the slots only in a segment held in part, in runs. part is its room,
// which it returns cleared; r, askInRuns'.
func askAgain(bs, part []*Block, r *runRoom) []*Block {
	for _, b := range bs {
		if b.seg.held == unasked {
			b.seg.held = b.seg.askWhole()
		}
		b.held = b.seg.held != heldNone
		if b.seg.held == heldPart {
			part = append(part, b)
		}
	}
	askInRuns(part, r)
	clear(part)
	return part[:0]
}

// askInRuns sets held for each of bs, blocks of segments held in part,
// asking about runs of each segment's slots in slot order (see askHeld).
// Each block is marked in its segment's bitmap of slots, read back in
// order, which costs a bit a block and a word per 64 slots rather than
// a sort. r is its room, left empty.
func askInRuns(bs []*Block, r *runRoom) {
	segs := r.mark(bs)
	for _, s := range segs {
		run := r.run[:0]
		for w, word := range s.marks {
			for word != 0 {
				run = append(run, s.blocks[w*64+bits.TrailingZeros64(word)])
				word &= word - 1
			}
			s.marks[w] = 0
		}
		s.marked = false
		askHeld(s.alloc.fd(), run)
		clear(run)
		r.run = run[:0]
	}
	clear(segs)
	r.segs = segs[:0]
}

// runRoom is askInRuns' room, and appendInSlotOrder's, kept by a size
// class: the segments they marked slots of, and one segment's blocks in
// slot order.
type runRoom struct {
	segs []*segment
	run  []*Block
}

// mark marks each of bs in its segment's bitmap of slots and returns the
// segments it marked, in r's room: the caller reads each one's bitmap
// back, clearing it and its marked, then clears the room.
func (r *runRoom) mark(bs []*Block) []*segment {
	segs := r.segs[:0]
	for _, b := range bs {
		s := b.seg
		if s.marks == nil {
			s.marks = make([]uint64, (s.nslots+63)/64)
		}
		if !s.marked {
			s.marked = true
			segs = append(segs, s)
		}
		s.marks[b.slot/64] |= 1 << (b.slot % 64)
	}
	return segs
}

// Answers of segment.askWhole: which of a segment's slots other
// descriptions hold.
const (
	unasked  = iota
	heldNone // no slot
	heldAll  // every slot, or the kernel could not be asked
	heldPart // some
)

// askWhole returns which of the segment's slots descriptions other than
// alloc.fd's hold, as far as one question tells: heldAll for a segment
// whose ticket description this process holds open.
func (s *segment) askWhole() int8 {
	if s.tickets.open() {
		return heldAll
	}
	first, end := slotByte(0), slotByte(s.nslots)
	from, to, held, err := lockInWay(s.alloc.fd(), first, end-first)
	switch {
	case err != nil || held && from <= first && to >= end:
		return heldAll
	case held:
		return heldPart
	}
	return heldNone
}

// askHeld sets held for each of bs, blocks of the segment whose
// descriptor is fd sorted by slot, to whether a description other than
// fd's holds its slot. It asks about runs of slots: the kernel answers a
// run with one lock in its way, whose slots are all held, and the parts
// of the run on either side of that lock are asked about again. So a run
// nobody holds is one call, and so is one that a ticket description,
// which locks every slot, holds. A slot the kernel could not be asked
// about counts as held, to be asked again at the next reclaim.
func askHeld(fd int, bs []*Block) {
	var room [16][]*Block
	runs := append(room[:0], bs)
	for len(runs) > 0 {
		run := runs[len(runs)-1]
		runs = runs[:len(runs)-1]
		first, last := run[0].slot, run[len(run)-1].slot
		from, to, held, err := lockInWay(fd, slotByte(first), int64(last-first+1))
		if err != nil || !held {
			for _, b := range run {
				b.held = err != nil
			}
			continue
		}
		i, _ := slices.BinarySearchFunc(run, from, func(b *Block, off int64) int { return cmp.Compare(slotByte(b.slot), off) })
		j, _ := slices.BinarySearchFunc(run, to, func(b *Block, off int64) int { return cmp.Compare(slotByte(b.slot), off) })
		// The lock overlaps run's span, so it covers run's first or last
		// slot, or falls between two of its slots (i == j, 0 < i <
		// len(run)): either way each part asked about again is smaller.
		for _, b := range run[i:j] {
			b.held = true
		}
		if i > 0 {
			runs = append(runs, run[:i])
		}
		if j < len(run) {
			runs = append(runs, run[j:])
		}
	}
}

// rotateLocked replaces this process's dirty ticket descriptions of the
// class's segments, so that slots only those held can be reclaimed. It
// reports whether any was replaced.
func (p *Pool) rotateLocked(c *sizeClass) bool {
	any := false
	for _, seg := range c.segs {
		if seg.tickets.rotateUnlessRecent(pressureRotate) {
			any = true
		}
	}
	return any
}

// growOnce is growLocked for one goroutine of those that find class c
// empty at once; the others wait for it (grown).
func (p *Pool) growOnce(c *sizeClass) error {
	c.growing = true
	defer func() {
		c.growing = false
		p.grown.Broadcast()
	}()
	return p.growLocked(c)
}

// growLocked adds a segment to class c: a slab of blocks (see slabSlots),
// or one large block. When the system is out of room, it trims the pool
// and tries once more. A segment that this process mapped as a receiver
// before the pool listed it is given up, and another made. It lets go of the pool's lock while an extent is
// made or closed (see newSegment), and adds nothing if the class has
// free blocks when the lock is back after a failed try.
func (p *Pool) growLocked(c *sizeClass) error {
	nslots := slabSlots(c.cap, len(c.segs))
	var seg *segment
	for tries := 0; ; tries++ {
		var err error
		seg, err = p.newSegment(c, nslots)
		if err != nil {
			p.trimAllLocked(0)
			p.mu.Unlock()
			extentClosing.wait() // their memory back before the retry
			p.mu.Lock()
			if len(c.free) > 0 {
				return nil
			}
			seg, err = p.newSegment(c, nslots)
		}
		if err != nil {
			return err
		}
		if hook := beforeListing.Load(); hook != nil {
			(*hook)(seg)
		}
		produced.add(seg)
		if hook := afterListing.Load(); hook != nil {
			(*hook)(seg)
		}
		if !mappedAsReceived(seg) { // listed first: an attach that maps it after this look finds it listed
			break
		}
		// A holder of the new segment (by its name, or by the process's
		// descriptor of it in /proc) opened it before the pool listed it,
		// and this process attached a block of it then, as a receiver: a
		// hold no look at the pool checked (see heldLook). The pool hands
		// out no block of it.
		where := seg.alloc.where()
		seg.close()
		if tries == 2 {
			return &Error{Op: "grow", Path: where, Err: errors.New("each segment made was mapped by an attach of this process before its pool listed it")}
		}
	}
	p.segs[seg] = struct{}{}
	c.segs = append(c.segs, seg)
	liveSegments.add(seg)
	p.cached += seg.bytes()
	seg.blocks = make([]*Block, nslots)
	for slot := nslots - 1; slot >= 0; slot-- { // handed out from slot 0 up: pages are reserved in order
		b := &Block{seg: seg, slot: int(slot), gen: 1, pool: p, free: true}
		seg.blocks[slot] = b
		c.free = append(c.free, b)
	}
	return nil
}

// beforeListing and afterListing, if set, run in growLocked with each
// segment it made, before the pool lists it and after, before it looks
// for a receiver's mapping of it: tests set them to attach a block of
// the segment there. They run under the pool's mu, and an attach takes
// attached.mu, which the lock order forbids (state.go); it cannot
// deadlock there, since nothing takes a pool's mu under attached.mu.
var beforeListing, afterListing atomic.Pointer[func(*segment)]

// mappedAsReceived reports whether this process maps seg, a segment its
// pool just made, as a receiver too.
func mappedAsReceived(seg *segment) bool {
	id := seg.alloc.ID()
	for _, s := range liveSegments.list() {
		if s != seg && s.pool == nil && s.alloc.ID() == id {
			return true
		}
	}
	return false
}

// newSegment makes a segment of nslots slots of class c, owned by the
// pool, with its slot table written (and its pages reserved); on error
// nothing is left of it.
//
// The caller holds p.mu, which newSegment lets go of while the extent is
// made: a device slab takes the driver milliseconds, more for a big one,
// and the pool's other allocations and releases need not wait for it.
func (p *Pool) newSegment(c *sizeClass, nslots int64) (*segment, error) {
	dataOff := slabLayout(nslots)
	segSize := dataOff + nslots*c.cap
	var ext io.Closer
	if p.extent != nil {
		// The table alone; the data in an extent of its own, made with
		// the lock let go (and taken back, the maker panicking or not).
		var err error
		ext, err = func() (io.Closer, error) {
			p.mu.Unlock()
			defer p.mu.Lock()
			return p.extent(nslots * c.cap)
		}()
		if err != nil {
			return nil, err
		}
		segSize, dataOff = dataOff, 0
	}
	seg, err := p.newSegmentWith(c, nslots, segSize, dataOff)
	if err != nil {
		if ext != nil {
			closeLater(ext)
		}
		return nil, err
	}
	seg.external, seg.ext = ext != nil, ext
	return seg, nil
}

// newSegmentWith is newSegment's segment: segSize bytes, of which the
// slots' data starts at dataOff (0: in an extent).
func (p *Pool) newSegmentWith(c *sizeClass, nslots, segSize, dataOff int64) (*segment, error) {
	flags := KeepFD | Unlink | sparse
	if p.named {
		flags = KeepFD | sparse
	}
	a, err := Create(segSize, flags)
	if err != nil {
		return nil, err
	}
	if ok, err := lockRead(a.fd(), lockBase, 1); !ok || err != nil {
		_ = a.Remove()
		_ = a.Release()
		if err == nil {
			err = &Error{Op: "lock", Path: a.where(), Err: errors.New("a new segment's pool byte is held elsewhere")}
		}
		return nil, err
	}
	seg := &segment{alloc: a, cap: c.cap, nslots: int(nslots), dataOff: dataOff, named: p.named, pool: p, class: c,
		reserved: make([]uint64, (segSize+64*reserveChunk-1)/(64*reserveChunk))}
	if err := seg.reserveLocked(0, slabLayout(nslots)); err != nil { // the slot table's pages
		_ = a.Remove()
		_ = a.Release()
		return nil, err // it names the segment
	}
	err = Guard(func() {
		h := (*slabHdr)(ptrAt(a.mapping, 0))
		h.cap, h.nslots, h.dataOff = c.cap, nslots, dataOff
		h.version, h.magic = slabVersion, slabMagic
		for slot := range int(nslots) {
			seg.gen(slot).Store(1)
		}
	})
	if err != nil {
		_ = a.Remove()
		_ = a.Release()
		return nil, &Error{Op: "write", Path: a.where(), Err: fmt.Errorf("slot table: %w", err)}
	}
	return seg, nil
}

// put takes back a block the producer released.
func (p *Pool) put(b *Block) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if b.lent > 0 {
		b.parked = true // lent to a message: its last Return puts it
		return
	}
	p.putLocked(b)
}

// putLocked puts b on its class's pending list. The caller holds p.mu.
func (p *Pool) putLocked(b *Block) {
	c := b.seg.class
	c.pending = append(c.pending, b)
	if p.cached > p.limit && time.Since(p.stuck) >= overLimitTrim {
		before := p.cached
		p.trimAllLocked(p.limit)
		if p.cached == before {
			p.stuck = time.Now() // nothing could go: not again at once
		}
	}
}

// Trim closes the pool's segments that no block uses, keeping at most
// keep bytes of them, and returns once their extents are closed. It is
// how memory goes back to the system on demand.
func (p *Pool) Trim(keep int64) {
	p.mu.Lock()
	p.trimAllLocked(keep)
	p.mu.Unlock()
	extentClosing.wait()
}

// trimAllLocked retires this process's ticket descriptions of the pool's
// segments that hold released slots (messages in flight keep theirs),
// takes back every slot nobody holds, and closes unused segments until at
// most keep bytes are cached.
func (p *Pool) trimAllLocked(keep int64) {
	for _, c := range p.classes {
		if len(c.pending) == 0 {
			continue
		}
		for _, seg := range c.segs {
			seg.tickets.rotate()
		}
		p.reclaimLocked(c)
	}
	p.trimLocked(keep)
}

// trimLocked closes unused segments until at most keep bytes are cached.
// A segment is unused when all its slots are free.
func (p *Pool) trimLocked(keep int64) {
	if p.cached <= keep {
		return
	}
	for seg := range p.segs {
		if p.cached <= keep {
			return
		}
		if seg.inUse != 0 {
			continue
		}
		c := seg.class
		c.free = without(c.free, seg)
		c.segs = deleteSeg(c.segs, seg)
		delete(p.segs, seg)
		p.cached -= seg.bytes()
		seg.close()
	}
}

// close gives up a producer's segment for good: its name goes first, so
// nobody opens it any more, then its mapping and descriptors, and its
// extent, if it has one.
func (seg *segment) close() {
	liveSegments.remove(seg)
	produced.remove(seg)
	seg.tickets.rotate()
	_ = seg.alloc.Remove()
	_ = seg.alloc.Release()
	seg.closeExtent()
}

func without(blocks []*Block, seg *segment) []*Block {
	kept := blocks[:0]
	for _, b := range blocks {
		if b.seg != seg {
			kept = append(kept, b)
		}
	}
	clear(blocks[len(kept):])
	return kept
}

func deleteSeg(segs []*segment, seg *segment) []*segment {
	for i, s := range segs {
		if s == seg {
			return append(segs[:i], segs[i+1:]...)
		}
	}
	return segs
}

// Stats reports the pool's segments: how many, their bytes, and how many
// blocks are free for reuse.
func (p *Pool) Stats() (segments int, bytes int64, freeBlocks int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.classes {
		freeBlocks += len(c.free)
	}
	return len(p.segs), p.cached, freeBlocks
}

// InUse returns how many of the pool's blocks are handed out or still
// held by another process or a message in flight, after taking back those
// nobody holds any more.
func (p *Pool) InUse() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.classes {
		p.reclaimLocked(c)
	}
	for seg := range p.segs {
		n += seg.inUse
	}
	return n
}

// letGo gives up, for a process about to exit, the named segments the pool
// still has blocks of elsewhere: each keeps its name while another process
// holds a block of it, and the last to let go removes it (see
// segment.abandoned). The rest are closed as by Trim.
func (p *Pool) letGo() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.classes {
		p.reclaimLocked(c)
	}
	p.trimLocked(0)
	for seg := range p.segs {
		seg.tickets.rotate()
		if !seg.named {
			continue
		}
		_ = unlock(seg.alloc.fd(), lockBase, 1)
		if seg.abandoned() {
			_ = seg.alloc.Remove()
		}
	}
}

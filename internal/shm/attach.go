package shm

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

// A receiver keeps up to idleMax segments that no block of its uses any
// more mapped, idleBytes at most, because their producer keeps recycling
// their blocks: the next block from one costs no mmap and no page faults.
// A segment whose producer is gone is never kept idle.
const (
	idleMax   = 64
	idleBytes = 256 << 20
)

// segmentTable is the table of received segments (attached).
type segmentTable struct {
	mu        sync.Mutex
	m         map[ID]*segment
	names     map[string]ID // the named segments in m, by name
	idle      []*segment    // mapped, unused, oldest first
	idleBytes int64
}

// SegmentRef names a pooled segment as a message does: a
// file_descriptor segment by its file's identity, a file_system one by
// its name.
type SegmentRef struct {
	ID   ID     // the segment's file; unknown (zero) for a named segment
	Name string // a file_system segment's name in Dir, else ""
	Size int64  // the bytes the segment holds, at least
}

// BlockRef names a block of a pooled segment as a message does, with the
// descriptor the message carried for it.
type BlockRef struct {
	Seg    SegmentRef
	Offset int64  // the block's data offset in its segment
	Size   int64  // its data bytes
	Gen    uint64 // its generation
	// Ticket is the descriptor the message carried (see Block.Ticket), of
	// the segment. It stays the caller's. A message that came by a lane
	// carries none (-1): the block is found by the segment's identity in
	// what this process maps, or not at all (ErrNotMapped).
	Ticket int
	// Covers reports whether the caller lends Ticket, a descriptor of
	// segment id, to hold the block for this process until it hands
	// Ticket to AdoptTicket. Nil is never.
	Covers func(id ID) bool
}

func (r *BlockRef) covers(id ID) bool { return r.Covers != nil && r.Covers(id) }

// Attach returns the block ref names, held for this process until its
// Release. A segment is mapped once per process, through a description of
// its own, whatever the number of blocks attached from it. One this
// process maps already is found by its identity or its name, with no look
// at the ticket; another is opened from the ticket (file_descriptor) or by
// its name (file_system, a name tensormp made), once the ticket is found
// to be of it.
//
// Unless the ticket covers the block, its slot is locked through this
// process's own description at once. If it does, no call is made: the
// ticket holds the slot, so the caller keeps it open until it hands it to
// AdoptTicket, which keeps it until this process's holds are moved to its
// own description in a batch, within milliseconds. Receiving a stream of
// blocks costs no lock call that way, and one close call per batch of
// descriptors. A caller that says so vouches that the ticket is a
// descriptor of the segment, as a message's ticket is: a ticket of
// another file would hold nothing, and the block could be recycled under
// this process until its hold moves to this process's own description.
// Only a peer that could write the segment anyway can send such a
// ticket.
//
// A block of one of this process's own pools (a message may return one,
// or carry one this process sent itself) is attached only while the pool
// has it in use, or waiting for its holders, at the generation ref names,
// and is always held by a lock of this process's own, whatever covers
// it: never a slot the pool has free, which it hands out next without
// asking anybody (see ownLook).
func Attach(ref BlockRef) (*Block, error) { return attachRef(ref, true) }

// attachRef is Attach; own says whether to look at this process's own
// pools (ownLook), which a test that stands for another process's
// receiver with this one does not.
func attachRef(ref BlockRef, own bool) (*Block, error) {
	if ref.Seg.Name != "" {
		return attachNamed(ref, own)
	}
	id := ref.Seg.ID
	b, err := attachChecked(id, ref, own, nil)
	if !errors.Is(err, errNotMapped) {
		return b, err
	}
	if ref.Ticket < 0 {
		return nil, &Error{Op: "attach", Path: fmt.Sprintf("segment %v", id), Err: ErrNotMapped}
	}
	st, err := Stat(ref.Ticket)
	switch {
	case err != nil:
		return nil, err
	case st.ID != id:
		return nil, &Error{Op: "attach", Path: fmt.Sprintf("fd %d", ref.Ticket), Err: fmt.Errorf("descriptor is of segment %v, not of %v that the message names", st.ID, id)}
	case st.Size < ref.Seg.Size:
		return nil, &Error{Op: "attach", Path: fmt.Sprintf("fd %d", ref.Ticket), Err: fmt.Errorf("segment holds %d bytes, fewer than the %d claimed", st.Size, ref.Seg.Size)}
	}
	return attachChecked(id, ref, own, func() (*Allocation, error) {
		raw, err := reopen(ref.Ticket)
		if err != nil {
			return nil, err
		}
		return openFD(raw, ref.Seg.Size, KeepFD) // checks the seals
	})
}

// attachChecked holds the block ref names in segment id, the segment this
// process maps or open maps, as attached.attach does. With check, a
// block of one of this process's own pools is looked at in its pool
// before the hold and again after it (ownLook, heldLook), and held by a
// lock of this process's own, never by the ticket alone: a peer's
// descriptor of the segment may hold nothing, and the pool frees a slot
// nobody locks.
func attachChecked(id ID, ref BlockRef, check bool, open func() (*Allocation, error)) (*Block, error) {
	own := false
	if check {
		var err error
		if own, err = ownLook(id, ref.Offset, ref.Gen); err != nil {
			return nil, err
		}
	}
	if hook := afterLook.Load(); hook != nil {
		(*hook)()
	}
	b, err := attached.attach(id, !own && ref.covers(id), ref, open)
	if err != nil || !check {
		return b, err
	}
	if err := heldLook(b, ref, own); err != nil {
		return nil, errors.Join(err, b.Release())
	}
	return b, nil
}

// AttachAll attaches the blocks refs name, each by its segment's
// identity alone, in segments this process maps (a lane's message: see
// Attach), as Attach would one by one, but with one lock call per run of
// neighbouring slots of a segment rather than one per block: the slots
// are locked first and their generations checked second. It returns the
// blocks in refs' order, or an error and no block held.
func AttachAll(refs []BlockRef) ([]*Block, error) {
	var own []bool // made at the first block of this process's own pools
	for i, ref := range refs {
		o, err := ownLook(ref.Seg.ID, ref.Offset, ref.Gen)
		if err != nil {
			return nil, err
		}
		if o && own == nil {
			own = make([]bool, len(refs))
		}
		if o {
			own[i] = true
		}
	}
	if hook := afterLook.Load(); hook != nil {
		(*hook)()
	}
	attached.mu.Lock()
	bs, err := attached.attachMappedLocked(refs)
	attached.mu.Unlock()
	if err != nil {
		return nil, err
	}
	for i, b := range bs { // as attachChecked: once more, held
		if err := heldLook(b, refs[i], own != nil && own[i]); err != nil {
			for _, b := range bs {
				err = errors.Join(err, b.Release())
			}
			return nil, err
		}
	}
	return bs, nil
}

func (t *segmentTable) attachMappedLocked(refs []BlockRef) ([]*Block, error) {
	for _, ref := range refs {
		if !t.mapsLocked(ref) {
			return nil, &Error{Op: "attach", Path: fmt.Sprintf("segment %v", ref.Seg.ID), Err: ErrNotMapped}
		}
	}
	t.lockLocked(refs, false)
	// The batch's blocks are made in one allocation: each keeps the
	// others' few bytes until all are unreachable, never their holds.
	blocks := make([]Block, len(refs))
	bs := make([]*Block, 0, len(refs))
	for i, ref := range refs {
		seg := t.m[ref.Seg.ID]
		if seg.users == 0 {
			t.unidleLocked(seg)
		}
		b := &blocks[i]
		if err := seg.holdLocked(b, ref.Offset, ref.Size, ref.Gen, false); err != nil {
			for _, b := range bs {
				_ = b.seg.releaseLocked(b.slot)
			}
			for _, b := range bs {
				_ = t.settleLocked(b.seg)
			}
			_ = t.settleLocked(seg)
			return nil, err
		}
		bs = append(bs, b)
	}
	return bs, nil
}

// mapsLocked reports whether this process maps as much of the segment
// ref names, by identity, as ref says it holds.
func (t *segmentTable) mapsLocked(ref BlockRef) bool {
	seg, ok := t.m[ref.Seg.ID]
	return ok && seg.alloc.Size() >= ref.Seg.Size
}

// lockLocked locks the slots of the blocks refs name by identity that
// this process neither holds nor has locked, in the segments it maps,
// through its own description: one call per run of neighbouring slots.
// A slot it cannot lock is left for holdLocked, which says what is wrong
// with it; a lock no block takes up goes at the next transfer, or for
// LockAhead's (ahead), at the first one aheadKeep after it was taken.
func (t *segmentTable) lockLocked(refs []BlockRef, ahead bool) {
	type group struct {
		seg   *segment
		slots []int
	}
	var groups []group // by segment, refs naming mostly one
	at := -1           // the group of the last ref
	for _, ref := range refs {
		if at < 0 || ref.Seg.ID != groups[at].seg.alloc.ID() {
			seg, ok := t.m[ref.Seg.ID]
			if !ok {
				continue
			}
			at = slices.IndexFunc(groups, func(g group) bool { return g.seg == seg })
			if at < 0 {
				groups = append(groups, group{seg: seg})
				at = len(groups) - 1
			}
		}
		seg := groups[at].seg
		slot, ok := seg.slotAt(ref.Offset)
		if !ok || seg.alloc.Size() < ref.Seg.Size {
			continue // holdLocked says what is wrong with it
		}
		if st := seg.slots.get(slot); st.holds > 0 || st.onFD {
			continue // needs no call
		}
		groups[at].slots = append(groups[at].slots, slot)
	}
	var now int64
	if ahead {
		now = time.Now().UnixNano()
	}
	for _, g := range groups {
		g.seg.lockRunsLocked(g.slots, ahead, now)
	}
}

// lockRunsLocked locks slots of seg, one call per run of neighbours, for
// lockLocked; ahead says the locks are LockAhead's, taken at now (Unix
// nanoseconds).
func (seg *segment) lockRunsLocked(slots []int, ahead bool, now int64) {
	for _, r := range runs(slots) {
		attachLocks.Add(1)
		ok, err := lockRead(seg.alloc.fd(), slotByte(r[0]), int64(r[1]))
		if err != nil || !ok {
			continue // write-locked for a moment (see abandoned): holdLocked locks each again
		}
		for slot := r[0]; slot < r[0]+r[1]; slot++ {
			seg.slots.setOnFD(slot, true)
			if ahead {
				seg.slots.setAhead(slot, now)
			}
		}
		seg.dirty = true // locks not taken up by a block go at a transfer
		transfers.schedule(seg)
	}
}

// attachLocks counts the lock calls of attaches (see AttachLocks).
var attachLocks atomic.Uint64

// AttachLocks returns how many lock calls this process has made to lock
// the slots of blocks it attached, as it attached them: one a block, or
// one a run of neighbouring slots for those AttachAll and LockAhead lock
// together. Tests and benchmarks look at it to see how a receiver's
// holds were taken.
func AttachLocks() uint64 { return attachLocks.Load() }

// Locked reports whether this process holds the slot of the block ref
// names by identity, or has it locked already (LockAhead): attaching
// the block then costs no lock call.
func Locked(ref BlockRef) bool {
	attached.mu.Lock()
	defer attached.mu.Unlock()
	seg, ok := attached.m[ref.Seg.ID]
	if !ok {
		return false
	}
	slot, ok := seg.slotAt(ref.Offset)
	if !ok {
		return false
	}
	st := seg.slots.get(slot)
	return st.holds > 0 || st.onFD
}

// Holds returns how many holds this process's Blocks take on the slot of
// the block ref names by identity, whatever their generation, or 0 where
// it maps no such segment or slot. Tests look at it to see that a decode
// gave back every hold it took.
func Holds(ref BlockRef) int {
	attached.mu.Lock()
	defer attached.mu.Unlock()
	seg, ok := attached.m[ref.Seg.ID]
	if !ok {
		return 0
	}
	slot, ok := seg.slotAt(ref.Offset)
	if !ok {
		return 0
	}
	return int(seg.slots.get(slot).holds)
}

// LockAhead locks, through this process's own description, the slots of
// the blocks refs name by identity in segments this process maps, one
// call per run of neighbouring slots, as AttachAll does for the blocks
// of one message: for a lane's reader, those of the messages it has not
// taken yet, so that attaching each of them later costs no call. It
// takes no hold and checks no generation; each Attach does, after the
// lock, as always. A lock that no Attach takes up goes at the first
// transfer aheadKeep after it was taken, within aheadKeep+transferDelay:
// the reader of a lane whose writer lends its blocks until they are taken
// keeps nothing from the producer meanwhile that the loan does not keep
// already, unless it let go of the lane. Refs of segments this process
// does not map, and slots it holds, are passed over.
func LockAhead(refs []BlockRef) {
	attached.mu.Lock()
	defer attached.mu.Unlock()
	attached.lockLocked(refs, true)
}

// slotAt returns the slot whose data starts at off, if one does.
func (seg *segment) slotAt(off int64) (int, bool) {
	rel := off - seg.dataOff
	if rel < 0 || rel%seg.cap != 0 || rel/seg.cap >= int64(seg.nslots) {
		return 0, false
	}
	return int(rel / seg.cap), true
}

// ownLook reports whether segment id is one of this process's own pools'
// (any: a named pool's, a device slab's), and for one, whether the pool
// has the slot whose data starts at off in use, or released and waiting
// for its holders, at generation gen: else it is ErrStaleBlock (or an
// error of its own where no slot starts at off). A slot the pool has free
// carries the generation it is handed out with next, and the pool hands
// it out without asking the kernel whether anybody locks it: a hold on
// it, which a peer that holds a descriptor of the segment and guessed
// the generation could ask for, would alias the next block handed out.
//
// The attach looks twice, before its hold and after it, at the pool's own
// record of the slot, which no peer can write (the slot table's
// generations, which holdLocked checks, any holder of the segment can;
// its header too, which readSlab checks against the pool's slots for
// this process's own segment). A slot the pool frees gets the next
// generation of the pool's record, whatever the table says: a slot
// found in use or waiting at gen both times was never free in between,
// so the pool, which frees a slot only once nobody locks it, could not
// free it under the hold. (A waiting slot may carry a generation it was
// never handed out with: its reclaim bumped it and then found it held.
// A hold on it keeps it waiting all the same.) The caller holds neither
// attached.mu nor a pool's mu (see state.go's lock order).
func ownLook(id ID, off int64, gen uint64) (own bool, err error) {
	seg := produced.byID(id)
	if seg == nil || seg.pool == nil {
		return false, nil
	}
	slot, ok := seg.slotAt(off)
	if !ok {
		return true, &Error{Op: "attach", Path: fmt.Sprintf("block %d of %v", off, seg.alloc), Err: errors.New("not a slot of this process's pool")}
	}
	p := seg.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if slot < len(seg.blocks) {
		if b := seg.blocks[slot]; b != nil && !b.free && b.gen == gen {
			return true, nil
		}
	}
	return true, &Error{Op: "attach", Path: fmt.Sprintf("block %d of %v", off, seg.alloc), Err: fmt.Errorf("%w: a slot of this process's pool, not in use at generation %d", ErrStaleBlock, gen)}
}

// heldLook is an attach's look after its hold on b, the block ref names
// (see ownLook): for a segment of this process's own pools, the first
// look must have found it so (else it became the pool's in between, a
// named segment its pool was making, and the hold may rest on a ticket
// alone), this process's mapping of it must have the pool's slots (a
// mapping made in that window skipped readSlab's check), and the pool
// must have the slot in use or waiting at ref's generation still.
func heldLook(b *Block, ref BlockRef, wasOwn bool) error {
	id := b.seg.alloc.ID()
	seg := produced.byID(id)
	switch {
	case seg == nil || seg.pool == nil:
		return nil
	case !wasOwn:
		return &Error{Op: "attach", Path: b.String(), Err: fmt.Errorf("%w: a segment of this process's pool, made as it was attached", ErrStaleBlock)}
	case !b.seg.sameSlots(seg):
		return &Error{Op: "attach", Path: b.String(), Err: fmt.Errorf("slot table of %d slots of %d bytes at %d, not this process's pool's %d of %d at %d", b.seg.nslots, b.seg.cap, b.seg.dataOff, seg.nslots, seg.cap, seg.dataOff)}
	}
	_, err := ownLook(id, ref.Offset, ref.Gen)
	return err
}

// sameSlots reports whether seg, a mapping of a segment, has the slots of
// own, the segment its pool made.
func (seg *segment) sameSlots(own *segment) bool {
	return seg.cap == own.cap && seg.nslots == own.nslots && seg.dataOff == own.dataOff && seg.external == own.external
}

// afterLook, if set, runs in an attach between its first look at the
// pool and its hold: tests set it to race a reclaim.
var afterLook atomic.Pointer[func()]

// attachNamed is attachRef for a block of a named segment. The segment is
// the file the message's descriptor is, whatever its name: a name this
// process maps is taken for its segment, else the name must open the
// descriptor's file.
func attachNamed(ref BlockRef, own bool) (*Block, error) {
	name := ref.Seg.Name
	if !validName(name) {
		return nil, &Error{Op: "attach", Path: fmt.Sprintf("%q", name), Err: ErrBadName}
	}
	attached.mu.Lock()
	id, mapped := attached.names[name]
	attached.mu.Unlock()
	if mapped {
		b, err := attachChecked(id, ref, own, nil)
		if !errors.Is(err, errNotMapped) {
			return b, err
		}
	}
	st, err := Stat(ref.Ticket)
	if err != nil {
		return nil, err
	}
	return attachChecked(st.ID, ref, own, func() (*Allocation, error) {
		a, err := OpenName(name, ref.Seg.Size, KeepFD)
		if err != nil {
			return nil, err
		}
		if a.ID() != st.ID {
			_ = a.Release()
			return nil, &Error{Op: "attach", Path: name, Err: errors.New("not the file the message's descriptor names")}
		}
		return a, nil
	})
}

// AdoptTicket takes over ticket, a descriptor of segment id that covered
// blocks attached with Attach: it is kept while it holds them for
// this process, and closed once their holds have moved to this process's
// own description, within transferDelay. The caller must not use ticket
// afterwards.
func AdoptTicket(ticket int, id ID) {
	attached.mu.Lock()
	defer attached.mu.Unlock()
	seg, ok := attached.m[id]
	if !ok {
		_ = unix.Close(ticket)
		return
	}
	seg.adopted = append(seg.adopted, ticket)
	if len(seg.adopted) >= 2*adoptMax {
		_ = seg.transferLocked()
	} else if len(seg.adopted) == 1 {
		transfers.schedule(seg)
	}
}

// errNotMapped: the segment is not mapped by this process, or too small
// a part of it, and attach was given no way to open it.
var errNotMapped = ErrNotMapped

// Pin keeps segment id, which this process maps for blocks it received,
// mapped until the returned unpin is called, whether or not a block of it
// is in use: a peer may then name its blocks by the segment's identity
// alone, with no descriptor (package sock's lanes). A pinned segment is
// never idle, so never dropped; its producer's death does not unmap it.
// Pin returns the bytes the segment keeps (a device slab's, those of its
// extent), and reports false for a segment this process does not map.
func Pin(id ID) (unpin func(), size int64, ok bool) {
	attached.mu.Lock()
	defer attached.mu.Unlock()
	seg, ok := attached.m[id]
	if !ok {
		return nil, 0, false
	}
	if seg.users == 0 {
		attached.unidleLocked(seg)
	}
	seg.users++ // a user with no slot: settleLocked leaves it be
	var once sync.Once
	return func() {
		once.Do(func() {
			attached.mu.Lock()
			defer attached.mu.Unlock()
			seg.users--
			_ = attached.settleLocked(seg)
		})
	}, seg.bytes(), true
}

// Kept reports whether the producer of segment id, which this process
// maps, still keeps it in its pool: once it has let go of it, it hands out
// no block of it again, and a pin of it keeps only memory nobody will
// name. A segment this process does not map is not kept, as far as it
// knows.
func Kept(id ID) bool {
	attached.mu.Lock()
	defer attached.mu.Unlock()
	seg, ok := attached.m[id]
	if !ok {
		return false
	}
	_, _, held, err := lockInWay(seg.alloc.fd(), lockBase, 1)
	return held || err != nil
}

// attach finds or maps the segment id and holds the block ref names in
// it. Without open, a segment not mapped yet is errNotMapped.
func (t *segmentTable) attach(id ID, covered bool, ref BlockRef, open func() (*Allocation, error)) (*Block, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.attachLocked(id, covered, ref, open)
}

func (t *segmentTable) attachLocked(id ID, covered bool, ref BlockRef, open func() (*Allocation, error)) (*Block, error) {
	seg, ok := t.m[id]
	if !ok || seg.alloc.Size() < ref.Seg.Size {
		if open == nil {
			return nil, errNotMapped
		}
		a, err := open()
		if fd.OutOfDescriptors(err) {
			// Idle mappings keep a descriptor each: give them up first.
			_ = t.trimLocked(0, 0)
			a, err = open()
		}
		if err != nil {
			return nil, err
		}
		seg, err = readSlab(a)
		if err != nil {
			_ = a.Release()
			return nil, err
		}
		if old, ok := t.m[id]; ok {
			delete(t.m, id) // too small a mapping of it: replace it
			if old.users == 0 {
				t.unidleLocked(old)
				_ = t.dropLocked(old)
			}
		}
		t.m[id] = seg
		if seg.named {
			t.names[seg.alloc.Name()] = id
		}
		liveSegments.add(seg)
	} else if seg.users == 0 {
		t.unidleLocked(seg)
	}
	b := new(Block)
	if err := seg.holdLocked(b, ref.Offset, ref.Size, ref.Gen, covered); err != nil {
		_ = t.settleLocked(seg)
		return nil, err
	}
	return b, nil
}

// readSlab checks the slot table of a segment just mapped and returns
// the segment. The table is then made read-only in this process: no
// stray write of ours can change it.
func readSlab(a *Allocation) (*segment, error) {
	bad := func(err error) (*segment, error) { return nil, &Error{Op: "attach", Path: a.String(), Err: err} }
	if len(a.mapping) < slabHdrSize {
		return bad(errors.New("too small for a slot table"))
	}
	var h slabHdr
	if err := Guard(func() { h = *(*slabHdr)(ptrAt(a.mapping, 0)) }); err != nil { // one read: peers may write it
		return bad(err)
	}
	total := int64(len(a.mapping))
	external := h.dataOff == 0 // the data lies in an extent (see NewExtentPool)
	switch {
	case h.magic != slabMagic || h.version != slabVersion:
		return bad(errors.New("no tensormp slot table"))
	case h.nslots > maxSlabSlots:
		return bad(fmt.Errorf("%d slots, more than any slab has (%d)", h.nslots, maxSlabSlots))
	case h.cap <= 0 || h.nslots <= 0 || h.nslots > total/8 || !external && h.dataOff != slabLayout(h.nslots):
		return bad(fmt.Errorf("malformed slot table (%d slots of %d bytes at %d)", h.nslots, h.cap, h.dataOff))
	case external && (slabLayout(h.nslots) > total || h.cap > maxExtent/h.nslots):
		return bad(fmt.Errorf("%d slots of %d bytes in an extent do not fit", h.nslots, h.cap))
	case !external && (h.nslots > total/smallMin || h.cap > (total-h.dataOff)/h.nslots):
		return bad(fmt.Errorf("%d slots of %d bytes do not fit", h.nslots, h.cap))
	}
	if own := produced.byID(a.ID()); own != nil && (own.cap != h.cap || own.nslots != int(h.nslots) || own.dataOff != h.dataOff || own.external != external) {
		// This process's own segment, whose table a holder rewrote:
		// its slots must be the ones its pool hands out (see ownLook).
		return bad(fmt.Errorf("slot table of %d slots of %d bytes at %d, not this process's pool's %d of %d at %d", h.nslots, h.cap, h.dataOff, own.nslots, own.cap, own.dataOff))
	}
	if err := unix.Mprotect(a.mapping[:slabLayout(h.nslots)], unix.PROT_READ); err != nil {
		return nil, &Error{Op: "protect", Path: a.String(), Err: err}
	}
	return &segment{alloc: a, cap: h.cap, nslots: int(h.nslots), dataOff: h.dataOff, external: external,
		named: a.path != "", slots: newSlotTable(int(h.nslots))}, nil
}

// maxExtent bounds the bytes of a received slab's extent: 1 PiB, beyond
// any device's memory.
const maxExtent = 1 << 50

// adoptMax is how many message descriptors a receiver keeps per segment
// before it closes them, in one call, once it lets go of the segment's
// last block; at twice as many it moves the holds of the blocks it still
// has to its own description and closes them at once.
const adoptMax = 8

// aheadKeep is how long a slot LockAhead locked keeps its lock with no
// block taking it up: long enough for a reader to take the messages it
// looked ahead at, whatever the scheduler does meanwhile, short enough
// that a lane's reader that let go of the lane keeps its producer's
// blocks only for a moment.
const aheadKeep = 100 * time.Millisecond

// transferDelay is how long a receiver keeps the descriptors it adopted,
// and, while it still holds blocks of the segment, the locks of blocks it
// let go of, before it settles them in one batch (the locks of a segment
// no block uses any more are dropped at once, and those of letGoMax
// blocks let go of as the last is). It is a timer's period: each firing
// wakes a thread.
const transferDelay = 10 * time.Millisecond

// holdLocked takes this process's hold on the block at data offset off,
// and makes b that block: the slot held first (through an adopted
// descriptor, or a lock of this process's own), the generation checked
// second, so that the producer, which bumps the generation only while
// nobody holds the slot, cannot recycle it under us. b is left as it was
// if holdLocked fails. The caller holds attached.mu.
func (seg *segment) holdLocked(b *Block, off, size int64, gen uint64, covered bool) error {
	bad := func(err error) error {
		return &Error{Op: "attach", Path: fmt.Sprintf("block %d+%d of %v", off, size, seg.alloc), Err: err}
	}
	slot, ok := seg.slotAt(off)
	if !ok || size <= 0 || size > seg.cap {
		return bad(errors.New("not a slot"))
	}
	if st := seg.slots.get(slot); st.holds == 0 {
		locked := st.onFD
		if !locked && !covered {
			attachLocks.Add(1)
			ok, err := lockRead(seg.alloc.fd(), slotByte(slot), 1)
			if err != nil {
				return err
			}
			if !ok {
				return bad(ErrStaleBlock)
			}
			seg.slots.setOnFD(slot, true)
		}
		if !seg.genIs(slot, gen) {
			if !locked && !covered {
				_ = unlock(seg.alloc.fd(), slotByte(slot), 1)
				seg.slots.setOnFD(slot, false)
			}
			return bad(ErrStaleBlock)
		}
		if locked || covered {
			seg.dirty = true // to lock (covered) or to keep (locked, was let go of)
		}
		seg.slots.setAhead(slot, 0) // taken up
	} else if !seg.genIs(slot, gen) {
		return bad(ErrStaleBlock)
	}
	seg.slots.hold(slot)
	seg.users++
	*b = Block{seg: seg, slot: slot, size: size, gen: gen}
	return nil
}

// detach gives up a receiver's block.
func (t *segmentTable) detach(b *Block) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return errors.Join(b.seg.releaseLocked(b.slot), t.settleLocked(b.seg))
}

// releaseLocked drops one of this process's holds on slot. A slot no
// longer held keeps its lock until the next transfer, or until letGoMax
// slots of the segment are let go of, when they are unlocked together
// (unlockLetGoLocked).
func (seg *segment) releaseLocked(slot int) error {
	st, ok := seg.slots.release(slot)
	if !ok {
		return nil // let go of already, for the process's exit
	}
	if st.holds == 0 {
		if st.onFD {
			seg.dirty = true
			seg.letGo = append(seg.letGo, slot)
			if len(seg.letGo) >= letGoMax {
				seg.unlockLetGoLocked()
			}
			transfers.schedule(seg)
		}
	}
	seg.users--
	return nil
}

// letGoMax is how many slots a receiver lets go of in a segment before it
// unlocks them, without waiting for the transfer. A stream's receiver so
// gives its slots back to the producer within a few dozen messages, one
// call per run of neighbours: the producer, which can reclaim a slot only
// once nobody locks it, reuses slots still warm in its caches and asks
// the kernel about fewer held ones. A slot that comes back to this
// process over and over (a round trip's) keeps its lock between trips but
// for one trip in letGoMax.
const letGoMax = 64

// unlockLetGoLocked unlocks the slots of seg.letGo that no block of this
// process holds again, one call per run of neighbours. A closed segment
// has none: closeLocked forgets its locks, and no slot of it is listed
// once none is locked.
func (seg *segment) unlockLetGoLocked() {
	slots := seg.letGo[:0]
	for _, slot := range seg.letGo {
		if st := seg.slots.get(slot); st.holds == 0 && st.onFD {
			slots = append(slots, slot)
		}
	}
	seg.letGo = seg.letGo[:0]
	for _, r := range seg.slots.unlockRuns(slots) {
		if seg.unlock(r) != nil {
			continue // the transfer tries again
		}
		seg.slots.unlocked(r[0], r[0]+r[1])
	}
}

// transferLocked settles this process's holds on the segment in its own
// description: it locks the held slots that only adopted descriptors
// held, unlocks the slots no longer held, one call per run of neighbours,
// and then closes the adopted descriptors. A slot LockAhead locked less
// than aheadKeep ago keeps its lock, and the segment stays dirty: the
// timed transfer that LockAhead scheduled goes on looking at it. The
// caller holds attached.mu.
func (seg *segment) transferLocked() error {
	if seg.alloc.closed.Load() {
		return nil // its description, and its locks, are gone
	}
	var errs []error
	if seg.dirty {
		var need, drop []int
		now, kept := time.Now().UnixNano(), false
		seg.slots.each(func(slot int, st slotState) {
			switch {
			case st.holds > 0:
				if !st.onFD {
					need = append(need, slot)
				}
			case !st.onFD:
			case st.aheadAt != 0 && now-st.aheadAt < int64(aheadKeep):
				kept = true
			default:
				seg.slots.setAhead(slot, 0)
				drop = append(drop, slot)
			}
		})
		for _, r := range runs(need) {
			if _, err := lockRead(seg.alloc.fd(), slotByte(r[0]), int64(r[1])); err != nil {
				errs = append(errs, err)
				continue
			}
			for slot := r[0]; slot < r[0]+r[1]; slot++ {
				seg.slots.setOnFD(slot, true)
			}
		}
		for _, r := range seg.slots.unlockRuns(drop) {
			if err := seg.unlock(r); err != nil {
				errs = append(errs, err)
			}
			seg.slots.unlocked(r[0], r[0]+r[1])
		}
		seg.dirty = kept // the timed transfers look again while it is
		seg.letGo = seg.letGo[:0]
	}
	if len(errs) > 0 {
		return errors.Join(errs...) // keep the adopted descriptors: they still hold
	}
	fd.CloseAll(seg.adopted)
	clear(seg.adopted)
	seg.adopted = seg.adopted[:0]
	return nil
}

// unlock unlocks the run r, [first, length], of seg's slots through
// its own description.
func (seg *segment) unlock(r [2]int) error {
	unlockCalls.Add(1)
	return unlock(seg.alloc.fd(), slotByte(r[0]), int64(r[1]))
}

// unlockCalls counts the calls that unlock runs of a received segment's
// slots (see UnlockCalls).
var unlockCalls atomic.Uint64

// runs turns slots into runs of neighbours, [first, length] each,
// sorting them and passing over a slot listed twice.
func runs(slots []int) [][2]int {
	slices.Sort(slots)
	slots = slices.Compact(slots)
	var out [][2]int
	for i := 0; i < len(slots); {
		j := i + 1
		for j < len(slots) && slots[j] == slots[j-1]+1 {
			j++
		}
		out = append(out, [2]int{slots[i], j - i})
		i = j
	}
	return out
}

// settleLocked decides the fate of a segment no block of this process
// uses: the locks of the blocks it let go of are dropped at once, and it
// is kept mapped for the next block from it, unless nobody else holds
// anything of it a while later (see idleChecks).
func (t *segmentTable) settleLocked(seg *segment) error {
	if seg.users > 0 || seg.alloc.closed.Load() {
		return nil // in use, or dropped already (see closeLocked)
	}
	// The descriptors of messages received from it hold nothing this
	// process uses now; they go once there are adoptMax, or within
	// transferDelay, in one system call (see closeAll). This
	// process's ticket description, if it sent from the segment, stays
	// for the next message; rotation retires it within milliseconds.
	if seg.slots.locked > 0 || len(seg.adopted) >= adoptMax {
		if err := seg.transferLocked(); err != nil {
			return err
		}
	}
	idleChecks.schedule(seg)
	if t.m[seg.alloc.ID()] != seg {
		return t.dropLocked(seg) // superseded: nobody finds it any more
	}
	if !t.isIdleLocked(seg) {
		t.idle = append(t.idle, seg)
		t.idleBytes += seg.bytes()
	}
	return t.trimLocked(idleLimit(len(t.idle)), idleBytes)
}

// idleLimit returns how many idle mappings to keep, n being kept now: at
// most idleMax, and at most an eighth of the descriptors the process may
// have, since each keeps one.
func idleLimit(n int) int {
	if n <= 8 {
		return idleMax // few: not worth a system call
	}
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err == nil && rl.Cur/8 < idleMax {
		return int(max(rl.Cur/8, 1))
	}
	return idleMax
}

// idleCheckDelay is how long a received segment no block of this process
// uses waits before this process asks whether anybody else still holds
// it. A segment used again meanwhile (the common case: its producer keeps
// sending from it) is not asked about at all.
const idleCheckDelay = 20 * time.Millisecond

func (t *segmentTable) dropIfAbandoned(seg *segment) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if seg.users > 0 || seg.tickets.open() || !t.isIdleLocked(seg) && t.m[seg.alloc.ID()] != seg {
		return // in use again, or dropped already
	}
	// Its adopted descriptors go first: they would hold it.
	if seg.transferLocked() != nil || !seg.abandoned() {
		return
	}
	t.forgetLocked(seg)
	_ = t.closeLocked(seg)
}

// forgetLocked takes seg out of the table and the idle list: nobody finds
// it any more.
func (t *segmentTable) forgetLocked(seg *segment) {
	if t.m[seg.alloc.ID()] == seg {
		delete(t.m, seg.alloc.ID())
		if seg.named {
			delete(t.names, seg.alloc.Name())
		}
	}
	t.unidleLocked(seg)
}

// afterTicketsRotated runs once this process's ticket description of seg
// is closed: a receiver's unused segment may be abandoned now.
func (seg *segment) afterTicketsRotated() {
	if seg.pool != nil {
		return
	}
	attached.mu.Lock()
	defer attached.mu.Unlock()
	_ = attached.settleLocked(seg)
}

// abandoned reports whether no description but this process's own holds
// any lock on the segment: no producer keeps it, no process holds a block
// of it, no message carries one. The caller holds no lock of its own on it
// but perhaps the pool's, which this call does not keep. A named segment
// found abandoned loses its name; a received one found held elsewhere is
// watched (orphans), in case no process that holds it looks again.
func (seg *segment) abandoned() bool {
	ok, err := lockWrite(seg.alloc.fd(), lockBase, 0)
	if err != nil {
		return false
	}
	if !ok {
		if seg.named && seg.pool == nil {
			orphans.watch(seg.alloc.path, seg.alloc.ID())
		}
		return false
	}
	_ = unlock(seg.alloc.fd(), lockBase, 0)
	if seg.named {
		_ = seg.alloc.Remove()
	}
	return true
}

// dropLocked unmaps a received segment. One that no block of this
// process uses is settled first, and loses its name if nobody else holds
// anything of it: unmapping it is letting go of it.
func (t *segmentTable) dropLocked(seg *segment) error {
	if seg.alloc.closed.Load() {
		return nil // dropped already
	}
	if seg.users == 0 && seg.transferLocked() == nil {
		seg.abandoned()
	}
	return t.closeLocked(seg)
}

// closeLocked unmaps a received segment and closes what this process keeps
// of it.
func (t *segmentTable) closeLocked(seg *segment) error {
	liveSegments.remove(seg)
	seg.tickets.rotate()
	fd.CloseAll(seg.adopted)
	seg.adopted = nil
	// Its locks go with its description. Nothing may act through its
	// descriptor's number again, which may be another file's soon: a
	// transfer or a settle that comes later (a timer's, or a rotation's
	// second half) finds the allocation closed and does nothing.
	seg.slots.forgetLocks()
	seg.letGo = nil
	seg.dirty = false
	seg.closeExtent()
	return seg.alloc.Release()
}

func (t *segmentTable) isIdleLocked(seg *segment) bool {
	for _, s := range t.idle {
		if s == seg {
			return true
		}
	}
	return false
}

func (t *segmentTable) unidleLocked(seg *segment) {
	for i, s := range t.idle {
		if s == seg {
			t.idle = append(t.idle[:i], t.idle[i+1:]...)
			t.idleBytes -= seg.bytes()
			return
		}
	}
}

// trimLocked unmaps the oldest idle segments until at most n of them,
// and bytes in all, are left.
func (t *segmentTable) trimLocked(n int, bytes int64) error {
	var errs []error
	for len(t.idle) > 0 && (len(t.idle) > n || t.idleBytes > bytes) {
		seg := t.idle[0]
		t.forgetLocked(seg)
		if err := t.dropLocked(seg); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func ptrAt(b []byte, off int64) unsafe.Pointer { return unsafe.Pointer(&b[off]) }

package sock

import (
	"crypto/rand"
	"encoding/binary"
	"sync/atomic"
	"time"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
)

// Tensors by the lane.
//
// A block of a pooled segment travels on the socket with a ticket, a
// descriptor whose lock holds the block in flight (see shm.Block.Ticket).
// A Way's lane carries no descriptor, so a block goes by it only where no
// descriptor is needed: its writer produced it (a block of the writing
// process's own pool), and its reader keeps the block's segment mapped.
//
//   - Pins. A reader that receives a block by descriptor on the Way, while
//     it holds the reader's role, pins its segment (shm.Pin): the segment
//     stays mapped in the reading process, however long no block of it is
//     in use and whether or not its producer lives, until the Way closes
//     or the producer has let go of the segment (shm.Kept: it then hands
//     out no block of it) and every entry sent before the reader saw so
//     has been taken, by whichever reader (a dead producer has let go
//     too, and its messages still in the lane name it). The reader looks
//     at that as it pins another, at the role's idle look (each
//     idleRole) after it has received, at most once a pinLookEvery in a
//     receive that waits, and, once it has let go of the role idle with
//     pins left, each pinLookEvery. It pins at most maxPins segments,
//     maxPinBytes in all. While it holds the role it lists its pins in
//     the lane's reader's page; from the first time it takes the role
//     until it closes, it holds a read lock on the lane's byte
//     pinnerByte, as it may take entries that name blocks by identity.
//   - Loans. The writer names a block of a segment the list holds by the
//     segment's identity alone (see carry.Lane), and lends the block to
//     the message (shm.Block.Lend): its pool does not reuse the slot, even
//     once the writer's tensor is released, until the loan is returned.
//   - Taking. The reader rebuilds a block named by identity only if it
//     pins its segment (Pinned; another is ErrNotMapped, even one it maps
//     for another reason, for which the writer holds nothing, unless the
//     reader made it: a return, see way_returns.go, which it takes back
//     from its pool, pinned or not), taking its
//     own lock on the slot and then checking the slot's generation, as for
//     a block that came with a descriptor: it relies on the loan for
//     nothing, since any holder of the lane could write the ack that ends
//     it.
//   - Locks ahead. A reader whose lock a message's block needs looks at
//     the entries behind it (Ahead) and locks their blocks' slots in the
//     same calls, one per run of neighbouring slots (shm.LockAhead), so
//     that taking them costs no call. Such a lock holds nothing the loan
//     does not hold already while the entry waits; a lock no entry taken
//     takes up (another reader took it, or this one let go of the lane)
//     goes within shm's aheadKeep and a transfer, and with the reader's
//     process, SIGKILL included.
//   - Acks. When a receive is done, the reader writes the count of entries
//     it has taken to its words (acked, on the taken count's line). The writer returns the loans of
//     entries below it at its next Send, while it waits for room, each
//     settleEvery while it sends nothing, and at Close; and all its loans
//     once no process holds pinnerByte (every reader that took the role is
//     gone or closed). A writer that closes with loans out keeps the lane
//     mapped in a goroutine that returns them so.
//
// So a message in the lane is held by the writer's loan while the writer
// lives, and needs no hold once it is dead, since only a producer reuses
// its slots; the reader's mapping keeps the memory. A reader killed with
// messages untaken lets go of pinnerByte, and the writer's loans come
// back. Nothing of a block is owned by the lane's memory, so a lane
// whose processes are all gone leaves nothing.
//
// A reader killed as it waits on a fair Way's lane leaves its wait and
// its list behind: the writer names blocks only for a reader that holds
// the role, as the kernel says (readerHeld), or whose stamps say its
// process ran within liveWindow (readerLive: its wait's, which is its
// last receive, or its spin's). A reader killed within that window may
// be named for, as one killed just after the kernel's answer may: the
// message is lost with it, and its blocks come back with the loan.
//
// A message named by identity is the reader's that pins its segments. A
// reader that hands its end on (LetGo) unlists its pins first (or, with
// a receive under way, as that receive ends), so the writer sends by the
// socket from then on; one that closes unlists them too. A reader that
// takes the role over from another that left entries untaken gets
// ErrNotMapped (shm) for each block they name (unless it
// made the block, or pins the segment itself: then, the loan perhaps returned, it holds the
// block or gets ErrStaleBlock, never another's, since the producer's
// reclaim asks again after it bumps a generation), and the writer's loans
// of them come back once the first reader has closed.
//
// The reader's page, in the lane's header (see Lane), is written by the
// reader's role holder only; the writer reads it as a hint, whose worst
// is a message its reader cannot rebuild:
//
//	+0   seq: odd while the holder rewrites the list
//	+4   owner: the mark of the Way whose list it is
//	+8   count: segments listed
//	+16  the list: count identities (device, inode), 16 bytes each
//	+1040 prodCount: segments listed as the reader's own (see
//	     way_returns.go), under seq too
//	+1048 that list: prodCount identities, 16 bytes each
//	+2072 laneMisses: a count of the messages the writer sent by the
//	     socket that the lane would have taken from a reader waiting on
//	     it (see socketRun)
//
// The reader's words that change as it takes messages lie before the
// page, on the first cache line of the lane's taken bell, after the
// bell's own words (takenLine; see Bell), where each take writes the
// taken count. A writer that reads them and the count then moves one line
// between the two CPUs each message, not one a word, and so does the
// reader that writes them:
//
//	acked: the reader has done with every entry before this position
//	waits: a fair Way's reader's wait (see waitFair), which the writer
//	     claims before it hands the lane an entry; a Pipe's reader's,
//	     which the writer wakes on the socket (see park)
//	waitsAt: sockSends as the reader last found the socket empty
//	sockSends: a count of the messages writers sent by the socket,
//	     which they bump (a fair Way's)
//	readerAt: a fair Way's reader's stamp of its last wait on the lane,
//	     which is its process's last receive before it (see stamp,
//	     and readerLive)

// The reader's page lies in the lane's header, after the bells.
const readerPage = 1024

const (
	pinSeq   = 0
	pinOwner = 4
	pinCount = 8
	pinTable = 16

	// takenLine is where the taken bell's first line is free for its
	// caller (offset 24 of the bell at 256; lane_linux.go asserts it), as
	// an offset from the reader's page.
	takenLine   = 256 + 24 - readerPage
	pinAcked    = takenLine
	readerWaits = takenLine + 4
	waitsAt     = takenLine + 8
	sockSends   = takenLine + 12
	readerAt    = takenLine + 16 // an int64, 8-aligned

	// maxPins and maxPinBytes bound the segments a reader pins for a
	// Way: pinned segments keep their memory until the Way closes, or
	// their producers let go of them and the entries that may name them
	// are taken (prunePins).
	maxPins     = 64
	maxPinBytes = 1 << 30
	// pinnerByte is the lane file's byte whose read locks are the pinning
	// readers', and readersByte the one whose read locks are a fair Way's
	// readers' without the role.
	pinnerByte  = 2
	readersByte = 3
	// settleEvery is how often a closed writer's loans are looked at.
	settleEvery = 10 * time.Millisecond
)

// lentSent counts the messages this process sent by a lane with blocks
// lent to them (see LentSent).
var lentSent atomic.Uint64

// LentSent returns how many messages this process has sent by a lane
// naming blocks by identity: what tests and benchmarks look at to see
// that tensors took the lane.
func LentSent() uint64 { return lentSent.Load() }

// pins is a reader's pinned segments.
type pins struct {
	held  map[shm.ID]pinned
	order []shm.ID // as listed
	bytes int64
	lock  *fd.FD // the read lock on pinnerByte, once pinning
	owner uint32 // this Way's mark in the list
	// goneAt: segments whose producers have let go of them, with the
	// lane's count of entries sent when the reader saw so (prunePins).
	goneAt map[shm.ID]uint32
	// The most segments, and bytes, it pins: maxPins and maxPinBytes
	// (tests lower them).
	most      int
	mostBytes int64
}

// pinned is a segment a reader pins: how to let go of it, and its size.
type pinned struct {
	unpin func()
	size  int64
}

// loan is a block lent to the lane's entry at pos.
type loan struct {
	pos uint32
	b   *shm.Block
}

// ledger is a writer's loans, in the order of their entries: those of
// loans from returned on are out, the ones before it returned (and
// cleared), moved out of the way only once they are half of loans, so
// that a Send's settling costs what it returns, not what is out.
type ledger struct {
	loans    []loan
	returned int
	checked  int64 // the last look at whether a pinner is left (monoNow)
}

// out returns the loans not yet returned.
func (g *ledger) out() []loan { return g.loans[g.returned:] }

// Maps reports whether a message of this Way's writer may name b by its
// segment's identity alone (carry.Lane): b is a block of this process's
// pool, in a sealed segment of its own (not a named one), on the CPU or
// in a device slab (whose data lies in the slab's allocation, which the
// reader imported with the first block of the slab it received), the
// lane's reader lists the segment as pinned, and, for a fair Way, the
// lane would take a message now (handsOver).
func (w *Way) Maps(b *shm.Block) bool { return w.names(b, true) }

// Warm asks, without waiting, for the cache lines of the lane that this
// Way's next send writes and its reader, on another CPU, wrote last (see
// Lane.warmSend): a writer calls it as it begins a message, so that they
// move while it encodes. The taken count's line only while the lane
// takes this writer's messages: a fair Way's reader that gets them by the
// socket writes that line at each receive. It does nothing unless this
// process holds the writer's role.
func (w *Way) Warm() {
	if !w.writes || !w.writing.Load() {
		return
	}
	w.viewMu.Lock()
	if l := w.lane.Load(); l != nil && !w.viewClosed {
		l.warmSend(w.fair && w.byLane.Load())
	}
	w.viewMu.Unlock()
}

// names is Maps for a block of this process's pool (own), and Returns for
// one received here: the reader lists b's segment among its pins, or
// among the segments it made. A block of a device slab is never a
// return: its producer takes back only CPU blocks so (shm.Revive).
func (w *Way) names(b *shm.Block, own bool) bool {
	if !w.writes || !w.writing.Load() || b.Produced() != own || b.Named() || !own && b.InExtent() {
		return false
	}
	w.viewMu.Lock()
	defer w.viewMu.Unlock()
	l := w.lane.Load()
	if l == nil || w.viewClosed || !w.readView(l) {
		return false
	}
	if own && !w.view.listed[b.Segment().ID()] || !own && !w.view.produced[b.Segment().ID()] {
		return false
	}
	if w.handsOver(l, l.Tail(), false, true) || w.mayAwait(l) {
		return true
	}
	if w.fair {
		// The lane would have taken it from a reader waiting there: the
		// reader waits there next (see socketRun), where a message with
		// descriptors, as this one becomes, would not move it.
		l.readerWord(laneMisses).Add(1)
	}
	return false
}

// readView brings the writer's copy of the reader's lists up to date,
// and reports whether it could: not while the reader rewrites them. The
// caller holds viewMu.
func (w *Way) readView(l *Lane) bool {
	seq := l.readerWord(pinSeq)
	if seq == nil {
		return false
	}
	s := seq.Load()
	if s&1 != 0 {
		return false // being rewritten
	}
	v := &w.view
	if s != v.seq || v.listed == nil {
		v.seq, v.n, v.nprod = s, 0, 0
		if v.listed == nil {
			v.listed, v.produced = map[shm.ID]bool{}, map[shm.ID]bool{}
		}
		clear(v.listed)
		clear(v.produced)
	}
	n := min(l.readerWord(pinCount).Load(), maxPins)
	for ; v.n < n; v.n++ {
		v.listed[l.readerID(pinTable+16*int(v.n))] = true
	}
	n = min(l.readerWord(prodCount).Load(), maxPins)
	for ; v.nprod < n; v.nprod++ {
		v.produced[l.readerID(prodTable+16*int(v.nprod))] = true
	}
	if seq.Load() != s {
		v.listed = nil // rewritten while read: read it anew next time
		return false
	}
	return true
}

// pinView is a writer's copy of the reader's lists, as of seq: its pins
// (listed) and the segments it produced.
type pinView struct {
	seq      uint32
	n, nprod uint32
	listed   map[shm.ID]bool
	produced map[shm.ID]bool
}

// Pin pins segment id, a block of which this process just received by
// descriptor on the Way, and lists it for the writer (carry.Lane). It
// does nothing unless this process holds the reader's role; segments
// their producers have let go of are unpinned first where no untaken
// entry may name them (prunePins), and none is pinned beyond maxPins or
// maxPinBytes. The caller holds the receive.
func (w *Way) Pin(id shm.ID) {
	p := &w.pins
	if _, ok := p.held[id]; ok || w.writes || !w.held || w.broken || p.lock == nil {
		return // no role, or listPins could not take the pinner's lock
	}
	l := w.lane.Load()
	w.prunePins(l)
	if len(p.order) >= p.most {
		return
	}
	unpin, size, ok := shm.Pin(id)
	if !ok {
		return
	}
	if p.bytes+size > p.mostBytes {
		unpin()
		return
	}
	if p.held == nil {
		p.held = map[shm.ID]pinned{}
	}
	p.held[id] = pinned{unpin, size}
	p.order = append(p.order, id)
	p.bytes += size
	// The list is this process's since it took the role (listPins).
	l.setReaderID(pinTable+16*(len(p.order)-1), id)
	l.readerWord(pinCount).Store(uint32(len(p.order)))
}

// Pinned reports whether this process pins segment id for the Way
// (carry.Lane): only such a segment's blocks may a lane's message name by
// identity. The caller holds the receive.
func (w *Way) Pinned(id shm.ID) bool {
	_, ok := w.pins.held[id]
	return ok && !w.writes
}

// Ahead calls yield with each message in the lane after the one being
// received, oldest first, until yield returns false (carry.Lane): for a
// reader that prepares now what it will need to take them. Each is a
// copy, valid until yield returns, and a hint only: what the message is
// is known once it is taken. Markers are passed over. Only the role's
// reader, receiving, sees any; the caller holds the receive.
func (w *Way) Ahead(yield func(data []byte) bool) {
	if w.writes || !w.held || w.broken {
		return
	}
	l := w.lane.Load()
	if l == nil {
		return
	}
	w.abuf = l.Ahead(w.abuf[:0], func(e []byte) bool {
		if len(e) == 0 || e[0] != kindValue {
			return true
		}
		return yield(e[1:])
	})
}

// prunePins unpins the segments whose producers have let go of them
// (shm.Kept) once every entry the lane held when the reader first saw so
// has been taken, by whichever reader: a live producer lets go of a segment only once none of
// its blocks is in use, lent ones included, and a dead one sends nothing
// more, so no entry sent after names them, whoever holds the reader's
// role. A reader that holds the role rewrites its list without them; one
// that does not leaves the page alone, which is the role holder's to
// write (it rewrites its own list as it takes the role: listPins). The
// caller holds sem.
func (w *Way) prunePins(l *Lane) {
	p := &w.pins
	for _, id := range p.order {
		if _, seen := p.goneAt[id]; seen || shm.Kept(id) {
			continue
		}
		if p.goneAt == nil {
			p.goneAt = map[shm.ID]uint32{}
		}
		p.goneAt[id] = l.Sent() // read after Kept: what may name it lies below
	}
	if len(p.goneAt) == 0 {
		return
	}
	taken := l.Taken()
	kept := p.order[:0]
	for _, id := range p.order {
		// Entries before the mark are left while the mark is ahead of
		// what the reader took, by a lane's length at most: a mark
		// further ahead, which only a peer that moved the counts makes,
		// keeps nothing.
		at, seen := p.goneAt[id]
		if ahead := at - taken; !seen || ahead > 0 && ahead <= l.entries {
			kept = append(kept, id)
			continue
		}
		p.held[id].unpin()
		p.bytes -= p.held[id].size
		delete(p.held, id)
		delete(p.goneAt, id)
	}
	if len(kept) == len(p.order) {
		return
	}
	clear(p.order[len(kept):])
	p.order = kept
	if w.held {
		w.listPins(l)
	}
}

// listPins makes the reader's list this process's pins, as it takes the
// reader's role.
func (w *Way) listPins(l *Lane) {
	seq := l.readerWord(pinSeq)
	if seq == nil {
		return
	}
	p := &w.pins
	if p.lock == nil {
		// A reader that takes the role may take entries named by
		// identity: it counts as pinning until it closes, whether or
		// not it pins anything, so that the writer keeps the loans of
		// what it takes until it acks.
		if lock, err := shm.ShareByte(w.mem, pinnerByte); err == nil && lock != nil {
			p.lock = lock
		}
	}
	if p.owner == 0 {
		var b [4]byte
		_, _ = rand.Read(b[:])
		p.owner = binary.LittleEndian.Uint32(b[:]) | 1
	}
	s := (seq.Load() + 1) | 1
	seq.Store(s) // odd: a writer reading it now reads it again
	l.readerWord(pinOwner).Store(p.owner)
	for i, id := range p.order {
		l.setReaderID(pinTable+16*i, id)
	}
	l.readerWord(pinCount).Store(uint32(len(p.order)))
	w.listProduced(l)
	seq.Store(s + 1)
}

// unlistPins empties the reader's list if it is this process's, taking
// the reader's role for it if need be, as the reader closes: the writer
// names nothing by identity for a process that will not map it.
func (w *Way) unlistPins(l *Lane) {
	p := &w.pins
	seq := l.readerWord(pinSeq)
	if seq == nil || p.owner == 0 {
		return
	}
	if !w.held {
		role, err := shm.HoldByte(w.mem, 1)
		if err != nil || role == nil {
			return // another reader holds it, and has rewritten the list
		}
		defer role.Close()
	}
	if l.readerWord(pinOwner).Load() != p.owner {
		return
	}
	s := (seq.Load() + 1) | 1
	seq.Store(s)
	l.readerWord(pinOwner).Store(0)
	l.readerWord(pinCount).Store(0)
	l.readerWord(prodCount).Store(0)
	seq.Store(s + 1)
}

// unpinAll gives up the reader's pins and its lock on pinnerByte.
func (p *pins) unpinAll() error {
	for _, id := range p.order {
		p.held[id].unpin()
	}
	clear(p.held)
	clear(p.goneAt)
	p.order, p.bytes = nil, 0
	if p.lock == nil {
		return nil
	}
	err := p.lock.Close()
	p.lock = nil
	return err
}

// ack tells the writer that the reader has done with what it took of
// the lane, as a receive ends: it holds, by its own locks, the blocks of
// it that it still uses. The caller holds the receive and the reader's
// role.
func ack(l *Lane) {
	if a := l.readerWord(pinAcked); a != nil {
		a.Store(l.Taken())
	}
}

// lend records blocks lent to the entry at pos, those of this process's
// pool (the others are returns, lent nothing), and reports whether there
// were any.
func (g *ledger) lend(pos uint32, lent []*shm.Block) bool {
	any := false
	for _, b := range lent {
		if b.Produced() {
			g.loans = append(g.loans, loan{pos, b})
			any = true
		}
	}
	return any
}

// settle returns the loans of the entries the reader has done with, and
// all of them if no reader pins (mem is the lane's memory). A look at the
// pinners is taken at most each peerCheck, unless force; now is monoNow.
func (g *ledger) settle(l *Lane, mem *fd.FD, force bool, now int64) {
	if len(g.out()) == 0 {
		return
	}
	if a := l.readerWord(pinAcked); a != nil {
		acked := a.Load()
		i := g.returned
		for i < len(g.loans) && int32(acked-g.loans[i].pos) > 0 {
			g.loans[i].b.Return()
			g.loans[i] = loan{}
			i++
		}
		g.returned = i
		switch {
		case i == len(g.loans):
			g.loans, g.returned = g.loans[:0], 0
		case 2*i >= len(g.loans):
			n := copy(g.loans, g.loans[i:])
			clear(g.loans[n:])
			g.loans, g.returned = g.loans[:n], 0
		}
	}
	if len(g.out()) == 0 || !force && now-g.checked < int64(peerCheck) {
		return
	}
	g.checked = now
	if held, err := shm.ByteHeld(mem, pinnerByte); err == nil && !held {
		g.returnAll()
	}
}

// returnAll returns every loan.
func (g *ledger) returnAll() {
	for _, n := range g.out() {
		n.b.Return()
	}
	clear(g.loans)
	g.loans, g.returned = g.loans[:0], 0
}

// keepSettling returns a closed writer's loans in a goroutine of their
// own, which owns the lane and its memory until the last is returned.
func (g *ledger) keepSettling(l *Lane, mem *fd.FD) {
	go func() {
		for len(g.out()) > 0 {
			time.Sleep(settleEvery)
			g.settle(l, mem, true, monoNow())
		}
		_ = l.Close()
		_ = mem.Close()
	}()
}

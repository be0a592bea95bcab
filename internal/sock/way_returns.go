package sock

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"

	"github.com/tensormp/tensormp/internal/shm"
)

// Returns by the lane.
//
// A block that the lane's reader produced (a block of the reading
// process's pool, received here and sent back, as a worker answers with
// the tensor it was given) goes by the lane too, named by identity, with
// no descriptor (Returns). What holds it in flight is its producer, the
// reader, as shm's Returns say: the entry says which blocks it returns,
// ahead of the message's bytes, and the reader registers a scanner
// (shm.RegisterReturns) that names them, from the lanes' untaken entries
// and from the one it is taking, so that its pools do not reuse them
// once the writer has let go of its own lock on them, or died; taking the
// message, it takes the block back (shm.Revive).
//
//   - The writer names a block by identity as a return only if the
//     lane's reader lists the block's segment among those it produced:
//     the role's reader lists up to maxPins of them in its page beside
//     its pins, and lists them again as its pools change.
//   - The writer holds its own lock on the slot (its tensor's) until the
//     entry is published: the scanner, asked after the kernel, sees it.
//   - The reader takes the entry and records its returns (w.taking)
//     under one lock that the scanner takes too, so that no return is
//     between the two, and forgets them once the message is done.
//   - A queue hands a return, as any tensor by identity, only to a reader
//     that waits on the lane (or comes back to it within the writer's
//     patience): another getter could not take it back. A pipe's reader
//     keeps its role while a return to it waits (letGoIdle).
//   - A reader that takes the role over from another that left returns
//     untaken gets ErrNotMapped for them, unless it produced them too, or
//     pins their segment (it then holds them as blocks of its pins, with
//     its own lock and a look at the generation); their producer keeps
//     them while they wait, and reuses them once they are taken.
//
// The returns an entry names are only a hint to the scanner: a hostile
// writer's can keep released slots of the reader's pools from reuse
// until the entry is taken, and the reader revives only a block it
// released with the generation the message names.

// Lane entries of a Way that return blocks: kindReturn, the count of
// blocks, returnRefSize bytes for each (identity, offset, generation),
// then the message's bytes.
const (
	kindReturn    = 2
	returnRefSize = 32
	maxReturns    = 64 // a message that returns more goes by the socket
)

// The reader's list of the segments it produced, in its page (see
// way_pins.go), rewritten under pinSeq.
const (
	prodCount = pinTable + 16*maxPins
	prodTable = prodCount + 8 // 8-aligned, as its words are loaded whole
)

// laneMisses, in the reader's page after the list of its own segments,
// counts the messages a fair Way's writer with the role sent by the
// socket that the lane would have taken from a reader waiting on it
// (see socketRun).
const laneMisses = prodTable + 16*maxPins

// returnsSent and returnsTaken count the messages this process sent by a
// lane returning blocks to their producer, and those it took so.
var returnsSent, returnsTaken atomic.Uint64

// ReturnsSent returns how many messages this process has sent by a lane
// returning blocks to the process that made them, and ReturnsTaken how
// many it has taken: what tests and benchmarks look at to see that
// answers took the lane.
func ReturnsSent() uint64  { return returnsSent.Load() }
func ReturnsTaken() uint64 { return returnsTaken.Load() }

// Returns reports whether a message of this Way's writer may name b by
// its segment's identity alone as a return (carry.Lane): b is a block
// received here, of a sealed segment of its own, whose producer is the
// lane's reader (it lists the segment), and, for a fair Way, the lane
// would take a message that names blocks now (handsOver), or may once
// the busy reader comes back (mayAwait).
func (w *Way) Returns(b *shm.Block) bool { return w.names(b, false) }

// returnWaits reports whether an untaken entry of the lane returns blocks
// to this process: only this process, their producer, can take them
// back, so its reader keeps the role until it has (see letGoIdle).
func (w *Way) returnWaits(l *Lane) bool {
	w.takeMu.Lock() // sbuf is the scanner's too
	defer w.takeMu.Unlock()
	waits := false
	w.sbuf = l.Heads(w.sbuf[:0], 1, func(e []byte) bool {
		waits = len(e) > 0 && e[0] == kindReturn
		return !waits
	})
	return waits
}

// appendReturns appends to hdr the head of an entry whose message names
// lent, the blocks of a message by identity: kindValue if none is a
// return, else kindReturn and the returns. It reports false if there are
// more than maxReturns.
func appendReturns(hdr []byte, lent []*shm.Block) ([]byte, bool) {
	n := 0
	for _, b := range lent {
		if !b.Produced() {
			n++
		}
	}
	if n == 0 {
		return append(hdr, kindValue), true
	}
	if n > maxReturns {
		return hdr, false
	}
	hdr = append(hdr, kindReturn, byte(n))
	for _, b := range lent {
		if b.Produced() {
			continue
		}
		id := b.Segment().ID()
		hdr = binary.LittleEndian.AppendUint64(hdr, id.Dev)
		hdr = binary.LittleEndian.AppendUint64(hdr, id.Ino)
		hdr = binary.LittleEndian.AppendUint64(hdr, uint64(b.Offset()))
		hdr = binary.LittleEndian.AppendUint64(hdr, b.Gen())
	}
	return hdr, true
}

// parseReturns reads the returns of e, a kindReturn entry, calling yield
// with each, and returns the message's bytes after them.
func parseReturns(e []byte, yield func(shm.ReturnRef)) ([]byte, error) {
	if len(e) < 2 || int(e[1]) > maxReturns || len(e) < 2+int(e[1])*returnRefSize {
		return nil, fmt.Errorf("mp: receiving on a lane: %w: an entry that returns %d blocks in %d bytes", ErrMalformed, returnCount(e), len(e))
	}
	n := int(e[1])
	for i := range n {
		r := e[2+i*returnRefSize:]
		yield(shm.ReturnRef{
			ID:     shm.ID{Dev: binary.LittleEndian.Uint64(r), Ino: binary.LittleEndian.Uint64(r[8:])},
			Offset: int64(binary.LittleEndian.Uint64(r[16:])),
			Gen:    binary.LittleEndian.Uint64(r[24:]),
		})
	}
	return e[2+n*returnRefSize:], nil
}

func returnCount(e []byte) int {
	if len(e) < 2 {
		return 0
	}
	return int(e[1])
}

// scanReturns calls yield with each block that the lane's untaken entries
// return, and those of the entry being taken (shm.RegisterReturns' scan).
func (w *Way) scanReturns(yield func(shm.ReturnRef)) {
	w.takeMu.Lock()
	defer w.takeMu.Unlock()
	for _, r := range w.taking {
		yield(r)
	}
	l := w.lane.Load()
	if l == nil {
		return
	}
	w.sbuf = l.Heads(w.sbuf[:0], returnsHead, func(e []byte) bool {
		if len(e) > 0 && e[0] == kindReturn {
			_, _ = parseReturns(e, yield)
		}
		return true
	})
}

// returnsHead is the most an entry's returns take, kind and count
// included: what the scanner copies of each.
const returnsHead = 2 + maxReturns*returnRefSize

// registerReturns registers the reader's scanner, once: from the first
// time it takes the role until Close. The caller holds sem.
func (w *Way) registerReturns() {
	if w.unregister == nil {
		w.unregister = shm.RegisterReturns(w.scanReturns)
	}
}

// listProduced writes the segments this process produced to the reader's
// page, as of shm.ProducedVersion; the caller has made the page's seq odd
// and holds sem and the role.
func (w *Way) listProduced(l *Lane) {
	var v uint64
	w.prods, v = shm.Produced(w.prods[:0], maxPins)
	for i, id := range w.prods {
		l.setReaderID(prodTable+16*i, id)
	}
	l.readerWord(prodCount).Store(uint32(len(w.prods)))
	w.prodsAt = v
}

// relistProduced lists the segments this process produced again if its
// pools have made or closed one since the list was written. The caller
// holds sem and the role.
func (w *Way) relistProduced(l *Lane) {
	if shm.ProducedVersion() == w.prodsAt {
		return
	}
	seq := l.readerWord(pinSeq)
	if seq == nil || l.readerWord(pinOwner).Load() != w.pins.owner {
		return
	}
	s := (seq.Load() + 1) | 1
	seq.Store(s)
	w.listProduced(l)
	seq.Store(s + 1)
}

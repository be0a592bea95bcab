package shm

import (
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

// rotateDelay is how long a ticket description stays open before it is
// replaced. Each message
// carries a duplicate of it, so closing this process's copy drops no hold a
// message in flight still needs; it only stops the description from
// outliving the messages.
const rotateDelay = 10 * time.Millisecond

// pressureRotate is the least time between two rotations that a pool out
// of free slots forces.
const pressureRotate = time.Millisecond

// Ticket is the description of a segment whose descriptor messages carry:
// its read locks are the holds of the messages in flight. One Ticket serves
// every message this process sends from the segment until it is rotated;
// each Block.Ticket call pins it, so that its descriptor stays open until
// that message is sent (Done) or given up (Discard).
//
// A Ticket locks every slot of its segment at once, the first time it is
// used: one call instead of one per message. That holds more than the
// messages need, so a Ticket is short-lived: it is rotated within
// rotateDelay, or at once when its producer runs out of free slots.
type Ticket struct {
	set *tickets
	fd  *fd.FD // each pin is a loan of it; retiring it is closing it
}

// FD returns the descriptor to send. It stays the Ticket's: valid until
// Done or Discard.
func (t *Ticket) FD() int { return t.fd.Num() }

// Covers reports whether t, pinned for a message, holds b's slot too: it
// is a ticket of b's segment, whose description locks every slot. A
// message that carries t needs no other ticket for b. A nil t covers
// nothing.
func (t *Ticket) Covers(b *Block) bool { return t != nil && t.set == &b.seg.tickets }

// Done unpins the ticket once the message that carries it was sent.
func (t *Ticket) Done() { _ = t.fd.Return() }

// Discard unpins the ticket of a message that will never be sent and drops
// the holds it stood for: the description is replaced at once (messages
// already sent keep theirs through their own copies of it).
func (t *Ticket) Discard() {
	s := t.set
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == t {
		s.rotateLocked()
	}
	_ = t.fd.Return()
}

// tickets is one process's ticket description of one segment.
type tickets struct {
	mu      sync.Mutex
	cur     *Ticket // holds every slot of the segment
	opened  time.Time
	rotated time.Time
}

// take returns the current ticket description, opening one (and locking
// every slot through it) if there is none, and pins it.
func (s *tickets) take(seg *segment) (*Ticket, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.cur
	if t == nil {
		raw, err := reopen(seg.alloc.fd())
		if err != nil {
			return nil, err
		}
		if _, err := lockRead(raw, slotByte(0), int64(seg.nslots)); err != nil {
			_ = unix.Close(raw)
			return nil, err
		}
		t = &Ticket{set: s, fd: fd.New(raw)}
		s.cur, s.opened = t, time.Now()
		rotations.schedule(seg)
	}
	if _, err := t.fd.Lend(); err != nil {
		return nil, err
	}
	return t, nil
}

// rotateLocked retires the current description: it is closed now, or by
// the last message still pinning it.
func (s *tickets) rotateLocked() {
	t := s.cur
	if t == nil {
		return
	}
	s.cur, s.rotated = nil, time.Now()
	_ = t.fd.Close()
}

// rotate retires the current description, if any, and reports whether
// there was one.
func (s *tickets) rotate() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == nil {
		return false
	}
	s.rotateLocked()
	return true
}

// rotateUnlessRecent retires the current description unless one was
// retired less than min ago. A pool out of free slots calls it.
func (s *tickets) rotateUnlessRecent(min time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == nil || time.Since(s.rotated) < min {
		return false
	}
	s.rotateLocked()
	return true
}

// open reports whether there is a current description: it holds every
// slot, with no need to ask the kernel.
func (s *tickets) open() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur != nil
}

type rotation int

const (
	none rotation = iota
	rotated
	tooYoung
)

// rotateIfOlder retires the current description if it was opened at
// least age ago.
func (s *tickets) rotateIfOlder(age time.Duration) rotation {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.cur == nil:
		return none
	case time.Since(s.opened) < age:
		return tooYoung
	}
	s.rotateLocked()
	return rotated
}

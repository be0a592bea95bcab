package fd

import (
	"fmt"
	"slices"

	"golang.org/x/sys/unix"
)

// A Set owns the descriptors that one received message brought, from the
// receive that took them until each has an owner of its own: Take hands
// one to an FD, Disown to an owner that keeps numbers, and Close closes
// every one still the Set's. Borrow lends one for a system call, which
// the Set stays the owner of. Borrowing or taking a descriptor marks it
// used, so that a message whose descriptors some part did not use can be
// refused (Unused).
//
// A Set is reset and reused from message to message by its owner; it is
// not safe for concurrent use. The zero Set is empty.
type Set struct {
	raws  []int
	state []uint8
}

const (
	setUsed  = 1 << iota // borrowed or taken
	setTaken             // owned elsewhere now
)

// NewSet returns a Set that owns raws.
func NewSet(raws []int) *Set {
	s := &Set{}
	s.Reset(raws)
	return s
}

// Reset makes s own raws, and nothing else: what s owned before must have
// been given away or closed (Close).
func (s *Set) Reset(raws []int) {
	s.raws = raws
	if cap(s.state) < len(raws) {
		s.state = make([]uint8, len(raws))
	}
	s.state = s.state[:len(raws)]
	clear(s.state)
}

// Len returns how many descriptors the message brought.
func (s *Set) Len() int { return len(s.raws) }

// index checks i, a message's descriptor index, and marks it used.
func (s *Set) index(i int) error {
	if i < 0 || i >= len(s.raws) {
		return fmt.Errorf("descriptor index %d out of range: the message has %d", i, len(s.raws))
	}
	s.state[i] |= setUsed
	return nil
}

// Borrow returns descriptor i for a system call; it stays the Set's, or
// the owner's it was taken by, until the Set is closed.
func (s *Set) Borrow(i int) (int, error) {
	if err := s.index(i); err != nil {
		return -1, err
	}
	return s.raws[i], nil
}

// Taken reports whether descriptor i has an owner other than the Set.
func (s *Set) Taken(i int) bool { return i >= 0 && i < len(s.raws) && s.state[i]&setTaken != 0 }

// Take hands descriptor i to a new FD, which the caller owns. A
// descriptor taken already is duplicated instead: the message named it
// twice. The duplicate is of the number, which its first owner must not
// have closed meanwhile; an owner that may (a storage that lost a race
// for its cache slot) makes a second Take fail or duplicate another
// file, which a caller that checks what it took (fstat) refuses.
func (s *Set) Take(i int) (*FD, error) {
	raw, err := s.Disown(i)
	if err != nil {
		return nil, err
	}
	return New(raw), nil
}

// Disown hands descriptor i's number to the caller, an owner that keeps
// numbers and closes them, as Take does to an FD.
func (s *Set) Disown(i int) (int, error) {
	if err := s.index(i); err != nil {
		return -1, err
	}
	if s.state[i]&setTaken != 0 {
		return Dup(s.raws[i])
	}
	s.state[i] |= setTaken
	return s.raws[i], nil
}

// Unused returns how many of the descriptors were neither borrowed nor
// taken.
func (s *Set) Unused() int {
	n := 0
	for _, st := range s.state {
		if st&setUsed == 0 {
			n++
		}
	}
	return n
}

// Move returns a new Set that owns what s owned, and empties s: for
// descriptors that must outlive the receive whose Set s is.
func (s *Set) Move() *Set {
	m := &Set{raws: slices.Clone(s.raws), state: slices.Clone(s.state)}
	s.Reset(nil)
	return m
}

// Close closes every descriptor still the Set's, and empties it. A nil
// Set owns nothing.
func (s *Set) Close() {
	if s == nil {
		return
	}
	for i, raw := range s.raws {
		if s.state[i]&setTaken == 0 && raw >= 0 {
			_ = unix.Close(raw)
		}
	}
	s.Reset(nil)
}

package shm

import "math/bits"

// slotState is what a receiver keeps of one slot of a segment it maps,
// under attached.mu. It is changed only through its slotTable's methods,
// which keep the table's count and its marks of the slots in use.
type slotState struct {
	holds int32 // blocks of this process holding the slot
	onFD  bool  // locked through the segment's own description (alloc.fd)
	// aheadAt: when LockAhead locked the slot (Unix nanoseconds), while
	// no block has taken the lock up; 0 otherwise.
	aheadAt int64
}

// slotPage is how many slots a page of a slotTable covers.
const slotPage = 256

// page is a slotTable's states of slotPage slots, with a mark for each
// slot whose state is not the zero one.
type page struct {
	used  [slotPage / 64]uint64
	slots [slotPage]slotState
}

// slotTable is a received segment's slot states, indexed by slot, in
// pages made as their slots are first used: a slab of a quarter of a
// million slots (the most one has, maxSlabSlots) costs what this process
// uses of it, and a walk of the slots in use (each) costs what is in use.
// It counts the slots locked through the segment's own description, for
// the transfers.
type slotTable struct {
	pages  []*page
	locked int // slots whose onFD is set
}

func newSlotTable(nslots int) slotTable {
	return slotTable{pages: newPages[page](nslots)}
}

// newPages returns the index of the pages of P, slotPage slots each, that
// cover nslots slots, none made yet.
func newPages[P any](nslots int) []*P {
	return make([]*P, (nslots+slotPage-1)/slotPage)
}

// get returns slot's state; slot must be one of the segment's.
func (t *slotTable) get(slot int) slotState {
	if p := t.pages[slot/slotPage]; p != nil {
		return p.slots[slot%slotPage]
	}
	return slotState{}
}

// change calls f with slot's state to change, making its page if need
// be, and marks the slot in use or not after it; slot must be one of the
// segment's.
func (t *slotTable) change(slot int, f func(s *slotState)) {
	p := t.pages[slot/slotPage]
	if p == nil {
		p = new(page)
		t.pages[slot/slotPage] = p
	}
	i := slot % slotPage
	s := &p.slots[i]
	onFD := s.onFD
	f(s)
	switch {
	case s.onFD && !onFD:
		t.locked++
	case !s.onFD && onFD:
		t.locked--
	}
	if *s == (slotState{}) {
		p.used[i/64] &^= 1 << (i % 64)
	} else {
		p.used[i/64] |= 1 << (i % 64)
	}
}

// setOnFD records whether slot is locked through the segment's own
// description.
func (t *slotTable) setOnFD(slot int, on bool) {
	t.change(slot, func(s *slotState) { s.onFD = on })
}

// setAhead records when LockAhead locked slot, or with 0 that no lock of
// LockAhead's waits to be taken up on it.
func (t *slotTable) setAhead(slot int, at int64) {
	t.change(slot, func(s *slotState) { s.aheadAt = at })
}

// hold adds a block's hold on slot.
func (t *slotTable) hold(slot int) {
	t.change(slot, func(s *slotState) { s.holds++ })
}

// release drops a block's hold on slot and returns the slot's state
// after it, or reports false if there was none.
func (t *slotTable) release(slot int) (after slotState, ok bool) {
	if t.get(slot).holds == 0 {
		return slotState{}, false
	}
	t.change(slot, func(s *slotState) { s.holds--; after = *s })
	return after, true
}

// usedIn calls f with each slot in [from, to) marked in use, in slot
// order, until f returns false; it looks at a word of marks at a time.
// f may change, through t, the state of the slot it is given and no
// other, as each's may.
func (t *slotTable) usedIn(from, to int, f func(slot int) bool) {
	for from < to {
		p := t.pages[from/slotPage]
		end := min(to, (from/slotPage+1)*slotPage)
		for p != nil && from < end {
			i := from % slotPage
			wordEnd := min(end, from-i%64+64)
			used := p.used[i/64] >> (i % 64) // the marks as they were
			if n := wordEnd - from; n < 64 {
				used &= 1<<n - 1
			}
			for ; used != 0; used &= used - 1 {
				if !f(from + bits.TrailingZeros64(used)) {
					return
				}
			}
			from = wordEnd
		}
		from = end
	}
}

// lockedIn reports whether a slot in [from, to) is locked through the
// segment's own description.
func (t *slotTable) lockedIn(from, to int) bool {
	locked := false
	t.usedIn(from, to, func(slot int) bool {
		locked = t.get(slot).onFD
		return !locked
	})
	return locked
}

// unlocked records that no slot in [from, to) is locked through the
// segment's own description any more.
func (t *slotTable) unlocked(from, to int) {
	t.usedIn(from, to, func(slot int) bool {
		if t.get(slot).onFD {
			t.setOnFD(slot, false)
		}
		return true
	})
}

// unlockRuns turns slots, each locked through the segment's own
// description, into the runs to unlock, [first, length] each, as runs
// does, but joins two runs across the slots between them when none of
// those is locked through that description: unlocking a byte the
// description does not lock changes nothing, so slots let go of here
// and there cost one call per stretch between the slots still locked,
// not one per run of neighbours.
func (t *slotTable) unlockRuns(slots []int) [][2]int {
	rs := runs(slots)
	out := rs[:0]
	for _, r := range rs {
		if n := len(out); n > 0 {
			last := &out[n-1]
			if end := last[0] + last[1]; !t.lockedIn(end, r[0]) {
				last[1] = r[0] + r[1] - last[0]
				continue
			}
		}
		out = append(out, r)
	}
	return out
}

// each calls f with each slot whose state is not the zero one and that
// state, in slot order. f may change, through t, the state of the slot
// it is given and no other, as usedIn's may.
func (t *slotTable) each(f func(slot int, s slotState)) {
	t.usedIn(0, len(t.pages)*slotPage, func(slot int) bool {
		f(slot, t.get(slot))
		return true
	})
}

// forgetLocks clears every slot's onFD and aheadAt: the segment's
// description, and its locks, are gone.
func (t *slotTable) forgetLocks() {
	t.each(func(slot int, _ slotState) {
		t.change(slot, func(s *slotState) { s.onFD, s.aheadAt = false, 0 })
	})
}

// forgetHolds clears every slot's holds and aheadAt, for a process
// about to exit: its locks stay, to go at the next transfer.
func (t *slotTable) forgetHolds() {
	t.each(func(slot int, _ slotState) {
		t.change(slot, func(s *slotState) { s.holds, s.aheadAt = 0, 0 })
	})
}

package shm

// slotState is what a receiver keeps of one slot of a segment it maps,
// under attached.mu.
type slotState struct {
	holds int32 // blocks of this process holding the slot
	onFD  bool  // locked through the segment's own description (alloc.fd)
	// aheadAt: when LockAhead locked the slot (Unix nanoseconds), while
	// no block has taken the lock up; 0 otherwise.
	aheadAt int64
}

// slotPage is how many slots a page of a slotTable covers.
const slotPage = 256

// slotTable is a received segment's slot states, indexed by slot, in
// pages made as their slots are first used: a slab of a quarter of a
// million slots costs what this process uses of it. It counts the slots
// locked through the segment's own description, for the transfers.
type slotTable struct {
	pages  [][]slotState
	locked int // slots whose onFD is set
}

func newSlotTable(nslots int) slotTable {
	return slotTable{pages: make([][]slotState, (nslots+slotPage-1)/slotPage)}
}

// get returns slot's state; slot must be one of the segment's.
func (t *slotTable) get(slot int) slotState {
	if p := t.pages[slot/slotPage]; p != nil {
		return p[slot%slotPage]
	}
	return slotState{}
}

// at returns slot's state to change, making its page if need be; slot
// must be one of the segment's. The caller changes onFD through setOnFD.
func (t *slotTable) at(slot int) *slotState {
	p := t.pages[slot/slotPage]
	if p == nil {
		p = make([]slotState, slotPage)
		t.pages[slot/slotPage] = p
	}
	return &p[slot%slotPage]
}

// setOnFD records whether slot is locked through the segment's own
// description.
func (t *slotTable) setOnFD(slot int, on bool) {
	s := t.at(slot)
	switch {
	case on && !s.onFD:
		t.locked++
	case !on && s.onFD:
		t.locked--
	}
	s.onFD = on
}

// each calls f with each slot whose state is not the zero one, in slot
// order.
func (t *slotTable) each(f func(slot int, s *slotState)) {
	for i, p := range t.pages {
		for j := range p {
			if p[j] != (slotState{}) {
				f(i*slotPage+j, &p[j])
			}
		}
	}
}

// forgetLocks clears every slot's onFD and aheadAt: the segment's
// description, and its locks, are gone.
func (t *slotTable) forgetLocks() {
	for _, p := range t.pages {
		for j := range p {
			p[j].onFD, p[j].aheadAt = false, 0
		}
	}
	t.locked = 0
}

// forgetHolds clears every slot's holds and aheadAt, for a process
// about to exit: its locks stay, to go at the next transfer.
func (t *slotTable) forgetHolds() {
	for _, p := range t.pages {
		for j := range p {
			p[j].holds, p[j].aheadAt = 0, 0
		}
	}
}

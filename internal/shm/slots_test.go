package shm

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// A slot table makes a page only for the slots used, visits the slots
// in use in order, and counts those locked through the segment's own
// description.
func TestSlotTable(t *testing.T) {
	tb := newSlotTable(1000)
	assert.Len(t, tb.pages, 4)
	assert.Equal(t, slotState{}, tb.get(999))
	tb.at(700).holds = 2
	tb.setOnFD(5, true)
	tb.setOnFD(5, true)
	tb.setOnFD(999, true)
	tb.at(999).aheadAt = 1
	made := 0
	for _, p := range tb.pages {
		if p != nil {
			made++
		}
	}
	assert.Equal(t, 3, made, "pages for slots 5, 700 and 999 only")
	assert.Equal(t, 2, tb.locked)

	var seen []int
	tb.each(func(slot int, _ *slotState) { seen = append(seen, slot) })
	assert.Equal(t, []int{5, 700, 999}, seen)

	tb.setOnFD(5, false)
	tb.setOnFD(5, false)
	assert.Equal(t, 1, tb.locked)
	tb.forgetHolds()
	assert.Equal(t, slotState{onFD: true}, tb.get(999), "holds and look-ahead times go; locks stay")
	assert.Equal(t, slotState{}, tb.get(700))
	tb.forgetLocks()
	assert.Equal(t, slotState{}, tb.get(999))
	assert.Zero(t, tb.locked)
	seen = nil
	tb.each(func(slot int, _ *slotState) { seen = append(seen, slot) })
	assert.Empty(t, seen)
}

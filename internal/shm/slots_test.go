package shm

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A slot table makes a page only for the slots used, visits the slots
// in use in order and only those, and counts those locked through the
// segment's own description.
func TestSlotTable(t *testing.T) {
	tb := newSlotTable(1000)
	assert.Len(t, tb.pages, 4)
	assert.Equal(t, slotState{}, tb.get(999))
	tb.hold(700)
	tb.hold(700)
	tb.setOnFD(5, true)
	tb.setOnFD(5, true)
	tb.setOnFD(999, true)
	tb.setAhead(999, 1)
	tb.setAhead(998, 2)
	made := 0
	for _, p := range tb.pages {
		if p != nil {
			made++
		}
	}
	assert.Equal(t, 3, made, "pages for slots 5, 700 and 998-999 only")
	assert.Equal(t, 2, tb.locked)

	inUse := func() []int {
		var seen []int
		tb.each(func(slot int, _ slotState) { seen = append(seen, slot) })
		return seen
	}
	assert.Equal(t, []int{5, 700, 998, 999}, inUse())
	tb.setAhead(998, 0)
	after, ok := tb.release(700)
	assert.True(t, ok)
	assert.Equal(t, slotState{holds: 1}, after)
	assert.Equal(t, []int{5, 700, 999}, inUse(), "one of two holds let go of")
	after, ok = tb.release(700)
	assert.True(t, ok)
	assert.Equal(t, slotState{}, after)
	_, ok = tb.release(700)
	assert.False(t, ok, "no hold left")
	assert.Equal(t, []int{5, 999}, inUse())

	tb.setOnFD(5, false)
	tb.setOnFD(5, false)
	assert.Equal(t, 1, tb.locked)
	assert.Equal(t, []int{999}, inUse())
	tb.hold(3)
	tb.forgetHolds()
	assert.Equal(t, slotState{onFD: true}, tb.get(999), "holds and look-ahead times go; locks stay")
	assert.Equal(t, []int{999}, inUse())
	tb.setAhead(999, 5)
	tb.forgetLocks()
	assert.Equal(t, slotState{}, tb.get(999), "locks and look-ahead times go")
	assert.Zero(t, tb.locked)
	assert.Empty(t, inUse())
}

// A segment's table of users makes a page only for the slots registered:
// a slab of thousands of slots with one user costs one page.
func TestSlotUsersPages(t *testing.T) {
	p := newPool(1 << 30)
	t.Cleanup(func() { p.Trim(0) })
	b, err := p.Alloc(smallMin)
	require.NoError(t, err)
	defer b.Release()
	require.Greater(t, b.seg.nslots, 4*slotPage)
	var users Users[int]
	u := new(int)
	require.Same(t, u, users.Set(b, u, func(*int) bool { return true }))
	assert.Same(t, u, users.Find(BlockRef{Seg: SegmentRef{ID: b.seg.alloc.ID()}, Offset: b.Offset(), Gen: b.gen}))
	other := BlockRef{Seg: SegmentRef{ID: b.seg.alloc.ID()}, Offset: b.seg.slotOffset(b.seg.nslots - 1), Gen: 0}
	assert.Nil(t, users.Find(other), "a slot of a page not made")
	made := 0
	for _, pg := range b.seg.slotUsers.pages {
		if pg != nil {
			made++
		}
	}
	assert.Equal(t, 1, made, "pages made, a looking up included")
	b.forgetUser()
	assert.Nil(t, users.Find(BlockRef{Seg: SegmentRef{ID: b.seg.alloc.ID()}, Offset: b.Offset(), Gen: b.gen}))

	// Users of neighbouring slots, and of slots on two pages at the same
	// place on each, are each their own.
	var bs []*Block
	for len(bs) == 0 || bs[len(bs)-1].slot < b.slot+slotPage {
		x, err := p.Alloc(smallMin)
		require.NoError(t, err)
		defer x.Release()
		bs = append(bs, x)
	}
	near, far := bs[0], bs[len(bs)-1]
	require.Equal(t, b.seg, far.seg)
	require.Equal(t, b.slot/slotPage, near.slot/slotPage)
	ref := func(x *Block) BlockRef {
		return BlockRef{Seg: SegmentRef{ID: x.seg.alloc.ID()}, Offset: x.Offset(), Gen: x.gen}
	}
	us := map[*Block]*int{b: u, near: new(int), far: new(int)}
	for x, xu := range us {
		require.Same(t, xu, users.Set(x, xu, func(*int) bool { return true }))
	}
	for x, xu := range us {
		assert.Same(t, xu, users.Find(ref(x)), "slot %d", x.slot)
	}
}

// Runs to unlock are joined across slots the description does not lock,
// held or not, and split at each slot it still locks; lockedIn looks at
// every slot of its range, in any page and word, and at no other.
func TestUnlockRuns(t *testing.T) {
	tb := newSlotTable(3 * slotPage)
	for _, slot := range []int{3, 4, 10, 70, 300, 700} {
		tb.setOnFD(slot, true) // to unlock
	}
	tb.hold(20)           // held through a ticket: not locked here
	tb.hold(250)          // the same, after a locked slot in its gap
	tb.setOnFD(200, true) // still locked here: held, or locked ahead
	tb.setAhead(600, 1)   // marked, but not locked
	tb.setOnFD(767, true) // the table's last slot
	assert.Equal(t, [][2]int{{3, 68}, {300, 401}}, tb.unlockRuns([]int{70, 3, 4, 10, 300, 700, 4}))
	assert.Equal(t, [][2]int{{3, 1}}, tb.unlockRuns([]int{3}))
	assert.Empty(t, tb.unlockRuns(nil))

	for _, c := range []struct {
		from, to int
		locked   bool
	}{
		{5, 10, false}, {5, 11, true}, {11, 70, false}, {11, 71, true}, {71, 200, false}, {71, 201, true},
		{200, 201, true}, {201, 300, false}, {64, 71, true}, {128, 192, false}, {301, 700, false},
		{701, 767, false}, {701, 768, true}, {0, 3, false}, {0, 768, true}, {767, 767, false},
		{71, 300, true}, {5, 30, true}, // a locked slot before a marked one that is not
	} {
		assert.Equal(t, c.locked, tb.lockedIn(c.from, c.to), "[%d, %d)", c.from, c.to)
	}

	locked := tb.locked
	tb.unlocked(3, 71)
	assert.Equal(t, locked-4, tb.locked)
	for _, slot := range []int{3, 4, 10, 70} {
		assert.False(t, tb.get(slot).onFD, "slot %d", slot)
	}
	assert.Equal(t, slotState{holds: 1}, tb.get(20), "a slot in the run held otherwise is left as it is")
	assert.Equal(t, slotState{}, tb.get(4), "and a slot let go of is no longer marked")
	assert.True(t, tb.get(200).onFD, "a slot past the run is left as it is")

	sparse := newSlotTable(3 * slotPage)
	sparse.setOnFD(10, true)
	sparse.setOnFD(600, true)
	assert.Equal(t, [][2]int{{10, 591}}, sparse.unlockRuns([]int{600, 10}))
	sparse.unlocked(10, 601)
	assert.Zero(t, sparse.locked)
	assert.Nil(t, sparse.pages[1], "a page never used is not made")
	sparse.each(func(slot int, _ slotState) { t.Errorf("slot %d still marked", slot) })
}

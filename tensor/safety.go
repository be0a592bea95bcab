package tensor

import (
	"runtime"
	"sync"
	"weak"
)

// The safety net gives back the memory of a Storage that became
// unreachable without Release.
//
// It holds each armed Storage's memory beside the Storage's weak pointer,
// in a slot the Storage keeps, and after every garbage collection it
// releases the memory of those whose weak pointer went nil. A Storage
// thus carries one runtime special, its weak handle, which package
// reduction's cache of storages uses too (see Storage.Weak), where a
// runtime.AddCleanup per Storage would add a second: each special costs a
// walk of its span's list of specials when it is added and when it is
// removed, the largest single cost of streaming small tensors. A sweep
// costs a constant time per armed Storage, once per collection, on the
// runtime's cleanup goroutine.
type safetyNet struct {
	mu    sync.Mutex
	slots []netSlot // a Storage's slot is its index here
	free  []int32   // indexes of empty slots
	start sync.Once
}

// netSlot is one armed Storage: its weak pointer and its memory. An
// empty slot has neither.
type netSlot struct {
	w weak.Pointer[Storage]
	m *memory
}

// safety is the process's safety net, guarded by its mutex.
var safety = &safetyNet{}

// arm puts m, w's memory, in the net and returns its slot: the memory is
// released once w's Storage is unreachable, unless disarm takes it out
// first.
func (n *safetyNet) arm(w weak.Pointer[Storage], m *memory) int32 {
	n.start.Do(func() { afterEachGC(n.sweep) })
	n.mu.Lock()
	defer n.mu.Unlock()
	if k := len(n.free); k > 0 {
		i := n.free[k-1]
		n.free = n.free[:k-1]
		n.slots[i] = netSlot{w, m}
		return i
	}
	n.slots = append(n.slots, netSlot{w, m})
	return int32(len(n.slots) - 1)
}

// disarm empties slot i, for a Release that gives its memory back itself.
func (n *safetyNet) disarm(i int32) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.emptyLocked(i)
}

func (n *safetyNet) emptyLocked(i int32) {
	n.slots[i] = netSlot{}
	n.free = append(n.free, i)
}

// sweep releases the memory of every armed Storage that was collected.
func (n *safetyNet) sweep() {
	var dead []*memory
	n.mu.Lock()
	for i, sl := range n.slots {
		if sl.m != nil && sl.w.Value() == nil {
			dead = append(dead, sl.m)
			n.emptyLocked(int32(i))
		}
	}
	n.mu.Unlock()
	for _, m := range dead {
		_ = m.release()
	}
}

// len returns the number of armed storages.
func (n *safetyNet) len() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.slots) - len(n.free)
}

// gcSentinel is an object nothing refers to, whose cleanup runs after
// the first collection that follows its allocation. It holds a pointer
// so that it is not batched with other small objects by the allocator.
type gcSentinel struct{ _ *byte }

// afterEachGC runs f on the runtime's cleanup goroutine after every
// garbage collection, from now until the process exits.
func afterEachGC(f func()) {
	runtime.AddCleanup(new(gcSentinel), func(struct{}) {
		f()
		afterEachGC(f)
	}, struct{}{})
}

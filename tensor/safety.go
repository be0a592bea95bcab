package tensor

import (
	"runtime"
	"sync"
	"sync/atomic"
	"weak"
)

// The safety net gives back the memory of a Storage that became
// unreachable without Release.
//
// It holds each armed Storage's memory beside the Storage's StorageRef,
// in a slot the Storage keeps, and after every garbage collection it
// releases the memory of those whose reference went nil. A young
// reference holds its Storage strongly and costs the runtime nothing; the
// sweep after the first whole collection cycle the Storage lives through
// makes it weak, which adds the Storage's one runtime special, its weak
// handle. Each special costs a walk of its span's list of specials when it
// is added and when it is removed, the largest single cost of streaming
// small tensors; most storages in shared memory are released within
// microseconds or milliseconds of being made or received, and never get
// one. Package reduction's caches of storages use the same references (see
// Storage.Ref), where a runtime.AddCleanup per Storage would add a second
// special. A sweep costs a constant time per armed Storage, and a weak
// handle per Storage that ages, once per collection, on the runtime's
// cleanup goroutine. A Storage dropped unreleased while young is thus
// given back after the third collection that follows, not the first.
type safetyNet struct {
	mu    sync.Mutex
	slots []netSlot // a Storage's slot is its index here
	free  []int32   // indexes of empty slots
	start sync.Once
	// sweeps counts the sweeps begun: a reference made when it was e is
	// young until sweep e+2, the first that follows a whole cycle.
	sweeps atomic.Uint32
}

// netSlot is one armed Storage: its reference and its memory. An empty
// slot has neither.
type netSlot struct {
	r *StorageRef
	m *memory
}

// safety is the process's safety net, guarded by its mutex.
var safety = &safetyNet{}

// arm puts m, r's Storage's memory, in the net and returns its slot: the
// memory is released once r's Storage is unreachable, unless disarm takes
// it out first.
func (n *safetyNet) arm(r *StorageRef, m *memory) int32 {
	n.start.Do(func() { afterEachGC(n.sweep) })
	n.mu.Lock()
	defer n.mu.Unlock()
	if k := len(n.free); k > 0 {
		i := n.free[k-1]
		n.free = n.free[:k-1]
		n.slots[i] = netSlot{r, m}
		return i
	}
	n.slots = append(n.slots, netSlot{r, m})
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

// sweep releases the memory of every armed Storage that was collected,
// and makes the references of those still young weak.
func (n *safetyNet) sweep() {
	var dead []*memory
	var young []*StorageRef
	epoch := n.sweeps.Add(1)
	n.mu.Lock()
	for i, sl := range n.slots {
		switch {
		case sl.m == nil:
		case sl.r.young.Load() != nil:
			if epoch-sl.r.born >= 2 {
				young = append(young, sl.r)
			}
		case sl.r.Value() == nil:
			dead = append(dead, sl.m)
			n.emptyLocked(int32(i))
		}
	}
	n.mu.Unlock()
	for _, r := range young {
		r.age()
	}
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

// A StorageRef refers to a Storage without keeping it from being
// collected, as a weak pointer does, but some collections later: a
// reference to a Storage in shared memory or on a device starts young,
// holding the Storage, and turns weak after the first whole garbage
// collection cycle the Storage lives through, unless Release comes first.
// Making a weak pointer costs the runtime more than a tensor's whole
// hand-off to another process, and most such storages are released long
// before that. A cache of storages, such as the one package reduction keeps
// of those it received, is keyed by their references (see Storage.Ref).
type StorageRef struct {
	young ptr[Storage]               // the Storage, while young and unreleased
	weak  ptr[weak.Pointer[Storage]] // set before young is cleared, once it ages
	born  uint32                     // the net's sweeps when it was made
}

// Value returns the Storage r refers to, or nil once it was collected or,
// if it was released young, released.
func (r *StorageRef) Value() *Storage {
	if s := r.young.Load(); s != nil {
		return s
	}
	if w := r.weak.Load(); w != nil {
		return w.Value()
	}
	return nil
}

// weakRef returns a reference to s that is weak from the start.
func weakRef(s *Storage) *StorageRef {
	r := &StorageRef{}
	w := weak.Make(s)
	r.weak.init(&w)
	return r
}

// age makes r weak if it is young. The weak pointer is set before the
// Storage is let go, so that Value finds one or the other.
func (r *StorageRef) age() {
	s := r.young.Load()
	if s == nil {
		return
	}
	w := weak.Make(s) // the same handle, however often it is made for s
	r.weak.CompareAndSwap(nil, &w)
	r.young.CompareAndSwap(s, nil)
}

// drop lets a released Storage go.
func (r *StorageRef) drop() { r.young.Store(nil) }

package main

import (
	"sort"
	"sync"
	"unsafe"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/tensor"
)

// cudaMemory is device memory DLPack can hand out: a device, an address
// and ways to wait for the work queued on it (package cuda's Buffer):
// tensormp's own (Sync), or every stream's, another library's included
// (SyncAll).
type cudaMemory interface {
	Device() int
	Ptr() cuda.DevicePtr
	Sync() error
	SyncAll() error
}

// holdTable counts, per storage, the handles and DLPack exports that use
// it, and releases (unmaps) a storage when its count falls to zero. The
// foreign caller's references are counted here, so the memory goes back
// when the last of them goes, not when Go's collector gets to it.
//
// One rule keeps a release from racing a receive: package reduction maps a
// segment once per process, so a message received now may decode onto a
// storage whose count just fell to zero. A storage whose count falls to
// zero while any receive is in progress is kept, and released when the
// last receive in progress ends, unless that receive held it again.
type holdTable struct {
	mu        sync.Mutex
	n         map[*tensor.Storage]int
	spans     []span // storages held, with bytes, by base address
	receiving int    // receives in progress
	pending   map[*tensor.Storage]struct{}
}

// span is the address range of a held storage's bytes: host addresses for
// a CPU storage, device addresses for a GPU one. CUDA gives host and
// device memory one address space, so the ranges never overlap.
type span struct {
	base, end uintptr
	s         *tensor.Storage
}

// rangeOf returns the address range of s's bytes, or ok false when it has
// none.
func rangeOf(s *tensor.Storage) (base, end uintptr, ok bool) {
	if b := s.Bytes(); len(b) > 0 {
		base = uintptr(unsafe.Pointer(unsafe.SliceData(b)))
		return base, base + uintptr(len(b)), true
	}
	if b, isGPU := s.Backing().(cudaMemory); isGPU && s.Size() > 0 {
		base = uintptr(b.Ptr())
		return base, base + uintptr(s.Size()), true
	}
	return 0, 0, false
}

var holds = &holdTable{n: make(map[*tensor.Storage]int), pending: make(map[*tensor.Storage]struct{})}

// hold counts one more reference to s.
func (h *holdTable) hold(s *tensor.Storage) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.holdLocked(s)
}

func (h *holdTable) holdLocked(s *tensor.Storage) {
	h.n[s]++
	if h.n[s] > 1 {
		return
	}
	delete(h.pending, s)
	if base, end, ok := rangeOf(s); ok {
		i := sort.Search(len(h.spans), func(i int) bool { return h.spans[i].base >= base })
		h.spans = append(h.spans, span{})
		copy(h.spans[i+1:], h.spans[i:])
		h.spans[i] = span{base: base, end: end, s: s}
	}
}

// drop counts one reference to s less, releasing s at zero.
func (h *holdTable) drop(s *tensor.Storage) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n[s] == 0 {
		return
	}
	h.n[s]--
	if h.n[s] > 0 {
		return
	}
	delete(h.n, s)
	for i := range h.spans {
		if h.spans[i].s == s {
			h.spans = append(h.spans[:i], h.spans[i+1:]...)
			break
		}
	}
	if h.receiving > 0 {
		h.pending[s] = struct{}{}
		return
	}
	_ = s.Release()
}

// beginReceive marks a receive in progress.
func (h *holdTable) beginReceive() {
	h.mu.Lock()
	h.receiving++
	h.mu.Unlock()
}

// endReceive ends a receive, holding the storages it received once each
// (the caller drops them when it has made its handles), and releases
// the storages that fell to zero meanwhile if no receive is left.
func (h *holdTable) endReceive(got []*tensor.Storage) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range got {
		h.holdLocked(s)
	}
	h.receiving--
	if h.receiving > 0 {
		return
	}
	for s := range h.pending {
		_ = s.Release()
	}
	clear(h.pending)
}

// holdAt returns the held storage on place whose bytes hold [p, p+n),
// with one more reference counted to it, or nil.
func (h *holdTable) holdAt(place device.Place, p, n uintptr) *tensor.Storage {
	h.mu.Lock()
	defer h.mu.Unlock()
	i := sort.Search(len(h.spans), func(i int) bool { return h.spans[i].base > p })
	if i == 0 {
		return nil
	}
	sp := h.spans[i-1]
	if p+n < p || p+n > sp.end || sp.s.Place() != place {
		return nil
	}
	h.holdLocked(sp.s)
	return sp.s
}

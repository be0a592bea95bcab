package tensor

import (
	"sync/atomic"
	"unsafe"
)

// ptr is a pointer to a T that is loaded and stored atomically, as an
// atomic.Pointer is, and that the goroutine making a new object may also
// set with a plain store (init) while no other goroutine can see the
// object. On amd64, atomic.Pointer's Store is a locked exchange, which
// waits for every store before it to reach the cache: in a Storage just
// allocated, the runtime's clearing of it. Each storage made, for every
// tensor made, sent or received, sets four such pointers.
type ptr[T any] struct {
	_ noCopy
	p unsafe.Pointer
}

// noCopy makes go vet's copylocks check report a copy of what holds it,
// as atomic.Pointer's does.
type noCopy struct{}

func (*noCopy) Lock()   {}
func (*noCopy) Unlock() {}

func (x *ptr[T]) Load() *T { return (*T)(atomic.LoadPointer(&x.p)) }

func (x *ptr[T]) Store(v *T) { atomic.StorePointer(&x.p, unsafe.Pointer(v)) }

func (x *ptr[T]) CompareAndSwap(old, new *T) bool {
	return atomic.CompareAndSwapPointer(&x.p, unsafe.Pointer(old), unsafe.Pointer(new))
}

// init sets x to v with a plain store. The caller made the object x is
// in and has let no other goroutine see it yet: whatever lets one see it
// later (a channel, a lock, an atomic store) orders init before that
// goroutine's loads.
func (x *ptr[T]) init(v *T) { x.p = unsafe.Pointer(v) }

package tensor

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"unsafe"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/strategy"
)

// ErrReleased is returned for any use of a tensor whose storage was
// released.
var ErrReleased = errors.New("tensor: storage released")

// ErrTooLarge is returned for a tensor whose copy in host memory would
// need more bytes than the machine has: a peer's shape over a small
// storage (zero strides let a few bytes stand for any number of
// elements) must be an error, not the end of the process.
var ErrTooLarge = errors.New("tensor: more host memory than this machine has")

// hostBytesFor makes n bytes of host memory, or returns ErrTooLarge.
func hostBytesFor(n int64) ([]byte, error) {
	if err := checkHostSize(n); err != nil {
		return nil, err
	}
	return make([]byte, n), nil
}

// checkHostSize reports whether n bytes of host memory can be asked for.
func checkHostSize(n int64) error {
	if max := hostMemory(); n > max {
		return fmt.Errorf("%w: %d bytes, of %d", ErrTooLarge, n, max)
	}
	return nil
}

// Backing is the memory behind a Storage: heap bytes, a block of a
// pooled shared segment, a whole shared segment, or device memory. A
// Storage owns its Backing: it calls Release exactly once, when the
// Storage is released or becomes unreachable unreleased.
//
// Package tensor makes the backings of the storages it allocates. Other
// packages make the backings of memory they receive or allocate (package
// reduction from a message, package cuda from its allocator, a program
// from memory of its own) and hand them to NewStorage.
type Backing interface {
	// Bytes returns the memory's host bytes, which alias it, or nil for
	// memory the host cannot address.
	Bytes() []byte
	// Size returns the memory's size in bytes.
	Size() int64
	// Release gives the memory back.
	Release() error
}

// Buffer is device memory: a Backing whose bytes the host reaches by
// copies. A Backend hands Buffers out.
type Buffer interface {
	Backing
	// Read copies len(dst) bytes starting at off into host memory.
	Read(dst []byte, off int64) error
	// Write copies src into the buffer starting at off.
	Write(src []byte, off int64) error
}

// DeviceCopier is a Buffer that can copy from another device's Buffer
// directly. CopyFrom copies n bytes starting at srcOff of src to the start
// of the receiver; done is false when it cannot copy from src (another
// backend's buffer, say), and the caller copies through host memory.
type DeviceCopier interface {
	CopyFrom(src Buffer, srcOff, n int64) (done bool, err error)
}

// Backend allocates memory on the devices of one device.Type. The cuda
// package registers the backend of device.TypeGPU; CPU memory needs none.
type Backend interface {
	// Alloc returns nbytes of zeroed memory on p.
	Alloc(p device.Place, nbytes int64) (Buffer, error)
}

var backends sync.Map // device.Type -> Backend

// RegisterBackend makes b the allocator of every place of type t, replacing
// any earlier one. It may be called at any time, from any goroutine.
func RegisterBackend(t device.Type, b Backend) {
	if t == device.TypeCPU {
		panic("tensor: the CPU needs no backend")
	}
	backends.Store(t, b)
}

// CloseBackends closes every registered Backend that is an io.Closer (the
// cuda package's gives the driver's contexts back) and returns their
// errors joined. A closed backend allocates nothing more and its device
// storages are lost, so it is for a process that is about to exit:
// workers started by mp.Spawn call it when their function returns; a
// program that made device tensors calls it before it exits, or the
// driver may leave files of its own in /dev/shm.
func CloseBackends() error {
	var errs []error
	backends.Range(func(t, b any) bool {
		if c, ok := b.(io.Closer); ok {
			if err := c.Close(); err != nil {
				errs = append(errs, fmt.Errorf("tensor: closing the %s backend: %w", t, err))
			}
		}
		return true
	})
	return errors.Join(errs...)
}

func backendFor(p device.Place) (Backend, error) {
	if b, ok := backends.Load(p.Type()); ok {
		return b.(Backend), nil
	}
	if p.IsGPU() {
		return nil, fmt.Errorf("tensor: no backend for %s: GPU storage needs the cuda package and a driver", p)
	}
	return nil, fmt.Errorf("tensor: no backend registered for device type %s", p.Kind())
}

// memory is one state of a Storage's backing. A Storage swaps whole
// memory values atomically, so readers never see a half-made state.
type memory struct {
	bytes    []byte  // host memory; nil on a device or once released
	backing  Backing // what bytes, or device memory, belong to; nil for heap memory
	dev      Buffer  // backing as device memory, or nil
	shared   bool    // in shared memory (an empty storage counts once shared)
	released bool
}

var releasedMemory = &memory{released: true}

// Storage is the memory behind one or more tensors: host bytes, a shared
// segment, or a device buffer. Views made from a tensor share its Storage.
//
// A Storage owns its segment or buffer. Release gives it back; a Storage
// that becomes unreachable without Release gives it back after some garbage
// collections (see safetyNet), so memory is never lost, but only Release
// says when.
type Storage struct {
	place  device.Place
	nbytes int64

	mu        sync.Mutex // serialises changes of mem, ref, armed and slot, and onRelease
	mem       ptr[memory]
	ref       ptr[StorageRef] // set once, by Ref or arm, under mu
	armed     bool            // mem is in the safety net,
	slot      int32           // in this slot
	onRelease []func()        // run by Release, once

	// spare is the Tensor made in one allocation with the Storage, until
	// the first tensor made on the Storage takes it (see newTensor).
	spare ptr[Tensor]
}

// storageAndTensor is a Storage and the Tensor that is usually made on it
// next, allocated together: one allocation fewer for each tensor made,
// sent or received. Either keeps the other's memory until both are
// unreachable, which a tensor does to its storage anyway.
type storageAndTensor struct {
	s Storage
	t Tensor
}

// allocStorage returns a Storage of nbytes on p, without memory yet, with
// a spare Tensor.
func allocStorage(p device.Place, nbytes int64) *Storage {
	st := &storageAndTensor{s: Storage{place: p, nbytes: nbytes}}
	st.s.spare.init(&st.t)
	return &st.s
}

// newTensor returns v in a Tensor of its own: s's spare, the first time.
func (s *Storage) newTensor(v Tensor) *Tensor {
	t := s.spare.Load()
	if t == nil || !s.spare.CompareAndSwap(t, nil) {
		t = new(Tensor)
	}
	*t = v
	return t
}

// newHeapStorage allocates nbytes of zeroed host memory, aligned for every
// element type.
func newHeapStorage(nbytes int64) (*Storage, error) {
	if err := checkHostSize(nbytes); err != nil {
		return nil, err
	}
	words := make([]uint64, (nbytes+7)/8)
	var b []byte
	if nbytes > 0 {
		b = unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(words))), nbytes)
	} else {
		b = []byte{}
	}
	s := allocStorage(device.CPU(), nbytes)
	s.mem.init(&memory{bytes: b})
	return s, nil
}

func newStorage(p device.Place, nbytes int64) (*Storage, error) {
	if nbytes < 0 {
		return nil, fmt.Errorf("tensor: negative storage size %d", nbytes)
	}
	if p.IsCPU() {
		return newHeapStorage(nbytes)
	}
	if !p.Valid() {
		return nil, fmt.Errorf("tensor: cannot allocate on invalid place %s", p)
	}
	b, err := backendFor(p)
	if err != nil {
		return nil, err
	}
	buf, err := b.Alloc(p, nbytes)
	if err != nil {
		return nil, fmt.Errorf("tensor: allocating %d bytes on %s: %w", nbytes, p, err)
	}
	s := allocStorage(p, nbytes)
	s.armNew(memory{backing: buf, dev: buf, shared: true})
	return s, nil
}

// NewStorage wraps b, memory on p, as a storage of b.Size() bytes. The
// Storage takes ownership of b: Release, or the cleanup of an unreachable
// Storage, releases it once; on error b stays the caller's. Device memory
// must be a Buffer on a device place, host memory a backing with bytes on
// the CPU.
//
// The storage counts as shared when b is shared memory whose holders
// tensormp tracks (the blocks and segments package tensor allocates and
// package reduction receives) or device memory, which crosses processes by
// its backend's handles. Any other host backing, a mmapalloc.Allocation of
// the caller's included, is private memory that ShareMemory copies out.
func NewStorage(p device.Place, b Backing) (*Storage, error) {
	if b == nil {
		return nil, errors.New("tensor: a storage of no memory")
	}
	buf, onDevice := b.(Buffer)
	bytes, size := b.Bytes(), b.Size()
	switch {
	case !p.Valid():
		return nil, fmt.Errorf("tensor: storage on invalid place %s", p)
	case p.IsCPU() && onDevice:
		return nil, fmt.Errorf("tensor: %d bytes of device memory on %s", size, p)
	case p.IsCPU() && int64(len(bytes)) != size:
		return nil, fmt.Errorf("tensor: host memory of %d bytes that says it has %d", len(bytes), size)
	case !p.IsCPU() && !onDevice:
		return nil, fmt.Errorf("tensor: %d bytes of host memory on %s", size, p)
	}
	s := allocStorage(p, size)
	s.armNew(memory{bytes: bytes, backing: b, dev: buf, shared: onDevice || sharedHost(b)})
	return s, nil
}

// sharedHost reports whether b is host memory other processes can map
// and tensormp tracks the holders of.
func sharedHost(b Backing) bool {
	_, ok := b.(shm.Shared)
	return ok
}

// heapMemory is the Backing of a storage in this process's heap.
type heapMemory []byte

func (h heapMemory) Bytes() []byte  { return h }
func (h heapMemory) Size() int64    { return int64(len(h)) }
func (h heapMemory) Release() error { return nil }

// armedMemory is memory in the safety net together with the reference
// the net holds its Storage by, if the Storage had none yet: one
// allocation for both.
type armedMemory struct {
	memory
	ref StorageRef
}

// arm makes m s's memory and puts it in the safety net, which releases it
// if s becomes unreachable unreleased. Callers hold s.mu.
func (s *Storage) arm(m memory) { s.armAs(m, false) }

// armNew is arm for a storage that its caller made and has let no other
// goroutine see yet: its pointers are set with plain stores (see ptr).
func (s *Storage) armNew(m memory) { s.armAs(m, true) }

func (s *Storage) armAs(m memory, fresh bool) {
	am := &armedMemory{memory: m}
	r := s.ref.Load()
	if r == nil {
		am.ref.young.init(s)
		am.ref.born = safety.sweeps.Load()
		r = &am.ref
		if fresh {
			s.ref.init(r)
		} else {
			s.ref.Store(r)
		}
	}
	if fresh {
		s.mem.init(&am.memory)
	} else {
		s.mem.Store(&am.memory)
	}
	s.slot, s.armed = safety.arm(r, &am.memory), true
}

// disarm takes s's memory out of the safety net. Callers hold s.mu.
func (s *Storage) disarm() {
	if s.armed {
		safety.disarm(s.slot)
		s.armed = false
	}
}

// Ref returns a reference to s, the same one each time, that keeps s from
// being collected at most until its first whole garbage collection cycle
// is over (see StorageRef): the key of a cache of storages.
func (s *Storage) Ref() *StorageRef {
	if r := s.ref.Load(); r != nil {
		return r
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.ref.Load()
	if r == nil {
		r = weakRef(s) // not armed: nothing would make a young one weak
		s.ref.Store(r)
	}
	return r
}

// Place returns where the storage's memory lives.
func (s *Storage) Place() device.Place { return s.place }

// Size returns the storage's size in bytes.
func (s *Storage) Size() int64 { return s.nbytes }

// Bytes returns the host bytes of a CPU storage. The slice aliases the
// storage (and, once shared, the memory other processes see); it is valid
// while the Storage is reachable and not released. It is nil for device
// storage and after Release.
func (s *Storage) Bytes() []byte { return s.mem.Load().bytes }

// Backing returns the memory behind the storage, or nil once released.
// The Storage keeps ownership: the caller must not release it.
func (s *Storage) Backing() Backing {
	m := s.mem.Load()
	switch {
	case m.released:
		return nil
	case m.backing == nil:
		return heapMemory(m.bytes)
	}
	return m.backing
}

// buffer returns the storage's device memory, or nil for host memory and
// once released.
func (s *Storage) buffer() Buffer { return s.mem.Load().dev }

// IsShared reports whether the storage lives in shared memory.
func (s *Storage) IsShared() bool { return s.mem.Load().shared }

// Released reports whether Release was called.
func (s *Storage) Released() bool { return s.mem.Load().released }

// ShareMemory moves the storage into a new shared segment made under
// strategy st, copying its bytes, unless it is shared already. Every tensor
// on the storage sees the shared memory from then on; slices taken from it
// before keep pointing at the old, private memory. Device memory is shared
// already: it crosses processes by its backend's handles.
func (s *Storage) ShareMemory(st strategy.Strategy) error {
	if m := s.mem.Load(); m.shared && !m.released {
		return nil // shared memory stays shared until Release
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.mem.Load()
	switch {
	case m.released:
		return ErrReleased
	case m.shared:
		return nil
	}
	if s.nbytes == 0 {
		s.disarm() // the private memory's, if it has a backing of its own
		s.mem.Store(&memory{bytes: []byte{}, shared: true})
	} else {
		nm, err := newSharedMemory(s.nbytes, st, false)
		if err != nil {
			return err
		}
		if err := copyBytes(nm.bytes, m.bytes); err != nil {
			_ = nm.release()
			return fmt.Errorf("tensor: share memory (%d bytes, %s): %w", s.nbytes, st, err)
		}
		s.disarm()
		s.arm(nm)
	}
	if err := m.release(); err != nil {
		return fmt.Errorf("tensor: share memory: giving back the private memory: %w", err)
	}
	return nil
}

// AllocSharedStorage returns a CPU storage of nbytes of shared memory,
// made under the process's strategy, whose bytes are not cleared: a
// recycled block still holds what its last user in this process wrote.
// It is for callers that overwrite every byte at once, such as a receiver
// copying a tensor's body off the network. The caller owns the storage.
func AllocSharedStorage(nbytes int64) (*Storage, error) {
	if nbytes < 0 {
		return nil, fmt.Errorf("tensor: shared storage of %d bytes", nbytes)
	}
	return newSharedStorage(nbytes, strategy.Get(), false)
}

// newSharedStorage returns a storage of nbytes of shared memory, cleared
// with zero.
func newSharedStorage(nbytes int64, st strategy.Strategy, zero bool) (*Storage, error) {
	s := allocStorage(device.CPU(), nbytes)
	if nbytes == 0 {
		s.mem.init(&memory{bytes: []byte{}, shared: true})
		return s, nil
	}
	m, err := newSharedMemory(nbytes, st, zero)
	if err != nil {
		return nil, err
	}
	s.armNew(m)
	return s, nil
}

// newSharedMemory returns nbytes of shared memory made under strategy st:
// a pooled block for file_descriptor, and for file_system a pooled block
// of a named segment in a process whose session has a keeper, else a
// reference-counted segment of its own. With zero, a recycled block is
// cleared of its last user's bytes; without, the caller overwrites all of
// it.
func newSharedMemory(nbytes int64, st strategy.Strategy, zero bool) (memory, error) {
	switch st {
	case strategy.FileDescriptor:
		return blockMemory(shm.DefaultPool(), nbytes, st, zero)
	case strategy.FileSystem:
		if pool := shm.NamedPool(); pool != nil {
			return blockMemory(pool, nbytes, st, zero)
		}
		a, err := shm.Create(nbytes, shm.RefCount)
		if err != nil {
			return memory{}, fmt.Errorf("tensor: share memory (%d bytes, %s): %w", nbytes, st, err)
		}
		return memory{bytes: a.Bytes(), backing: a, shared: true}, nil
	}
	return memory{}, fmt.Errorf("tensor: share memory: unknown strategy %q", st)
}

// blockMemory returns nbytes of a block of pool, cleared with zero.
func blockMemory(pool *shm.Pool, nbytes int64, st strategy.Strategy, zero bool) (memory, error) {
	alloc := pool.Alloc
	if zero {
		alloc = pool.AllocZeroed
	}
	b, err := alloc(nbytes)
	if err != nil {
		return memory{}, fmt.Errorf("tensor: share memory (%d bytes, %s): %w", nbytes, st, err)
	}
	return memory{bytes: b.Bytes(), backing: b, shared: true}, nil
}

// Release gives the storage's memory back now: it unmaps a shared segment
// (dropping this process's reference), frees a device buffer, or drops
// host memory. Every tensor on the storage becomes unusable. Releasing
// twice returns nil.
func (s *Storage) Release() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.mem.Load()
	if m.released {
		return nil
	}
	s.mem.Store(releasedMemory)
	s.disarm() // before the reference lets s go: a sweep would take s for collected
	if r := s.ref.Load(); r != nil {
		r.drop()
	}
	for _, f := range s.onRelease {
		f()
	}
	s.onRelease = nil
	return m.release()
}

// OnRelease registers f to run when Release gives the storage's memory
// back, or at once if it did already. It is not run for a storage that
// becomes unreachable unreleased. f must not call s's methods. A cache of
// storages uses it to forget them.
func (s *Storage) OnRelease(f func()) {
	s.mu.Lock()
	if s.mem.Load().released {
		s.mu.Unlock()
		f()
		return
	}
	s.onRelease = append(s.onRelease, f)
	s.mu.Unlock()
}

// release gives m's backing back.
func (m *memory) release() error {
	if m.backing == nil {
		return nil
	}
	return m.backing.Release()
}

func (s *Storage) String() string {
	m := s.mem.Load()
	state := "heap"
	switch b, named := m.backing.(fmt.Stringer); {
	case m.released:
		state = "released"
	case named:
		state = b.String()
	case m.dev != nil:
		state = "device"
	case m.shared:
		state = "shared"
	}
	return fmt.Sprintf("storage(%d bytes on %s, %s)", s.nbytes, s.place, state)
}

package reduction

import (
	"errors"
	"fmt"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// Version is the version of Meta this package writes and reads.
const Version = 3

// ErrDeviceTensor is returned for a tensor whose memory is not on the
// CPU: device tensors cross processes through CUDA IPC, which this
// package does not do yet.
var ErrDeviceTensor = errors.New("reduction: tensors on this device cannot be shared: only CPU and NVIDIA GPU memory can")

// Meta describes a shared tensor to the process that rebuilds it. It
// travels as a msgpack array, Version first.
type Meta struct {
	//lint:ignore U1000 the tag tells msgpack to use the array form
	_msgpack struct{} `msgpack:",as_array"`

	Version  uint8
	Strategy string // "file_descriptor", "file_system", or "" for an empty tensor
	FD       int    // file_descriptor: index of the segment's descriptor in the message; else -1
	Name     string // file_system: the segment's name in the shared-memory directory
	Size     int64  // the storage's bytes
	Segment  int64  // pooled file_descriptor block: the segment's size
	Block    int64  // pooled file_descriptor block: its header's offset in the segment; else -1
	Gen      uint64 // pooled file_descriptor block: its generation
	Offset   int64  // byte offset of the first element in the storage
	DType    tensor.DType
	Shape    []int
	Strides  []int // in elements
	LoD      [][]int
	Place    string

	// cuda_ipc: the device allocation's IPC handle and event handle (64
	// bytes each) and where the storage starts in the allocation. FD,
	// Segment, Block and Gen then name the token block whose reference
	// count keeps the producer's memory alive.
	IPC       []byte
	IPCEvent  []byte
	DevOffset int64
}

// StrategyCUDAIPC is Meta.Strategy for a GPU tensor.
const StrategyCUDAIPC = "cuda_ipc"

// Reduce turns t into metadata and the descriptors that must travel with
// it, moving its storage into shared memory first if it is not there yet
// (under the process's strategy). A tensor already shared is not copied,
// and a view keeps its offset and strides. An empty tensor needs no
// segment and no descriptor.
//
// The returned descriptors are borrowed: they belong to t's storage and
// stay valid while it is reachable and not released. Send them (sendmsg
// duplicates them in flight) or dup them; never close them.
//
// Under file_descriptor the storage is a block of a pooled segment, and
// Reduce takes a reference to it on behalf of the receiver, so that the
// block cannot be recycled while the message is in flight; Rebuild adopts
// it. Call Discard for metadata that will not be rebuilt.
func Reduce(t *tensor.Tensor) (Meta, []int, error) {
	m, fd, _, err := reduce(t)
	if err != nil || fd < 0 {
		return m, nil, err
	}
	m.FD = 0
	return m, []int{fd}, nil
}

// Discard gives back the reference Reduce took on t's storage for
// metadata that will never be rebuilt.
func Discard(t *tensor.Tensor) {
	if b := t.Storage().Block(); b != nil {
		b.Drop()
	}
}

// reduce is Reduce returning the storage's descriptor itself, or -1, and
// the block it took a reference on, if any.
func reduce(t *tensor.Tensor) (Meta, int, *mmapalloc.Block, error) {
	if t.Place().IsGPU() {
		return reduceGPU(t)
	}
	if !t.Place().IsCPU() {
		return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: %w", t, ErrDeviceTensor)
	}
	s := t.Storage()
	m := Meta{
		Version: Version,
		FD:      -1,
		Block:   -1,
		Offset:  t.Offset(),
		DType:   t.DType(),
		Shape:   t.Shape(),
		Strides: t.Strides(),
		LoD:     t.LoD(),
		Place:   t.Place().String(),
	}
	if s.Released() {
		return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: %w", t, tensor.ErrReleased)
	}
	if t.Numel() == 0 {
		m.Offset = 0
		m.Strides = make([]int, len(m.Shape))
		return m, -1, nil, nil
	}
	if err := s.ShareMemory(strategy.Get()); err != nil {
		return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: %w", t, err)
	}
	if b := s.Block(); b != nil {
		if err := b.Retain(); err != nil {
			return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: %w", t, err)
		}
		seg := b.Segment()
		m.Size, m.Segment, m.Block, m.Gen = b.Size(), seg.Size(), b.Offset(), b.Gen()
		if name := seg.Name(); name != "" && seg.FD() < 0 {
			m.Strategy, m.Name = string(strategy.FileSystem), name
			storages.put(namedBlockKey(name, b.Offset(), b.Gen()), s)
			return m, -1, b, nil
		}
		storages.put(blockKey(seg.ID(), b.Offset(), b.Gen()), s)
		fd := seg.FD()
		if fd < 0 {
			b.Drop()
			return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: %w", t, tensor.ErrReleased)
		}
		m.Strategy = string(strategy.FileDescriptor)
		return m, fd, b, nil
	}
	a := s.Allocation()
	if a == nil {
		return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: %w", t, tensor.ErrReleased)
	}
	m.Size = a.Size()
	if a.Flags()&mmapalloc.RefCount != 0 {
		m.Strategy = string(strategy.FileSystem)
		m.Name = a.Name()
		storages.put(nameKey(m.Name), s)
		return m, -1, nil, nil
	}
	fd := a.FD()
	if fd < 0 {
		return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: %w", t, tensor.ErrReleased)
	}
	m.Strategy = string(strategy.FileDescriptor)
	storages.put(idKey(a.ID()), s)
	return m, fd, nil, nil
}

// Rebuild makes a tensor from metadata and the descriptors that came with
// it. It checks the metadata against the segment before mapping anything,
// and a segment this process maps already (received before, or its own)
// yields a tensor on the same Storage.
//
// The descriptors stay the caller's: Rebuild duplicates the one it keeps.
func Rebuild(m Meta, fds []int) (*tensor.Tensor, error) {
	return rebuild(m, borrowed(fds), nil)
}

// fdSource gives rebuild access to a message's descriptors.
type fdSource interface {
	// fd returns descriptor i for inspection, marking it referenced.
	fd(i int) (int, error)
	// take returns descriptor i for the rebuilt storage to own.
	take(i int) (int, error)
}

type borrowed []int

func (b borrowed) fd(i int) (int, error) {
	if i < 0 || i >= len(b) {
		return -1, fmt.Errorf("descriptor index %d out of range: the message has %d", i, len(b))
	}
	return b[i], nil
}

func (b borrowed) take(i int) (int, error) {
	fd, err := b.fd(i)
	if err != nil {
		return -1, err
	}
	return mmapalloc.Dup(fd)
}

// rebuild builds a tensor from m. Storages it maps afresh are appended to
// *made (when made is non-nil), so that a failed decode can release them.
func rebuild(m Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Tensor, error) {
	t, err := rebuildTensor(m, fds, made)
	if err != nil {
		return nil, fmt.Errorf("reduction: rebuild %s tensor %v: %w", m.DType, m.Shape, err)
	}
	return t, nil
}

func rebuildTensor(m Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Tensor, error) {
	if m.Version != Version {
		return nil, fmt.Errorf("metadata version %d, want %d", m.Version, Version)
	}
	p, err := device.Parse(m.Place)
	if err != nil {
		return nil, err
	}
	if !p.IsCPU() && !p.IsGPU() {
		return nil, fmt.Errorf("place %s: %w", p, ErrDeviceTensor)
	}
	if p.IsGPU() != (m.Strategy == StrategyCUDAIPC) && m.Strategy != "" {
		return nil, fmt.Errorf("strategy %q for a tensor on %s", m.Strategy, p)
	}
	if m.Size < 0 {
		return nil, fmt.Errorf("negative segment size %d", m.Size)
	}
	if err := tensor.CheckView(m.DType, m.Offset, m.Shape, m.Strides, m.Size); err != nil {
		return nil, err
	}

	var s *tensor.Storage
	switch strategy.Strategy(m.Strategy) {
	case "":
		if m.Size != 0 || m.FD != -1 || m.Name != "" || m.Block != -1 || m.IPC != nil {
			return nil, errors.New("an empty tensor carries no segment")
		}
		if len(m.Shape) == 0 || productNonZero(m.Shape) {
			return nil, fmt.Errorf("no segment for a tensor of shape %v that has elements", m.Shape)
		}
		if p.IsGPU() {
			return tensor.On(p).Zeros(m.DType, m.Shape...)
		}
		s = tensor.NewEmptySharedStorage()
	case StrategyCUDAIPC:
		s, err = openGPU(m, p, fds, made)
	case strategy.FileDescriptor:
		if m.Name != "" {
			return nil, errors.New("file_descriptor metadata carries a name")
		}
		if m.Block >= 0 {
			s, err = openBlock(m, fds, made)
		} else {
			s, err = openFD(m, fds, made)
		}
	case strategy.FileSystem:
		if m.FD != -1 {
			return nil, errors.New("file_system metadata refers to a descriptor")
		}
		if m.Block >= 0 {
			s, err = openNamedBlock(m, made)
		} else {
			s, err = openName(m, made)
		}
	default:
		return nil, fmt.Errorf("unknown strategy %q", m.Strategy)
	}
	if err != nil {
		return nil, err
	}
	t, err := tensor.FromStorage(s, m.DType, m.Offset, m.Shape, m.Strides)
	if err != nil {
		return nil, err
	}
	if m.LoD != nil {
		return t.WithLoD(m.LoD)
	}
	return t, nil
}

func productNonZero(shape []int) bool {
	for _, n := range shape {
		if n == 0 {
			return false
		}
	}
	return true
}

func openFD(m Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	fd, err := fds.fd(m.FD)
	if err != nil {
		return nil, err
	}
	id, size, err := mmapalloc.Stat(fd)
	if err != nil {
		return nil, err
	}
	if size < m.Size {
		return nil, fmt.Errorf("segment holds %d bytes, fewer than the %d claimed", size, m.Size)
	}
	key := idKey(id)
	if s := storages.get(key, m.Size); s != nil {
		return s, nil
	}
	own, err := fds.take(m.FD)
	if err != nil {
		return nil, err
	}
	a, err := mmapalloc.OpenFD(own, m.Size, mmapalloc.KeepFD)
	if err != nil {
		return nil, err
	}
	return adopt(key, a, made)
}

// openBlock attaches the pooled block m describes, or finds the storage
// this process has for it already; then the message's reference is given
// back, since the storage holds one of its own.
func openBlock(m Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	fd, err := fds.fd(m.FD)
	if err != nil {
		return nil, err
	}
	id, _, err := mmapalloc.Stat(fd)
	if err != nil {
		return nil, err
	}
	return adoptBlock(blockKey(id, m.Block, m.Gen), m, made, func() (*mmapalloc.Block, error) {
		return mmapalloc.AttachBlock(fd, m.Segment, m.Block, m.Size, m.Gen)
	})
}

// openNamedBlock is openBlock for a block of a named segment.
func openNamedBlock(m Meta, made *[]*tensor.Storage) (*tensor.Storage, error) {
	if !mmapalloc.ValidName(m.Name) {
		return nil, fmt.Errorf("segment name %q: %w", m.Name, mmapalloc.ErrBadName)
	}
	return adoptBlock(namedBlockKey(m.Name, m.Block, m.Gen), m, made, func() (*mmapalloc.Block, error) {
		return mmapalloc.AttachNamedBlock(m.Name, m.Segment, m.Block, m.Size, m.Gen)
	})
}

// adoptBlock returns the storage this process has for the block under
// key, giving back the message's reference, or attaches the block, whose
// storage then owns that reference.
func adoptBlock(key cacheKey, m Meta, made *[]*tensor.Storage, attach func() (*mmapalloc.Block, error)) (*tensor.Storage, error) {
	if s := storages.get(key, m.Size); s != nil {
		if b := s.Block(); b != nil {
			b.Drop()
			return s, nil
		}
	}
	b, err := attach()
	if err != nil {
		return nil, err
	}
	return keep(key, tensor.NewBlockStorage(b), made)
}

func openName(m Meta, made *[]*tensor.Storage) (*tensor.Storage, error) {
	if !mmapalloc.ValidName(m.Name) {
		return nil, fmt.Errorf("segment name %q: %w", m.Name, mmapalloc.ErrBadName)
	}
	key := nameKey(m.Name)
	if s := storages.get(key, m.Size); s != nil {
		return s, nil
	}
	a, err := mmapalloc.OpenName(m.Name, m.Size, mmapalloc.RefCount)
	if err != nil {
		return nil, err
	}
	return adopt(key, a, made)
}

// adopt wraps a new mapping in a Storage and caches it, unless another
// goroutine cached the same segment meanwhile: then that Storage wins and
// the new mapping is closed, so the process keeps one mapping.
func adopt(key cacheKey, a *mmapalloc.Allocation, made *[]*tensor.Storage) (*tensor.Storage, error) {
	return keep(key, tensor.NewSharedStorage(a), made)
}

// keep caches s, a storage just made for what key names, and returns it,
// unless another goroutine cached a storage for the same memory
// meanwhile: then that one wins and s is released, which also gives back
// whatever reference s held for the message. New storages are appended to
// *made, so that a failed decode can release them.
func keep(key cacheKey, s *tensor.Storage, made *[]*tensor.Storage) (*tensor.Storage, error) {
	if won := storages.put(key, s); won != s {
		return won, s.Release()
	}
	if made != nil {
		*made = append(*made, s)
	}
	return s, nil
}

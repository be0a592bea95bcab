package reduction

import (
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// Version is the version of Meta this package writes and reads.
const Version = 7

// ErrDeviceTensor is returned for a tensor whose memory is neither on the
// CPU nor on an NVIDIA GPU through package cuda.
var ErrDeviceTensor = errors.New("reduction: tensors on this device cannot be shared: only CPU and NVIDIA GPU memory can")

// Meta describes a shared tensor to the process that rebuilds it. It
// travels as a msgpack array, Version first.
type Meta struct {
	//lint:ignore U1000 the tag tells msgpack to use the array form
	_msgpack struct{} `msgpack:",as_array"`

	Version     uint8
	Strategy    string // "file_descriptor", "file_system", or "" for an empty tensor
	FDIndex     int    // index in the message of the segment's descriptor (a pooled block's ticket); else -1
	Dev, Ino    uint64 // file_descriptor: the segment's identity (see Rebuild)
	Name        string // file_system: the segment's name in the shared-memory directory
	Size        int64  // the storage's bytes
	SegmentSize int64  // pooled block: the segment's size
	BlockOffset int64  // pooled block: its data's offset in the segment; else -1
	Gen         uint64 // pooled block: its generation
	Offset      int64  // byte offset of the first element in the storage
	DType       tensor.DType
	Shape       []int
	Strides     []int // in elements
	LoD         [][]int
	Place       string

	// cuda_ipc: the device allocation's IPC handle and event handle (64
	// bytes each) and where the storage starts in the allocation.
	// FDIndex, SegmentSize, BlockOffset and Gen then name the token block
	// whose reference count keeps the producer's memory alive.
	IPC       []byte
	IPCEvent  []byte
	DevOffset int64

	// cuda_fd: index in the message of the device slab's descriptor.
	// FDIndex, Dev, Ino, SegmentSize, BlockOffset and Gen name the block
	// as for a pooled CPU block; the slab's segment holds its slot table.
	// Else -1.
	MemFDIndex int

	// A GPU tensor's device UUID (16 bytes), nil for a CPU one: Place
	// names the device by the sender's ordinal, and ordinals are per
	// process (CUDA_VISIBLE_DEVICES), so the receiver finds its own
	// ordinal of the device by this.
	DevUUID []byte
}

// StrategyCUDAIPC is Meta.Strategy for a GPU tensor shared by CUDA IPC,
// where the device cannot export its memory as descriptors.
const StrategyCUDAIPC = "cuda_ipc"

// StrategyCUDAFD is Meta.Strategy for a GPU tensor in a block of a device
// slab, whose descriptor travels with the message.
const StrategyCUDAFD = "cuda_fd"

// Reduce turns t into metadata and the descriptors that must travel with
// it, moving its storage into shared memory first if it is not there yet
// (under the process's strategy). A tensor already shared is not copied,
// and a view keeps its offset and strides. An empty tensor needs no
// segment and no descriptor.
//
// The returned descriptors are the caller's: send them, then close them.
// A pooled block's descriptor is a ticket (see package mmapalloc):
// while it is open, in flight or here, the block cannot be recycled, so
// closing it unsent is how metadata that will never be rebuilt is
// discarded.
func Reduce(t *tensor.Tensor) (Meta, []int, error) {
	var r reduced
	err := reduce(&r, t, nil, nil, nil)
	if err != nil || r.ticket < 0 {
		return r.Meta, nil, err
	}
	defer r.lease.Done()
	var fds []int
	for _, raw := range []int{r.ticket, r.memFD} {
		if raw < 0 {
			continue
		}
		own, err := fd.Dup(raw)
		if err != nil {
			fd.CloseAll(fds)
			return Meta{}, nil, fmt.Errorf("reduction: reduce %v: %w", t, err)
		}
		fds = append(fds, own)
	}
	r.FDIndex = 0
	if r.memFD >= 0 {
		r.MemFDIndex = 1
	}
	return r.Meta, fds, nil
}

// reduced is what reduce makes of a tensor: its Meta, whose descriptor
// indexes are the caller's to fill, and the descriptors the message must
// carry, each -1 if none: the ticket (a pooled block's, or a segment's
// lent descriptor) and a device slab's descriptor. lease keeps them open,
// and the block held, until the message is sent; it is nil where the
// message's pinned ticket covers the block or nothing is carried. lent
// is the block the message names by identity alone, lent to it (see
// carry.Lane), or nil.
type reduced struct {
	Meta
	ticket, memFD int
	lease         shm.Lease
	lent          *shm.Block
}

// reduce is Reduce returning the descriptors themselves (see reduced).
// The Meta's shape and strides are appended to room (see viewMeta).
// pinned is a ticket the message holds already, or nil: a block it
// covers is sent with it, and reduce returns no lease of its own. lane
// is the lane the message may take, or nil: a block of this process's
// pool whose segment the lane's reader maps is named by identity alone.
// r must be zero, as a new variable is: reduce fills it in place, with
// no copy nor second zeroing of its few hundred bytes on the path of
// every encode, and zeroes it again on an error.
func reduce(r *reduced, t *tensor.Tensor, room []int, pinned *shm.Ticket, lane carry.Lane) error {
	r.ticket, r.memFD = -1, -1
	var err error
	if t.Place().IsGPU() {
		err = reduceGPU(r, t, room, pinned, lane)
	} else {
		err = reduceCPU(r, t, room, pinned, lane)
	}
	if err != nil {
		*r = reduced{}
		return fmt.Errorf("reduction: reduce %v: %w", t, err)
	}
	return nil
}

// reduceCPU is reduce for a tensor in CPU memory, whose message carries
// one descriptor at most.
func reduceCPU(r *reduced, t *tensor.Tensor, room []int, pinned *shm.Ticket, lane carry.Lane) error {
	if !t.Place().IsCPU() {
		return ErrDeviceTensor
	}
	s := t.Storage()
	viewMeta(&r.Meta, t, room)
	if s.Released() {
		return tensor.ErrReleased
	}
	if t.Numel() == 0 {
		return nil
	}
	if err := s.ShareMemory(strategy.Get()); err != nil {
		return err
	}
	sh, ok := s.Backing().(shm.Shared)
	if !ok { // released since ShareMemory, which leaves shared memory of shm's
		return tensor.ErrReleased
	}
	// By identity alone: a block of this process's pool, lent to the
	// message, or one back to its producer, the lane's reader, which
	// holds it while the message waits (see shm.Revive; this process's
	// own hold lasts until the message is in the lane).
	if b, ok := sh.(*shm.Block); ok && lane != nil {
		lent := lane.Maps(b) && b.Lend() == nil
		if lent || lane.Returns(b) {
			seg := b.Segment()
			r.Strategy = string(strategy.FileDescriptor)
			r.Size, r.SegmentSize, r.BlockOffset, r.Gen = b.Size(), seg.Size(), b.Offset(), b.Gen()
			r.setSegmentID(seg.ID())
			if lent {
				registerBlock(s, b)
			}
			r.lent = b
			return nil
		}
	}
	h, err := sh.Share(pinned)
	if err != nil {
		return err
	}
	r.Size, r.SegmentSize, r.BlockOffset, r.Gen = h.Size, h.Segment, h.Offset, h.Gen
	if h.Name != "" {
		r.Strategy, r.Name = string(strategy.FileSystem), h.Name
	} else {
		r.Strategy = string(strategy.FileDescriptor)
		r.setSegmentID(h.ID)
	}
	remember(s, h)
	r.ticket, r.lease = h.FD, h.Lease
	return nil
}

// viewMeta fills m, a zero Meta, with t's view of its storage, naming
// no segment yet. An empty tensor's view is normalised: no offset, zero
// strides. Its shape and strides are appended to room[:0], which a caller
// that encodes the Meta at once reuses for the next one; a nil room
// makes them new.
func viewMeta(m *Meta, t *tensor.Tensor, room []int) {
	m.Version, m.FDIndex, m.MemFDIndex, m.BlockOffset = Version, -1, -1, -1
	m.Offset, m.DType, m.LoD, m.Place = t.Offset(), t.DType(), t.LoD(), t.Place().String()
	d, n := t.AppendDims(room[:0]), t.Dim()
	m.Shape, m.Strides = d[:n:n], d[n:]
	if t.Numel() == 0 {
		m.Offset = 0
		m.Strides = make([]int, len(m.Shape))
	}
}

// Rebuild makes a tensor from metadata and the descriptors that came with
// it. It checks the metadata against the segment before mapping anything,
// and a segment this process maps already (received before, or its own)
// yields a tensor on the same Storage.
//
// A file_descriptor segment is named twice: by its descriptor, and by its
// identity (Dev, Ino) in m. A segment this process maps already, as a
// Storage or as received blocks, is found by its identity, without a look
// at the descriptor: while the mapping lives it keeps the file, so no
// other file can have the identity, and a message can name that way only
// memory this process maps already. Anything else is mapped from the
// descriptor, whose identity must then be the one m names.
//
// The descriptors stay the caller's: Rebuild duplicates the one it keeps.
// An error for metadata or descriptors that are not what they should be
// wraps ErrMalformed.
func Rebuild(m Meta, fds []int) (*tensor.Tensor, error) {
	t, err := rebuild(&m, borrowed(fds), nil)
	return t, malformed(err)
}

// fdSource gives rebuild access to a message's descriptors.
type fdSource interface {
	// fd returns descriptor i for inspection, marking it referenced.
	fd(i int) (int, error)
	// take hands descriptor i to the rebuilt storage, which owns it.
	take(i int) (*fd.FD, error)
	// stat returns the identity and size of the file behind descriptor
	// i, marking it referenced: one fstat per descriptor per message.
	stat(i int) (shm.SegmentRef, error)
	// covers reports whether descriptor i, a pooled block's ticket of
	// segment id, covers the block (see shm.BlockRef) until the message
	// is decoded (see shm.AdoptTicket).
	covers(i int, id shm.ID) bool
	// body returns the storage body i was received into, which must hold
	// size bytes, for a message that carries its tensors by value.
	body(i int, size int64) (*tensor.Storage, error)
	// lane returns the lane of the pipe direction the message came on,
	// or nil, and whether it came by the lane itself (see carry.Lane).
	lane() (carry.Lane, bool)
	// attached returns the block ref names if the decode attached it
	// already, with others of its message, and hands it over; else nil.
	attached(ref shm.BlockRef) *shm.Block
	// lockAhead prepares the attaching of ref, a block a lane's message
	// names by identity, with that of the blocks the messages behind it
	// in the lane name (see fdReader.lockAhead).
	lockAhead(ref shm.BlockRef)
	// found returns the registered user of the block of the tensor being
	// opened, as the decode found it already, and true; else false (see
	// fdReader.found).
	found() (*tensor.StorageRef, bool)
}

type borrowed []int

func (b borrowed) covers(int, shm.ID) bool           { return false }
func (b borrowed) lane() (carry.Lane, bool)          { return nil, false }
func (b borrowed) attached(shm.BlockRef) *shm.Block  { return nil }
func (b borrowed) lockAhead(shm.BlockRef)            {}
func (b borrowed) found() (*tensor.StorageRef, bool) { return nil, false }

func (b borrowed) fd(i int) (int, error) {
	if i < 0 || i >= len(b) {
		return -1, fmt.Errorf("descriptor index %d out of range: the message has %d", i, len(b))
	}
	return b[i], nil
}

func (b borrowed) stat(i int) (shm.SegmentRef, error) {
	fd, err := b.fd(i)
	if err != nil {
		return shm.SegmentRef{}, err
	}
	return shm.Stat(fd)
}

func (b borrowed) take(i int) (*fd.FD, error) {
	raw, err := b.fd(i)
	if err != nil {
		return nil, err
	}
	own, err := fd.Dup(raw)
	if err != nil {
		return nil, err
	}
	return fd.New(own), nil
}

// rebuild builds a tensor from m. Storages it maps afresh are appended to
// *made (when made is non-nil), so that a failed decode can release them.
func rebuild(m *Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Tensor, error) {
	t, err := rebuildTensor(m, fds, made)
	if err != nil {
		return nil, fmt.Errorf("reduction: rebuild %s tensor %v: %w", m.DType, m.Shape, err)
	}
	return t, nil
}

func rebuildTensor(m *Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Tensor, error) {
	p, err := checkMeta(m)
	if err != nil {
		return nil, err
	}
	s, err := open(m, p, fds, made)
	if err != nil {
		return nil, err
	}
	// A storage found rather than made (this process's own, for a block
	// it holds) may be on another place than the metadata says.
	if s.Place() != p {
		return nil, fmt.Errorf("a storage on %s named for a tensor on %s", s.Place(), p)
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

// checkMeta checks what m says of itself, before anything is opened:
// its version, its place (this process's ordinal of its GPU, which
// checkMeta returns) against its strategy, its view of the storage, and
// that it carries only the fields of its strategy.
func checkMeta(m *Meta) (device.Place, error) {
	if m.Version != Version {
		return device.Place{}, fmt.Errorf("metadata version %d, want %d", m.Version, Version)
	}
	p, err := device.Parse(m.Place)
	if err != nil {
		return p, err
	}
	if !p.IsCPU() && !p.IsGPU() {
		return p, fmt.Errorf("place %s: %w", p, ErrDeviceTensor)
	}
	gpu := m.Strategy == StrategyCUDAIPC || m.Strategy == StrategyCUDAFD
	if p.IsGPU() != gpu && m.Strategy != "" {
		return p, fmt.Errorf("strategy %q for a tensor on %s", m.Strategy, p)
	}
	if p.IsGPU() {
		if p, err = localGPU(m.DevUUID); err != nil {
			return p, err
		}
	} else if m.DevUUID != nil {
		return p, errors.New("metadata of a CPU tensor names a device UUID")
	}
	if m.MemFDIndex != -1 && m.Strategy != StrategyCUDAFD {
		return p, fmt.Errorf("metadata of strategy %q carries a device slab's descriptor", m.Strategy)
	}
	if m.Size < 0 {
		return p, fmt.Errorf("negative segment size %d", m.Size)
	}
	if err := tensor.CheckView(m.DType, m.Offset, m.Shape, m.Strides, m.Size); err != nil {
		return p, err
	}
	if (m.Dev != 0 || m.Ino != 0) && m.Strategy != string(strategy.FileDescriptor) && m.Strategy != StrategyCUDAFD {
		return p, fmt.Errorf("metadata of strategy %q carries a file_descriptor segment's identity", m.Strategy)
	}
	return p, nil
}

// open finds or maps the storage that m, checked by checkMeta, names on
// p, with the message's descriptors fds, by the opener of m's strategy;
// a storage it maps afresh is appended to *made (see rebuild). The
// switch is the table of openers: calls through it, unlike through a
// map of functions, keep m on the caller's stack.
func open(m *Meta, p device.Place, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	switch m.Strategy {
	case "":
		return openEmpty(m, p)
	case string(strategy.FileDescriptor):
		return openFDStrategy(m, fds, made)
	case string(strategy.FileSystem):
		return openFSStrategy(m, fds, made)
	case StrategyBody:
		return openBody(m, fds)
	case StrategyCUDAIPC:
		return openGPU(m, p, fds, made)
	case StrategyCUDAFD:
		return openSlabBlock(m, p, fds, made)
	}
	return nil, fmt.Errorf("unknown strategy %q", m.Strategy)
}

// openEmpty is the opener of an empty tensor, which carries no memory.
func openEmpty(m *Meta, p device.Place) (*tensor.Storage, error) {
	if m.Size != 0 || m.FDIndex != -1 || m.Name != "" || m.BlockOffset != -1 || m.IPC != nil {
		return nil, errors.New("an empty tensor carries no segment")
	}
	if len(m.Shape) == 0 || productNonZero(m.Shape) {
		return nil, fmt.Errorf("no segment for a tensor of shape %v that has elements", m.Shape)
	}
	if p.IsGPU() {
		z, err := tensor.On(p).Zeros(m.DType, 0)
		if err != nil {
			return nil, err
		}
		return z.Storage(), nil
	}
	return tensor.AllocSharedStorage(0)
}

// openBody is the opener of a tensor whose bytes the message carries.
func openBody(m *Meta, fds fdSource) (*tensor.Storage, error) {
	if m.Name != "" || m.BlockOffset != -1 || m.IPC != nil || m.IPCEvent != nil {
		return nil, errors.New("body metadata names a segment")
	}
	return fds.body(m.FDIndex, m.Size)
}

// openFDStrategy is the opener of file_descriptor: a pooled block, or a
// whole segment, named by the message's descriptor and its identity.
func openFDStrategy(m *Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	switch {
	case m.Name != "":
		return nil, errors.New("file_descriptor metadata carries a name")
	case m.Ino == 0:
		return nil, errors.New("file_descriptor metadata names no segment")
	case m.BlockOffset >= 0:
		return openBlock(m, fds, made)
	}
	return openFD(m, fds, made)
}

// openFSStrategy is the opener of file_system: a pooled block of a named
// segment, held by the message's ticket, or a whole segment by its name.
func openFSStrategy(m *Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	switch {
	case m.BlockOffset >= 0:
		return openNamedBlock(m, fds, made)
	case m.FDIndex != -1:
		return nil, errors.New("file_system metadata refers to a descriptor")
	}
	return openName(m, made)
}

func productNonZero(shape []int) bool {
	for _, n := range shape {
		if n == 0 {
			return false
		}
	}
	return true
}

// openFD maps the segment m describes, or finds the storage this process
// has for it already.
func openFD(m *Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	if _, err := fds.fd(m.FDIndex); err != nil { // referenced even when the storage is cached
		return nil, err
	}
	key := idKey(m.segmentID())
	if s := storages.get(key, m.Size); s != nil {
		return s, nil
	}
	st, err := checkedStat(m, fds)
	if err != nil {
		return nil, err
	}
	if st.Size < m.Size {
		return nil, fmt.Errorf("segment holds %d bytes, fewer than the %d claimed", st.Size, m.Size)
	}
	own, err := fds.take(m.FDIndex)
	if err != nil {
		return nil, err
	}
	a, err := shm.OpenFD(own, m.Size, shm.KeepFD)
	if err != nil {
		return nil, err
	}
	return adopt(key, a, made)
}

// openBlock attaches the pooled block m describes, or finds the storage
// this process has for it already. The message's descriptor is the
// block's ticket: it holds the block until this process holds it too, and
// the decoder closes it afterwards. A block of a segment this process maps
// already is attached by the segment's identity, with the ticket taken
// for what m says it is (see shm.Attach); only a segment not mapped yet
// costs an fstat.
//
// A message that came by a lane names blocks by identity alone, with no
// descriptor. A block of a segment this process keeps mapped for the lane
// (a pin, see carry.Lane) is held by this process's lock on the slot,
// taken before the generation is checked, and by nothing else: the
// sender's loan keeps the slot until the lane's reader acks, but any
// holder of the lane can write the ack, so the reader never relies on
// it. A block this process made, which the message returns, is taken back
// from its pool (shm.Revive) with no lock, pinned or not: the reader's
// scanner kept it while the message waited. A block received by
// descriptor on a pipe that has a lane has its segment pinned for the
// lane's next messages.
func openBlock(m *Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	lane, byLane := fds.lane()
	if m.FDIndex == -1 {
		if !byLane {
			return nil, errors.New("a pooled block named without its descriptor, outside a lane")
		}
		pinned := lane != nil && lane.Pinned(m.segmentID())
		if !pinned || shm.Returnable(m.segmentID()) {
			// Only the lane's reader's pins are the lane's, and its
			// own blocks, returned (pinned or not, whatever the entry
			// says: see shm.Returnable): another holder of the segment
			// is not held for by the writer.
			s, err := openReturned(m, made)
			if errors.Is(err, shm.ErrNotReturnable) && !pinned {
				return nil, fmt.Errorf("a block of segment %v, which the lane's reader does not pin: %w", m.segmentID(), shm.ErrNotMapped)
			}
			return s, err
		}
		user, ok := fds.found()
		if !ok {
			user = userOf(shm.SegmentRef{ID: m.segmentID()}, m)
		}
		return adoptBlock(user, m, made, func() (*shm.Block, error) {
			ref := laneRef(m)
			if b := fds.attached(ref); b != nil {
				return b, nil
			}
			fds.lockAhead(ref)
			return shm.Attach(ref)
		})
	}
	if _, err := fds.fd(m.FDIndex); err != nil { // referenced even when the storage is cached
		return nil, err
	}
	s, err := adoptBlock(userOf(shm.SegmentRef{ID: m.segmentID()}, m), m, made, func() (*shm.Block, error) {
		return attachBlock(m, fds)
	})
	if err == nil && lane != nil {
		lane.Pin(m.segmentID())
	}
	return s, err
}

// openReturned is openBlock for a block that a lane's message names by
// identity in a segment this process produced: a return of one of its own
// blocks, which is found in use (found) or taken back from its pool,
// where the lane's scanner kept it while the message waited (see
// shm.Revive). A block of any other segment is shm.ErrNotReturnable.
func openReturned(m *Meta, made *[]*tensor.Storage) (*tensor.Storage, error) {
	ref := m.returnRef()
	var deadline time.Time
	revive := func() (*shm.Block, error) { return shm.Revive(ref, m.Size) }
	for {
		// Looked up at each try: another decode of a message that
		// returns the same block may have taken it back meanwhile.
		s, err := adoptBlock(userOf(shm.SegmentRef{ID: ref.ID}, m), m, made, revive)
		if errors.Is(err, shm.ErrInUse) {
			// A storage of this process that releases the block on
			// another goroutine lets go of it last: its Release is
			// under way, and the block is the message's once it is
			// done; or another decode took it back, and registers its
			// storage next. Not for long: an honest message names no
			// block in use otherwise.
			if deadline.IsZero() {
				deadline = time.Now().Add(reviveWait)
			}
			if time.Now().Before(deadline) {
				runtime.Gosched()
				continue
			}
		}
		return s, err
	}
}

// reviveWait is how long a decode waits for a storage of this process to
// let go of a block a message returns (see openReturned): long enough for
// a releasing goroutine that waits for a CPU on a loaded machine, which
// may be more than a few milliseconds. Only a message that names a block
// in use here dishonestly waits it out.
const reviveWait = 250 * time.Millisecond

// attachBlock attaches the pooled block m names, by the segment's
// identity if this process maps it already, else from the message's
// ticket.
func attachBlock(m *Meta, fds fdSource) (*shm.Block, error) {
	return attachIn(shm.SegmentRef{ID: m.segmentID(), Size: m.SegmentSize}, m, fds)
}

// attachIn attaches the block m names in seg, held by the message's
// ticket, which covers it as fds says.
func attachIn(seg shm.SegmentRef, m *Meta, fds fdSource) (*shm.Block, error) {
	ticket, err := fds.fd(m.FDIndex)
	if err != nil {
		return nil, err
	}
	i := m.FDIndex // not m, which the closure would move to the heap
	return shm.Attach(shm.BlockRef{Seg: seg, Offset: m.BlockOffset, Size: m.Size, Gen: m.Gen, Ticket: ticket,
		Covers: func(id shm.ID) bool { return fds.covers(i, id) }})
}

// laneRef names the block m, of a lane's message, names by identity.
func laneRef(m *Meta) shm.BlockRef {
	return shm.BlockRef{Seg: shm.SegmentRef{ID: m.segmentID(), Size: m.SegmentSize},
		Offset: m.BlockOffset, Size: m.Size, Gen: m.Gen, Ticket: -1}
}

// segmentID is the identity of the file_descriptor segment m names.
func (m *Meta) segmentID() shm.ID { return shm.ID{Dev: m.Dev, Ino: m.Ino} }

func (m *Meta) setSegmentID(id shm.ID) { m.Dev, m.Ino = id.Dev, id.Ino }

// returnRef names the pooled block m names, as a message that returns it
// to its producer does.
func (m *Meta) returnRef() shm.ReturnRef {
	return shm.ReturnRef{ID: m.segmentID(), Offset: m.BlockOffset, Gen: m.Gen}
}

// checkedStat returns the status of the message's descriptor for m,
// which must be of the segment m names.
func checkedStat(m *Meta, fds fdSource) (shm.SegmentRef, error) {
	st, err := fds.stat(m.FDIndex)
	if err != nil {
		return st, err
	}
	if st.ID != m.segmentID() {
		return st, fmt.Errorf("descriptor %d is of segment %v, not of %v that the metadata names", m.FDIndex, st.ID, m.segmentID())
	}
	return st, nil
}

// openNamedBlock is openBlock for a block of a named segment of this
// process's session.
func openNamedBlock(m *Meta, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	if err := checkName(m.Name); err != nil {
		return nil, err
	}
	if _, err := fds.fd(m.FDIndex); err != nil { // referenced even when the storage is cached
		return nil, err
	}
	return adoptBlock(userOf(shm.SegmentRef{Name: m.Name}, m), m, made, func() (*shm.Block, error) {
		return attachIn(shm.SegmentRef{Name: m.Name, Size: m.SegmentSize}, m, fds)
	})
}

// checkName refuses a segment name tensormp did not make, or one of
// another session: a message cannot make this process map, and hold,
// what its own session does not own.
func checkName(name string) error {
	n, ok := shm.ParseName(name)
	if !ok || n.Lock {
		return fmt.Errorf("segment name %q: %w", name, shm.ErrBadName)
	}
	if n.Session != shm.Session() {
		return fmt.Errorf("segment %s belongs to another session than %s", name, shm.Session())
	}
	return nil
}

// adoptBlock returns the storage this process has for the block whose
// registered user (see shm.Users) is found, or attaches the
// block, which then holds it for a new storage.
func adoptBlock(found *tensor.StorageRef, m *Meta, made *[]*tensor.Storage, attach func() (*shm.Block, error)) (*tensor.Storage, error) {
	if s := liveUser(found, m.Size); s != nil {
		return s, nil
	}
	b, err := attach()
	if err != nil {
		return nil, err
	}
	if b.InExtent() {
		_ = b.Release()
		return nil, fmt.Errorf("a block of a device slab named for a CPU tensor: %w", shm.ErrNoExtent)
	}
	s, err := tensor.NewStorage(device.CPU(), b)
	if err != nil {
		return nil, errors.Join(err, b.Release())
	}
	return kept(s, registerBlock(s, b), made)
}

func openName(m *Meta, made *[]*tensor.Storage) (*tensor.Storage, error) {
	if err := checkName(m.Name); err != nil {
		return nil, err
	}
	key := nameKey(m.Name)
	if s := storages.get(key, m.Size); s != nil {
		return s, nil
	}
	a, err := shm.OpenName(m.Name, m.Size, shm.RefCount)
	if err != nil {
		return nil, err
	}
	return adopt(key, a, made)
}

// adopt wraps a new mapping in a Storage and caches it, unless another
// goroutine cached the same segment meanwhile: then that Storage wins and
// the new mapping is closed, so the process keeps one mapping.
func adopt(key cacheKey, a *shm.Allocation, made *[]*tensor.Storage) (*tensor.Storage, error) {
	s, err := tensor.NewStorage(device.CPU(), a)
	if err != nil {
		return nil, errors.Join(err, a.Release())
	}
	return keep(key, s, made)
}

// keep caches s, a storage just made for what key names, and returns the
// storage the process keeps for that memory (see kept).
func keep(key cacheKey, s *tensor.Storage, made *[]*tensor.Storage) (*tensor.Storage, error) {
	return kept(s, storages.put(key, s), made)
}

// kept returns won, the storage registered for the memory of s, a storage
// just made. If another goroutine registered won meanwhile, s is released,
// which also gives back whatever reference s held for the message; else s
// is appended to *made, so that a failed decode can release it.
func kept(s, won *tensor.Storage, made *[]*tensor.Storage) (*tensor.Storage, error) {
	if won != s {
		return won, s.Release()
	}
	if made != nil {
		*made = append(*made, s)
	}
	return s, nil
}

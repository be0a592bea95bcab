package reduction

import (
	"errors"
	"fmt"

	// GPU tensors travel through package cuda: it registers the GPU
	// backend and the Sharer that reduceGPU and the openers use.
	_ "github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// tokenSize is the data size of the token block that keeps a GPU
// producer's memory alive.
const tokenSize = 8

// reduceGPU describes a GPU tensor: a block of a device slab by its
// ticket and the slab's descriptor (cuda_fd), or by the slab's identity
// alone where the lane maps it (see reduceCPU), else by CUDA IPC
// (cuda_ipc), whose export takes a ticket on the allocation's token for
// the message, as reduce does.
func reduceGPU(r *reduced, t *tensor.Tensor, room []int, pinned *shm.Ticket, lane carry.Lane) error {
	s := t.Storage()
	if s.Released() {
		return tensor.ErrReleased
	}
	buf, ok := s.Backing().(tensor.Buffer)
	if !ok {
		return tensor.ErrReleased
	}
	gs, err := gpushare.Get()
	if err != nil {
		return err
	}
	viewMeta(&r.Meta, t, room)
	uuid, err := gs.UUID(t.Place().Index())
	if err != nil {
		return err
	}
	r.DevUUID = uuid[:]
	if t.Numel() == 0 {
		return nil
	}
	sh, inSlab, err := gs.Share(buf)
	if errors.Is(err, gpushare.ErrForeign) {
		err = ErrDeviceTensor
	}
	if err != nil {
		return err
	}
	if inSlab && lane != nil && lane.Maps(sh.Block) && sh.Block.Lend() == nil {
		// By identity alone, lent to the message: the lane's reader pins
		// the slab's segment, and imported its allocation with the first
		// block of it it received. The work on the device is done
		// (Share waited for it).
		b, seg := sh.Block, sh.Block.Segment()
		r.Strategy = StrategyCUDAFD
		r.Size, r.SegmentSize, r.BlockOffset, r.Gen = s.Size(), seg.Size(), b.Offset(), b.Gen()
		r.setSegmentID(seg.ID())
		registerBlock(s, b)
		r.lent = b
		return nil
	}
	if inSlab {
		h, err := sh.Block.Share(pinned)
		if err != nil {
			return err
		}
		r.Strategy = StrategyCUDAFD
		r.Size, r.SegmentSize, r.BlockOffset, r.Gen = s.Size(), h.Segment, h.Offset, h.Gen
		r.setSegmentID(h.ID)
		remember(s, h)
		r.ticket, r.memFD, r.lease = h.FD, sh.MemFD, h.Lease
		return nil
	}
	h, err := gs.Export(buf)
	if err != nil {
		return err
	}
	seg := h.Token.Segment()
	r.Strategy = StrategyCUDAIPC
	r.Size, r.DevOffset = h.Size, h.Offset
	r.IPC, r.IPCEvent = h.Mem[:], h.Event[:]
	r.SegmentSize, r.BlockOffset, r.Gen = seg.Size(), h.Token.Offset(), h.Token.Gen()
	storages.put(gpuKey(h.Mem, h.Offset), s)
	r.ticket, r.lease = h.Ticket.FD(), h.Ticket
	return nil
}

// localGPU returns this process's place of the device a GPU tensor's
// metadata names by UUID.
func localGPU(uuid []byte) (device.Place, error) {
	var u [16]byte
	if len(uuid) != len(u) {
		return device.Place{}, fmt.Errorf("metadata of a GPU tensor with a device UUID of %d bytes, want %d", len(uuid), len(u))
	}
	copy(u[:], uuid)
	gs, err := gpushare.Get()
	if err != nil {
		return device.Place{}, err
	}
	dev, err := gs.Ordinal(u)
	if err != nil {
		return device.Place{}, err
	}
	return device.GPU(dev), nil
}

func gpuKey(h [64]byte, off int64) cacheKey {
	return cacheKey{name: "gpu:" + string(h[:]), off: off}
}

// openGPU returns the storage of a GPU tensor described by m: this
// process's own when it has one for that memory (the producer's own, or
// one received before), else the producer's allocation opened by IPC.
func openGPU(m *Meta, p device.Place, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	var h gpushare.Handle
	if len(m.IPC) != len(h.Mem) || len(m.IPCEvent) != len(h.Event) {
		return nil, fmt.Errorf("cuda_ipc metadata with %d- and %d-byte handles, want %d", len(m.IPC), len(m.IPCEvent), len(h.Mem))
	}
	if m.BlockOffset < 0 || m.Size <= 0 || m.DevOffset < 0 {
		return nil, errors.New("cuda_ipc metadata without a token block or size")
	}
	copy(h.Mem[:], m.IPC)
	copy(h.Event[:], m.IPCEvent)
	h.Device, h.Offset, h.Size = p.Index(), m.DevOffset, m.Size
	fd, err := fds.fd(m.FDIndex)
	if err != nil {
		return nil, err
	}
	// This process's own hold on the token keeps the producer's memory
	// alive; it is given back at once if this process holds the memory
	// already.
	st, err := fds.stat(m.FDIndex)
	if err != nil {
		return nil, err
	}
	token, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: st.ID, Size: m.SegmentSize}, Offset: m.BlockOffset, Size: tokenSize, Gen: m.Gen, Ticket: fd})
	if err != nil {
		return nil, err
	}
	key := gpuKey(h.Mem, h.Offset)
	if s := storages.get(key, m.Size); s != nil {
		return s, token.Release()
	}
	gs, err := gpushare.Get()
	if err != nil {
		_ = token.Release()
		return nil, err
	}
	h.Token = token
	buf, err := gs.Import(h)
	if err != nil {
		_ = token.Release()
		return nil, err
	}
	s, err := tensor.NewStorage(p, buf)
	if err != nil {
		return nil, errors.Join(err, buf.Release())
	}
	return keep(key, s, made)
}

// openSlabBlock returns the storage of a GPU tensor in a block of a device
// slab: this process's own when it has one for that block (the producer's
// own, or one received before), else the block attached from the
// message's ticket, in the slab imported from the message's descriptor
// unless this process maps it already. A message that came by a lane may
// name the block by the slab's identity alone, with neither descriptor:
// the block is then held as openBlock holds a CPU block named so, in a
// slab whose segment the lane's reader pins, which it imported with the
// first block of it it received by descriptor on the lane's pipe (and
// pinned then).
func openSlabBlock(m *Meta, p device.Place, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	switch {
	case m.Ino == 0 || m.BlockOffset < 0 || m.Size <= 0:
		return nil, errors.New("cuda_fd metadata names no slab block")
	case m.Name != "" || m.IPC != nil || m.IPCEvent != nil || m.DevOffset != 0:
		return nil, errors.New("cuda_fd metadata carries a name or IPC handles")
	}
	lane, byLane := fds.lane()
	memFD := -1
	if m.FDIndex == -1 {
		switch {
		case m.MemFDIndex != -1:
			return nil, errors.New("cuda_fd metadata names its block without its descriptor, but the slab's")
		case !byLane:
			return nil, errors.New("a slab block named without its descriptor, outside a lane")
		case lane == nil || !lane.Pinned(m.segmentID()):
			return nil, fmt.Errorf("a block of slab %v, which the lane's reader does not pin: %w", m.segmentID(), shm.ErrNotMapped)
		}
	} else {
		// Both referenced, even when the storage is found without them.
		if _, err := fds.fd(m.FDIndex); err != nil {
			return nil, err
		}
		var err error
		if memFD, err = fds.fd(m.MemFDIndex); err != nil {
			return nil, fmt.Errorf("the slab's descriptor: %w", err)
		}
	}
	gs, err := gpushare.Get()
	if err != nil {
		return nil, err
	}
	if s := liveUser(userOf(shm.SegmentRef{ID: m.segmentID()}, m), m.Size); s != nil {
		// On p, or refused by rebuildTensor; and the message's slab
		// descriptor must be the slab's, as for a block not held yet.
		if buf, ok := s.Backing().(tensor.Buffer); ok && memFD >= 0 {
			if err := gs.SameSlab(buf, memFD); err != nil && !errors.Is(err, gpushare.ErrForeign) {
				return nil, err
			}
		}
		return s, nil
	}
	var b *shm.Block
	if m.FDIndex == -1 {
		ref := laneRef(m)
		if b = fds.attached(ref); b == nil {
			fds.lockAhead(ref)
			b, err = shm.Attach(ref)
		}
	} else {
		b, err = attachBlock(m, fds)
	}
	if err != nil {
		return nil, err
	}
	buf, err := gs.ImportBlock(p.Index(), b, m.Size, memFD)
	if err != nil {
		_ = b.Release()
		return nil, err
	}
	s, err := tensor.NewStorage(p, buf)
	if err != nil {
		return nil, errors.Join(err, buf.Release())
	}
	s, err = kept(s, registerBlock(s, b), made)
	if err == nil && lane != nil && m.FDIndex != -1 {
		lane.Pin(m.segmentID())
	}
	return s, err
}

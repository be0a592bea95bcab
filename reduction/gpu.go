package reduction

import (
	"errors"
	"fmt"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/tensor"
)

// tokenSize is the data size of the token block that keeps a GPU
// producer's memory alive.
const tokenSize = 8

// reduceGPU describes a GPU tensor by CUDA IPC. The export takes a
// ticket on the allocation's token for the message.
func reduceGPU(t *tensor.Tensor) (Meta, int, lease, error) {
	s := t.Storage()
	if s.Released() {
		return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: %w", t, tensor.ErrReleased)
	}
	buf, ok := s.Buffer().(*cuda.Buffer)
	if !ok {
		return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: its memory is not a CUDA allocation: %w", t, ErrDeviceTensor)
	}
	m := Meta{
		Version: Version, FD: -1, Block: -1,
		Offset: t.Offset(), DType: t.DType(), Shape: t.Shape(), Strides: t.Strides(), LoD: t.LoD(),
		Place: t.Place().String(),
	}
	if t.Numel() == 0 {
		m.Offset, m.Strides = 0, make([]int, len(m.Shape))
		return m, -1, nil, nil
	}
	h, err := buf.Export()
	if err != nil {
		return Meta{}, -1, nil, fmt.Errorf("reduction: reduce %v: %w", t, err)
	}
	seg := h.Token.Segment()
	m.Strategy = StrategyCUDAIPC
	m.Size, m.DevOffset = h.Size, h.Offset
	m.IPC, m.IPCEvent = h.Mem[:], h.Event[:]
	m.Segment, m.Block, m.Gen = seg.Size(), h.Token.Offset(), h.Token.Gen()
	storages.put(gpuKey(h.Mem, h.Offset), s)
	return m, h.Ticket.FD(), h.Ticket, nil
}

func gpuKey(h cuda.IPCMemHandle, off int64) cacheKey {
	return cacheKey{name: "gpu:" + string(h[:]), off: off}
}

// openGPU returns the storage of a GPU tensor described by m: this
// process's own when it has one for that memory (the producer's own, or
// one received before), else the producer's allocation opened by IPC.
func openGPU(m Meta, p device.Place, fds fdSource, made *[]*tensor.Storage) (*tensor.Storage, error) {
	var h cuda.Handle
	if len(m.IPC) != len(h.Mem) || len(m.IPCEvent) != len(h.Event) {
		return nil, fmt.Errorf("cuda_ipc metadata with %d- and %d-byte handles, want %d", len(m.IPC), len(m.IPCEvent), len(h.Mem))
	}
	if m.Block < 0 || m.Size <= 0 || m.DevOffset < 0 {
		return nil, errors.New("cuda_ipc metadata without a token block or size")
	}
	copy(h.Mem[:], m.IPC)
	copy(h.Event[:], m.IPCEvent)
	h.Device, h.Offset, h.Size = p.Index(), m.DevOffset, m.Size
	fd, err := fds.fd(m.FD)
	if err != nil {
		return nil, err
	}
	// This process's own hold on the token keeps the producer's memory
	// alive; it is given back at once if this process holds the memory
	// already.
	st, err := fds.stat(m.FD)
	if err != nil {
		return nil, err
	}
	token, err := mmapalloc.AttachBlock(fd, st, false, m.Segment, m.Block, tokenSize, m.Gen)
	if err != nil {
		return nil, err
	}
	key := gpuKey(h.Mem, h.Offset)
	if s := storages.get(key, m.Size); s != nil {
		return s, token.Release()
	}
	rt, err := cuda.Default()
	if err != nil {
		_ = token.Release()
		return nil, err
	}
	h.Token = token
	buf, err := rt.Import(h)
	if err != nil {
		_ = token.Release()
		return nil, err
	}
	return keep(key, tensor.NewDeviceStorage(p, m.Size, buf), made)
}

package tensor

import (
	"fmt"

	"github.com/tensormp/tensormp/device"
)

// Copies between places: to and from device memory through its Buffer,
// and between host memories.

// Clone returns a contiguous copy of t in new storage on the same place.
func (t *Tensor) Clone() (*Tensor, error) {
	if !t.Place().IsCPU() {
		if out, ok, err := t.copyOnDevices(t.Place()); ok || err != nil {
			return out, err
		}
	}
	s, err := newHeapStorage(t.Nbytes())
	if err != nil {
		return nil, fmt.Errorf("tensor: cloning %v: %w", t, err)
	}
	c := t.contiguousOn(s)
	if err := t.readInto(c.storage.Bytes()); err != nil {
		return nil, err
	}
	if t.Place().IsCPU() {
		return c, nil
	}
	return c.To(t.Place())
}

// hostBytes returns the bytes of t's storage in host memory: the storage
// itself on the CPU, a copy read from the device otherwise.
func (t *Tensor) hostBytes() ([]byte, error) {
	dev := t.storage.buffer()
	if dev == nil {
		if t.storage.Released() {
			return nil, ErrReleased
		}
		return t.storage.Bytes(), nil
	}
	b, err := hostBytesFor(t.storage.nbytes)
	if err != nil {
		return nil, err
	}
	if err := dev.Read(b, 0); err != nil {
		return nil, fmt.Errorf("tensor: reading %d bytes from %s: %w", len(b), t.Place(), err)
	}
	return b, nil
}

// denseHost returns t's elements densely in host memory: a slice of the
// storage when t is a contiguous CPU tensor, else a copy.
func (t *Tensor) denseHost() ([]byte, error) {
	host, err := t.hostBytes()
	if err != nil {
		return nil, err
	}
	if t.IsContiguous() {
		return host[t.offset : t.offset+t.Nbytes()], nil
	}
	dense, err := hostBytesFor(t.Nbytes())
	if err != nil {
		return nil, fmt.Errorf("tensor: copying %v: %w", t, err)
	}
	if err := t.gather(host, dense); err != nil {
		return nil, err
	}
	return dense, nil
}

// readInto copies t's elements densely into dst, host memory of
// t.Nbytes() bytes, in one copy: a contiguous device tensor reads just its
// own bytes from the device.
func (t *Tensor) readInto(dst []byte) error {
	if dev := t.storage.buffer(); dev != nil && t.IsContiguous() {
		if err := dev.Read(dst, t.offset); err != nil {
			return fmt.Errorf("tensor: reading %d bytes from %s: %w", len(dst), t.Place(), err)
		}
		return nil
	}
	host, err := t.hostBytes()
	if err != nil {
		return err
	}
	return t.gather(host, dst)
}

// gather copies t's elements, read from its storage bytes src, densely
// into dst.
func (t *Tensor) gather(src, dst []byte) error {
	item := t.dtype.Size()
	if t.IsContiguous() {
		if err := copyBytes(dst, src[t.offset:t.offset+t.Nbytes()]); err != nil {
			return fmt.Errorf("tensor: reading %v: %w", t, err)
		}
		return nil
	}
	i := 0
	return touch(func() {
		t.forEach(func(elem int64) {
			at := t.offset + elem*int64(item)
			copy(dst[i:i+item], src[at:at+int64(item)])
			i += item
		})
	}, t.storage)
}

// To returns t on place p: t itself when it is there already, else a
// contiguous copy.
func (t *Tensor) To(p device.Place) (*Tensor, error) {
	if p == t.Place() {
		return t, nil
	}
	if out, ok, err := t.copyOnDevices(p); ok || err != nil {
		return out, err
	}
	if p.IsCPU() {
		s, err := newHeapStorage(t.Nbytes())
		if err != nil {
			return nil, fmt.Errorf("tensor: copying %v to %s: %w", t, p, err)
		}
		out := t.contiguousOn(s)
		return out, t.readInto(out.storage.Bytes())
	}
	dense, err := t.denseHost()
	if err != nil {
		return nil, err
	}
	s, err := newStorage(p, int64(len(dense)))
	if err != nil {
		return nil, err
	}
	if err := s.buffer().Write(dense, 0); err != nil {
		_ = s.Release()
		return nil, fmt.Errorf("tensor: copying %d bytes to %s: %w", len(dense), p, err)
	}
	return t.contiguousOn(s), nil
}

// copyOnDevices copies a contiguous device tensor to another device
// without going through host memory, when the destination's Buffer can
// (DeviceCopier). ok is false when it cannot, and the caller copies
// through the host.
func (t *Tensor) copyOnDevices(p device.Place) (out *Tensor, ok bool, err error) {
	src := t.storage.buffer()
	if p.IsCPU() || src == nil || !t.IsContiguous() {
		return nil, false, nil
	}
	s, err := newStorage(p, t.Nbytes())
	if err != nil {
		return nil, false, err
	}
	c, can := s.buffer().(DeviceCopier)
	if !can {
		_ = s.Release()
		return nil, false, nil
	}
	done, err := c.CopyFrom(src, t.offset, t.Nbytes())
	if err != nil || !done {
		_ = s.Release()
		if err != nil {
			return nil, false, fmt.Errorf("tensor: copying %d bytes from %s to %s: %w", t.Nbytes(), t.Place(), p, err)
		}
		return nil, false, nil
	}
	return t.contiguousOn(s), true, nil
}

// contiguousOn returns a contiguous tensor of t's dtype, shape and LoD on
// s, a new storage of t's size, for a copy of t to fill.
func (t *Tensor) contiguousOn(s *Storage) *Tensor {
	c := s.newTensor(Tensor{storage: s, dtype: t.dtype, lod: cloneLoD(t.lod)})
	c.shape, c.strides = contiguousDims(t.shape, c.dims[:])
	return c
}

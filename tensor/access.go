package tensor

import (
	"fmt"
	"slices"
)

// Data returns the elements of a contiguous CPU tensor as a []T that
// aliases the tensor's memory: no copy is made, and writes through the
// slice are seen by every process sharing the storage. T must match the
// tensor's dtype.
//
// The slice is valid while t's storage is reachable and not released: keep
// t alive (runtime.KeepAlive) for as long as the slice is used, since an
// unreachable storage's shared memory is unmapped by its cleanup.
//
// Under file_system, any process of the same user can truncate the named
// segment behind a shared tensor; touching the slice then raises SIGBUS,
// which ends the process. tensormp's own functions (At, Set, Fill, Copy,
// Clone, ...) turn that fault into an error wrapping mmapalloc.ErrFault;
// code that reads or writes the slice itself can do the same by running
// under mmapalloc.Guard. file_descriptor segments are sealed against it.
func Data[T Element](t *Tensor) ([]T, error) {
	b, err := elemBytes[T](t)
	if err != nil {
		return nil, err
	}
	if !t.IsContiguous() {
		return nil, fmt.Errorf("tensor: Data of a non-contiguous %v: use At/Set, or Contiguous first", t)
	}
	return asSlice[T](b[t.offset : t.offset+t.Nbytes()]), nil
}

// At returns the element at index idx (one index per dimension).
func At[T Element](t *Tensor, idx ...int) (T, error) {
	var zero T
	b, err := elemBytes[T](t)
	if err != nil {
		return zero, err
	}
	i, err := t.index(idx)
	if err != nil {
		return zero, err
	}
	var v T
	err = touch(func() { v = asSlice[T](b)[i] }, t.storage)
	return v, err
}

// Set stores v at index idx (one index per dimension).
func Set[T Element](t *Tensor, v T, idx ...int) error {
	b, err := elemBytes[T](t)
	if err != nil {
		return err
	}
	i, err := t.index(idx)
	if err != nil {
		return err
	}
	return touch(func() { asSlice[T](b)[i] = v }, t.storage)
}

// Fill sets every element of t, contiguous or not, to the value fn returns
// for its row-major position.
func Fill[T Element](t *Tensor, fn func(i int) T) error {
	b, err := elemBytes[T](t)
	if err != nil {
		return err
	}
	s := asSlice[T](b)
	base := t.offset / int64(t.dtype.Size())
	i := 0
	return touch(func() {
		t.forEach(func(elem int64) {
			s[base+elem] = fn(i)
			i++
		})
	}, t.storage)
}

// Values returns a copy of t's elements in row-major order, whatever its
// layout.
func Values[T Element](t *Tensor) ([]T, error) {
	b, err := elemBytes[T](t)
	if err != nil {
		return nil, err
	}
	if err := checkHostSize(t.Nbytes()); err != nil {
		return nil, fmt.Errorf("tensor: the values of %v: %w", t, err)
	}
	out := make([]T, 0, t.Numel())
	s := asSlice[T](b)
	base := t.offset / int64(t.dtype.Size())
	err = touch(func() {
		t.forEach(func(elem int64) { out = append(out, s[base+elem]) })
	}, t.storage)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// elemBytes checks that T matches t's dtype and that t's memory is on the
// host, and returns the storage's bytes.
func elemBytes[T Element](t *Tensor) ([]byte, error) {
	if want := DTypeOf[T](); want != t.dtype {
		return nil, fmt.Errorf("tensor: %v elements read as %v", t.dtype, want)
	}
	if !t.Place().IsCPU() {
		return nil, fmt.Errorf("tensor: %v is not in host memory: copy it with To(device.CPU())", t)
	}
	m := t.storage.mem.Load()
	if m.released {
		return nil, ErrReleased
	}
	return m.bytes, nil
}

// index returns the storage element index of idx.
func (t *Tensor) index(idx []int) (int64, error) {
	if len(idx) != len(t.shape) {
		return 0, fmt.Errorf("tensor: %d indices for %d dimensions", len(idx), len(t.shape))
	}
	pos := t.offset / int64(t.dtype.Size())
	for d, i := range idx {
		if i < 0 || i >= t.shape[d] {
			return 0, fmt.Errorf("tensor: index %d out of range for size %d of dimension %d", i, t.shape[d], d)
		}
		pos += int64(i) * int64(t.strides[d])
	}
	return pos, nil
}

// Copy copies src's elements into dst, element by element in row-major
// order, whatever the layouts of the two: the way to write into a view.
// The tensors must have the same dtype and shape; dst must be in host
// memory.
func Copy(dst, src *Tensor) error {
	if dst.dtype != src.dtype || !slices.Equal(dst.shape, src.shape) {
		return fmt.Errorf("tensor: cannot copy %v %v into %v %v", src.dtype, src.shape, dst.dtype, dst.shape)
	}
	if !dst.Place().IsCPU() {
		return fmt.Errorf("tensor: copy into %v: not in host memory", dst)
	}
	from, err := src.denseHost()
	if err != nil {
		return err
	}
	if src.storage == dst.storage {
		from = slices.Clone(from) // the two may overlap
	}
	m := dst.storage.mem.Load()
	if m.released {
		return ErrReleased
	}
	if dst.IsContiguous() {
		return copyBytes(m.bytes[dst.offset:dst.offset+dst.Nbytes()], from)
	}
	item := int64(dst.dtype.Size())
	var i int64
	return touch(func() {
		dst.forEach(func(elem int64) {
			at := dst.offset + elem*item
			copy(m.bytes[at:at+item], from[i:i+item])
			i += item
		})
	}, dst.storage, src.storage)
}

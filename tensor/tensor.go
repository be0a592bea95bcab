package tensor

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strings"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/strategy"
)

// MaxDims bounds the number of dimensions of a tensor.
const MaxDims = 64

// Tensor is a typed, strided view of a Storage: element (i0, i1, ...) lives
// at byte Offset() + (i0*stride0 + i1*stride1 + ...) * DType().Size().
// A Tensor's shape and strides never change; views are new Tensors on the
// same Storage. Tensors may be read from several goroutines; writes to the
// elements are the caller's to synchronise, as with any slice.
type Tensor struct {
	storage *Storage
	offset  int64 // bytes
	dtype   DType
	shape   []int
	strides []int // elements
	lod     [][]int
	// dims holds shape and strides for tensors of up to inlineDims
	// dimensions, made with the tensor instead of beside it: a tensor
	// sent or received is one allocation fewer.
	dims [2 * inlineDims]int
}

// inlineDims is the most dimensions whose shape and strides a Tensor
// holds in itself.
const inlineDims = 4

// Factory makes tensors on one place. In and On return one; the
// package-level constructors use the process default place.
type Factory struct {
	place  device.Place
	shared bool
}

// In returns a Factory for the current place of ctx: its device scope, or
// the process default.
func In(ctx context.Context) Factory { return Factory{place: device.Current(ctx)} }

// On returns a Factory for place p.
func On(p device.Place) Factory { return Factory{place: p} }

// Place returns where the Factory puts tensors.
func (f Factory) Place() device.Place { return f.place }

// Shared returns a Factory whose CPU tensors are born in shared memory,
// under the process's sharing strategy: what a producer that hands every
// tensor it makes to another process wants, since sending then copies
// nothing, not even once.
func (f Factory) Shared() Factory {
	f.shared = true
	return f
}

// Zeros returns a tensor of zeros.
func (f Factory) Zeros(dt DType, shape ...int) (*Tensor, error) { return f.create(dt, shape, true) }

// Empty returns a tensor whose elements are not set, as torch.empty does:
// for a caller that writes every element before it reads any, such as a
// producer filling a batch. In shared memory it skips clearing a recycled
// block, which still holds what its last user in this process wrote;
// heap and device memory come zeroed all the same.
func (f Factory) Empty(dt DType, shape ...int) (*Tensor, error) { return f.create(dt, shape, false) }

// create returns a contiguous tensor of dt and shape on f's place, whose
// shared memory is cleared with zero.
func (f Factory) create(dt DType, shape []int, zero bool) (*Tensor, error) {
	if err := checkNewShape(dt, shape); err != nil {
		return nil, err
	}
	n := Numel(shape...)
	nbytes := int64(n) * int64(dt.Size())
	var s *Storage
	var err error
	if f.shared && f.place.IsCPU() {
		s, err = newSharedStorage(nbytes, strategy.Get(), zero)
	} else {
		s, err = newStorage(f.place, nbytes)
	}
	if err != nil {
		return nil, err
	}
	t := s.newTensor(Tensor{storage: s, dtype: dt})
	t.shape, t.strides = contiguousDims(shape, t.dims[:])
	return t, nil
}

// Full returns a tensor with every element v, converted to dt.
func (f Factory) Full(dt DType, v float64, shape ...int) (*Tensor, error) {
	host, err := f.hostEmpty(dt, shape)
	if err != nil {
		return nil, err
	}
	b := host.storage.Bytes()
	if len(b) > 0 {
		setFloat(dt, b, 0, v)
		for n := dt.Size(); n < len(b); n *= 2 { // fill by doubling
			copy(b[n:], b[:n])
		}
	}
	return host.To(f.place)
}

// Arange returns a one-dimensional tensor holding 0, 1, ..., n-1 converted
// to dt.
func (f Factory) Arange(dt DType, n int) (*Tensor, error) {
	return f.fill(dt, []int{n}, func(i int) float64 { return float64(i) })
}

// hostEmpty makes the host tensor a constructor fills, every element of
// it, before moving it to f's place: in shared memory already when f
// makes shared tensors.
func (f Factory) hostEmpty(dt DType, shape []int) (*Tensor, error) {
	if f.shared && f.place.IsCPU() {
		return f.Empty(dt, shape...)
	}
	return On(device.CPU()).Empty(dt, shape...)
}

func (f Factory) fill(dt DType, shape []int, at func(int) float64) (*Tensor, error) {
	host, err := f.hostEmpty(dt, shape)
	if err != nil {
		return nil, err
	}
	b := host.storage.Bytes()
	for i := range host.Numel() {
		setFloat(dt, b, i, at(i))
	}
	return host.To(f.place)
}

// Zeros returns a tensor of zeros on the process default place.
func Zeros(dt DType, shape ...int) (*Tensor, error) { return On(device.Default()).Zeros(dt, shape...) }

// Empty returns a tensor whose elements are not set on the process default
// place (see Factory.Empty).
func Empty(dt DType, shape ...int) (*Tensor, error) { return On(device.Default()).Empty(dt, shape...) }

// Full returns a tensor filled with v on the process default place.
func Full(dt DType, v float64, shape ...int) (*Tensor, error) {
	return On(device.Default()).Full(dt, v, shape...)
}

// Arange returns 0..n-1 on the process default place.
func Arange(dt DType, n int) (*Tensor, error) { return On(device.Default()).Arange(dt, n) }

// FromSlice returns a tensor on the process default place holding a copy
// of data, with the given shape (a vector of len(data) when shape is
// empty).
func FromSlice[T Element](data []T, shape ...int) (*Tensor, error) {
	return FromSliceOn(device.Default(), data, shape...)
}

// FromSliceOn is FromSlice on place p.
func FromSliceOn[T Element](p device.Place, data []T, shape ...int) (*Tensor, error) {
	if len(shape) == 0 {
		shape = []int{len(data)}
	}
	dt := DTypeOf[T]()
	host, err := On(device.CPU()).Zeros(dt, shape...)
	if err != nil {
		return nil, err
	}
	if host.Numel() != len(data) {
		return nil, fmt.Errorf("tensor: %d values do not fill shape %v (%d elements)", len(data), shape, host.Numel())
	}
	copy(asSlice[T](host.storage.Bytes()), data)
	return host.To(p)
}

// FromStorage returns a tensor viewing s: dt elements from byte offset
// with the given shape and strides (in elements). It checks that every
// element lies inside s, so it is safe on metadata from another process.
func FromStorage(s *Storage, dt DType, offset int64, shape, strides []int) (*Tensor, error) {
	if err := checkView(dt, offset, shape, strides, s.Size()); err != nil {
		return nil, err
	}
	t := s.newTensor(Tensor{storage: s, offset: offset, dtype: dt})
	t.shape, t.strides = cloneDims(shape, strides, t.dims[:])
	return t, nil
}

// checkNewShape checks a new tensor's dtype and shape. Its errors, like
// checkView's, show a copy of shape, so that shape does not escape: a
// caller's variadic shape stays on the caller's stack.
func checkNewShape(dt DType, shape []int) error {
	if !dt.Valid() {
		return fmt.Errorf("tensor: invalid dtype %v", dt)
	}
	if len(shape) > MaxDims {
		return fmt.Errorf("tensor: %d dimensions, more than %d", len(shape), MaxDims)
	}
	total := uint64(dt.Size())
	for i, n := range shape {
		if n < 0 {
			return fmt.Errorf("tensor: negative size %d in dimension %d of shape %v", n, i, slices.Clone(shape))
		}
		hi, lo := bits.Mul64(total, uint64(n))
		if hi != 0 || lo > math.MaxInt64 {
			return fmt.Errorf("tensor: shape %v of %v overflows", slices.Clone(shape), dt)
		}
		total = lo
	}
	return nil
}

// CheckView checks a view's metadata against a storage of size bytes:
// a valid dtype, sizes and strides non-negative, no overflow, the byte
// offset aligned, and the furthest element inside the storage. FromStorage
// applies it; receivers call it on metadata before mapping anything.
func CheckView(dt DType, offset int64, shape, strides []int, size int64) error {
	return checkView(dt, offset, shape, strides, size)
}

func checkView(dt DType, offset int64, shape, strides []int, size int64) error {
	if err := checkNewShape(dt, shape); err != nil {
		return err
	}
	if len(strides) != len(shape) {
		return fmt.Errorf("tensor: %d strides for %d dimensions", len(strides), len(shape))
	}
	item := int64(dt.Size())
	if offset < 0 || offset%item != 0 {
		return fmt.Errorf("tensor: byte offset %d is negative or not a multiple of the %v size %d", offset, dt, item)
	}
	if offset > size {
		return fmt.Errorf("tensor: byte offset %d beyond the storage's %d bytes", offset, size)
	}
	if Numel(shape...) == 0 {
		return nil
	}
	var last uint64 // index of the furthest element, in elements
	for i, n := range shape {
		st := strides[i]
		if st < 0 {
			return fmt.Errorf("tensor: negative stride %d in dimension %d", st, i)
		}
		hi, lo := bits.Mul64(uint64(n-1), uint64(st))
		sum, carry := bits.Add64(last, lo, 0)
		if hi != 0 || carry != 0 || sum > math.MaxInt64 {
			return fmt.Errorf("tensor: strides %v with shape %v overflow", slices.Clone(strides), slices.Clone(shape))
		}
		last = sum
	}
	hi, endElems := bits.Mul64(last+1, uint64(item))
	end, carry := bits.Add64(endElems, uint64(offset), 0)
	if hi != 0 || carry != 0 || end > uint64(size) {
		return fmt.Errorf("tensor: shape %v, strides %v and offset %d reach past the storage's %d bytes", slices.Clone(shape), slices.Clone(strides), offset, size)
	}
	return nil
}

// Numel returns the number of elements of a tensor of the given shape, as
// torch.Size.numel does: the product of its sizes, 1 for a scalar's empty
// shape.
func Numel(shape ...int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

func contiguousStrides(shape []int) []int {
	st := make([]int, len(shape))
	fillContiguous(st, shape)
	return st
}

func fillContiguous(strides, shape []int) {
	acc := 1
	for i := len(shape) - 1; i >= 0; i-- {
		strides[i] = acc
		acc *= max(shape[i], 1)
	}
}

// cloneDims returns copies of shape and strides (they are copied for
// every tensor received), in room if they fit, else in one allocation. A
// nil one stays nil.
func cloneDims(shape, strides, room []int) ([]int, []int) {
	if shape == nil || strides == nil {
		return slices.Clone(shape), slices.Clone(strides)
	}
	d := dimsIn(room, len(shape)+len(strides))
	n := copy(d, shape)
	copy(d[n:], strides)
	return d[:n:n], d[n:]
}

// contiguousDims returns a copy of shape and its contiguous strides, in
// room if they fit, else in one allocation. A nil shape stays nil.
func contiguousDims(shape, room []int) ([]int, []int) {
	if shape == nil {
		return nil, []int{}
	}
	d := dimsIn(room, 2*len(shape))
	n := copy(d, shape)
	fillContiguous(d[n:], shape)
	return d[:n:n], d[n:]
}

// dimsIn returns n ints of room, or new ones if room is too small.
func dimsIn(room []int, n int) []int {
	if n <= len(room) {
		return room[:n:n]
	}
	return make([]int, n)
}

// DType returns the element type.
func (t *Tensor) DType() DType { return t.dtype }

// Shape returns a copy of the sizes of the dimensions.
func (t *Tensor) Shape() []int { return slices.Clone(t.shape) }

// Strides returns a copy of the strides, in elements.
func (t *Tensor) Strides() []int { return slices.Clone(t.strides) }

// Dims returns copies of the shape and the strides, as Shape and Strides
// do, with one allocation for both.
func (t *Tensor) Dims() (shape, strides []int) { return cloneDims(t.shape, t.strides, nil) }

// AppendDims appends the shape and then the strides to dst and returns
// the extended slice, for a caller that reuses one buffer where Dims
// would allocate: the shape is the Dim() elements after dst's, the strides
// the Dim() elements after those.
func (t *Tensor) AppendDims(dst []int) []int {
	return append(append(dst, t.shape...), t.strides...)
}

// Dim returns the number of dimensions.
func (t *Tensor) Dim() int { return len(t.shape) }

// Numel returns the number of elements.
func (t *Tensor) Numel() int { return Numel(t.shape...) }

// Offset returns the byte offset of the first element in the storage.
func (t *Tensor) Offset() int64 { return t.offset }

// Nbytes returns the number of bytes the elements take when contiguous.
func (t *Tensor) Nbytes() int64 { return int64(t.Numel()) * int64(t.dtype.Size()) }

// Storage returns the storage the tensor views.
func (t *Tensor) Storage() *Storage { return t.storage }

// Place returns where the tensor's memory lives.
func (t *Tensor) Place() device.Place { return t.storage.place }

// LoD returns the tensor's level-of-detail offsets (Paddle's sequence
// boundaries), or nil. The result must not be modified.
func (t *Tensor) LoD() [][]int { return t.lod }

// WithLoD returns a view of t carrying lod. Each level must be
// non-decreasing and start at 0.
func (t *Tensor) WithLoD(lod [][]int) (*Tensor, error) {
	if err := checkLoD(lod); err != nil {
		return nil, err
	}
	v := *t
	v.lod = cloneLoD(lod)
	return &v, nil
}

func checkLoD(lod [][]int) error {
	for l, level := range lod {
		for i, x := range level {
			if i == 0 && x != 0 || i > 0 && x < level[i-1] {
				return fmt.Errorf("tensor: LoD level %d is not non-decreasing from 0: %v", l, level)
			}
		}
	}
	return nil
}

func cloneLoD(lod [][]int) [][]int {
	if lod == nil {
		return nil
	}
	out := make([][]int, len(lod))
	for i, l := range lod {
		out[i] = slices.Clone(l)
	}
	return out
}

// IsContiguous reports whether the elements are laid out densely in
// row-major order. A tensor without elements is contiguous, whatever
// its strides.
func (t *Tensor) IsContiguous() bool {
	acc, contiguous := 1, true
	for i := len(t.shape) - 1; i >= 0; i-- {
		if t.shape[i] == 0 {
			return true // no element lies anywhere, as torch has it
		}
		if t.shape[i] != 1 && t.strides[i] != acc {
			contiguous = false
		}
		acc *= t.shape[i]
	}
	return contiguous
}

// IsShared reports whether the tensor's storage is in memory another
// process can map: shared host memory, or device memory, which crosses
// processes by its backend's handles.
func (t *Tensor) IsShared() bool { return t.storage.IsShared() }

// ShareMemory moves the tensor's storage into shared memory under the
// process's sharing strategy, in place: t and every view of its storage
// keep working and become shared. A storage that is shared already, such
// as device memory, is left as it is.
func (t *Tensor) ShareMemory() error { return t.storage.ShareMemory(strategy.Get()) }

// Release gives back the memory of the tensor's storage now, for every
// view of it. See Storage.Release.
func (t *Tensor) Release() error { return t.storage.Release() }

func (t *Tensor) checkDim(dim int) error {
	if dim < 0 || dim >= len(t.shape) {
		return fmt.Errorf("tensor: dimension %d out of range for %d dimensions", dim, len(t.shape))
	}
	return nil
}

func (t *Tensor) view(offset int64, shape, strides []int) *Tensor {
	return t.storage.newTensor(Tensor{storage: t.storage, offset: offset, dtype: t.dtype, shape: shape, strides: strides})
}

// Narrow returns a view of length elements of dimension dim starting at
// start.
func (t *Tensor) Narrow(dim, start, length int) (*Tensor, error) {
	if err := t.checkDim(dim); err != nil {
		return nil, err
	}
	if start < 0 || length < 0 || start > t.shape[dim]-length {
		return nil, fmt.Errorf("tensor: narrow [%d, %d+%d) out of range for size %d of dimension %d", start, start, length, t.shape[dim], dim)
	}
	shape := slices.Clone(t.shape)
	shape[dim] = length
	off := t.offset
	if length > 0 {
		off += int64(start) * int64(t.strides[dim]) * int64(t.dtype.Size())
	}
	return t.view(off, shape, slices.Clone(t.strides)), nil
}

// Slice returns a view of elements [start, end) of dimension dim.
func (t *Tensor) Slice(dim, start, end int) (*Tensor, error) {
	if end < start {
		return nil, fmt.Errorf("tensor: slice [%d, %d) has end before start", start, end)
	}
	return t.Narrow(dim, start, end-start)
}

// Transpose returns a view with dimensions d0 and d1 swapped.
func (t *Tensor) Transpose(d0, d1 int) (*Tensor, error) {
	if err := errors.Join(t.checkDim(d0), t.checkDim(d1)); err != nil {
		return nil, err
	}
	shape, strides := slices.Clone(t.shape), slices.Clone(t.strides)
	shape[d0], shape[d1] = shape[d1], shape[d0]
	strides[d0], strides[d1] = strides[d1], strides[d0]
	return t.view(t.offset, shape, strides), nil
}

// Reshape returns a tensor with the same elements and a new shape; one
// size may be -1 and is inferred. A contiguous tensor gives a view on the
// same storage; any other is copied first, as torch.reshape does.
func (t *Tensor) Reshape(shape ...int) (*Tensor, error) {
	shape = slices.Clone(shape)
	infer, known := -1, 1
	for i, n := range shape {
		switch {
		case n == -1 && infer < 0:
			infer = i
		case n < 0:
			return nil, fmt.Errorf("tensor: bad size %d in shape %v", n, shape)
		default:
			known *= n
		}
	}
	if infer >= 0 {
		if known == 0 || t.Numel()%known != 0 {
			return nil, fmt.Errorf("tensor: cannot infer -1 in shape %v for %d elements", shape, t.Numel())
		}
		shape[infer] = t.Numel() / known
	}
	if err := checkNewShape(t.dtype, shape); err != nil {
		return nil, err
	}
	if Numel(shape...) != t.Numel() {
		return nil, fmt.Errorf("tensor: cannot reshape %v (%d elements) to %v", t.shape, t.Numel(), shape)
	}
	src := t
	if !t.IsContiguous() {
		c, err := t.Contiguous()
		if err != nil {
			return nil, err
		}
		src = c
	}
	return src.view(src.offset, shape, contiguousStrides(shape)), nil
}

// Contiguous returns t if it is contiguous, else a contiguous copy.
func (t *Tensor) Contiguous() (*Tensor, error) {
	if t.IsContiguous() {
		return t, nil
	}
	return t.Clone()
}

// forEach calls fn with the storage index (in elements, relative to the
// offset) of every element in row-major order.
func (t *Tensor) forEach(fn func(elem int64)) {
	n := t.Numel()
	if n == 0 {
		return
	}
	idx := make([]int, len(t.shape))
	var pos int64
	for range n {
		fn(pos)
		for d := len(idx) - 1; d >= 0; d-- {
			idx[d]++
			pos += int64(t.strides[d])
			if idx[d] < t.shape[d] {
				break
			}
			pos -= int64(t.strides[d]) * int64(idx[d])
			idx[d] = 0
		}
	}
}

// Equal reports whether a and b have the same dtype, shape and element
// values. Floating-point elements compare as numbers: 0 equals -0 and NaN
// equals nothing.
func Equal(a, b *Tensor) bool {
	if a.dtype != b.dtype || !slices.Equal(a.shape, b.shape) {
		return false
	}
	ba, errA := a.denseHost()
	bb, errB := b.denseHost()
	if errA != nil || errB != nil {
		return false
	}
	equal := false
	err := touch(func() { equal = equalBytes(a.dtype, a.Numel(), ba, bb) }, a.storage, b.storage)
	return err == nil && equal
}

func equalBytes(dt DType, n int, ba, bb []byte) bool {
	switch dt {
	case Float16, BFloat16, Float32, Float64, Complex64, Complex128:
		for i := range n {
			if value(dt, ba, i) != value(dt, bb, i) {
				return false
			}
		}
		return true
	}
	return string(ba) == string(bb)
}

func (t *Tensor) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "tensor(%v, %v, %v", t.dtype, t.shape, t.Place())
	if t.IsShared() {
		b.WriteString(", shared")
	}
	if t.storage.Released() {
		b.WriteString(", released")
	}
	b.WriteString(")")
	return b.String()
}

package tensor_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

func TestDTypes(t *testing.T) {
	dts := tensor.DTypes()
	require.Len(t, dts, 12)
	sizes := map[tensor.DType]int{
		tensor.Bool: 1, tensor.Uint8: 1, tensor.Int8: 1, tensor.Int16: 2, tensor.Int32: 4, tensor.Int64: 8,
		tensor.Float16: 2, tensor.BFloat16: 2, tensor.Float32: 4, tensor.Float64: 8, tensor.Complex64: 8, tensor.Complex128: 16,
	}
	for _, d := range dts {
		assert.Equal(t, sizes[d], d.Size(), d.String())
		p, err := tensor.ParseDType(d.String())
		require.NoError(t, err)
		assert.Equal(t, d, p)
	}
	_, err := tensor.ParseDType("float8")
	assert.ErrorContains(t, err, "valid: bool, uint8")
	assert.False(t, tensor.Invalid.Valid())
	assert.False(t, tensor.DType(200).Valid())
	assert.Equal(t, 0, tensor.DType(200).Size())

	assert.Equal(t, tensor.Bool, tensor.DTypeOf[bool]())
	assert.Equal(t, tensor.Uint8, tensor.DTypeOf[uint8]())
	assert.Equal(t, tensor.Int8, tensor.DTypeOf[int8]())
	assert.Equal(t, tensor.Int16, tensor.DTypeOf[int16]())
	assert.Equal(t, tensor.Int32, tensor.DTypeOf[int32]())
	assert.Equal(t, tensor.Int64, tensor.DTypeOf[int64]())
	assert.Equal(t, tensor.Float16, tensor.DTypeOf[tensor.Half]())
	assert.Equal(t, tensor.BFloat16, tensor.DTypeOf[tensor.BHalf]())
	assert.Equal(t, tensor.Float32, tensor.DTypeOf[float32]())
	assert.Equal(t, tensor.Float64, tensor.DTypeOf[float64]())
	assert.Equal(t, tensor.Complex64, tensor.DTypeOf[complex64]())
	assert.Equal(t, tensor.Complex128, tensor.DTypeOf[complex128]())
}

func TestHalfConversions(t *testing.T) {
	cases := []struct {
		in   float32
		bits uint16
	}{
		{0, 0x0000}, {1, 0x3c00}, {-2, 0xc000}, {0.5, 0x3800}, {65504, 0x7bff},
		{65520, 0x7c00}, // rounds up to infinity
		{float32(math.Inf(1)), 0x7c00}, {float32(math.Inf(-1)), 0xfc00},
		{5.960464477539063e-08, 0x0001}, // smallest subnormal
		{6.097555160522461e-05, 0x03ff}, // largest subnormal
		{1e-9, 0x0000},
		{1.0009765625, 0x3c01}, {1.00048828125, 0x3c00}, // a tie rounds to even
	}
	for _, c := range cases {
		h := tensor.HalfFromFloat32(c.in)
		assert.Equal(t, c.bits, uint16(h), "HalfFromFloat32(%g)", c.in)
	}
	for b := range uint32(0x7c00) {
		h := tensor.Half(b)
		assert.Equal(t, h, tensor.HalfFromFloat32(h.Float32()), "round trip of %#04x", b)
	}
	assert.True(t, math.IsNaN(float64(tensor.HalfFromFloat32(float32(math.NaN())).Float32())))

	assert.Equal(t, float32(1), tensor.BHalfFromFloat32(1).Float32())
	assert.Equal(t, float32(-3.140625), tensor.BHalfFromFloat32(-3.14159).Float32())
	assert.Equal(t, uint16(0x3f80), uint16(tensor.BHalfFromFloat32(1.00390625)), "a tie rounds to even")
	assert.True(t, math.IsNaN(float64(tensor.BHalfFromFloat32(float32(math.NaN())).Float32())))
}

// Shapes and strides are right on both sides of the most dimensions a
// tensor holds in itself, and AppendDims appends the same as Dims returns.
func TestDimsAtEveryRank(t *testing.T) {
	for rank := 0; rank <= 6; rank++ {
		shape := make([]int, rank)
		for i := range shape {
			shape[i] = i + 2
		}
		x, err := tensor.Zeros(tensor.Int8, shape...)
		require.NoError(t, err)
		gotShape, gotStrides := x.Dims()
		assert.Equal(t, len(shape), len(gotShape), "rank %d", rank)
		if rank > 0 {
			assert.Equal(t, shape, gotShape, "rank %d", rank)
		}
		assert.Len(t, gotStrides, rank)
		for i := range rank {
			want := 1
			for _, n := range shape[i+1:] {
				want *= n
			}
			assert.Equal(t, want, gotStrides[i], "rank %d, stride %d", rank, i)
		}
		y, err := tensor.FromStorage(x.Storage(), tensor.Int8, 0, gotShape, gotStrides)
		require.NoError(t, err)
		yShape, yStrides := y.Dims()
		assert.Equal(t, gotShape, yShape, "rank %d", rank)
		assert.Equal(t, gotStrides, yStrides, "rank %d", rank)
		if rank > 0 {
			gotShape[0] = 99
			assert.Equal(t, shape[0], y.Shape()[0], "y holds its own copy of the shape")
		}

		dst := []int{-1}
		d := y.AppendDims(dst)
		require.Len(t, d, 1+2*rank)
		assert.Equal(t, -1, d[0], "what dst held stays")
		assert.True(t, slices.Equal(yShape, d[1:1+rank]), "rank %d: shape %v, appended %v", rank, yShape, d)
		assert.True(t, slices.Equal(yStrides, d[1+rank:]), "rank %d: strides %v, appended %v", rank, yStrides, d)
		require.NoError(t, x.Release())
	}
}

func TestConstructors(t *testing.T) {
	z, err := tensor.Zeros(tensor.Float32, 2, 3)
	require.NoError(t, err)
	assert.Equal(t, []int{2, 3}, z.Shape())
	assert.Equal(t, []int{3, 1}, z.Strides())
	shape, strides := z.Dims()
	assert.Equal(t, []int{2, 3}, shape)
	assert.Equal(t, []int{3, 1}, strides)
	shape[0] = 9
	_ = append(shape, 9) // the copies share an array; the shape's growth must not reach the strides
	assert.Equal(t, []int{3, 1}, strides)
	assert.Equal(t, []int{2, 3}, z.Shape(), "Dims returns copies")
	assert.Equal(t, []int{3, 1}, z.Strides())
	assert.Equal(t, 6, z.Numel())
	assert.Equal(t, int64(24), z.Nbytes())
	assert.True(t, z.IsContiguous())
	assert.False(t, z.IsShared())
	assert.Equal(t, device.CPU(), z.Place())

	f, err := tensor.Full(tensor.Int16, 7, 4)
	require.NoError(t, err)
	vals, err := tensor.Data[int16](f)
	require.NoError(t, err)
	assert.Equal(t, []int16{7, 7, 7, 7}, vals)

	a, err := tensor.Arange(tensor.Float16, 5)
	require.NoError(t, err)
	hs, err := tensor.Data[tensor.Half](a)
	require.NoError(t, err)
	for i, h := range hs {
		assert.Equal(t, float32(i), h.Float32())
	}

	s, err := tensor.FromSlice([]complex64{1, 2i, 3, 4}, 2, 2)
	require.NoError(t, err)
	v, err := tensor.At[complex64](s, 0, 1)
	require.NoError(t, err)
	assert.Equal(t, complex64(2i), v)

	scalar, err := tensor.Zeros(tensor.Float64)
	require.NoError(t, err)
	assert.Equal(t, 1, scalar.Numel())
	require.NoError(t, tensor.Set(scalar, 2.5))
	x, err := tensor.At[float64](scalar)
	require.NoError(t, err)
	assert.Equal(t, 2.5, x)

	e, err := tensor.Empty(tensor.Int32, 3, 2)
	require.NoError(t, err)
	assert.Equal(t, []int{3, 2}, e.Shape())
	assert.Equal(t, []int{2, 1}, e.Strides())
	assert.Equal(t, int64(24), e.Nbytes())
	assert.False(t, e.IsShared())
	_, err = tensor.Empty(tensor.Float32, -1)
	assert.ErrorContains(t, err, "negative size")

	_, err = tensor.FromSlice([]int32{1, 2, 3}, 2, 2)
	assert.ErrorContains(t, err, "do not fill")
	_, err = tensor.Zeros(tensor.Float32, 2, -1)
	assert.ErrorContains(t, err, "negative size")
	_, err = tensor.Zeros(tensor.Float32, math.MaxInt/2, 4)
	assert.ErrorContains(t, err, "overflows")
	_, err = tensor.Zeros(tensor.Invalid, 1)
	assert.ErrorContains(t, err, "invalid dtype")
}

func TestTypedAccessChecksDType(t *testing.T) {
	x, err := tensor.Zeros(tensor.Float32, 4)
	require.NoError(t, err)
	_, err = tensor.Data[float64](x)
	assert.ErrorContains(t, err, "float32 elements read as float64")
	_, err = tensor.At[int32](x, 0)
	assert.Error(t, err)
	assert.Error(t, tensor.Set[int64](x, 1, 0))
	_, err = tensor.At[float32](x, 4)
	assert.ErrorContains(t, err, "out of range")
	_, err = tensor.At[float32](x, 0, 0)
	assert.ErrorContains(t, err, "2 indices for 1 dimensions")
}

func TestViewsShareStorage(t *testing.T) {
	base, err := tensor.Arange(tensor.Int64, 12)
	require.NoError(t, err)
	m, err := base.Reshape(3, 4)
	require.NoError(t, err)
	assert.Same(t, base.Storage(), m.Storage(), "a contiguous reshape is a view")

	row, err := m.Narrow(0, 1, 1)
	require.NoError(t, err)
	require.NoError(t, tensor.Set[int64](row, 100, 0, 2))
	v, err := tensor.At[int64](base, 6)
	require.NoError(t, err)
	assert.Equal(t, int64(100), v, "a write through a view lands in the shared storage")

	tr, err := m.Transpose(0, 1)
	require.NoError(t, err)
	assert.Equal(t, []int{4, 3}, tr.Shape())
	assert.Equal(t, []int{1, 4}, tr.Strides())
	assert.False(t, tr.IsContiguous())
	_, err = tensor.Data[int64](tr)
	assert.ErrorContains(t, err, "non-contiguous")
	vals, err := tensor.Values[int64](tr)
	require.NoError(t, err)
	assert.Equal(t, []int64{0, 4, 8, 1, 5, 9, 2, 100, 10, 3, 7, 11}, vals)

	cols, err := m.Slice(1, 1, 3)
	require.NoError(t, err)
	assert.Equal(t, int64(8), cols.Offset())
	vals, err = tensor.Values[int64](cols)
	require.NoError(t, err)
	assert.Equal(t, []int64{1, 2, 5, 100, 9, 10}, vals)

	flat, err := tr.Reshape(-1)
	require.NoError(t, err)
	assert.NotSame(t, base.Storage(), flat.Storage(), "a non-contiguous reshape copies")
	got, err := tensor.Data[int64](flat)
	require.NoError(t, err)
	assert.Equal(t, []int64{0, 4, 8, 1, 5, 9, 2, 100, 10, 3, 7, 11}, got)

	require.NoError(t, tensor.Fill(tr, func(i int) int64 { return int64(-i) }))
	vals, err = tensor.Values[int64](tr)
	require.NoError(t, err)
	assert.Equal(t, []int64{0, -1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11}, vals)

	_, err = m.Narrow(0, 2, 2)
	assert.Error(t, err)
	_, err = m.Narrow(2, 0, 1)
	assert.Error(t, err)
	_, err = m.Slice(0, 2, 1)
	assert.Error(t, err)
	_, err = m.Transpose(0, 5)
	assert.Error(t, err)
	_, err = m.Reshape(5, -1)
	assert.Error(t, err)
	_, err = m.Reshape(-1, -1)
	assert.Error(t, err)
	_, err = m.Reshape(13)
	assert.Error(t, err)
}

func TestCloneAndEqual(t *testing.T) {
	a, err := tensor.FromSlice([]float32{1, 2, 3, 4, 5, 6}, 2, 3)
	require.NoError(t, err)
	tr, err := a.Transpose(0, 1)
	require.NoError(t, err)
	c, err := tr.Clone()
	require.NoError(t, err)
	assert.True(t, c.IsContiguous())
	assert.True(t, tensor.Equal(tr, c))
	require.NoError(t, tensor.Set[float32](c, 9, 0, 0))
	assert.False(t, tensor.Equal(tr, c), "a clone has its own storage")

	b, err := tensor.FromSlice([]float32{1, 2, 3, 4, 5, 6}, 3, 2)
	require.NoError(t, err)
	assert.False(t, tensor.Equal(a, b), "shapes differ")
	i, err := tensor.FromSlice([]int32{1, 2, 3, 4, 5, 6}, 2, 3)
	require.NoError(t, err)
	assert.False(t, tensor.Equal(a, i), "dtypes differ")

	nan, err := tensor.FromSlice([]float64{math.NaN()})
	require.NoError(t, err)
	assert.False(t, tensor.Equal(nan, nan), "NaN equals nothing")
	pz, err := tensor.FromSlice([]float64{0})
	require.NoError(t, err)
	nz, err := tensor.FromSlice([]float64{math.Copysign(0, -1)})
	require.NoError(t, err)
	assert.True(t, tensor.Equal(pz, nz), "0 equals -0")
}

func TestLoD(t *testing.T) {
	x, err := tensor.Zeros(tensor.Float32, 5, 2)
	require.NoError(t, err)
	y, err := x.WithLoD([][]int{{0, 2, 5}})
	require.NoError(t, err)
	assert.Equal(t, [][]int{{0, 2, 5}}, y.LoD())
	assert.Nil(t, x.LoD(), "WithLoD makes a view; the original is unchanged")
	_, err = x.WithLoD([][]int{{1, 2}})
	assert.Error(t, err)
	_, err = x.WithLoD([][]int{{0, 3, 2}})
	assert.Error(t, err)
}

func TestShareMemoryInPlace(t *testing.T) {
	for _, st := range strategy.All() {
		t.Run(st.String(), func(t *testing.T) {
			leakcheck.Check(t)
			x, err := tensor.Arange(tensor.Float32, 1000)
			require.NoError(t, err)
			view, err := x.Narrow(0, 10, 5)
			require.NoError(t, err)
			require.NoError(t, x.Storage().ShareMemory(st))
			assert.True(t, x.IsShared())
			assert.True(t, view.IsShared(), "a view made before sharing is shared too")
			vals, err := tensor.Values[float32](view)
			require.NoError(t, err)
			assert.Equal(t, []float32{10, 11, 12, 13, 14}, vals, "values survive the move")

			// file_descriptor storages are pooled blocks, file_system ones
			// whole segments.
			shared := func() []byte {
				switch b := x.Storage().Backing().(type) {
				case *shm.Block:
					return b.Bytes()
				case *shm.Allocation:
					return b.Bytes()
				}
				return nil
			}
			require.NotNil(t, shared())
			require.NoError(t, tensor.Set[float32](view, -1, 0))
			got := shared()[40:44]
			assert.Equal(t, []byte{0, 0, 0x80, 0xbf}, got, "the view writes into the segment")

			before := &shared()[0]
			require.NoError(t, x.ShareMemory(), "sharing again is a no-op")
			assert.Same(t, before, &shared()[0])

			require.NoError(t, view.Release())
			assert.True(t, x.Storage().Released())
			_, err = tensor.Data[float32](x)
			assert.ErrorIs(t, err, tensor.ErrReleased)
			assert.ErrorIs(t, x.ShareMemory(), tensor.ErrReleased)
			require.NoError(t, x.Release(), "releasing twice is harmless")
		})
	}
}

func TestShareEmpty(t *testing.T) {
	leakcheck.Check(t)
	e, err := tensor.Zeros(tensor.Float32, 0, 3)
	require.NoError(t, err)
	require.NoError(t, e.ShareMemory())
	assert.True(t, e.IsShared())
	assert.NotImplements(t, (*interface{ Sealed() bool })(nil), e.Storage().Backing(), "an empty tensor needs no segment")
	assert.Equal(t, int64(0), e.Storage().Backing().Size())
}

func TestCleanupReleasesUnreachable(t *testing.T) {
	leakcheck.Check(t) // fails if the cleanup did not unmap the segments
	for _, st := range strategy.All() {
		x, err := tensor.Zeros(tensor.Uint8, 1<<16)
		require.NoError(t, err)
		require.NoError(t, x.Storage().ShareMemory(st))
	}
	runtime.GC()
}

func TestConcurrentShareMemory(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.Arange(tensor.Int32, 4096)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			assert.NoError(t, x.ShareMemory())
			_, err := tensor.Values[int32](x)
			assert.NoError(t, err)
		}()
	}
	wg.Wait()
	assert.True(t, x.IsShared())
	require.NoError(t, x.Release())
}

// hostBackend is a fake device backend that keeps "device" memory in Go
// slices and counts live buffers.
type hostBackend struct {
	mu   sync.Mutex
	live int
}

type hostBuffer struct {
	b     []byte
	owner *hostBackend
}

func (h *hostBackend) Alloc(p device.Place, n int64) (tensor.Buffer, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.live++
	return &hostBuffer{b: make([]byte, n), owner: h}, nil
}

func (b *hostBuffer) Bytes() []byte                     { return nil }
func (b *hostBuffer) Size() int64                       { return int64(len(b.b)) }
func (b *hostBuffer) Read(dst []byte, off int64) error  { copy(dst, b.b[off:]); return nil }
func (b *hostBuffer) Write(src []byte, off int64) error { copy(b.b[off:], src); return nil }
func (b *hostBuffer) Release() error {
	b.owner.mu.Lock()
	defer b.owner.mu.Unlock()
	b.owner.live--
	return nil
}

// hostDevice registers a device type served by a new hostBackend and
// returns device i of it.
func hostDevice(t *testing.T, kind string, i int) (device.Place, *hostBackend) {
	typ, err := device.RegisterType(kind)
	require.NoError(t, err)
	be := &hostBackend{}
	tensor.RegisterBackend(typ, be)
	dev, err := device.Custom(kind, i)
	require.NoError(t, err)
	return dev, be
}

func TestPlaceFollowsContext(t *testing.T) {
	dev, be := hostDevice(t, "test_dev", 1)

	ctx := device.With(context.Background(), dev)
	x, err := tensor.In(ctx).Arange(tensor.Float32, 6)
	require.NoError(t, err)
	assert.Equal(t, dev, x.Place(), "new tensors go to the context's place")
	assert.Equal(t, 1, be.live)
	_, err = tensor.Data[float32](x)
	assert.ErrorContains(t, err, "not in host memory")
	assert.NoError(t, x.ShareMemory(), "device memory is shared already")
	assert.True(t, x.IsShared())

	back, err := x.To(device.CPU())
	require.NoError(t, err)
	vals, err := tensor.Data[float32](back)
	require.NoError(t, err)
	assert.Equal(t, []float32{0, 1, 2, 3, 4, 5}, vals)

	m, err := x.Reshape(2, 3)
	require.NoError(t, err)
	tr, err := m.Transpose(0, 1)
	require.NoError(t, err)
	c, err := tr.Clone()
	require.NoError(t, err)
	assert.Equal(t, dev, c.Place())
	assert.True(t, tensor.Equal(c, tr))
	require.NoError(t, c.Release())
	require.NoError(t, x.Release())
	assert.Equal(t, 0, be.live, "Release frees device buffers")

	y, err := tensor.On(device.CPU()).Zeros(tensor.Int8, 2)
	require.NoError(t, err)
	assert.Equal(t, device.CPU(), y.Place())
	assert.Equal(t, device.CPU(), tensor.In(context.Background()).Place(), "no scope: the default")

	_, err = device.RegisterType("test_nobackend")
	require.NoError(t, err)
	none, err := device.Custom("test_nobackend", 0)
	require.NoError(t, err)
	_, err = tensor.On(none).Zeros(tensor.Float32, 2)
	assert.ErrorContains(t, err, "no backend registered for device type test_nobackend")
	_, err = y.To(none)
	assert.Error(t, err)
}

func TestFromStorageChecksBounds(t *testing.T) {
	x, err := tensor.Zeros(tensor.Float32, 16)
	require.NoError(t, err)
	s := x.Storage()
	cases := []struct {
		name    string
		dt      tensor.DType
		off     int64
		shape   []int
		strides []int
	}{
		{"unknown dtype", tensor.DType(99), 0, []int{1}, []int{1}},
		{"negative size", tensor.Float32, 0, []int{-1}, []int{1}},
		{"negative stride", tensor.Float32, 0, []int{2}, []int{-1}},
		{"strides past end", tensor.Float32, 0, []int{4, 4}, []int{5, 1}},
		{"offset plus size past end", tensor.Float32, 8, []int{16}, []int{1}},
		{"misaligned offset", tensor.Float32, 2, []int{1}, []int{1}},
		{"negative offset", tensor.Float32, -4, []int{1}, []int{1}},
		{"offset past end, empty", tensor.Float32, 128, []int{0}, []int{1}},
		{"rank mismatch", tensor.Float32, 0, []int{2, 2}, []int{1}},
		{"overflowing shape", tensor.Float32, 0, []int{math.MaxInt / 2, 8}, []int{1, 1}},
		{"overflowing stride", tensor.Float32, 0, []int{3}, []int{math.MaxInt / 2}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := tensor.FromStorage(s, c.dt, c.off, c.shape, c.strides)
			assert.Error(t, err)
		})
	}
	v, err := tensor.FromStorage(s, tensor.Float32, 4, []int{3, 5}, []int{5, 1})
	require.NoError(t, err)
	assert.Equal(t, 15, v.Numel())
	_, err = tensor.FromStorage(s, tensor.Float32, 64, []int{0}, []int{1})
	assert.NoError(t, err, "an empty view may sit at the end")
}

// The first tensor made on a new storage is allocated with it, and every
// other is a tensor of its own, however many goroutines make them at once.
// TestRecycledSharedBlocks checks what each constructor makes of a pooled
// block that its last user wrote all over: Zeros clears it, Full and
// Arange (which start from Empty) set every element, and Empty leaves it
// as it was.
func TestRecycledSharedBlocks(t *testing.T) {
	leakcheck.Check(t)
	shared := tensor.On(device.CPU()).Shared()
	const n, size = 2048, 4 << 10 // more blocks than the pool's first slab holds
	// round makes n tensors with mk, checks each with check, and
	// releases them all at the end: the next round's blocks are these
	// recycled, as the pool takes released blocks back once its free ones
	// run out.
	round := func(name string, mk func() (*tensor.Tensor, error), check func(b []byte) bool) (passed int) {
		xs := make([]*tensor.Tensor, 0, n)
		defer func() {
			for _, x := range xs {
				assert.NoError(t, x.Release())
			}
		}()
		for range n {
			x, err := mk()
			require.NoError(t, err, name)
			xs = append(xs, x)
			b, err := tensor.Data[uint8](x)
			require.NoError(t, err, name)
			if check(b) {
				passed++
			}
		}
		return passed
	}
	all := func(v uint8) func([]byte) bool {
		return func(b []byte) bool { return !slices.ContainsFunc(b, func(c byte) bool { return c != v }) }
	}
	written := func(b []byte) bool { clear(b); b[0], b[len(b)-1] = 0xab, 0xcd; return true }
	round("dirty", func() (*tensor.Tensor, error) { return shared.Empty(tensor.Uint8, size) }, written)
	assert.Equal(t, n, round("Zeros", func() (*tensor.Tensor, error) { return shared.Zeros(tensor.Uint8, size) }, all(0)))
	assert.Equal(t, n, round("Full", func() (*tensor.Tensor, error) { return shared.Full(tensor.Uint8, 7, size) }, all(7)))
	arange := func(b []byte) bool {
		for i, c := range b {
			if c != uint8(i) {
				return false
			}
		}
		return true
	}
	round("dirty again", func() (*tensor.Tensor, error) { return shared.Empty(tensor.Uint8, size) }, written)
	assert.Equal(t, n, round("Arange", func() (*tensor.Tensor, error) { return shared.Arange(tensor.Uint8, size) }, arange))
	kept := round("Empty", func() (*tensor.Tensor, error) { return shared.Empty(tensor.Uint8, size) }, arange)
	assert.Positive(t, kept, "Empty hands out recycled blocks as their last user left them")
}

func TestFirstTensorComesWithItsStorage(t *testing.T) {
	leakcheck.Check(t)
	shared := tensor.On(device.CPU()).Shared()
	allocs := testing.AllocsPerRun(100, func() {
		x, err := shared.Zeros(tensor.Uint8, 4<<10)
		if err != nil {
			panic(err)
		}
		_ = x.Release()
	})
	assert.Equal(t, 2.0, allocs, "a pooled block's tensor: the storage with its tensor, and the safety net's record of the memory")
	allocs = testing.AllocsPerRun(100, func() {
		if _, err := tensor.Zeros(tensor.Float32, 4); err != nil {
			panic(err)
		}
	})
	assert.Equal(t, 3.0, allocs, "a heap tensor: the bytes, their record, and the storage with its tensor")

	s, err := tensor.AllocSharedStorage(0)
	require.NoError(t, err)
	const n = 8
	made := make([]*tensor.Tensor, n)
	var wg sync.WaitGroup
	for i := range made {
		wg.Go(func() {
			x, err := tensor.FromStorage(s, tensor.Float32, 0, []int{0, i}, []int{i, 1})
			assert.NoError(t, err)
			made[i] = x
		})
	}
	wg.Wait()
	for i, x := range made {
		require.NotNil(t, x)
		assert.Equal(t, []int{0, i}, x.Shape(), "tensor %d kept its own shape", i)
		assert.Same(t, s, x.Storage())
		for _, y := range made[:i] {
			assert.NotSame(t, x, y)
		}
	}
}

func ExampleTensor_ShareMemory() {
	x, _ := tensor.Arange(tensor.Float32, 6)
	m, _ := x.Reshape(2, 3)
	_ = x.ShareMemory()
	defer x.Release()
	fmt.Println(m.IsShared(), m.Shape())
	// Output: true [2 3]
}

func TestShareMemoryLargeCopiesEverything(t *testing.T) {
	leakcheck.Check(t)
	// Above the size where the copy is split across cores.
	x, err := tensor.Arange(tensor.Int32, 5<<20)
	require.NoError(t, err)
	want, err := x.Clone()
	require.NoError(t, err)
	require.NoError(t, x.ShareMemory())
	assert.True(t, tensor.Equal(x, want))
	require.NoError(t, x.Release())
}

// closingBackend is a hostBackend that can be closed.
type closingBackend struct {
	hostBackend
	closed int
	err    error
}

func (c *closingBackend) Close() error {
	c.closed++
	return c.err
}

func TestCloseBackendsClosesThoseThatClose(t *testing.T) {
	quiet, err := device.RegisterType("test_closing")
	require.NoError(t, err)
	failing, err := device.RegisterType("test_failing")
	require.NoError(t, err)
	q, f := &closingBackend{}, &closingBackend{err: errors.New("driver gone")}
	tensor.RegisterBackend(quiet, q)
	tensor.RegisterBackend(failing, f)

	err = tensor.CloseBackends()
	assert.Equal(t, 1, q.closed)
	assert.Equal(t, 1, f.closed)
	assert.ErrorContains(t, err, "closing the test_failing backend: driver gone")
	assert.NotContains(t, err.Error(), "test_closing", "a backend that closed cleanly adds nothing")
}

// A view of more elements than the machine has memory for (a zero stride
// lets four bytes stand for a trillion of them), as a peer's metadata can
// describe one, is an error to copy, not the end of the process.
func TestCopyOfAHugeViewIsAnError(t *testing.T) {
	x, err := tensor.Zeros(tensor.Float32, 1)
	require.NoError(t, err)
	huge, err := tensor.FromStorage(x.Storage(), tensor.Float32, 0, []int{1 << 40}, []int{0})
	require.NoError(t, err, "a valid view: every element is the one float")
	_, err = huge.Contiguous()
	assert.ErrorIs(t, err, tensor.ErrTooLarge)
	_, err = huge.Clone()
	assert.ErrorIs(t, err, tensor.ErrTooLarge)
	_, err = tensor.Values[float32](huge)
	assert.ErrorIs(t, err, tensor.ErrTooLarge)
	v, err := tensor.At[float32](huge, 1<<40-1)
	require.NoError(t, err, "its elements are still readable one by one")
	assert.Equal(t, float32(0), v)
}

// Many goroutines making the first tensors on a storage at once get a
// tensor each: only one takes the storage's spare.
func TestFirstTensorsFromManyGoroutinesAreTheirOwn(t *testing.T) {
	const n = 4
	for range 500 {
		s, err := tensor.AllocSharedStorage(0)
		require.NoError(t, err)
		made := make([]*tensor.Tensor, n)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range made {
			wg.Go(func() {
				<-start
				x, err := tensor.FromStorage(s, tensor.Float32, 0, []int{0, i}, []int{i, 1})
				assert.NoError(t, err)
				made[i] = x
			})
		}
		close(start)
		wg.Wait()
		for i, x := range made {
			require.NotNil(t, x)
			require.Equal(t, []int{0, i}, x.Shape(), "tensor %d kept its own shape", i)
			for _, y := range made[:i] {
				require.NotSame(t, x, y)
			}
		}
	}
}

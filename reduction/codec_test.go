//go:build linux

package reduction_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

type inner struct {
	W     *tensor.Tensor
	Scale float64
}

type nested struct {
	Name    string
	Inputs  []*tensor.Tensor
	Layers  map[string]inner
	Any     any
	Ptr     *inner
	Missing *tensor.Tensor
	Steps   []int
}

func TestCodecNestedValues(t *testing.T) {
	withStrategy(t, func(t *testing.T, st strategy.Strategy) {
		a, err := tensor.FromSlice([]float32{1, 2, 3, 4}, 2, 2)
		require.NoError(t, err)
		b, err := tensor.Arange(tensor.Int64, 5)
		require.NoError(t, err)
		aT, err := a.Transpose(0, 1)
		require.NoError(t, err)
		defer a.Release()
		defer b.Release()

		in := nested{
			Name:   "model",
			Inputs: []*tensor.Tensor{a, b},
			Layers: map[string]inner{"fc": {W: aT, Scale: 0.5}},
			Any:    b,
			Ptr:    &inner{W: a, Scale: 2},
			Steps:  []int{1, 2, 3},
		}
		data, fds, err := reduction.Marshal(&in)
		require.NoError(t, err)
		defer fd.CloseAll(fds)
		if st == strategy.FileDescriptor {
			assert.Len(t, fds, 1, "two small storages share one pooled segment, one descriptor")
		}
		// Give the decoder descriptors of its own, as a receiver has.
		own := make([]int, len(fds))
		for i, fd := range fds {
			own[i], err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
			require.NoError(t, err)
		}

		var out nested
		require.NoError(t, reduction.Unmarshal(data, own, &out))
		assert.Equal(t, "model", out.Name)
		assert.Equal(t, []int{1, 2, 3}, out.Steps)
		require.Len(t, out.Inputs, 2)
		assert.True(t, tensor.Equal(a, out.Inputs[0]))
		assert.True(t, tensor.Equal(b, out.Inputs[1]))
		assert.True(t, tensor.Equal(aT, out.Layers["fc"].W))
		assert.Equal(t, 0.5, out.Layers["fc"].Scale)
		anyT, ok := out.Any.(*tensor.Tensor)
		require.True(t, ok, "a tensor in an interface comes back as *tensor.Tensor, got %T", out.Any)
		assert.True(t, tensor.Equal(b, anyT))
		assert.True(t, tensor.Equal(a, out.Ptr.W))
		assert.Nil(t, out.Missing)
		assert.Same(t, out.Inputs[0].Storage(), out.Layers["fc"].W.Storage())
		assert.Same(t, out.Inputs[0].Storage(), out.Ptr.W.Storage())

		var loose map[string]any
		own2 := make([]int, len(fds))
		for i, fd := range fds {
			own2[i], err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
			require.NoError(t, err)
		}
		require.NoError(t, reduction.Unmarshal(data, own2, &loose))
		inputs, ok := loose["Inputs"].([]any)
		require.True(t, ok)
		_, ok = inputs[0].(*tensor.Tensor)
		assert.True(t, ok, "into map[string]any")
	})
}

func TestEncoderReuse(t *testing.T) {
	leakcheck.Check(t)
	enc := reduction.NewEncoder()
	dec := reduction.NewDecoder()
	for i := range 3 {
		x, err := tensor.Full(tensor.Int32, float64(i), 4)
		require.NoError(t, err)
		data, fds, err := enc.Encode(map[string]*tensor.Tensor{"x": x})
		require.NoError(t, err)
		require.Len(t, fds, 1)
		dup, err := unix.FcntlInt(uintptr(fds[0]), unix.F_DUPFD_CLOEXEC, 0)
		require.NoError(t, err)
		var got map[string]*tensor.Tensor
		require.NoError(t, dec.Decode(data, []int{dup}, &got))
		enc.Done() // the message was delivered
		v, err := tensor.At[int32](got["x"], 3)
		require.NoError(t, err)
		assert.Equal(t, int32(i), v)
		require.NoError(t, x.Release())
	}
}

// transposed returns a 24-element tensor and a transposed 4 x 6 view of
// it, which the test releases at its end.
func transposed(t *testing.T) (x, view *tensor.Tensor) {
	x, err := tensor.Arange(tensor.Float32, 24)
	require.NoError(t, err)
	t.Cleanup(func() { _ = x.Release() })
	m, err := x.Reshape(4, 6)
	require.NoError(t, err)
	view, err = m.Transpose(0, 1)
	require.NoError(t, err)
	return x, view
}

// A bare tensor, the commonest message, is encoded and decoded without
// msgpack's reflection: its bytes are those msgpack writes for it inside
// any other value, and they decode alike into a tensor and into any.
func TestBareTensorIsPlainMsgpack(t *testing.T) {
	leakcheck.Check(t)
	x, view := transposed(t)
	view, err := view.Narrow(0, 1, 3)
	require.NoError(t, err)

	enc := reduction.NewEncoder()
	bare, fds, err := enc.Encode(view)
	require.NoError(t, err)
	bare = append([]byte(nil), bare...)
	require.Len(t, fds, 1)
	enc.Done()
	inSlice, _, err := enc.Encode([]any{view}) // through msgpack
	require.NoError(t, err)
	enc.Done()
	assert.Equal(t, []byte{0x91}, inSlice[:1], "an array of one")
	assert.Equal(t, inSlice[1:], bare, "the same tensor encoding inside the array")

	_, fds, err = reduction.Marshal(view)
	require.NoError(t, err)
	dup, err := unix.Dup(fds[0])
	require.NoError(t, err)
	var got *tensor.Tensor
	require.NoError(t, reduction.Unmarshal(bare, fds, &got))
	var asAny any
	require.NoError(t, reduction.Unmarshal(bare, []int{dup}, &asAny))
	viaAny, ok := asAny.(*tensor.Tensor)
	require.True(t, ok, "%T", asAny)
	for _, y := range []*tensor.Tensor{got, viaAny} {
		assert.Same(t, x.Storage(), y.Storage())
		assert.Equal(t, view.Shape(), y.Shape())
		assert.Equal(t, view.Offset(), y.Offset())
		gotShape, gotStrides := y.Dims()
		wantShape, wantStrides := view.Dims()
		assert.Equal(t, wantShape, gotShape)
		assert.Equal(t, wantStrides, gotStrides)
	}
}

// A batch of tensors, what mp.PutMany sends, is encoded and decoded
// without msgpack's reflection too: its bytes are msgpack's for the same
// tensors in any array, and they decode alike through both paths.
func TestTensorBatchIsPlainMsgpack(t *testing.T) {
	leakcheck.Check(t)
	x, view := transposed(t)
	y, err := tensor.Full(tensor.Int64, 7, 3)
	require.NoError(t, err)
	defer y.Release()
	batch := []*tensor.Tensor{x, view, y, x}

	enc := reduction.NewEncoder()
	fast, fds, err := enc.Encode(batch)
	require.NoError(t, err)
	fast = append([]byte(nil), fast...)
	nfds := len(fds)
	enc.Done()
	viaMsgpack, fds, err := enc.Encode([]any{x, view, y, x})
	require.NoError(t, err)
	assert.Len(t, fds, nfds)
	assert.Equal(t, viaMsgpack, fast)
	enc.Done()

	check := func(t *testing.T, got []*tensor.Tensor) {
		t.Helper()
		require.Len(t, got, len(batch))
		for i, want := range batch {
			assert.Same(t, want.Storage(), got[i].Storage(), "tensor %d", i)
			gotShape, gotStrides := got[i].Dims()
			wantShape, wantStrides := want.Dims()
			assert.Equal(t, wantShape, gotShape, "tensor %d", i)
			assert.Equal(t, wantStrides, gotStrides, "tensor %d", i)
		}
	}
	t.Run("into a slice with room", func(t *testing.T) {
		data, fds, err := reduction.Marshal(batch)
		require.NoError(t, err)
		room := make([]*tensor.Tensor, 1, 8)
		got := room[1:]
		require.NoError(t, reduction.Unmarshal(data, fds, &got))
		check(t, got)
		assert.Same(t, &room[:2][1], &got[0], "the slice's room is reused")
	})
	t.Run("into a nil slice", func(t *testing.T) {
		data, fds, err := reduction.Marshal(batch)
		require.NoError(t, err)
		var got []*tensor.Tensor
		require.NoError(t, reduction.Unmarshal(data, fds, &got))
		check(t, got)
	})
	t.Run("into any", func(t *testing.T) {
		data, fds, err := reduction.Marshal(batch)
		require.NoError(t, err)
		var got []any
		require.NoError(t, reduction.Unmarshal(data, fds, &got))
		ts := make([]*tensor.Tensor, len(got))
		for i, v := range got {
			ts[i] = v.(*tensor.Tensor)
		}
		check(t, ts)
	})
	t.Run("with a nil tensor", func(t *testing.T) {
		data, fds, err := reduction.Marshal([]*tensor.Tensor{x, nil})
		require.NoError(t, err)
		var got []*tensor.Tensor
		require.NoError(t, reduction.Unmarshal(data, fds, &got))
		require.Len(t, got, 2)
		assert.Same(t, x.Storage(), got[0].Storage())
		assert.Nil(t, got[1])
	})
	t.Run("malformed", func(t *testing.T) {
		data, fds, err := reduction.Marshal(batch)
		require.NoError(t, err)
		defer fd.CloseAll(fds)
		dups := func() []int {
			out := make([]int, len(fds))
			for i, d := range fds {
				out[i], err = unix.Dup(d)
				require.NoError(t, err)
			}
			return out
		}
		short := slices.Clone(data)
		short[0] = 0x95 // five tensors announced, four there
		long := append(slices.Clone(data), 0xc0)
		mixed := append([]byte{0x95}, append(slices.Clone(data[1:]), 0x01)...) // four tensors and an integer
		for name, msg := range map[string][]byte{"short": short, "trailing": long, "mixed": mixed} {
			var got []*tensor.Tensor
			err := reduction.Unmarshal(msg, dups(), &got)
			assert.Error(t, err, name)
		}
	})
}

func TestPlainMsgpackRefusesTensors(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.Zeros(tensor.Float32, 2)
	require.NoError(t, err)
	_, err = msgpack.Marshal(map[string]*tensor.Tensor{"x": x})
	assert.ErrorContains(t, err, "reduction.Marshal")
	assert.False(t, x.IsShared(), "nothing was shared for a failed encode")

	data, fds, err := reduction.Marshal(map[string]*tensor.Tensor{"x": x})
	require.NoError(t, err)
	defer fd.CloseAll(fds) // the message's holds, which would otherwise outlive the test
	defer x.Release()
	var got map[string]*tensor.Tensor
	err = msgpack.Unmarshal(data, &got)
	assert.ErrorContains(t, err, "reduction.Unmarshal")
}

func TestDecodeClosesUnusedDescriptors(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.Zeros(tensor.Float32, 2)
	require.NoError(t, err)
	defer x.Release()
	data, fds, err := reduction.Marshal([]*tensor.Tensor{x, x})
	require.NoError(t, err)
	require.Len(t, fds, 1)
	defer fd.CloseAll(fds)

	dups := make([]int, 3)
	for i := range dups {
		dups[i], err = unix.FcntlInt(uintptr(fds[0]), unix.F_DUPFD_CLOEXEC, 0)
		require.NoError(t, err)
	}
	var got []*tensor.Tensor
	err = reduction.Unmarshal(data, dups, &got)
	assert.ErrorContains(t, err, "2 of them not used")
	for _, fd := range dups {
		_, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		assert.ErrorIs(t, err, unix.EBADF, "descriptor %d closed", fd)
	}
}

func BenchmarkReduceRebuildShared(b *testing.B) {
	for _, st := range strategy.All() {
		b.Run(st.String(), func(b *testing.B) {
			old := strategy.Get()
			_ = strategy.Set(st)
			defer strategy.Set(old)
			x, err := tensor.Zeros(tensor.Float32, 1<<20)
			require.NoError(b, err)
			require.NoError(b, x.ShareMemory())
			defer x.Release()
			b.ReportAllocs()
			for b.Loop() {
				m, fds, err := reduction.Reduce(x)
				if err != nil {
					b.Fatal(err)
				}
				y, err := reduction.Rebuild(m, fds)
				if err != nil {
					b.Fatal(err)
				}
				fd.CloseAll(fds)
				_ = y
			}
		})
	}
}

// BenchmarkReduce is the sender's cost for a tensor already shared, as
// an Encoder pays it for each message.
func BenchmarkReduce(b *testing.B) {
	x, err := tensor.Zeros(tensor.Float32, 1<<20)
	require.NoError(b, err)
	require.NoError(b, x.ShareMemory())
	defer x.Release()
	enc := reduction.NewEncoder()
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := enc.Encode(x); err != nil {
			b.Fatal(err)
		}
		enc.Done()
	}
}

func BenchmarkMarshalUnmarshal(b *testing.B) {
	x, err := tensor.Zeros(tensor.Float32, 1<<20)
	require.NoError(b, err)
	require.NoError(b, x.ShareMemory())
	defer x.Release()
	enc, dec := reduction.NewEncoder(), reduction.NewDecoder()
	v := map[string]*tensor.Tensor{"x": x}
	b.ReportAllocs()
	for b.Loop() {
		data, fds, err := enc.Encode(v)
		if err != nil {
			b.Fatal(err)
		}
		dup, err := unix.FcntlInt(uintptr(fds[0]), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			b.Fatal(err)
		}
		var out map[string]*tensor.Tensor
		if err := dec.Decode(data, []int{dup}, &out); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRebuildFresh is the receiving side without the cache's help:
// each iteration maps a segment this process does not hold yet, builds the
// tensor, and releases it (dup, fstat, mmap, munmap, close).
func BenchmarkRebuildFresh(b *testing.B) {
	for _, size := range []int64{4 << 10, 64 << 20} {
		b.Run(fmt.Sprintf("file_descriptor/%dKiB", size>>10), func(b *testing.B) {
			a, err := shm.Create(size, shm.KeepFD|shm.Unlink)
			require.NoError(b, err)
			defer a.Release()
			m := reduction.Meta{
				Version: reduction.Version, Strategy: "file_descriptor", FDIndex: 0, MemFDIndex: -1, Size: size, BlockOffset: -1,
				Dev: a.ID().Dev, Ino: a.ID().Ino,
				DType: tensor.Float32, Shape: []int{int(size / 4)}, Strides: []int{1}, Place: "cpu",
			}
			fds := []int{a.FD()}
			b.ReportAllocs()
			for b.Loop() {
				x, err := reduction.Rebuild(m, fds)
				if err != nil {
					b.Fatal(err)
				}
				if err := x.Release(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

//go:build linux

package reduction_test

import (
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// blockOf returns the pooled block behind x's storage.
func blockOf(t *testing.T, x *tensor.Tensor) *shm.Block {
	t.Helper()
	b, ok := x.Storage().Backing().(*shm.Block)
	require.True(t, ok, "%v is on a pooled block", x)
	return b
}

// segmentOf returns the segment of its own behind x's storage.
func segmentOf(t *testing.T, x *tensor.Tensor) *shm.Allocation {
	t.Helper()
	a, ok := x.Storage().Backing().(*shm.Allocation)
	require.True(t, ok, "%v is on a segment of its own", x)
	return a
}

// onSegment reports whether x's storage is in a shared segment.
func onSegment(x *tensor.Tensor) bool {
	switch x.Storage().Backing().(type) {
	case *shm.Block, *shm.Allocation:
		return true
	}
	return false
}

func TestMain(m *testing.M) {
	reexec.Register("rebuild-check", helperRebuildCheck)
	reexec.Register("rebuild-gpu", helperRebuildGPU)
	testmain.Run(m, testmain.WithStandInGPU(reduction.GPUConfig))
}

// withStrategy runs fn once per sharing strategy, with the process
// strategy set to it.
func withStrategy(t *testing.T, fn func(t *testing.T, st strategy.Strategy)) {
	for _, st := range strategy.All() {
		t.Run(st.String(), func(t *testing.T) {
			old := strategy.Get()
			require.NoError(t, strategy.Set(st))
			defer strategy.Set(old)
			leakcheck.Check(t)
			fn(t, st)
		})
	}
}

func TestReduceSharesInPlaceAndCopiesOnce(t *testing.T) {
	withStrategy(t, func(t *testing.T, st strategy.Strategy) {
		x, err := tensor.Arange(tensor.Float32, 64)
		require.NoError(t, err)
		defer x.Release()
		require.False(t, x.IsShared())

		m, fds, err := reduction.Reduce(x)
		require.NoError(t, err)
		defer fd.CloseAll(fds)
		assert.True(t, x.IsShared(), "sending shares the tensor in place")
		assert.Equal(t, st.String(), m.Strategy)
		assert.Equal(t, int64(256), m.Size)
		assert.Equal(t, reduction.Version, int(m.Version))
		var mem []byte
		if st == strategy.FileDescriptor {
			b := blockOf(t, x)
			mem = b.Bytes()
			require.Len(t, fds, 1)
			st, err := shm.Stat(fds[0])
			require.NoError(t, err)
			assert.Equal(t, b.Segment().ID(), st.ID, "the descriptor is the block's segment's")
			assert.Equal(t, 0, m.FDIndex)
			assert.Empty(t, m.Name)
			assert.Equal(t, b.Offset(), m.BlockOffset)
			assert.Equal(t, b.Gen(), m.Gen)
			assert.True(t, b.Busy(), "the message holds the block")
		} else {
			a := segmentOf(t, x)
			mem = a.Bytes()
			assert.Empty(t, fds)
			assert.Equal(t, -1, m.FDIndex)
			assert.Equal(t, a.Name(), m.Name)
		}

		maps, err := leakcheck.Mappings()
		require.NoError(t, err)
		_, unsent, err := reduction.Reduce(x)
		require.NoError(t, err)
		fd.CloseAll(unsent) // that metadata is never rebuilt
		data, err := tensor.Data[float32](x)
		require.NoError(t, err)
		assert.Same(t, &mem[0], (*byte)(unsafe.Pointer(&data[0])), "reducing a shared tensor copies nothing")
		after, err := leakcheck.Mappings()
		require.NoError(t, err)
		assert.Equal(t, maps, after, "and maps nothing new")

		back, err := reduction.Rebuild(m, fds)
		require.NoError(t, err)
		assert.Same(t, x.Storage(), back.Storage(), "this process's own segment comes back as the same storage")
		assert.True(t, tensor.Equal(x, back))
	})
}

func TestViewKeepsOffsetAndStrides(t *testing.T) {
	withStrategy(t, func(t *testing.T, st strategy.Strategy) {
		base, err := tensor.Arange(tensor.Int64, 48)
		require.NoError(t, err)
		defer base.Release()
		m2, err := base.Reshape(6, 8)
		require.NoError(t, err)
		rows, err := m2.Narrow(0, 2, 3)
		require.NoError(t, err)
		view, err := rows.Transpose(0, 1)
		require.NoError(t, err)

		m, fds, err := reduction.Reduce(view)
		require.NoError(t, err)
		defer fd.CloseAll(fds)
		assert.Equal(t, int64(2*8*8), m.Offset)
		assert.Equal(t, []int{8, 3}, m.Shape)
		assert.Equal(t, []int{1, 8}, m.Strides)
		assert.Equal(t, int64(48*8), m.Size, "the whole storage travels")

		back, err := reduction.Rebuild(m, fds)
		require.NoError(t, err)
		assert.True(t, tensor.Equal(view, back))
	})
}

func TestEmptyTensorTravelsWithoutSegment(t *testing.T) {
	withStrategy(t, func(t *testing.T, st strategy.Strategy) {
		e, err := tensor.Zeros(tensor.Float64, 4, 0)
		require.NoError(t, err)
		m, fds, err := reduction.Reduce(e)
		require.NoError(t, err)
		assert.Empty(t, fds)
		assert.Empty(t, m.Strategy)
		assert.Zero(t, m.Size)
		assert.False(t, onSegment(e), "an empty tensor needs no segment")

		back, err := reduction.Rebuild(m, nil)
		require.NoError(t, err)
		assert.Equal(t, []int{4, 0}, back.Shape())
		assert.True(t, back.IsShared())
		assert.Equal(t, 0, back.Numel())
	})
}

// deviceBackend is a stand-in for GPU memory, enough to make a tensor whose
// place is gpu:0.
type deviceBackend struct{}
type deviceBuffer []byte

func (deviceBackend) Alloc(p device.Place, n int64) (tensor.Buffer, error) {
	b := make(deviceBuffer, n)
	return &b, nil
}
func (b *deviceBuffer) Bytes() []byte                     { return nil }
func (b *deviceBuffer) Size() int64                       { return int64(len(*b)) }
func (b *deviceBuffer) Read(dst []byte, off int64) error  { copy(dst, (*b)[off:]); return nil }
func (b *deviceBuffer) Write(src []byte, off int64) error { copy((*b)[off:], src); return nil }
func (b *deviceBuffer) Release() error                    { return nil }

func TestOtherDeviceTensorRefused(t *testing.T) {
	typ, err := device.RegisterType("test_npu")
	require.NoError(t, err)
	tensor.RegisterBackend(typ, deviceBackend{})
	npu, err := device.Custom("test_npu", 0)
	require.NoError(t, err)
	g, err := tensor.On(npu).Zeros(tensor.Float32, 4)
	require.NoError(t, err)
	_, _, err = reduction.Reduce(g)
	assert.ErrorIs(t, err, reduction.ErrDeviceTensor)
	_, _, err = reduction.Marshal(map[string]*tensor.Tensor{"g": g})
	assert.ErrorIs(t, err, reduction.ErrDeviceTensor)
}

func TestReleasedTensorRefused(t *testing.T) {
	x, err := tensor.Zeros(tensor.Int8, 3)
	require.NoError(t, err)
	require.NoError(t, x.Release())
	_, _, err = reduction.Reduce(x)
	assert.ErrorIs(t, err, tensor.ErrReleased)
}

// receivedSegment makes a file_descriptor segment this process did not
// share itself, as if it had come from another process, and its Meta.
func receivedSegment(t *testing.T, n int) (*shm.Allocation, reduction.Meta) {
	t.Helper()
	a, err := shm.Create(int64(n)*4, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	t.Cleanup(func() { a.Release() })
	return a, reduction.Meta{
		Version: reduction.Version, Strategy: "file_descriptor", FDIndex: 0, MemFDIndex: -1, Dev: a.ID().Dev, Ino: a.ID().Ino, Size: int64(n) * 4, BlockOffset: -1,
		DType: tensor.Float32, Shape: []int{n}, Strides: []int{1}, Place: "cpu",
	}
}

func TestSameSegmentMapsOnce(t *testing.T) {
	leakcheck.Check(t)
	a, m := receivedSegment(t, 1024)
	before, err := leakcheck.Mappings()
	require.NoError(t, err)

	first, err := reduction.Rebuild(m, []int{a.FD()})
	require.NoError(t, err)
	half := m
	half.Shape, half.Offset = []int{512}, 2048
	second, err := reduction.Rebuild(half, []int{a.FD()})
	require.NoError(t, err)
	assert.Same(t, first.Storage(), second.Storage())
	after, err := leakcheck.Mappings()
	require.NoError(t, err)
	assert.Equal(t, before+1, after, "one new mapping for two receipts")

	require.NoError(t, tensor.Set[float32](second, 7, 0))
	v, err := tensor.At[float32](first, 512)
	require.NoError(t, err)
	assert.Equal(t, float32(7), v)
	require.NoError(t, first.Release())

	third, err := reduction.Rebuild(m, []int{a.FD()})
	require.NoError(t, err, "a released storage is not served from the cache")
	assert.NotSame(t, first.Storage(), third.Storage())
	require.NoError(t, third.Release())
}

// A segment this process holds a live storage of is found by the identity
// the metadata names, without a look at the descriptor: a pipe in its
// place is closed, not inspected. Memory it holds no storage of is mapped
// from the descriptor, which must then be that segment.
func TestHeldSegmentIsFoundByItsIdentity(t *testing.T) {
	leakcheck.Check(t)
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	defer fd.CloseAll(p[:])

	a, m := receivedSegment(t, 1024)
	first, err := reduction.Rebuild(m, []int{a.FD()})
	require.NoError(t, err)
	again, err := reduction.Rebuild(m, []int{p[0]})
	require.NoError(t, err)
	assert.Same(t, first.Storage(), again.Storage())
	require.NoError(t, first.Release())
	_, err = reduction.Rebuild(m, []int{p[0]})
	assert.ErrorContains(t, err, "not a regular file", "a released storage is not found by its identity")

	// A pooled block, and the whole decoder: the message's descriptor is
	// closed either way.
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Float32, 64)
	require.NoError(t, err)
	defer x.Release()
	data, fds, err := reduction.Marshal(x)
	require.NoError(t, err)
	fd.CloseAll(fds)
	held, err := unix.Dup(p[0])
	require.NoError(t, err)
	var y *tensor.Tensor
	require.NoError(t, reduction.Unmarshal(data, []int{held}, &y))
	assert.Same(t, x.Storage(), y.Storage())
	_, err = unix.FcntlInt(uintptr(held), unix.F_GETFD, 0)
	assert.ErrorIs(t, err, unix.EBADF, "the descriptor is closed")
}

// A new block of a segment this process maps already is attached by the
// segment's identity: its descriptor, the block's ticket, is taken for
// what the metadata says it is, not inspected. (Blocks of named segments,
// found by name, are mmapalloc's TestNamedPool.)
func TestMappedSegmentNeedsNoStat(t *testing.T) {
	leakcheck.Check(t)
	born := tensor.On(device.CPU()).Shared()
	x, err := born.Zeros(tensor.Float32, 64)
	require.NoError(t, err)
	y, err := born.Zeros(tensor.Float32, 64)
	require.NoError(t, err)
	require.Equal(t, blockOf(t, x).Segment().ID(), blockOf(t, y).Segment().ID(), "one segment")
	// Sent and let go of by their producer: only the messages hold them.
	xdata, xfds, err := reduction.Marshal(x)
	require.NoError(t, err)
	ydata, yfds, err := reduction.Marshal(y)
	require.NoError(t, err)
	defer fd.CloseAll(yfds)
	require.NoError(t, x.Release())
	require.NoError(t, y.Release())

	var rx, ry *tensor.Tensor
	require.NoError(t, reduction.Unmarshal(xdata, xfds, &rx), "the first block maps the segment")
	defer rx.Release()
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	defer unix.Close(p[1])
	require.NoError(t, reduction.Unmarshal(ydata, []int{p[0]}, &ry), "the second is found by the segment's identity")
	defer ry.Release()
	assert.Equal(t, blockOf(t, rx).Segment(), blockOf(t, ry).Segment(), "one mapping")
}

// Goroutines decoding the same pooled block at once all get one storage:
// the first registered wins, and the others give back what they attached.
func TestConcurrentReceiptsOfABlockShareOneStorage(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Float32, 64)
	require.NoError(t, err)
	data, fds, err := reduction.Marshal(x)
	require.NoError(t, err)
	defer fd.CloseAll(fds)
	require.NoError(t, x.Release()) // the message holds it; receivers attach it
	s := oneStorageFromAll(t, func() (*tensor.Tensor, error) {
		fd, err := unix.Dup(fds[0])
		if err != nil {
			return nil, err
		}
		var y *tensor.Tensor
		return y, reduction.Unmarshal(data, []int{fd}, &y)
	})
	require.NoError(t, s.Release())
}

func TestConcurrentRebuildSharesOneStorage(t *testing.T) {
	leakcheck.Check(t)
	a, m := receivedSegment(t, 4096)
	s := oneStorageFromAll(t, func() (*tensor.Tensor, error) { return reduction.Rebuild(m, []int{a.FD()}) })
	require.NoError(t, s.Release())
}

// oneStorageFromAll runs rebuild in 16 goroutines at once and checks that
// the tensors they made are all on one storage, which it returns.
func oneStorageFromAll(t *testing.T, rebuild func() (*tensor.Tensor, error)) *tensor.Storage {
	t.Helper()
	got := make([]*tensor.Tensor, 16)
	var wg sync.WaitGroup
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x, err := rebuild()
			if assert.NoError(t, err) {
				got[i] = x
			}
		}()
	}
	wg.Wait()
	for _, x := range got {
		require.NotNil(t, x)
		assert.Same(t, got[0].Storage(), x.Storage())
	}
	return got[0].Storage()
}

func TestRebuildBorrowsDescriptors(t *testing.T) {
	leakcheck.Check(t)
	a, m := receivedSegment(t, 16)
	x, err := reduction.Rebuild(m, []int{a.FD()})
	require.NoError(t, err)
	require.NoError(t, a.Release())
	_, err = unix.FcntlInt(uintptr(segmentOf(t, x).FD()), unix.F_GETFD, 0)
	assert.NoError(t, err, "the rebuilt storage holds its own duplicate")
	require.NoError(t, x.Release())
}

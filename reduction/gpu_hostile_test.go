//go:build linux

package reduction

import (
	"errors"
	"flag"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// slabMessage is a message carrying a GPU tensor of n int32s in a device
// slab of device 0, as another process would receive it: the
// tensor is released here, so that the receiver finds no storage of its
// own and imports the slab. It returns the message's Meta and its two
// descriptors, the block's ticket and the slab's, which are the caller's.
func slabMessage(t testing.TB, n int) (Meta, [2]int) {
	t.Helper()
	x, err := tensor.On(slabGPU).Arange(tensor.Int32, n)
	require.NoError(t, err)
	return messageOf(t, x)
}

// messageOf is slabMessage for x, which it releases.
func messageOf(t testing.TB, x *tensor.Tensor) (Meta, [2]int) {
	t.Helper()
	m, fds, err := Reduce(x)
	require.NoError(t, err)
	require.NoError(t, x.Release())
	require.Len(t, fds, 2)
	require.Equal(t, StrategyCUDAFD, m.Strategy)
	return m, [2]int{fds[0], fds[1]}
}

// A received slab is imported from the message's descriptor, once.
func TestGPUSlabImportedFromTheMessage(t *testing.T) {
	leakcheck.Check(t)
	handles := cudastub.Handles()
	m, fds := slabMessage(t, 256)
	x, err := Rebuild(m, fds[:])
	require.NoError(t, err)
	fd.CloseAll(fds[:])
	assert.Equal(t, handles+2, cudastub.Handles(), "the producer's slab, and the receiver's import of it")
	want, err := tensor.Arange(tensor.Int32, 256)
	require.NoError(t, err)
	host, err := x.To(device.CPU())
	require.NoError(t, err)
	assert.True(t, tensor.Equal(host, want))
	require.NoError(t, x.Release())
}

// What is not the slab a cuda_fd tensor names is a clear error: a slab
// descriptor that is no allocation, another device's, one smaller than
// the slab; a ticket of another segment; a block outside the slab. Each
// closes every descriptor and maps nothing.
func TestHostileSlabMessages(t *testing.T) {
	leakcheck.Check(t)
	var pipe [2]int
	require.NoError(t, unix.Pipe2(pipe[:], unix.O_CLOEXEC))
	defer fd.CloseAll(pipe[:])
	memfd, err := unix.MemfdCreate("not-an-allocation", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(memfd)
	require.NoError(t, unix.Ftruncate(memfd, 2<<20))
	cpu, err := shm.Create(4096, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	defer cpu.Release()
	other, err := tensor.On(otherGPU).Zeros(tensor.Uint8, 16)
	require.NoError(t, err)
	defer other.Release()
	_, otherFDs, err := Reduce(other)
	require.NoError(t, err)
	defer fd.CloseAll(otherFDs)

	for _, c := range []struct {
		name string
		edit func(m *Meta, fds *[2]int)
		want string
	}{
		{"a pipe for the slab", func(m *Meta, fds *[2]int) { swap(t, &fds[1], pipe[0]) }, "importing a slab"},
		{"a memfd for the slab", func(m *Meta, fds *[2]int) { swap(t, &fds[1], memfd) }, "importing a slab"},
		{"a CPU segment for the slab", func(m *Meta, fds *[2]int) { swap(t, &fds[1], cpu.FD()) }, "importing a slab"},
		{"another device's slab", func(m *Meta, fds *[2]int) { swap(t, &fds[1], otherFDs[1]) }, "not of gpu:0"},
		{"the slab for the ticket", func(m *Meta, fds *[2]int) { swap(t, &fds[0], fds[1]) }, "descriptor is of segment"},
		{"a CPU segment for the ticket", func(m *Meta, fds *[2]int) { swap(t, &fds[0], cpu.FD()) }, "descriptor is of segment"},
		{"a slab of another size", func(m *Meta, fds *[2]int) {
			// The block of a slab of its own, over 16 MiB, with the
			// small slab's descriptor.
			large, err := tensor.On(slabGPU).Zeros(tensor.Uint8, 17<<20)
			require.NoError(t, err)
			lm, lfds := messageOf(t, large)
			*m = lm
			swap(t, &fds[0], lfds[0])
			fd.CloseAll(lfds[:])
		}, "mapping a slab"},
		{"a block outside the slab", func(m *Meta, fds *[2]int) { m.BlockOffset = 1 << 40 }, "not a slot"},
		{"a size beyond the block", func(m *Meta, fds *[2]int) { m.Size, m.Shape = 1<<20, []int{1 << 18} }, "not a slot"},
		{"no slab descriptor", func(m *Meta, fds *[2]int) { m.MemFDIndex = 2 }, "slab's descriptor"},
		{"a slab descriptor on a CPU tensor", func(m *Meta, fds *[2]int) { m.Place = "cpu" }, `strategy "cuda_fd" for a tensor on cpu`},
		{"a slab descriptor for cuda_ipc", func(m *Meta, fds *[2]int) { m.Strategy = StrategyCUDAIPC }, "carries a device slab's descriptor"},
	} {
		t.Run(c.name, func(t *testing.T) {
			shm.Trim()
			base, handles, mapped := leakcheck.Count(), cudastub.Handles(), cudastub.Mappings()
			m, fds := slabMessage(t, 256)
			c.edit(&m, &fds)
			var x *tensor.Tensor
			err := NewDecoder().Decode(extMessage(t, m), fds[:], &x)
			require.Error(t, err)
			assert.ErrorContains(t, err, c.want)
			assert.ErrorIs(t, err, ErrMalformed)
			// The producer's slab, held by nothing now, goes with the
			// trim, and so does what the receiver keeps for reuse.
			var fdsNow, handlesNow, mappedNow int
			assert.Eventually(t, func() bool {
				shm.Trim()
				fdsNow, handlesNow, mappedNow = leakcheck.Count(), cudastub.Handles(), cudastub.Mappings()
				return fdsNow <= base && handlesNow <= handles && mappedNow <= mapped
			}, 5*time.Second, time.Millisecond, "every descriptor of the message closed, nothing imported or mapped stays: "+
				"descriptors %d -> %d, handles %d -> %d, mappings %d -> %d", base, fdsNow, handles, handlesNow, mapped, mappedNow)
		})
	}
}

// swap replaces *fd, a message's descriptor, by a duplicate of other.
func swap(t testing.TB, fd *int, other int) {
	t.Helper()
	require.NoError(t, unix.Close(*fd))
	*fd = dupFD(t, other)
}

// FuzzUnmarshalGPU decodes arbitrary bytes with descriptors of a device
// slab's message, and of other kinds, in any order: whatever the input,
// no panic, every descriptor owned by a rebuilt tensor or closed, and
// nothing of the device left imported once the results are released.
func FuzzUnmarshalGPU(f *testing.F) {
	// The message stays in flight for the whole run: its ticket holds the
	// block, so every input names a live block of a live slab, which
	// this process no longer holds a tensor of (slabMessage released
	// it), and the seeds reach the import, the mapping and the rebuild.
	m, kept := slabMessage(f, 64)
	msg := extMessage(f, m)
	f.Cleanup(func() { fd.CloseAll(kept[:]) })
	f.Add(msg, []byte{0, 1})
	f.Add(msg, []byte{1, 0})
	f.Add(msg, []byte{0, 2})
	f.Add(msg, []byte{0, 3})
	f.Add(msg, []byte{0})
	legacy := m
	legacy.Strategy, legacy.MemFDIndex, legacy.Dev, legacy.Ino = StrategyCUDAIPC, -1, 0, 0
	f.Add(extMessage(f, legacy), []byte{0})
	var pipe [2]int
	require.NoError(f, unix.Pipe2(pipe[:], unix.O_CLOEXEC))
	f.Cleanup(func() { fd.CloseAll(pipe[:]) })
	shm.Trim()
	base := leakcheck.Count()
	handles, mapped := cudastub.Handles(), cudastub.Mappings()

	var rebuilt atomic.Int64
	f.Cleanup(func() {
		if fuzzing := flag.Lookup("test.fuzz"); (fuzzing == nil || fuzzing.Value.String() == "") && rebuilt.Load() == 0 {
			f.Error("no seed reached a rebuild")
		}
	})
	f.Fuzz(func(t *testing.T, data []byte, kinds []byte) {
		msgFDs := [2]int{dupFD(t, kept[0]), dupFD(t, kept[1])}
		var fds []int
		for _, k := range kinds[:min(len(kinds), 4)] {
			switch k % 4 {
			case 0, 1:
				fds = append(fds, dupFD(t, msgFDs[k%2]))
			case 2:
				fds = append(fds, dupFD(t, pipe[0]))
			case 3:
				fds = append(fds, dupFD(t, pipe[1]))
			}
		}
		fd.CloseAll(msgFDs[:])
		var v any
		if err := Unmarshal(data, fds, &v); err == nil {
			if x, ok := v.(*tensor.Tensor); ok && x.Place().IsGPU() {
				rebuilt.Add(1)
			}
			leakcheck.Free(v)
		} else if !errors.Is(err, ErrMalformed) {
			t.Errorf("an error for a message that does not wrap ErrMalformed: %v", err)
		}
		// What the producer's pool and the receiver keep for reuse goes
		// with the trim, once the receiver's holds are settled.
		for deadline := time.Now().Add(time.Second); ; time.Sleep(time.Millisecond) {
			shm.Trim()
			n, h, m := leakcheck.Count(), cudastub.Handles(), cudastub.Mappings()
			if n == base && h == handles && m == mapped {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("descriptors %d, device handles %d, mappings %d before; %d, %d, %d after", base, handles, mapped, n, h, m)
			}
		}
	})
}

// Metadata that names a block of a device slab this process holds a GPU
// tensor in, for a tensor on another place, is refused: a tensor rebuilt
// is never on a place other than the one its metadata names.
func TestMetaNamingALiveSlabBlockElsewhere(t *testing.T) {
	for _, c := range []struct {
		name, strategy, place string
		keepMemFD             bool
	}{
		{"a CPU tensor", "file_descriptor", "cpu", false},
		{"another GPU's tensor", StrategyCUDAFD, legacyGPU.String(), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			leakcheck.Check(t)
			x, err := tensor.On(slabGPU).Arange(tensor.Int32, 256)
			require.NoError(t, err)
			defer x.Release()
			m, fds, err := Reduce(x)
			require.NoError(t, err)
			require.Len(t, fds, 2)
			if !c.keepMemFD {
				require.NoError(t, unix.Close(fds[1]))
				fds, m.MemFDIndex = fds[:1], -1
			}
			m.Strategy, m.Place, m.DevUUID = c.strategy, c.place, nil
			if p := device.MustParse(c.place); p.IsGPU() {
				rt, err := cuda.Default()
				require.NoError(t, err)
				u, err := rt.UUID(p.Index())
				require.NoError(t, err)
				m.DevUUID = u[:]
			}
			var y *tensor.Tensor
			err = NewDecoder().Decode(extMessage(t, m), fds, &y)
			assert.ErrorContains(t, err, "a storage on gpu:0 named for a tensor on "+c.place)
			assert.ErrorIs(t, err, ErrMalformed)
			assert.Nil(t, y)
		})
	}
}

// A message naming a block of a slab this process holds a tensor in,
// with the descriptor of another allocation for the slab, is refused:
// every honest message about a slab carries the one export of it.
func TestSlabDescriptorOfAnotherAllocation(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.On(slabGPU).Arange(tensor.Int32, 256)
	require.NoError(t, err)
	defer x.Release()
	large, err := tensor.On(slabGPU).Zeros(tensor.Uint8, 17<<20) // a slab of its own
	require.NoError(t, err)
	defer large.Release()
	_, lfds, err := Reduce(large)
	require.NoError(t, err)
	defer fd.CloseAll(lfds)
	m, fds, err := Reduce(x)
	require.NoError(t, err)
	require.Len(t, fds, 2)
	swap(t, &fds[1], lfds[1])
	var y *tensor.Tensor
	err = NewDecoder().Decode(extMessage(t, m), fds, &y)
	assert.ErrorContains(t, err, "not of the allocation this process maps for its segment")
	assert.ErrorIs(t, err, ErrMalformed)
	assert.Nil(t, y)
}

// A message that came by a lane names a slab block by the slab's
// identity alone, with neither descriptor: it is rebuilt where the
// lane's reader pins the slab's segment and has imported the slab (the
// first block of it it received came with the slab's descriptor), and is
// a clear error everywhere else: outside a lane, with the slab's
// descriptor but not the block's, in a segment the lane does not pin, in
// a slab not imported here, or in a CPU segment.
func TestSlabBlockByLane(t *testing.T) {
	leakcheck.Check(t)
	t.Cleanup(shm.Trim)
	x, err := tensor.On(slabGPU).Arange(tensor.Int32, 256)
	require.NoError(t, err)
	y, err := tensor.On(slabGPU).Full(tensor.Int32, 9, 256)
	require.NoError(t, err)
	mx, fx := messageOf(t, x)
	my, fy := messageOf(t, y) // in flight: its ticket holds y's block
	defer fd.CloseAll(fy[:])
	require.Equal(t, mx.segmentID(), my.segmentID(), "one slab")
	byID := my
	byID.FDIndex, byID.MemFDIndex = -1, -1
	pins := pinnedLane{my.segmentID(): true}
	decode := func(m Meta, lane carry.Lane, byLane bool) (*tensor.Tensor, error) {
		var fds fd.Set
		var got *tensor.Tensor
		err := carry.DecodeFrom(extMessage(t, m), &fds, &got, lane, byLane)
		return got, err
	}

	// The slab's segment mapped here (x's block attached from its
	// ticket), the slab not imported yet.
	held, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: mx.segmentID(), Size: mx.SegmentSize}, Offset: mx.BlockOffset, Size: mx.Size, Gen: mx.Gen, Ticket: fx[0]})
	require.NoError(t, err)
	_, err = decode(byID, pins, true)
	assert.ErrorIs(t, err, shm.ErrNotMapped, "a slab not imported here")
	assert.ErrorIs(t, err, ErrMalformed)
	require.NoError(t, held.Release())

	// Imported with x, received by descriptor.
	rx, err := Rebuild(mx, fx[:])
	require.NoError(t, err)
	fd.CloseAll(fx[:])
	defer rx.Release()
	got, err := decode(byID, pins, true)
	require.NoError(t, err)
	host, err := got.To(device.CPU())
	require.NoError(t, err)
	vals, err := tensor.Values[int32](host)
	require.NoError(t, err)
	assert.Equal(t, slices.Repeat([]int32{9}, 256), vals, "y's block, whose values it has")
	again, err := decode(byID, pins, true)
	require.NoError(t, err, "a block this process holds already")
	assert.Same(t, got.Storage(), again.Storage(), "the storage that holds it")
	require.NoError(t, got.Release())

	gs, err := gpushare.Get()
	require.NoError(t, err)
	uuid, err := gs.UUID(otherGPU.Index())
	require.NoError(t, err)
	elsewhere := byID
	elsewhere.DevUUID = uuid[:]
	_, err = decode(elsewhere, pins, true)
	assert.ErrorContains(t, err, "mapped for another device", "a block of a slab imported for another device")

	_, err = decode(byID, pins, false)
	assert.ErrorContains(t, err, "outside a lane")
	withSlab := byID
	withSlab.MemFDIndex = 0
	_, err = decode(withSlab, pins, true)
	assert.ErrorContains(t, err, "but the slab's")
	_, err = decode(byID, pinnedLane{}, true)
	assert.ErrorIs(t, err, shm.ErrNotMapped, "a slab the lane does not pin")

	cpu, cm := laneBlocks(t, 1, 4096)[0], byID // a block of another process's pool, whose segment this process pins
	cm.setSegmentID(cpu.segmentID())
	cm.SegmentSize, cm.BlockOffset, cm.Gen, cm.Size = cpu.SegmentSize, cpu.BlockOffset, cpu.Gen, cpu.Size
	_, err = decode(cm, pinnedLane{cpu.segmentID(): true}, true)
	assert.ErrorIs(t, err, shm.ErrNoExtent, "a CPU block named as a slab's")
	assert.ErrorIs(t, err, ErrMalformed)
}

// A peer that reopened a message's descriptor of this process's own
// device slab's segment, a description that holds nothing, names a slot
// its pool has free with the generation it is handed out with next: the
// attach is refused, as for a CPU segment (TestOwnBlockByAPeersDescriptor).
func TestOwnFreeSlabBlockByAPeersDescriptor(t *testing.T) {
	leakcheck.Check(t)
	t.Cleanup(shm.Trim)
	keep, err := tensor.On(slabGPU).Zeros(tensor.Int32, 256) // keeps the slab in its pool
	require.NoError(t, err)
	defer keep.Release()
	x, err := tensor.On(slabGPU).Arange(tensor.Int32, 256)
	require.NoError(t, err)
	m, fds := messageOf(t, x) // x released: its block waits for the message's ticket
	defer unix.Close(fds[1])
	peer, err := unix.Open("/proc/self/fd/"+strconv.Itoa(fds[0]), unix.O_RDWR|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(peer)
	require.NoError(t, unix.Close(fds[0])) // the ticket goes: nothing holds the block
	shm.Trim()                             // which its pool takes back, free, at a new generation
	m.Gen++                                // that one
	var got *tensor.Tensor
	err = NewDecoder().Decode(extMessage(t, m), []int{dupFD(t, peer), dupFD(t, fds[1])}, &got)
	if err == nil {
		require.NoError(t, got.Release())
	}
	assert.ErrorIs(t, err, shm.ErrStaleBlock)
	assert.ErrorContains(t, err, "this process's pool")
}

// A lane's reader that pins a device slab's segment keeps the slab's
// device memory mapped: the pin counts those bytes against the reader's
// bound on what it pins, not the few of the slot table's segment.
func TestPinOfASlabCountsItsDeviceMemory(t *testing.T) {
	leakcheck.Check(t)
	t.Cleanup(shm.Trim)
	x, err := tensor.On(slabGPU).Zeros(tensor.Uint8, 64<<20) // a slab of its own
	require.NoError(t, err)
	m, fds := messageOf(t, x)
	rx, err := Rebuild(m, fds[:])
	require.NoError(t, err)
	fd.CloseAll(fds[:])
	defer rx.Release()
	unpin, size, ok := shm.Pin(m.segmentID())
	require.True(t, ok)
	defer unpin()
	assert.GreaterOrEqual(t, size, rx.Storage().Size())
}

// importedSlab imports slabGPU's slab into this process, as a block of
// it received by descriptor does, until the test's end, and returns that
// block's message.
func importedSlab(t *testing.T) Meta {
	t.Helper()
	t.Cleanup(shm.Trim) // after the release below
	x, err := tensor.On(slabGPU).Zeros(tensor.Int32, 256)
	require.NoError(t, err)
	mx, fx := messageOf(t, x)
	rx, err := Rebuild(mx, fx[:])
	require.NoError(t, err)
	fd.CloseAll(fx[:])
	t.Cleanup(func() { _ = rx.Release() })
	return mx
}

// A lane's batch that names a slab block twice leaves the second attach
// of it untaken (its tensor finds the first one's storage): each tensor
// after it takes its own block, not that one, and the decode lets go of
// it, also once a later window attached blocks of its own.
func TestSlabBatchNamingABlockTwice(t *testing.T) {
	leakcheck.Check(t)
	mx := importedSlab(t)
	// Four blocks of the slab in flight, block i full of i+1.
	var ms []Meta
	for i := range 4 {
		y, err := tensor.On(slabGPU).Full(tensor.Int32, float64(i+1), 256)
		require.NoError(t, err)
		m, fds := messageOf(t, y) // its ticket holds its block
		defer fd.CloseAll(fds[:])
		require.Equal(t, mx.segmentID(), m.segmentID(), "one slab")
		m.FDIndex, m.MemFDIndex = -1, -1
		ms = append(ms, m)
	}
	lane := pinnedLane{mx.segmentID(): true}
	// The first window: A twice, B, then C to its end; the second: D twice.
	which := []int{0, 0, 1}
	for len(which) < batchWindow {
		which = append(which, 2)
	}
	which = append(which, 3, 3)
	var named []Meta
	for _, i := range which {
		named = append(named, ms[i])
	}
	before := blockHolds(ms)
	var fds fd.Set
	var xs []*tensor.Tensor
	require.NoError(t, carry.DecodeFrom(batchMessage(t, named...), &fds, &xs, lane, true))
	require.Len(t, xs, len(named))
	for i, x := range xs {
		host, err := x.To(device.CPU())
		require.NoError(t, err)
		vals, err := tensor.Values[int32](host)
		require.NoError(t, err)
		require.NoError(t, host.Release())
		assert.Equal(t, slices.Repeat([]int32{int32(which[i] + 1)}, 256), vals, "tensor %d, of block %d", i, which[i])
	}
	assert.Same(t, xs[0].Storage(), xs[1].Storage(), "the block named twice is one storage")
	for _, x := range xs {
		require.NoError(t, x.Release())
	}
	assert.Equal(t, before, blockHolds(ms), "the holds once the tensors are released")
}

// A lane's batch that names a slab block twice with one size, and then
// once more with a larger one, decodes the last tensor from the attach
// made for it: the second attach, left untaken (its tensor finds the
// first one's storage), is of the smaller size and may not stand in for
// it. The last tensor is a storage of the size it names, over the whole
// block, and the decode gives back every hold it took.
func TestSlabBatchNamingABlockTwiceWithTwoSizes(t *testing.T) {
	leakcheck.Check(t)
	mx := importedSlab(t)
	y, err := tensor.On(slabGPU).Arange(tensor.Int32, 256)
	require.NoError(t, err)
	whole, fds := messageOf(t, y) // its ticket holds its block
	defer fd.CloseAll(fds[:])
	require.Equal(t, mx.segmentID(), whole.segmentID(), "one slab")
	whole.FDIndex, whole.MemFDIndex = -1, -1
	half := whole // the block's first 128 int32s
	half.Size, half.Shape = whole.Size/2, []int{128}
	lane := pinnedLane{whole.segmentID(): true}

	before := blockHolds([]Meta{whole})
	var dec fd.Set
	var xs []*tensor.Tensor
	require.NoError(t, carry.DecodeFrom(batchMessage(t, half, half, whole), &dec, &xs, lane, true))
	require.Len(t, xs, 3)
	assert.Same(t, xs[0].Storage(), xs[1].Storage(), "the block named twice with one size is one storage")
	assert.Equal(t, whole.Size/2, xs[0].Storage().Size())
	assert.Equal(t, whole.Size, xs[2].Storage().Size(), "the block named with its whole size")
	for i, n := range []int{128, 128, 256} {
		host, err := xs[i].To(device.CPU())
		require.NoError(t, err)
		vals, err := tensor.Values[int32](host)
		require.NoError(t, err)
		require.NoError(t, host.Release())
		want := make([]int32, n)
		for j := range want {
			want[j] = int32(j)
		}
		assert.Equal(t, want, vals, "tensor %d", i)
	}
	for _, x := range xs {
		require.NoError(t, x.Release())
	}
	assert.Equal(t, before, blockHolds([]Meta{whole}), "the holds once the tensors are released")
}

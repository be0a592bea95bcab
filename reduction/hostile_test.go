//go:build linux

package reduction

import (
	"bytes"
	"errors"
	"flag"
	"math"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// extMessage encodes m the way the codec does, as a one-tensor message.
func extMessage(t testing.TB, m Meta) []byte {
	t.Helper()
	payload, err := msgpack.Marshal(&m)
	require.NoError(t, err)
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	require.NoError(t, enc.EncodeExtHeader(tensorExt, len(payload)))
	buf.Write(payload)
	return buf.Bytes()
}

func dupFD(t testing.TB, fd int) int {
	t.Helper()
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	require.NoError(t, err)
	return d
}

// TestHostileInput feeds the decoder malformed metadata and descriptor
// lists. Each must be a clear error, close every descriptor, and leak
// nothing.
func TestHostileInput(t *testing.T) {
	leakcheck.Check(t)
	seg, err := shm.Create(4096, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	defer seg.Release()
	var pipe [2]int
	require.NoError(t, unix.Pipe2(pipe[:], unix.O_CLOEXEC))
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])

	other, err := shm.Create(4096, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	defer other.Release()

	// with varies the valid Meta; one that leaves the file_descriptor
	// strategy loses the segment's identity too, which withID keeps.
	vary := func(f func(m *Meta), keepID bool) []byte {
		m := validMeta(seg.ID())
		f(&m)
		if m.Strategy != "file_descriptor" && !keepID {
			m.Dev, m.Ino = 0, 0
		}
		return extMessage(t, m)
	}
	with := func(f func(m *Meta)) []byte { return vary(f, false) }
	withID := func(f func(m *Meta)) []byte { return vary(f, true) }
	segFD := func() []int { return []int{dupFD(t, seg.FD())} }
	cases := []struct {
		name string
		data []byte
		fds  func() []int
		msg  string
	}{
		{"future version", with(func(m *Meta) { m.Version = Version + 1 }), segFD, "metadata version"},
		{"unknown dtype", with(func(m *Meta) { m.DType = 99 }), segFD, "invalid dtype"},
		{"invalid dtype", with(func(m *Meta) { m.DType = 0 }), segFD, "invalid dtype"},
		{"negative shape", with(func(m *Meta) { m.Shape = []int{-32, 32} }), segFD, "negative size"},
		{"overflowing shape", with(func(m *Meta) { m.Shape = []int{math.MaxInt / 2, 8}; m.Strides = []int{8, 1} }), segFD, "overflows"},
		{"too many dims", with(func(m *Meta) { m.Shape = make([]int, 65); m.Strides = make([]int, 65) }), segFD, "dimensions"},
		{"rank mismatch", with(func(m *Meta) { m.Strides = []int{1} }), segFD, "strides for"},
		{"strides reach outside", with(func(m *Meta) { m.Strides = []int{33, 1} }), segFD, "reach past"},
		{"overflowing stride", with(func(m *Meta) { m.Strides = []int{math.MaxInt / 4, 1} }), segFD, "overflow"},
		{"negative stride", with(func(m *Meta) { m.Strides = []int{-32, 1} }), segFD, "negative stride"},
		{"offset plus size beyond", with(func(m *Meta) { m.Offset = 4 }), segFD, "reach past"},
		{"misaligned offset", with(func(m *Meta) { m.Offset = 2; m.Shape = []int{4}; m.Strides = []int{1} }), segFD, "not a multiple"},
		{"size beyond segment", with(func(m *Meta) { m.Size = 8192 }), segFD, "fewer than"},
		{"negative size", with(func(m *Meta) { m.Size = -1 }), segFD, "negative segment size"},
		{"fd index out of range", with(func(m *Meta) { m.FDIndex = 3 }), segFD, "out of range"},
		{"fd index negative", with(func(m *Meta) { m.FDIndex = -1 }), segFD, "out of range"},
		{"no fds", validMetaMsg(t, seg.ID()), func() []int { return nil }, "out of range"},
		{"extra fds", validMetaMsg(t, seg.ID()), func() []int { return []int{dupFD(t, seg.FD()), dupFD(t, seg.FD())} }, "not used"},
		{"fd not a file", validMetaMsg(t, seg.ID()), func() []int { return []int{dupFD(t, pipe[0])} }, "not a regular file"},
		{"fd strategy with name", with(func(m *Meta) { m.Name = "x" }), segFD, "carries a name"},
		{"fd strategy naming no segment", with(func(m *Meta) { m.Dev, m.Ino = 0, 0 }), segFD, "names no segment"},
		{"descriptor of another segment", with(func(m *Meta) { m.Dev, m.Ino = other.ID().Dev, other.ID().Ino }), segFD, "that the metadata names"},
		{"block with descriptor of another segment", with(func(m *Meta) {
			m.Dev, m.Ino = other.ID().Dev, other.ID().Ino
			m.SegmentSize, m.BlockOffset, m.Gen = 1<<20, 4096, 1
		}), segFD, "is of segment"},
		{"block by identity outside a lane", with(func(m *Meta) {
			m.FDIndex = -1
			m.SegmentSize, m.BlockOffset, m.Gen = 1<<20, 4096, 1
		}), nil, "outside a lane"},
		{"identity in fs metadata", withID(func(m *Meta) {
			m.Strategy = "file_system"
			m.FDIndex = -1
			m.Name = shm.SessionPrefix() + "1_0123456789abcdef"
		}), nil, "carries a file_descriptor segment's identity"},
		{"identity in empty metadata", withID(func(m *Meta) { m.Strategy = ""; m.FDIndex = -1; m.Size = 0; m.Shape = []int{0}; m.Strides = []int{1} }), nil, "carries a file_descriptor segment's identity"},
		{"name traversal", with(func(m *Meta) { m.Strategy = "file_system"; m.FDIndex = -1; m.Name = "../../etc/passwd" }), nil, "not a tensormp segment name"},
		{"absolute name", with(func(m *Meta) {
			m.Strategy = "file_system"
			m.FDIndex = -1
			m.Name = "/dev/shm/" + shm.SessionPrefix() + "1_0123456789abcdef"
		}), nil, "not a tensormp segment name"},
		{"missing segment", with(func(m *Meta) {
			m.Strategy = "file_system"
			m.FDIndex = -1
			m.Name = shm.SessionPrefix() + "1_0123456789abcdef"
		}), nil, "no such file"},
		{"fs with fd", with(func(m *Meta) { m.Strategy = "file_system"; m.Name = seg.Name() }), segFD, "refers to a descriptor"},
		{"another session's segment", with(func(m *Meta) {
			m.Strategy = "file_system"
			m.FDIndex = -1
			m.Name = shm.NamePrefix + "0ther5e55_1_0123456789abcdef"
		}), nil, "belongs to another session"},
		{"another session's block", with(func(m *Meta) {
			m.Strategy = "file_system"
			m.Name = shm.NamePrefix + "0ther5e55_1_0123456789abcdef"
			m.SegmentSize, m.BlockOffset, m.Gen = 1<<20, 4096, 1
		}), segFD, "belongs to another session"},
		{"unknown strategy", with(func(m *Meta) { m.Strategy = "shared_pointer" }), segFD, "unknown strategy"},
		{"empty with elements", with(func(m *Meta) {
			m.Strategy = ""
			m.FDIndex = -1
			m.Size = 0
			m.Shape = []int{0}
			m.Strides = []int{1}
			m.Shape = []int{1}
		}), nil, "reach past"},
		{"empty with fd", with(func(m *Meta) { m.Strategy = ""; m.Size = 0; m.Shape = []int{0}; m.Strides = []int{1} }), segFD, "carries no segment"},
		{"unregistered place", with(func(m *Meta) { m.Place = "tpu:0" }), segFD, "unknown device type"},
		{"gpu place for a cpu strategy", with(func(m *Meta) { m.Place = "gpu:0" }), segFD, `strategy "file_descriptor" for a tensor on gpu:0`},
		{"cuda_ipc without handles", with(func(m *Meta) { m.Place, m.Strategy, m.DevUUID = "gpu:0", StrategyCUDAIPC, gpuUUID(0) }), segFD, "handles"},
		{"gpu tensor without a device uuid", with(func(m *Meta) { m.Place = "gpu:0"; m.Strategy = StrategyCUDAIPC }), segFD, "device UUID of 0 bytes"},
		{"gpu tensor of a device not here", with(func(m *Meta) {
			m.Place, m.Strategy, m.DevUUID = "gpu:0", StrategyCUDAIPC, make([]byte, 16)
		}), segFD, "is not one of this process's"},
		{"cpu tensor with a device uuid", with(func(m *Meta) { m.DevUUID = gpuUUID(0) }), segFD, "names a device UUID"},
		{"cuda_ipc on the cpu", with(func(m *Meta) { m.Strategy = StrategyCUDAIPC }), segFD, `strategy "cuda_ipc" for a tensor on cpu`},
		{"bad lod", with(func(m *Meta) { m.LoD = [][]int{{3, 1}} }), segFD, "LoD"},
		{"truncated", validMetaMsg(t, seg.ID())[:10], segFD, ""},
		{"trailing bytes", append(validMetaMsg(t, seg.ID()), 0xc0), segFD, "bytes after the value"},
		{"ext length past end", []byte{0xc7, 0xff, byte(tensorExt), 0x01}, segFD, "runs past the message"},
		{"garbage payload", []byte{0xd4, byte(tensorExt), 0xc2}, segFD, "code 0xc2 where an array belongs"},
		{"cut compact payload", []byte{0xd4, byte(tensorExt), compactTag}, segFD, "unexpected end of tensor metadata"},
		{"storage for a tensor", []byte{0xd4, byte(storageExt), 0xc1}, segFD, "ext type"},
		{"huge array header", []byte{0xdd, 0xdd, 0xdd, 0xdd, 0xdd, 0xc0}, segFD, "runs past the message"},
		{"huge shape in metadata", hugeShapeMsg(t), segFD, "unexpected end of tensor metadata"},
		{"deep nesting", append(bytes.Repeat([]byte{0x91}, 100000), 0xc0), segFD, "nested deeper"},
		{"wrong ext type", []byte{0xd4, 0x01, 0x00}, segFD, "ext"},
		{"empty message", nil, segFD, "unexpected end"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var fds []int
			if c.fds != nil {
				fds = c.fds()
			}
			var x *tensor.Tensor
			err := Unmarshal(c.data, fds, &x)
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrMalformed)
			if c.msg != "" {
				assert.ErrorContains(t, err, c.msg)
			}
			t.Log(err)
			for _, fd := range fds {
				_, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
				assert.ErrorIs(t, err, unix.EBADF, "descriptor %d closed after the error", fd)
			}
		})
	}

	// The baseline the cases vary is itself valid.
	var x *tensor.Tensor
	require.NoError(t, Unmarshal(validMetaMsg(t, seg.ID()), []int{dupFD(t, seg.FD())}, &x))
	assert.Equal(t, []int{32, 32}, x.Shape())
	require.NoError(t, x.Release())
}

func validMetaMsg(t testing.TB, id shm.ID) []byte { return extMessage(t, validMeta(id)) }

// hugeShapeMsg is a tensor whose metadata claims a shape of 2^32-1
// dimensions in a few bytes.
func hugeShapeMsg(t testing.TB) []byte {
	payload := []byte{0xdc, 0x00, metaFields, Version, 0xaf}
	payload = append(payload, "file_descriptor"...)
	// FD, Dev, Ino, Name, Size, Segment, Block, Gen, Offset, DType, Shape
	payload = append(payload, 0x00, 0x01, 0x02, 0xa0, 0xcd, 0x10, 0x00, 0xff, 0xff, 0x00, 0x00, 0x09, 0xdd, 0xff, 0xff, 0xff, 0xff)
	return append([]byte{0xc7, byte(len(payload)), byte(tensorExt)}, payload...)
}

// FuzzUnmarshal decodes arbitrary bytes with a real segment's descriptor:
// whatever the input, no panic, and every descriptor is either owned by a
// rebuilt tensor or closed.
func FuzzUnmarshal(f *testing.F) {
	seg, err := shm.Create(4096, shm.KeepFD|shm.Unlink)
	require.NoError(f, err)
	f.Cleanup(func() { seg.Release() })

	f.Add(validMetaMsg(f, seg.ID()), uint8(1))
	empty := validMeta(shm.ID{})
	empty.Strategy, empty.FDIndex, empty.Size, empty.Shape, empty.Strides = "", -1, 0, []int{0, 3}, []int{0, 0}
	f.Add(extMessage(f, empty), uint8(0))
	view := validMeta(seg.ID())
	view.Offset, view.Shape, view.Strides = 128, []int{8, 4}, []int{1, 32}
	f.Add(extMessage(f, view), uint8(1))
	fs := validMeta(shm.ID{})
	fs.Strategy, fs.FDIndex, fs.Name = "file_system", -1, shm.SessionPrefix()+"1_0123456789abcdef"
	f.Add(extMessage(f, fs), uint8(0))
	f.Add([]byte{0x92, 0x01, 0xc0}, uint8(2))
	byIdentity := laneMeta()
	byIdentity.setSegmentID(seg.ID())
	byIdentity.SegmentSize, byIdentity.BlockOffset, byIdentity.Offset = 4096, 0, 0
	f.Add(compactMessage(f, byIdentity), uint8(1))
	base := leakcheck.Count()

	f.Fuzz(func(t *testing.T, data []byte, nfds uint8) {
		fds := make([]int, int(nfds%4))
		for i := range fds {
			fds[i] = dupFD(t, seg.FD())
		}
		var v any
		err := Unmarshal(data, fds, &v)
		if err == nil {
			leakcheck.Free(v)
		} else if !errors.Is(err, ErrMalformed) {
			t.Errorf("an error for a message that does not wrap ErrMalformed: %v", err)
		}
		if n := leakcheck.Count(); n != base {
			t.Fatalf("descriptors: %d before, %d after", base, n)
		}
	})
}

// The cache keeps every live storage however many there are ("out and
// back is the same storage"), and its size follows the live ones: dead
// entries are swept.
// emptyStorage returns a new shared storage of no bytes.
func emptyStorage(t *testing.T) *tensor.Storage {
	s, err := tensor.AllocSharedStorage(0)
	require.NoError(t, err)
	return s
}

func TestCacheKeepsLiveStoragesAndDropsDeadOnes(t *testing.T) {
	c := &storageCache{m: make(map[cacheKey]*tensor.StorageRef), sweepAt: sweepMin}
	const n = 20_000
	live := make([]*tensor.Storage, 0, n)
	for i := range n {
		s := emptyStorage(t)
		live = append(live, s)
		c.put(cacheKey{id: shm.ID{Ino: uint64(i)}}, s)
	}
	for i, s := range live {
		require.Same(t, s, c.get(cacheKey{id: shm.ID{Ino: uint64(i)}}, 0), "live storage %d is still cached", i)
	}
	for _, s := range live[:n-10] {
		require.NoError(t, s.Release())
	}
	for i := range n {
		c.put(cacheKey{id: shm.ID{Ino: uint64(n + i)}}, live[n-1-i%10])
	}
	assert.Less(t, c.len(), n+n/2, "dead entries are swept as the cache grows")
	for i, s := range live[n-10:] {
		assert.Same(t, s, c.get(cacheKey{id: shm.ID{Ino: uint64(n - 10 + i)}}, 0))
	}
	last := live[len(live)-1]
	assert.Same(t, last, c.get(cacheKey{id: shm.ID{Ino: uint64(len(live) - 1)}}, 0))

	require.NoError(t, last.Release())
	assert.Nil(t, c.get(cacheKey{id: shm.ID{Ino: uint64(len(live) - 1)}}, 0), "released storages are not served")
	other := emptyStorage(t)
	k := cacheKey{name: "n"}
	assert.Same(t, other, c.put(k, other))
	assert.Same(t, other, c.put(k, emptyStorage(t)), "the first live storage wins")
	assert.Nil(t, c.get(k, 10), "a size mismatch is a miss")
}

func FuzzBodyDecode(f *testing.F) {
	body := validMeta(shm.ID{})
	body.Strategy, body.FDIndex, body.BlockOffset, body.SegmentSize, body.Gen = StrategyBody, 0, -1, 0, 0
	f.Add(extMessage(f, body), uint16(4096), uint8(1))
	view := body
	view.Offset, view.Shape, view.Strides = 128, []int{8, 4}, []int{1, 32}
	f.Add(extMessage(f, view), uint16(4096), uint8(2))
	f.Add(validMetaMsg(f, shm.ID{Dev: 1, Ino: 2}), uint16(4096), uint8(1))
	f.Add([]byte{0x92, 0x01, 0xc0}, uint16(0), uint8(0))

	f.Fuzz(func(t *testing.T, data []byte, size uint16, n uint8) {
		bodies := make([]*tensor.Storage, int(n%4))
		for i := range bodies {
			s, err := tensor.AllocSharedStorage(int64(size))
			if err != nil {
				t.Fatal(err)
			}
			bodies[i] = s
		}
		var v any
		if err := NewBodyDecoder().Decode(data, bodies, &v); err != nil {
			for _, s := range bodies {
				if !s.Released() {
					t.Fatalf("a failed decode left body %v unreleased", s)
				}
			}
			return
		}
		leakcheck.Free(v)
	})
}

// gpuUUID returns the UUID of this process's device dev.
func gpuUUID(dev int) []byte {
	rt, err := cuda.Default()
	if err != nil {
		panic(err)
	}
	u, err := rt.UUID(dev)
	if err != nil {
		panic(err)
	}
	return u[:]
}

// pinnedLane is the reader's side of a lane that pins the segments it
// holds, as package sock's Way answers for the segments it pinned.
type pinnedLane map[shm.ID]bool

func (p pinnedLane) Maps(*shm.Block) bool         { return false }
func (p pinnedLane) Returns(*shm.Block) bool      { return false }
func (p pinnedLane) Pin(shm.ID)                   {}
func (p pinnedLane) Pinned(id shm.ID) bool        { return p[id] }
func (p pinnedLane) Ahead(func(data []byte) bool) {}

// aheadLane is a pinnedLane that holds messages behind the one being
// decoded, as a Way's reader sees them in its lane, and counts the looks
// at them.
type aheadLane struct {
	pinnedLane
	ahead [][]byte
	looks *int
}

func (l aheadLane) Ahead(yield func(data []byte) bool) {
	*l.looks++
	for _, m := range l.ahead {
		if !yield(slices.Clone(m)) {
			return
		}
	}
}

// laneBlocks returns the metadata of a lane message naming each of n
// blocks of size bytes of another process's pool (foreignBlocks), every
// byte of the i-th i+1; this process maps their segment as a lane's
// reader does, holding block 0 as received by descriptor, until the
// test's end.
func laneBlocks(t testing.TB, n, size int) []Meta {
	t.Helper()
	ms, held := foreignBlocks(t, n, size)
	t.Cleanup(func() { require.NoError(t, held.Release()) })
	return ms
}

// batchMessage is a batch of the tensors ms describe, as mp.PutMany sends.
func batchMessage(t testing.TB, ms ...Meta) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	require.NoError(t, enc.EncodeArrayLen(len(ms)))
	for _, m := range ms {
		buf.Write(extMessage(t, m))
	}
	return buf.Bytes()
}

// A lane's message whose block this process has not locked locks, in the
// same calls, the blocks that the messages behind it in the lane name,
// bare tensors and batches of segments the lane's reader pins: decoding
// those later costs no lock call and no second look, and gives each
// tensor its own block and shape. A block of a segment the reader does
// not pin, and what is not a tensor, are passed over; so is what lies
// beyond the most blocks it locks at once. A batch, whose blocks share
// their calls already, does not look ahead.
func TestLaneDecodeLocksAhead(t *testing.T) {
	leakcheck.Check(t)
	t.Cleanup(func() {
		assert.Eventually(t, func() bool { return shm.DefaultPool().InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
			"every block goes back to its producer")
	})
	ms := laneBlocks(t, 10, 4096)
	for i := range ms {
		if i%2 == 1 { // tensors of another shape between them
			ms[i].Shape, ms[i].Strides = []int{64, 64}, []int{64, 1}
		}
	}
	others := laneBlocks(t, 2, 64<<10) // mapped, but not the lane's
	require.NotEqual(t, ms[0].segmentID(), others[0].segmentID())
	ref := func(m Meta) shm.BlockRef { return laneRef(&m) }
	notTensor, err := msgpack.Marshal(7)
	require.NoError(t, err)
	lane := aheadLane{pinnedLane: pinnedLane{ms[0].segmentID(): true}, looks: new(int)}
	lane.ahead = [][]byte{extMessage(t, ms[3]), notTensor, batchMessage(t, ms[4], ms[5]), extMessage(t, others[1]), {0xc1}, extMessage(t, ms[6])}

	var x *tensor.Tensor
	var xs []*tensor.Tensor
	var fds fd.Set
	require.NoError(t, carry.DecodeFrom(batchMessage(t, ms[1], ms[2]), &fds, &xs, lane, true))
	assert.Zero(t, *lane.looks, "a batch does not look ahead")
	assert.False(t, shm.Locked(ref(ms[3])))
	got := slices.Clone(xs)
	lane.ahead = lane.ahead[1:]
	before := shm.AttachLocks()
	require.NoError(t, carry.DecodeFrom(extMessage(t, ms[3]), &fds, &x, lane, true))
	calls := shm.AttachLocks() - before // one per run of neighbouring slots
	assert.True(t, calls >= 1 && calls <= 4, "%d lock calls", calls)
	for i := 4; i < 7; i++ {
		assert.True(t, shm.Locked(ref(ms[i])), "block %d, named by a message ahead", i)
	}
	assert.False(t, shm.Locked(ref(others[1])), "a block of a segment the lane does not pin")
	got = append(got, x)
	lane.ahead = lane.ahead[2:]
	require.NoError(t, carry.DecodeFrom(batchMessage(t, ms[4], ms[5]), &fds, &xs, lane, true))
	got = append(got, xs...)
	lane.ahead = nil
	require.NoError(t, carry.DecodeFrom(extMessage(t, ms[6]), &fds, &x, lane, true))
	got = append(got, x)
	require.Len(t, got, 6)
	assert.Equal(t, calls, shm.AttachLocks()-before, "their decodes made no call")
	assert.Equal(t, 1, *lane.looks, "nor looked ahead again: their blocks were locked")
	for i, x := range got {
		b, ok := x.Storage().Backing().(*shm.Block)
		require.True(t, ok)
		assert.Equal(t, byte(i+2), b.Bytes()[0], "tensor %d's block", i+1)
		assert.Equal(t, ms[i+1].Shape, x.Shape(), "tensor %d's shape", i+1)
		require.NoError(t, x.Release())
	}

	// A bare tensor looks ahead once its own shape is read: it keeps it.
	// More blocks behind than it locks at once: the last is left.
	many := make([]Meta, maxAhead+10)
	for i := range many {
		many[i] = ms[7]
	}
	lane.ahead = [][]byte{batchMessage(t, many...), extMessage(t, ms[9])}
	require.NoError(t, carry.DecodeFrom(extMessage(t, ms[8]), &fds, &x, lane, true))
	assert.Equal(t, []int{4096}, x.Shape(), "the tensor's own shape, not one ahead of it")
	assert.True(t, shm.Locked(ref(ms[7])))
	assert.False(t, shm.Locked(ref(ms[9])), "a block beyond the most locked at once")
	require.NoError(t, x.Release())
}

// A message that came by a lane names blocks by identity alone, and only
// blocks of segments the lane's reader pins, which this process maps, are
// found so, or blocks this process made (returns, see
// TestLaneReturnFindsItsBlock): another is ErrNotMapped, whatever the
// message says, even of a segment this process maps for another reason
// (another holder of the segment is not held for by the lane's writer).
func TestLaneMessageFindsOnlyMappedSegments(t *testing.T) {
	leakcheck.Check(t)
	seg, err := shm.Create(1<<20, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	defer seg.Release()
	m := validMeta(seg.ID())
	m.FDIndex = -1
	m.SegmentSize, m.BlockOffset, m.Gen = 1<<20, 4096, 1
	var fds fd.Set
	var x *tensor.Tensor
	err = carry.DecodeFrom(extMessage(t, m), &fds, &x, pinnedLane{seg.ID(): true}, true)
	assert.ErrorIs(t, err, shm.ErrNotMapped, "a segment this process does not map")
	assert.Nil(t, x)

	// A block of a segment this process maps, received by descriptor and
	// kept, but not pinned by the lane: this process made it, so the
	// message returns it, and it is in use (see shm.Revive).
	pool := shm.DefaultPool()
	b, err := pool.Alloc(4096)
	require.NoError(t, err)
	defer b.Release()
	tk, err := b.Ticket()
	require.NoError(t, err)
	st, err := shm.Stat(tk.FD())
	require.NoError(t, err)
	held, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: st.ID, Size: b.Segment().Size()}, Offset: b.Offset(), Size: 4096, Gen: b.Gen(), Ticket: tk.FD()})
	tk.Done()
	require.NoError(t, err)
	defer held.Release()
	m = validMeta(b.Segment().ID())
	m.FDIndex, m.Shape, m.Strides, m.DType = -1, []int{4096}, []int{1}, tensor.Uint8
	m.SegmentSize, m.BlockOffset, m.Gen = b.Segment().Size(), b.Offset(), b.Gen()
	for _, lane := range []carry.Lane{nil, pinnedLane{seg.ID(): true}} {
		err = carry.DecodeFrom(extMessage(t, m), &fds, &x, lane, true)
		assert.ErrorIs(t, err, shm.ErrStaleBlock, "a block of this process's pool in use is no return")
		assert.ErrorIs(t, err, ErrMalformed)
		assert.Nil(t, x)
	}
	// Pinned too (this process maps its own segment a second time, as
	// where a block of it came back by descriptor): a message can only
	// return a block of this process's pools, and their answer is
	// final. A block in use is no return; nor is a free one, which the
	// pool hands out next without asking anyone, whatever generation
	// the message gives.
	err = carry.DecodeFrom(extMessage(t, m), &fds, &x, pinnedLane{b.Segment().ID(): true}, true)
	assert.ErrorIs(t, err, shm.ErrStaleBlock, "a block of this process in use, pinned")
	assert.Nil(t, x)
	free, err := pool.Alloc(4096)
	require.NoError(t, err)
	require.NoError(t, free.Release())
	require.Eventually(t, func() bool { return pool.InUse() == 1 }, 5*time.Second, 5*time.Millisecond, "the block released comes back")
	for _, gen := range []uint64{free.Gen(), free.Gen() + 1} { // the one it is handed out with next among them
		next := m
		next.BlockOffset, next.Gen = free.Offset(), gen
		x = nil
		err = carry.DecodeFrom(extMessage(t, next), &fds, &x, pinnedLane{b.Segment().ID(): true}, true)
		assert.ErrorIs(t, err, shm.ErrStaleBlock, "a free block of this process, pinned, generation %d", gen)
		assert.Nil(t, x)
	}
	// Nor by descriptor: a peer that reopened a message's descriptor of
	// the segment names the free block with the generation it is handed
	// out with next (see shm.Attach).
	next := m
	next.FDIndex, next.BlockOffset, next.Gen = 0, free.Offset(), free.Gen()
	peer, err := unix.Open("/proc/self/fd/"+strconv.Itoa(b.Segment().FD()), unix.O_RDWR|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	x = nil
	err = Unmarshal(extMessage(t, next), []int{peer}, &x)
	assert.ErrorIs(t, err, shm.ErrStaleBlock, "a free block of this process, by descriptor")
	assert.ErrorIs(t, err, ErrMalformed)
	assert.Nil(t, x)
	_, err = unix.FcntlInt(uintptr(peer), unix.F_GETFD, 0)
	assert.ErrorIs(t, err, unix.EBADF, "the message's descriptor closed after the error")
}

// settledCount returns the process's count of descriptors once the
// closes that earlier tests and a set-up leave to shm's timers are done
// (adopted tickets go within 10 ms, idle mappings within 20): once it has
// stayed the same for longer than both.
func settledCount() int {
	n := leakcheck.Count()
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); {
		time.Sleep(30 * time.Millisecond)
		m := leakcheck.Count()
		if m == n {
			break
		}
		n = m
	}
	return n
}

// Whatever a lane's message says (blocks named by identity, alone or in
// a batch, of a segment this process maps or not, at any offset and
// generation, with whatever message behind it in the lane), its decode
// gives tensors of the blocks it names, whose bytes are theirs, or an
// error wrapping ErrMalformed: never a crash, a block held after its
// tensor is released (or, locked ahead for the message behind it, once
// the lock's transfer is due), or a descriptor left open.
func FuzzLaneDecode(f *testing.F) {
	pool := shm.DefaultPool()
	// Blocks of another process, whose segment this process maps as a
	// lane's reader does.
	blocks, held := foreignBlocks(f, 4, 4096)
	segID := blocks[0].segmentID()
	lane := func(b Meta, gen uint64, off int64) Meta {
		b.BlockOffset, b.Gen = b.BlockOffset+off, gen
		return b
	}
	batch := func(ms ...Meta) []byte { return batchMessage(f, ms...) }
	ok1, ok2, ok3 := lane(blocks[1], blocks[1].Gen, 0), lane(blocks[2], blocks[2].Gen, 0), lane(blocks[3], blocks[3].Gen, 0)
	f.Add(extMessage(f, ok1), []byte(nil))
	f.Add(batch(ok1, ok2, ok3), []byte(nil))
	f.Add(batch(ok1, ok1), []byte(nil))
	f.Add(batch(ok1, lane(blocks[2], blocks[2].Gen+1, 0)), []byte(nil))
	f.Add(batch(ok2, lane(blocks[3], blocks[3].Gen, 64)), []byte(nil))
	other := ok1
	other.Ino++
	f.Add(batch(ok1, other), []byte(nil))
	// A message behind in the lane, whose blocks the decode locks ahead.
	f.Add(extMessage(f, ok1), extMessage(f, ok2))
	f.Add(extMessage(f, ok1), batch(ok2, lane(blocks[3], blocks[3].Gen+1, 0)))
	f.Add(batch(ok1, ok2), batch(ok3, other))
	f.Add(extMessage(f, ok1), extMessage(f, lane(blocks[2], blocks[2].Gen, 4096)))
	// The same in the compact form a lane's writer sends them in.
	compactBatch := func(ms ...Meta) []byte {
		b := appendArrayLen(nil, len(ms))
		for _, m := range ms {
			b = append(b, compactMessage(f, m)...)
		}
		return b
	}
	f.Add(compactMessage(f, ok1), []byte(nil))
	f.Add(compactBatch(ok1, ok2, ok3), []byte(nil))
	f.Add(compactBatch(ok1, lane(blocks[2], blocks[2].Gen+1, 0)), []byte(nil))
	f.Add(compactMessage(f, ok1), compactBatch(ok2, other))
	f.Add(compactMessage(f, ok1), extMessage(f, ok2))
	// A batch longer than a window (batchWindow), the same blocks over
	// and over, with a wrong one in the second window.
	long := make([]Meta, 0, batchWindow+3)
	for len(long) < batchWindow+2 {
		long = append(long, ok1, ok2, ok3)
	}
	f.Add(compactBatch(append(long[:batchWindow+1], other)...), []byte(nil))
	// An array of one nil, no bare batch: a nil tensor, whose check
	// looks at no storage.
	f.Add([]byte{0xdc, 0, 1, 0xc0}, []byte("0"))
	reader := aheadLane{pinnedLane: pinnedLane{segID: true}, looks: new(int)}
	base := settledCount()
	var rebuilt atomic.Int64

	f.Fuzz(func(t *testing.T, data, ahead []byte) {
		reader.ahead = [][]byte{ahead}
		check := func(err error, ts []*tensor.Tensor) {
			rebuilt.Add(int64(len(ts)))
			if err != nil {
				if !errors.Is(err, ErrMalformed) {
					t.Errorf("an error for a message that does not wrap ErrMalformed: %v", err)
				}
				return
			}
			for _, x := range ts {
				if x == nil { // a batch's nil, which msgpack decodes as such
					continue
				}
				b, ok := x.Storage().Backing().(*shm.Block)
				if ok && x.Numel() > 0 && len(b.Bytes()) > 0 {
					for i, mine := range blocks {
						if b.Segment().ID() == segID && b.Offset() == mine.BlockOffset && b.Bytes()[0] != byte(i+1) {
							t.Errorf("block %d rebuilt with another's bytes", i)
						}
					}
				}
				_ = x.Release()
			}
		}
		var fds fd.Set
		var v any
		err := carry.DecodeFrom(data, &fds, &v, reader, true)
		var ts []*tensor.Tensor
		if x, ok := v.(*tensor.Tensor); ok && x != nil {
			ts = append(ts, x)
		}
		check(err, ts)
		if err == nil && len(ts) == 0 {
			leakcheck.Free(v)
		}
		var xs []*tensor.Tensor
		check(carry.DecodeFrom(data, &fds, &xs, reader, true), xs)
		if n := leakcheck.Count(); n != base {
			t.Fatalf("descriptors: %d before, %d after", base, n)
		}
	})
	f.Cleanup(func() {
		require.NoError(f, held.Release())
		assert.Eventually(f, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
			"blocks of this process's pool held by a decode")
		if fuzzing := flag.Lookup("test.fuzz"); (fuzzing == nil || fuzzing.Value.String() == "") && rebuilt.Load() == 0 {
			f.Error("no seed reached a rebuild")
		}
	})
}

// A peer that reopened a message's descriptor of this process's
// segment, a description that holds nothing, sends it back with
// metadata naming a block of this process's pool. A block released and
// waiting for its holders is rebuilt, held by a lock of this process's
// own: the pool does not hand it out while the tensor lives. A free one
// is refused whatever name the metadata gives the segment: the segment is
// the descriptor's.
func TestOwnBlockByAPeersDescriptor(t *testing.T) {
	leakcheck.Check(t)
	pool := shm.DefaultPool()
	keep, err := pool.Alloc(4096)
	require.NoError(t, err)
	defer keep.Release()
	a, err := pool.Alloc(4096)
	require.NoError(t, err)
	seg, off := a.Segment(), a.Offset()
	peer := func() int {
		fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(seg.FD()), unix.O_RDWR|unix.O_CLOEXEC, 0)
		require.NoError(t, err)
		return fd // the message's: the decode closes it
	}
	m := validMeta(seg.ID())
	m.Shape, m.Strides, m.DType = []int{4096}, []int{1}, tensor.Uint8
	m.SegmentSize, m.BlockOffset, m.Gen = seg.Size(), off, a.Gen()
	require.NoError(t, a.Release()) // waiting in its pool
	var x *tensor.Tensor
	require.NoError(t, Unmarshal(extMessage(t, m), []int{peer()}, &x))
	pool.InUse() // a reclaim, which finds the block held, and hands out what it frees first
	var more []*shm.Block
	for range 4 {
		d, err := pool.Alloc(4096)
		require.NoError(t, err)
		more = append(more, d)
		assert.False(t, d.Segment() == seg && d.Offset() == off, "the pool handed out the block a decoded tensor holds")
	}
	for _, d := range more {
		require.NoError(t, d.Release())
	}
	require.NoError(t, x.Release())
	require.Eventually(t, func() bool { return pool.InUse() == 1 }, 5*time.Second, 5*time.Millisecond, "free once the tensor is let go of")

	named := m
	named.Strategy, named.Name, named.Dev, named.Ino = "file_system", shm.NamePrefix+shm.Session()+"_1_0123456789abcdef", 0, 0
	named.Gen = a.Gen() // the generation the free slot is handed out with next
	x = nil
	err = Unmarshal(extMessage(t, named), []int{peer()}, &x)
	assert.ErrorIs(t, err, shm.ErrStaleBlock, "a free block of this process, under a name of the message's")
	assert.ErrorIs(t, err, ErrMalformed)
	assert.Nil(t, x)
}

// A lane's message locks at most maxAhead blocks at once, its own among
// them: with that many named, a message behind them is left, and with
// one fewer, its block is the last locked.
func TestLaneDecodeLocksAtMostMaxAhead(t *testing.T) {
	leakcheck.Check(t)
	t.Cleanup(func() {
		assert.Eventually(t, func() bool { return shm.DefaultPool().InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
			"every block goes back to its producer")
	})
	ms := laneBlocks(t, 6, 4096)
	ref := func(m Meta) shm.BlockRef { return laneRef(&m) }
	lane := aheadLane{pinnedLane: pinnedLane{ms[0].segmentID(): true}, looks: new(int)}
	behind := func(n int, last Meta) [][]byte {
		var ahead [][]byte
		for range n {
			ahead = append(ahead, extMessage(t, ms[2]))
		}
		return append(ahead, extMessage(t, last))
	}
	for _, c := range []struct {
		own, last Meta
		named     int // by the messages before last
		locked    bool
	}{
		{ms[1], ms[3], maxAhead - 1, false},
		{ms[4], ms[5], maxAhead - 2, true},
	} {
		require.False(t, shm.Locked(ref(c.own)))
		lane.ahead = behind(c.named, c.last)
		var fds fd.Set
		var x *tensor.Tensor
		require.NoError(t, carry.DecodeFrom(extMessage(t, c.own), &fds, &x, lane, true))
		assert.True(t, shm.Locked(ref(ms[2])))
		assert.Equal(t, c.locked, shm.Locked(ref(c.last)), "the block named after %d others and the message's own", c.named)
		require.NoError(t, x.Release())
	}
}

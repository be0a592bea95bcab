//go:build linux

package reduction

import (
	"bytes"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// compactMessage is extMessage with m in its compact form, as a lane
// carries a tensor named by identity.
func compactMessage(t testing.TB, m Meta) []byte {
	t.Helper()
	require.True(t, compactable(&m), "%+v", m)
	payload := appendCompact(nil, &m)
	var buf bytes.Buffer
	require.NoError(t, msgpack.NewEncoder(&buf).EncodeExtHeader(tensorExt, len(payload)))
	buf.Write(payload)
	return buf.Bytes()
}

// laneMeta is the Meta of a 4 KiB block of a pool's segment named by
// identity, as a lane's message names it.
func laneMeta() Meta {
	return Meta{Version: Version, Strategy: "file_descriptor", FDIndex: -1, MemFDIndex: -1, Dev: 64769, Ino: 1 << 33,
		Size: 4096, SegmentSize: 2 << 20, BlockOffset: 1 << 16, Gen: 5, Offset: 64, DType: tensor.Float32,
		Shape: []int{4, 252}, Strides: []int{252, 1}, Place: "cpu"}
}

// A compactable Meta reads back whole from its compact form, and its
// head alone as parseBlockRef reads it.
func TestCompactMetaRoundTrip(t *testing.T) {
	big := laneMeta()
	big.Dev, big.Ino, big.Gen = math.MaxUint64, math.MaxUint64-1, math.MaxUint64
	big.Size, big.SegmentSize, big.BlockOffset, big.Offset = math.MaxInt64, math.MaxInt64-1, math.MaxInt64-2, math.MinInt64
	big.Shape, big.Strides = []int{math.MaxInt64, 0, 3}, []int{math.MinInt64, -1, math.MaxInt64}
	many := laneMeta()
	many.Shape, many.Strides = make([]int, tensor.MaxDims), make([]int, tensor.MaxDims)
	for i := range many.Shape {
		many.Shape[i], many.Strides[i] = i+1, -i
	}
	scalar := laneMeta()
	scalar.Shape, scalar.Strides = []int{}, []int{}
	for _, m := range []Meta{laneMeta(), big, many, scalar} {
		b := appendCompact(nil, &m)
		assert.Len(t, b, compactHead+16*len(m.Shape))
		var room [2 * roomDims]int
		for _, r := range [][]int{nil, room[:]} {
			var got Meta
			require.NoError(t, parseMeta(b, r, &got))
			assert.Equal(t, m, got)
			if n := len(m.Shape); r != nil && n > 0 && 2*n <= len(r) {
				assert.Same(t, &r[0], &got.Shape[0], "the shape is read into room")
				assert.Same(t, &r[n], &got.Strides[0], "the strides after it")
			}
		}
		head, err := parsedBlockRef(b)
		require.NoError(t, err)
		want := m
		want.Shape, want.Strides = nil, nil
		assert.Equal(t, want, head)
	}
}

// Only a CPU tensor's pooled block of file_descriptor, named without a
// descriptor, with nothing else, travels compact.
func TestCompactableIsOnlyALanesBlock(t *testing.T) {
	m := laneMeta()
	require.True(t, compactable(&m))
	for name, f := range map[string]func(m *Meta){
		"a descriptor":      func(m *Meta) { m.FDIndex = 0 },
		"a whole segment":   func(m *Meta) { m.BlockOffset = -1 },
		"file_system":       func(m *Meta) { m.Strategy = "file_system" },
		"cuda_ipc":          func(m *Meta) { m.Strategy = StrategyCUDAIPC },
		"a name":            func(m *Meta) { m.Name = "tensormp_x_1_0123456789abcdef" },
		"cuda_fd":           func(m *Meta) { m.Strategy = StrategyCUDAFD },
		"a gpu place":       func(m *Meta) { m.Place = "gpu:0" },
		"a device uuid":     func(m *Meta) { m.DevUUID = make([]byte, 16) },
		"a slab descriptor": func(m *Meta) { m.MemFDIndex = 1 },
		"an ipc handle":     func(m *Meta) { m.IPC = make([]byte, 64) },
		"an event handle":   func(m *Meta) { m.IPCEvent = make([]byte, 64) },
		"a device offset":   func(m *Meta) { m.DevOffset = 8 },
		"a lod":             func(m *Meta) { m.LoD = [][]int{{0, 4}} },
		"more strides":      func(m *Meta) { m.Strides = append(m.Strides, 1) },
		"too many dims":     func(m *Meta) { m.Shape, m.Strides = make([]int, tensor.MaxDims+1), make([]int, tensor.MaxDims+1) },
	} {
		v := laneMeta()
		f(&v)
		assert.False(t, compactable(&v), name)
	}
}

// A compact Meta that is cut short, of another version, of too many
// dimensions, or with bytes missing or left over, is an error; one cut
// anywhere never panics.
func TestCompactMetaRefusesWhatIsNotOne(t *testing.T) {
	m := laneMeta()
	good := appendCompact(nil, &m)
	for n := range len(good) {
		var got Meta
		assert.Error(t, parseMeta(good[:n], nil, &got), "cut at %d", n)
		if n < compactHead {
			assert.Error(t, parseBlockRef(good[:n], &got), "head cut at %d", n)
		}
	}
	with := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for name, c := range map[string]struct {
		b    []byte
		want string
	}{
		"another version": {with(func(b []byte) []byte { b[1] = Version + 1; return b }), "metadata version"},
		"too many dims":   {with(func(b []byte) []byte { b[3] = tensor.MaxDims + 1; return b }), "more than"},
		"dims missing":    {with(func(b []byte) []byte { b[3]++; return b }), "bytes of them"},
		"a byte left":     {append(append([]byte(nil), good...), 0), "bytes of them"},
	} {
		var got Meta
		assert.ErrorContains(t, parseMeta(c.b, nil, &got), c.want, name)
	}
	var got Meta
	assert.ErrorContains(t, parseBlockRef(with(func(b []byte) []byte { b[1] = 0; return b }), &got), "metadata version")
}

// A compact Meta names a block without a descriptor: outside a lane it
// is refused, as the same Meta in msgpack is, and by a lane it names only
// what the lane's reader maps.
func TestCompactMetaOutsideALane(t *testing.T) {
	leakcheck.Check(t)
	m := laneMeta()
	var x *tensor.Tensor
	err := Unmarshal(compactMessage(t, m), nil, &x)
	assert.ErrorIs(t, err, ErrMalformed)
	assert.ErrorContains(t, err, "outside a lane")
	var fds fd.Set
	err = carry.DecodeFrom(compactMessage(t, m), &fds, &x, pinnedLane{}, true)
	assert.ErrorIs(t, err, ErrMalformed)
	assert.ErrorIs(t, err, shm.ErrNotMapped)
	assert.Nil(t, x)
}

// An encode for a lane whose reader maps the block writes its tensor in
// the compact form, and one for any other way, or of what the compact
// form cannot hold, in msgpack; each decodes to the same tensor.
func TestEncodeLaneWritesCompact(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Int32, 8, 16)
	require.NoError(t, err)
	defer x.Release()
	view, err := x.Slice(1, 2, 10)
	require.NoError(t, err)
	var sent []byte
	send := func(data []byte, fds []int, lent []*shm.Block) error {
		require.Empty(t, fds)
		require.Len(t, lent, 1)
		sent = append(sent[:0], data...)
		lent[0].Return() // as the reader's ack would
		return nil
	}
	for _, v := range []*tensor.Tensor{x, view} {
		require.NoError(t, carry.EncodeLane(v, lendingLane{}, send))
		payload, rest, ok := nextBare(sent)
		require.True(t, ok)
		require.Empty(t, rest)
		require.Equal(t, byte(compactTag), payload[0], "by the lane, compact")
		var m Meta
		require.NoError(t, parseMeta(payload, nil, &m))
		assert.Equal(t, v.Shape(), m.Shape)
		assert.Equal(t, v.Strides(), m.Strides)
		assert.Equal(t, v.Offset(), m.Offset)

		var fds fd.Set
		var back *tensor.Tensor
		require.NoError(t, carry.DecodeFrom(sent, &fds, &back, pinnedLane{}, true))
		assert.Same(t, v.Storage(), back.Storage(), "the return finds the tensor's storage")
		assert.Equal(t, v.Shape(), back.Shape())
		assert.Equal(t, v.Strides(), back.Strides())
		assert.Equal(t, v.Offset(), back.Offset())
	}

	// Without a lane, the same tensor goes in msgpack, with its ticket.
	data, fds, err := Marshal(x)
	require.NoError(t, err)
	defer func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}()
	payload, _, ok := nextBare(data)
	require.True(t, ok)
	assert.NotEqual(t, byte(compactTag), payload[0])

	// A batch by the lane: each tensor compact.
	send2 := func(data []byte, fds []int, lent []*shm.Block) error {
		require.Len(t, lent, 2)
		sent = append(sent[:0], data...)
		for _, b := range lent {
			b.Return()
		}
		return nil
	}
	require.NoError(t, carry.EncodeLane([]*tensor.Tensor{x, view}, lendingLane{}, send2))
	items, n, ok := bareBatch(sent)
	require.True(t, ok)
	require.Equal(t, 2, n)
	for range n {
		var payload []byte
		payload, items, _ = nextBare(items)
		assert.Equal(t, byte(compactTag), payload[0])
	}
}

// A lane's message that names a block this process holds already, pinned,
// finds the storage that holds it: no second Block, no second storage.
func TestPinnedBlockHeldIsFoundNotAttached(t *testing.T) {
	leakcheck.Check(t)
	m := laneBlocks(t, 1, 4096)[0]
	msg, lane := compactMessage(t, m), pinnedLane{m.segmentID(): true}
	var fds fd.Set
	var x *tensor.Tensor
	require.NoError(t, carry.DecodeFrom(msg, &fds, &x, lane, true))
	defer x.Release()
	// A Decoder of its own, not carry's pool's: under the race detector
	// a sync.Pool drops a quarter of what is put back, and each Decoder
	// made again would count.
	d := NewDecoder()
	allocs := testing.AllocsPerRun(100, func() {
		var y *tensor.Tensor
		require.NoError(t, d.decode(msg, &fds, &y, lane, true))
		require.Same(t, x.Storage(), y.Storage())
	})
	// The caller's *Tensor, which escapes into decode's any, and the new
	// Tensor; a Block, storage and hold attached afresh, then let go for
	// the one held, would be three more.
	assert.LessOrEqual(t, allocs, 2.0)
}

// Each tensor of a batch is reduced afresh: a lent block of one is not
// lent again for the next, whose Meta says what it is, here an empty
// tensor with no memory.
func TestEncodeBatchReducesEachTensorAfresh(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Int32, 8, 16)
	require.NoError(t, err)
	defer x.Release()
	empty, err := tensor.On(device.CPU()).Zeros(tensor.Int32, 0, 3)
	require.NoError(t, err)
	defer empty.Release()
	e := NewEncoder()
	data, fds, err := e.encode([]*tensor.Tensor{x, empty}, lendingLane{})
	require.NoError(t, err)
	defer e.Discard()
	assert.Empty(t, fds)
	assert.Len(t, e.w.lent, 1, "x's block, lent once")
	items, n, ok := bareBatch(data)
	require.True(t, ok)
	require.Equal(t, 2, n)
	var ms [2]Meta
	for i := range ms {
		var payload []byte
		payload, items, _ = nextBare(items)
		require.NoError(t, parseMeta(payload, nil, &ms[i]))
	}
	assert.Equal(t, "file_descriptor", ms[0].Strategy)
	assert.Equal(t, []int{8, 16}, ms[0].Shape)
	assert.Equal(t, "", ms[1].Strategy, "the empty tensor names no segment")
	assert.Equal(t, int64(-1), ms[1].BlockOffset)
	assert.Equal(t, []int{0, 3}, ms[1].Shape)
}

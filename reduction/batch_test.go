//go:build linux

package reduction

import (
	"bytes"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// A lane's batch whose blocks this process holds already finds their
// storages, as the bare tensor does (TestPinnedBlockHeldIsFoundNotAttached):
// the users attachAhead found are the ones its tensors open, with no
// Block, storage or hold made and let go for any of them.
func TestPinnedBatchHeldIsFoundNotAttached(t *testing.T) {
	leakcheck.Check(t)
	ms := laneBlocks(t, 3, 4096)
	lane := pinnedLane{ms[0].segmentID(): true}
	msg := batchMessage(t, ms...)
	var fds fd.Set
	var xs []*tensor.Tensor
	require.NoError(t, carry.DecodeFrom(msg, &fds, &xs, lane, true))
	defer func() {
		for _, x := range xs {
			assert.NoError(t, x.Release())
		}
	}()
	d := NewDecoder() // not carry's pool's (see TestPinnedBlockHeldIsFoundNotAttached)
	var ys []*tensor.Tensor
	allocs := testing.AllocsPerRun(100, func() {
		require.NoError(t, d.decode(msg, &fds, &ys, lane, true))
		if len(ys) != len(xs) { // not require.Len, which allocates
			t.Fatalf("%d tensors of a batch of %d", len(ys), len(xs))
		}
		for i := range ys {
			require.Same(t, xs[i].Storage(), ys[i].Storage())
		}
	})
	// A new Tensor for each; a Block, storage and hold attached afresh,
	// then let go for the one held, would be three more each.
	assert.LessOrEqual(t, allocs, float64(len(xs)))
}

// A batch whose second tensor's metadata is malformed (a byte past its
// end) is an error, found once the first tensor is built, which the
// failed decode lets go of.
func TestBatchWithMalformedMetadataIsRefused(t *testing.T) {
	leakcheck.Check(t)
	ms := laneBlocks(t, 2, 4096)
	lane := pinnedLane{ms[0].segmentID(): true}
	payload, err := msgpack.Marshal(&ms[1])
	require.NoError(t, err)
	payload = append(payload, 0xc0)
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	require.NoError(t, enc.EncodeArrayLen(2))
	buf.Write(extMessage(t, ms[0]))
	require.NoError(t, enc.EncodeExtHeader(tensorExt, len(payload)))
	buf.Write(payload)
	var fds fd.Set
	var xs []*tensor.Tensor
	err = carry.DecodeFrom(buf.Bytes(), &fds, &xs, lane, true)
	require.ErrorIs(t, err, ErrMalformed)
	assert.ErrorContains(t, err, "trailing")
}

// A batch of many tensors' worth of bytes that name no tensor makes the
// decoder take no room for all of them before it finds the first wrong:
// a peer's count is not a promise.
func TestBatchCountIsNotRoomTaken(t *testing.T) {
	const n = 1 << 18
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	require.NoError(t, enc.EncodeArrayLen(n))
	for range n {
		require.NoError(t, enc.EncodeExtHeader(tensorExt, 1))
		buf.WriteByte(0)
	}
	d := NewDecoder()
	var fds fd.Set
	var xs []*tensor.Tensor
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	err := d.decode(buf.Bytes(), &fds, &xs, pinnedLane{}, true)
	runtime.ReadMemStats(&after)
	require.ErrorIs(t, err, ErrMalformed)
	assert.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(buf.Len())/4,
		"bytes allocated for a message of %d bytes", buf.Len())
}

// A batch longer than a window of them, which names a block twice,
// makes each of its tensors, the twice-named one's on one storage, and
// gives every hold back once they are released.
func TestLongBatchNamingABlockTwiceLeavesNoHold(t *testing.T) {
	leakcheck.Check(t)
	ms := laneBlocks(t, batchWindow+6, 4096)
	named := append([]Meta{ms[3]}, ms...) // ms[3] twice in the first window
	lane := pinnedLane{ms[0].segmentID(): true}
	before := blockHolds(ms)
	var fds fd.Set
	var xs []*tensor.Tensor
	require.NoError(t, carry.DecodeFrom(batchMessage(t, named...), &fds, &xs, lane, true))
	require.Len(t, xs, len(named))
	assert.Same(t, xs[0].Storage(), xs[4].Storage(), "the block named twice is one storage")
	assert.Equal(t, before[3]+1, shm.Holds(laneRef(&ms[3])), "one hold more, the storage's")
	for _, x := range xs {
		require.NoError(t, x.Release())
	}
	assert.Equal(t, before, blockHolds(ms), "the holds once the tensors are released")
}

// blockHolds returns this process's holds on each block of ms (laneBlocks
// holds the first).
func blockHolds(ms []Meta) []int {
	n := make([]int, len(ms))
	for i := range ms {
		n[i] = shm.Holds(laneRef(&ms[i]))
	}
	return n
}

// The tensors of a batch's second window start afresh: the first
// window's tensor in the same room, which carried a LoD, leaves none.
func TestBatchWindowsDoNotShareMetadata(t *testing.T) {
	leakcheck.Check(t)
	ms := laneBlocks(t, batchWindow+1, 4096)
	ms[0].LoD = [][]int{{0, 4096}}
	lane := pinnedLane{ms[0].segmentID(): true}
	var fds fd.Set
	var xs []*tensor.Tensor
	require.NoError(t, carry.DecodeFrom(batchMessage(t, ms...), &fds, &xs, lane, true))
	defer func() {
		for _, x := range xs {
			assert.NoError(t, x.Release())
		}
	}()
	require.Len(t, xs, len(ms))
	assert.Equal(t, ms[0].LoD, xs[0].LoD())
	assert.Nil(t, xs[batchWindow].LoD(), "the second window's first tensor")
}

// A batch whose third tensor is wrong (its shape needs more bytes than
// its block has) fails after the blocks of the whole window were
// attached: the decode lets go of every one of them, those of the
// tensors it made and those of the tensors it never came to.
func TestFailedBatchLetsGoOfItsBlocks(t *testing.T) {
	leakcheck.Check(t)
	ms := laneBlocks(t, 4, 4096)
	ms[2].Shape = []int{8192}
	lane := pinnedLane{ms[0].segmentID(): true}
	before := blockHolds(ms)
	require.Positive(t, before[0], "laneBlocks holds the first: the holds are seen")
	var fds fd.Set
	var xs []*tensor.Tensor
	require.ErrorIs(t, carry.DecodeFrom(batchMessage(t, ms...), &fds, &xs, lane, true), ErrMalformed)
	assert.Equal(t, before, blockHolds(ms), "the holds after the failed decode")
}

// A decoder's next batch starts afresh too: the tensor of the batch it
// decoded last in the same room, which carried a LoD, leaves none to the
// next batch's, which carries none.
func TestBatchDecodesDoNotShareMetadata(t *testing.T) {
	leakcheck.Check(t)
	ms := laneBlocks(t, 2, 4096)
	lane := pinnedLane{ms[0].segmentID(): true}
	withLoD := ms[1]
	withLoD.LoD = [][]int{{0, 4096}}
	d := NewDecoder() // one decoder for both, not carry's pool's
	var fds fd.Set
	var xs, ys []*tensor.Tensor
	require.NoError(t, d.decode(batchMessage(t, withLoD, ms[0]), &fds, &xs, lane, true))
	require.Len(t, xs, 2)
	assert.Equal(t, withLoD.LoD, xs[0].LoD())
	for _, x := range xs {
		require.NoError(t, x.Release())
	}
	require.NoError(t, d.decode(batchMessage(t, ms[1]), &fds, &ys, lane, true))
	require.Len(t, ys, 1)
	assert.Nil(t, ys[0].LoD(), "the next batch's tensor, in the room of the last one's")
	require.NoError(t, ys[0].Release())
}

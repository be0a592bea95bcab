//go:build linux

package sock

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
)

// drained has r find the socket empty, as a receive that waits does
// first: the writer may then hand it entries (see handsOver).
func drained(t *testing.T, r *Way) {
	t.Helper()
	_, err := r.TryRecv(context.Background())
	require.ErrorIs(t, err, ErrWouldBlock)
}

// scanned returns what r's scanner names now.
func scanned(r *Way) []shm.ReturnRef {
	var refs []shm.ReturnRef
	r.scanReturns(func(ref shm.ReturnRef) { refs = append(refs, ref) })
	return refs
}

// returnsSetUp returns a block b of this process's pool, as its producer
// holds it, and got, the same block as a process it was sent to holds
// it, released when the test ends.
func returnsSetUp(t *testing.T) (b, got *shm.Block) {
	t.Helper()
	b, err := shm.DefaultPool().Alloc(4 << 10)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Release() })
	got = receivedCopy(t, b)
	t.Cleanup(func() { _ = got.Release() })
	return b, got
}

// A block received here and sent back to its producer, the lane's reader,
// goes by the lane as a return: the reader's scanner names it while the
// entry waits and while the reader takes it, until the message is done;
// and a pipe's reader keeps its role, idle, while a return to it waits,
// even behind a value.
func TestWayReturnsAreNamedUntilTaken(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b, got := returnsSetUp(t)
	w, r, _ := wayPair(t)
	takeRoles(t, ctx, w, r, nil) // the reader lists its pools' segments, b's among them

	assert.True(t, w.Returns(got), "a block of the reader's pool, received here")
	assert.False(t, w.Returns(b), "a block of the writer's own pool is no return")
	assert.False(t, r.Returns(got), "a reader's Way writes nothing")
	ref := shm.ReturnRef{ID: b.Segment().ID(), Offset: b.Offset(), Gen: b.Gen()}
	assert.Empty(t, scanned(r))

	sent := ReturnsSent()
	require.NoError(t, w.Send(ctx, binary.LittleEndian.AppendUint32(nil, 4), nil)) // a value first
	require.NoError(t, w.SendLent(ctx, binary.LittleEndian.AppendUint32(nil, 5), nil, []*shm.Block{got}))
	assert.Equal(t, sent+1, ReturnsSent(), "by the lane")
	assert.Equal(t, []shm.ReturnRef{ref}, scanned(r), "named while it waits")
	r.letGoIdle()
	r.letGoIdle() // no receive since the last look
	assert.True(t, holds(r), "the reader keeps its role while a return to it waits, behind a value")

	taken := ReturnsTaken()
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	assert.Equal(t, uint32(4), binary.LittleEndian.Uint32(m.Data))
	m.Done()
	m, err = r.Recv(ctx)
	require.NoError(t, err)
	assert.True(t, m.ByLane())
	assert.Equal(t, uint32(5), binary.LittleEndian.Uint32(m.Data), "the message's bytes, after the returns")
	assert.Equal(t, taken+1, ReturnsTaken())
	assert.Equal(t, []shm.ReturnRef{ref}, scanned(r), "named while it is taken")
	m.Done()
	assert.Empty(t, scanned(r), "done with")
	r.letGoIdle()
	r.letGoIdle()
	assert.False(t, holds(r), "idle, with nothing for it, the reader lets go")

	// A reader that hands its end on unlists its pools' segments: the
	// writer returns nothing to it by the lane.
	takeRoles(t, ctx, w, r, nil)
	assert.True(t, w.Returns(got))
	r.LetGo()
	assert.False(t, w.Returns(got), "unlisted")
}

// A queue hands a return, as any tensor by identity, only to a getter
// that waits on the lane, or that comes back to it while an answering
// writer waits: another getter could not take it back.
func TestFairWayReturnsOnlyToAWaitingReader(t *testing.T) {
	_, got := returnsSetUp(t)
	w, r, _, ctx := fairRoles(t)
	takeRoles(t, ctx, w, r, nil)
	drained(t, r)
	lastRecv.Store(0)
	assert.False(t, w.Returns(got), "a busy getter, and a writer that does not answer: the socket")
	require.ErrorIs(t, w.SendLent(ctx, binary.LittleEndian.AppendUint32(nil, 5), nil, []*shm.Block{got}), carry.ErrNoLane)

	w.wait.spin = time.Minute
	answered(t)
	assert.True(t, w.Returns(got), "an answering writer waits for it")
	sent := ReturnsSent()
	s := sendLater(t, w, func() error {
		answered(t)
		return w.SendLent(ctx, binary.LittleEndian.AppendUint32(nil, 6), nil, []*shm.Block{got})
	})
	g := within(t, recvLater(ctx, r), "the return never came")
	require.NoError(t, gotWithin(t, s, "the getter came back, but the writer waited on"))
	assert.True(t, g.byLane)
	assert.Equal(t, 6, g.i)
	assert.Equal(t, sent+1, ReturnsSent())
}

// An entry that says it returns more blocks than it holds is an error
// wrapping ErrMalformed; what it claims is not named by the scanner.
func TestWayRefusesAShortReturn(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	takeRoles(t, ctx, w, r, nil)
	rogue, err := OpenLane(w.mem)
	require.NoError(t, err)
	defer rogue.Close()
	rogue.Resume()
	l := r.lane.Load()
	claimed := l.readerWord(readerWaits)
	require.True(t, claimed.CompareAndSwap(waitBusy, claimedBusy))
	require.NoError(t, rogue.TrySend([]byte{kindReturn, 3, 1, 2, 3}))
	assert.Empty(t, scanned(r), "a short entry names nothing")
	_, err = r.Recv(ctx)
	assert.ErrorIs(t, err, ErrMalformed)
}

// A reader registers its scanner once, however often it takes the role,
// and Close unregisters it: no scanner of a closed reader is left for
// the pools' reclaims to call, reading a lane that is gone.
func TestWayRegistersItsScannerOnce(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	before := shm.ReturnScanners()
	w, r, _ := wayPair(t)
	takeRoles(t, ctx, w, r, nil)
	assert.Equal(t, before+1, shm.ReturnScanners(), "registered as it takes the role")
	for range 3 {
		r.LetGo()
		require.False(t, holds(r))
		takeRoles(t, ctx, w, r, nil) // takes it again
	}
	assert.Equal(t, before+1, shm.ReturnScanners(), "once, however often it takes the role")
	require.NoError(t, r.Close())
	assert.Equal(t, before, shm.ReturnScanners(), "the closed reader's scanner is gone")
}

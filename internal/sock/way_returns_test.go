package sock

import (
	"context"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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

// A block received here and sent back to its producer, the lane's reader,
// goes by the lane as a return: the reader's scanner names it while the
// entry waits and while the reader takes it, until the message is done;
// and the reader keeps its role, idle, while a return to it waits.
func TestWayReturnsAreNamedUntilTaken(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	b, err := shm.DefaultPool().Alloc(4 << 10)
	require.NoError(t, err)
	defer b.Release()
	got := receivedCopy(t, b) // as the writer, a process b was sent to, holds it
	defer got.Release()
	takeRoles(t, ctx, w, r, nil) // the reader lists its pools' segments again, b's among them
	drained(t, r)

	assert.True(t, w.Returns(got), "a block of the reader's pool, received here")
	assert.False(t, w.Returns(b), "a block of the writer's own pool is no return")
	assert.False(t, r.Returns(got), "a reader's Way writes nothing")
	ref := shm.ReturnRef{ID: b.Segment().ID(), Offset: b.Offset(), Gen: b.Gen()}
	assert.Empty(t, scanned(r))

	sent := ReturnsSent()
	require.NoError(t, w.SendLent(ctx, binary.LittleEndian.AppendUint32(nil, 5), nil, []*shm.Block{got}))
	assert.Equal(t, sent+1, ReturnsSent(), "by the lane, to the busy reader")
	assert.Equal(t, []shm.ReturnRef{ref}, scanned(r), "named while it waits")
	r.letGoIdle()
	r.letGoIdle() // no receive since the last look
	assert.True(t, holds(r), "the reader keeps its role while a return to it waits")

	taken := ReturnsTaken()
	m, err := r.Recv(ctx)
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

	// A reader that hands its end on unlists its pools' segments too: the
	// writer returns nothing to it by the lane. (A pipe's writer hands
	// its lane entries whatever the reader does: the list alone says.)
	pw, pr, _ := wayPair(t)
	takeRoles(t, ctx, pw, pr, nil)
	assert.True(t, pw.Returns(got))
	// A pipe's lane holds a return behind a value: the reader keeps its
	// role for it all the same.
	require.NoError(t, pw.Send(ctx, binary.LittleEndian.AppendUint32(nil, 6), nil))
	require.NoError(t, pw.SendLent(ctx, binary.LittleEndian.AppendUint32(nil, 7), nil, []*shm.Block{got}))
	pr.letGoIdle()
	pr.letGoIdle()
	assert.True(t, holds(pr), "a return behind a value keeps the role too")
	for want := uint32(6); want <= 7; want++ {
		m, err := pr.Recv(ctx)
		require.NoError(t, err)
		assert.Equal(t, want, binary.LittleEndian.Uint32(m.Data))
		m.Done()
	}
	pr.LetGo()
	assert.False(t, pw.Returns(got), "unlisted")
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

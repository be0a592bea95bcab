//go:build linux

package sock

import (
	"context"
	"encoding/binary"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/shm"
)

// busyReader returns a fair Way's writer and reader in their roles, the
// reader busy between two receives and pinning the segment of b, a block
// of this process's pool, which the writer may name by identity; the
// writer spins for a busy reader for patience. lend sends a message
// that names b, lent to it, as a process that has just received one
// (answering), and returns the loan if the lane did not take it.
func busyReader(t *testing.T, patience time.Duration) (w, r *Way, b *shm.Block, ctx context.Context, lend func() error) {
	t.Helper()
	w, r, _, ctx = fairRoles(t)
	b, err := shm.DefaultPool().Alloc(4 << 10)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Release() })
	got := receivedCopy(t, b) // the reader's process maps the segment as received, as Pin asks
	t.Cleanup(func() { _ = got.Release() })
	takeRoles(t, ctx, w, r, func() { r.Pin(b.Segment().ID()) })
	require.Equal(t, uint32(waitBusy), r.lane.Load().readerWord(readerWaits).Load())
	w.wait.spin = patience
	lend = func() error {
		if err := b.Lend(); err != nil {
			return err
		}
		answered(t)
		err := w.SendLent(ctx, binary.LittleEndian.AppendUint32(nil, 7), nil, []*shm.Block{b})
		if err != nil {
			b.Return()
		}
		return err
	}
	return w, r, b, ctx, lend
}

// answered marks this process as one that has just received a message
// (see answering), and keeps it so, however late the scheduler runs the
// test's next step, until the test ends.
func answered(t *testing.T) {
	lastRecv.Store(monoNow() + int64(time.Hour))
	t.Cleanup(func() { lastRecv.Store(0) })
}

// sendLater runs lend in a goroutine, returns once w waits for its busy
// reader, and reports lend's error on the channel.
func sendLater(t *testing.T, w *Way, lend func() error) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	before := w.wait.waits.Load()
	go func() { done <- lend() }()
	require.Eventually(t, func() bool { return w.wait.waits.Load() > before }, 10*time.Second, 50*time.Microsecond,
		"the writer never waited for its busy reader")
	return done
}

// A fair Way's writer with a message that names blocks, which only a
// reader waiting on the lane may be handed, waits for its busy reader
// (the end's only one) to come back to the lane, and hands it the entry
// then: the reader gets it by the lane.
func TestFairWayWriterWaitsForItsBusyReader(t *testing.T) {
	w, r, b, ctx, lend := busyReader(t, time.Minute)
	lastRecv.Store(0)
	assert.False(t, w.Maps(b), "a writer that has received nothing lately does not wait for a busy reader")
	answered(t)
	assert.True(t, w.Maps(b), "one that answers waits: the writer names its pins")
	sent := sendLater(t, w, lend)
	got := recvLater(ctx, r)
	require.NoError(t, gotWithin(t, sent, "the reader came back, but the writer waited on"))
	g := within(t, got, "the entry never came")
	assert.Equal(t, 7, g.i)
	assert.True(t, g.byLane, "handed to the reader once it waited on the lane")
	assert.Zero(t, w.wait.misses.Load())

	// With another reader of the end, the busy one is not waited for:
	// the other may take the message from the socket now.
	r2 := anotherFair(t, r, r.mem, false)
	got2 := recvLater(ctx, r2)
	require.Eventually(t, func() bool { return r2.shared.Waiting() == 1 }, 10*time.Second, 50*time.Microsecond)
	time.Sleep(2 * peerCheck) // the writer's look at other readers is that old at most
	answered(t)
	assert.False(t, w.Maps(b), "another reader: the busy one's pins are not named")
	require.NoError(t, w.Send(ctx, wayMsg(9, 8), nil))
	assert.Equal(t, 9, within(t, got2, "the other reader never got the message").i)
}

// A reader that does not come back within the writer's patience gets the
// message by the socket (the writer's send gives up the lane, ErrNoLane,
// and is encoded anew with descriptors); after patienceMisses such waits
// in a row the writer names no pins of a busy reader, but for one
// message in patienceProbe.
func TestFairWayWriterGivesUpOnABusyReader(t *testing.T) {
	w, r, b, ctx, lend := busyReader(t, time.Millisecond)
	for i := range patienceMisses {
		require.ErrorIs(t, lend(), carry.ErrNoLane, "wait %d", i)
	}
	assert.EqualValues(t, patienceMisses, w.wait.waits.Load())
	assert.EqualValues(t, patienceMisses, w.wait.misses.Load())
	maps := 0
	for range 2 * patienceProbe {
		answered(t)
		if w.Maps(b) {
			maps++
		}
	}
	assert.Equal(t, 2, maps, "one look in patienceProbe names the pins of a reader that stays busy")

	// A probe whose reader comes back: the writer waits for it again.
	w.wait.spin = time.Minute
	sent := sendLater(t, w, lend)
	got := recvLater(ctx, r)
	require.NoError(t, gotWithin(t, sent, "the reader came back, but the writer waited on"))
	assert.True(t, within(t, got, "the entry never came").byLane)
	assert.Zero(t, w.wait.misses.Load())
	answered(t)
	assert.True(t, w.Maps(b), "waiting for a busy reader again")
}

// A reader that parks on the socket, or lets go of its role, while the
// writer waits for it ends the wait at once: the writer sends by the
// socket, and counts no miss.
func TestFairWayWriterStopsWaitingForAReaderThatGoes(t *testing.T) {
	for _, tc := range []struct {
		name string
		move func(ctx context.Context, r *Way) <-chan gotMsg
	}{
		{"parks", func(ctx context.Context, r *Way) <-chan gotMsg {
			// Its next wait is on the socket: its messages came there,
			// and the writer has missed the lane no more since.
			r.missSeen = r.lane.Load().readerWord(laneMisses).Load()
			return recvAfter(ctx, r, socketRun)
		}},
		{"lets go", func(ctx context.Context, r *Way) <-chan gotMsg {
			r.LetGo()
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, r, _, ctx, lend := busyReader(t, time.Minute)
			sent := sendLater(t, w, lend)
			got := tc.move(ctx, r)
			require.ErrorIs(t, gotWithin(t, sent, "the reader went, but the writer waited on"), carry.ErrNoLane)
			assert.Zero(t, w.wait.misses.Load())
			if got != nil {
				require.NoError(t, w.Send(ctx, wayMsg(8, 8), nil))
				g := within(t, got, "the parked reader never got the socket's message")
				assert.Equal(t, 8, g.i)
				assert.False(t, g.byLane)
			}
		})
	}
}

// A receive that ends marks the process as one that answers (see
// answering): its writers may then wait for busy readers. It is marked
// as the receive ends (Msg.Done), not as its message came: a worker that
// works on a task longer than answerWindow before it is done with it
// answers all the same.
func TestReceiveMarksTheProcessAnswering(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	lastRecv.Store(0)
	assert.False(t, answering())
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	time.Sleep(2 * answerWindow) // the receiver works on its message
	before := monoNow()
	m.Done()
	assert.True(t, before <= lastRecv.Load() && lastRecv.Load() <= monoNow(), "stamped when the receive ended")
	assert.True(t, answering())
}

// A writer that spins for its busy reader stops once its context ends:
// the message is not the lane's, and no miss is counted.
func TestFairWayWriterStopsSpinningAtItsContext(t *testing.T) {
	w, r, b, ctx, _ := busyReader(t, time.Minute)
	r.idle.Stop() // the reader stays busy in its role: only the context ends the spin
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	require.NoError(t, b.Lend())
	answered(t)
	before := w.wait.waits.Load()
	done := make(chan error, 1)
	go func() { done <- w.SendLent(cctx, binary.LittleEndian.AppendUint32(nil, 7), nil, []*shm.Block{b}) }()
	require.Eventually(t, func() bool { return w.wait.waits.Load() > before }, 10*time.Second, 50*time.Microsecond,
		"the writer never spun for its busy reader")
	cancel()
	err := gotWithin(t, done, "the writer spun on past its context")
	if err != nil {
		b.Return()
	}
	require.ErrorIs(t, err, carry.ErrNoLane)
	assert.Zero(t, w.wait.misses.Load())
}

// A writer that may not name a block its reader pins, because the reader
// waits on the socket (its messages came there), counts the lane's miss
// all the same: the reader waits on the lane next, and the writer names
// the block then. Else a writer that had stopped waiting for its reader
// sent every tensor with descriptors, and the reader waited on the
// socket for good.
func TestFairWayMissedNameBringsTheReaderToTheLane(t *testing.T) {
	w, r, b, ctx, _ := busyReader(t, time.Minute)
	l := w.lane.Load()
	r.missSeen = l.readerWord(laneMisses).Load()
	got := recvAfter(ctx, r, socketRun) // on the socket
	require.Eventually(t, func() bool { return l.readerWord(readerWaits).Load() == waitParked }, 10*time.Second, 50*time.Microsecond,
		"the reader never parked")
	other, err := shm.DefaultPool().Alloc(64 << 10) // another class: another segment
	require.NoError(t, err)
	defer other.Release()
	require.NotEqual(t, b.Segment().ID(), other.Segment().ID())
	misses := l.readerWord(laneMisses).Load()
	answered(t)
	assert.False(t, w.Maps(other))
	assert.Equal(t, misses, l.readerWord(laneMisses).Load(), "a block of a segment the reader does not pin is no miss")
	assert.False(t, w.Maps(b), "a parked reader is named no block")
	assert.Equal(t, misses+1, l.readerWord(laneMisses).Load(), "the lane's miss is counted")
	require.NoError(t, w.Send(ctx, wayMsg(3, 8), nil))
	assert.False(t, within(t, got, "the parked reader never got the socket's message").byLane)

	got = recvAfter(ctx, r, socketRun) // on the lane: the writer missed it
	waitsOnLane(t, r)
	answered(t)
	assert.True(t, w.Maps(b), "the reader waits on the lane: the block may be named")
	require.NoError(t, w.Send(ctx, wayMsg(4, 8), nil))
	assert.True(t, within(t, got, "the message never came").byLane)
}

// A fair Way's writer asks the kernel whether the role's reader lives
// (readerHeld) before it names a block for the reader's pins, unless the
// reader began its wait on the lane, or spun there, within the Way's
// live: a reader killed as it
// waits leaves its wait behind, and a block named for its pins would be
// lost to the next reader, which maps none of them.
func TestFairWayAsksWhetherItsReaderLives(t *testing.T) {
	w, r, _, ctx, lend := busyReader(t, time.Millisecond)
	l := w.lane.Load()
	// sendAsleep sends a named block to r, asleep on the lane, whose wait
	// is stamped waited (-1: as the reader stamped it) and its last spin
	// spunAt, and returns how often the writer asked.
	sendAsleep := func(waited, spunAt int64) uint64 {
		t.Helper()
		asleep := make(chan struct{})
		onceBeforeSleep(t, func() { close(asleep) }) // past its spin: it stamps no more
		got := recvLater(ctx, r)
		select {
		case <-asleep:
		case <-time.After(10 * time.Second):
			t.Fatal("the reader never slept on the lane")
		}
		waitsOnLane(t, r)
		if waited != -1 {
			l.readerStamp(readerAt).Store(waited)
		}
		atomic.StoreInt64(l.sent.spunAt, spunAt)
		looks := heldLooks.Load()
		require.NoError(t, lend())
		g := within(t, got, "the named block never came")
		assert.Equal(t, 7, g.i)
		assert.True(t, g.byLane)
		return heldLooks.Load() - looks
	}
	w.live = time.Hour // however late the test's next step runs
	old, ahead := stamp()-int64(2*time.Hour), stamp()+int64(2*time.Hour)
	lastRecv.Store(monoNow())
	assert.Zero(t, sendAsleep(-1, old), "a reader stamps its wait as its process's last receive: no look")
	assert.Zero(t, sendAsleep(stamp(), old), "a reader that began its wait lately lives: no look")
	assert.Zero(t, sendAsleep(old, stamp()), "a reader that spun lately lives: no look")
	assert.EqualValues(t, 1, sendAsleep(old, old), "a wait and a spin too old: a look")
	assert.EqualValues(t, 1, sendAsleep(ahead, ahead), "stamps further ahead than live (stamps that disagree): a look")

	// A reader gone, its wait left behind as a killed one leaves it.
	require.NoError(t, r.Close())
	l.readerWord(readerWaits).Store(waitOnLane)
	l.readerStamp(readerAt).Store(old)
	atomic.StoreInt64(l.sent.spunAt, old)
	looks := heldLooks.Load()
	assert.ErrorIs(t, lend(), carry.ErrNoLane, "a block named for the pins of a reader gone")
	assert.EqualValues(t, 1, heldLooks.Load()-looks)
}

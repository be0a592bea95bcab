//go:build linux

package sock

import (
	"context"
	"encoding/binary"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
)

// fairPair is wayPair for a queue: the writer and the reader are fair
// Ways (NewFairWay), w over the socket's end that puts, r over the one
// that gets.
func fairPair(t *testing.T) (w, r *Way, mem *fd.FD) {
	t.Helper()
	w, r, mem = wayPair(t)
	w.fair, r.fair = true, true
	w.sleep, r.sleep = laneSleep, laneSleep
	w.live, r.live = liveWindow, liveWindow
	w.wait.spin = awaitSpin
	return w, r, mem
}

// fairRoles is fairPair, its writer and reader in their roles (a first
// message sent and received), with a context for the test, after a look
// at the descriptors the test leaves (leakcheck).
func fairRoles(t *testing.T) (w, r *Way, mem *fd.FD, ctx context.Context) {
	t.Helper()
	leakcheck.Check(t)
	w, r, mem = fairPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	recvWay(t, ctx, r)
	return w, r, mem, ctx
}

// anotherFair is another for a fair Way.
func anotherFair(t *testing.T, w *Way, mem *fd.FD, writes bool) *Way {
	t.Helper()
	w2 := another(t, w, mem, writes)
	w2.fair, w2.sleep, w2.live = true, laneSleep, liveWindow
	w2.wait.spin = awaitSpin
	return w2
}

// devNull returns a descriptor of /dev/null, for a message that must go
// by the socket, closed at the test's end.
func devNull(t *testing.T) int {
	t.Helper()
	null, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Close(null) })
	return null
}

// recvWay receives the next message on r and returns its index and
// whether it came by the lane.
func recvWay(t *testing.T, ctx context.Context, r *Way) (int, bool) {
	t.Helper()
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	defer m.Done()
	require.GreaterOrEqual(t, len(m.Data), 4)
	return int(binary.LittleEndian.Uint32(m.Data)), m.ByLane()
}

// gotMsg is a message a goroutine gotMsg: its index, whether it came
// by the lane, and the receive's error.
type gotMsg struct {
	i      int
	data   []byte // the message's bytes, copied
	byLane bool
	err    error
}

// recvLater receives one message on r in a goroutine, waiting on the lane
// (as if its messages had come by it lately) unless it cannot.
func recvLater(ctx context.Context, r *Way) <-chan gotMsg { return recvAfter(ctx, r, 0) }

// recvAfter is recvLater for a reader whose last run messages came by the
// socket (see socketRun).
func recvAfter(ctx context.Context, r *Way, run int) <-chan gotMsg {
	r.sockRun = run
	got := make(chan gotMsg, 1)
	go func() {
		m, err := r.Recv(ctx)
		if err != nil {
			got <- gotMsg{err: err}
			return
		}
		g := gotMsg{i: int(binary.LittleEndian.Uint32(m.Data)), data: append([]byte(nil), m.Data...), byLane: m.ByLane()}
		m.Done() // before the test goes on: the receive is over
		got <- g
	}()
	return got
}

// within returns what got reports within 5 s, which must be a message;
// else the test fails with why.
func within(t *testing.T, got <-chan gotMsg, why string) gotMsg {
	t.Helper()
	select {
	case g := <-got:
		require.NoError(t, g.err)
		return g
	case <-time.After(5 * time.Second):
		t.Fatal(why)
		return gotMsg{}
	}
}

// waitsOnLane waits until r's reader waits on the lane, as its writer
// sees it.
func waitsOnLane(t *testing.T, r *Way) {
	t.Helper()
	require.Eventually(t, func() bool {
		l := r.lane.Load()
		return l != nil && l.readerWord(readerWaits).Load() == waitOnLane
	}, 10*time.Second, 50*time.Microsecond, "the reader never waited on the lane")
}

// makeBusy makes r, which holds the reader's role, busy with the lane
// open to w's next message: r takes one message by the lane (so it has
// found the socket empty since w last sent there) and receives nothing
// after it, and keeps the role (its idle timer stopped).
func makeBusy(t *testing.T, ctx context.Context, w, r *Way) {
	t.Helper()
	r.idle.Stop()
	got := recvLater(ctx, r)
	waitsOnLane(t, r)
	require.NoError(t, w.Send(ctx, wayMsg(100, 8), nil))
	g := <-got
	require.NoError(t, g.err)
	require.True(t, g.byLane)
	l := w.lane.Load()
	require.True(t, w.handsOver(l, l.Tail(), false, false), "the lane takes a message for the busy reader")
}

// A fair Way's writer hands a message to the lane while the role's reader
// waits on it, or while it is busy and no other process reads the end
// (the reader takes it at its next receive); with another reader, only
// while the role's reader waits: one sent while it is busy goes by the
// socket, from which the other takes it. With no reader in the role, the
// socket.
func TestFairWayHandsToAWaitingOrLoneReader(t *testing.T) {
	leakcheck.Check(t)
	w, r, mem := fairPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	i, byLane := recvWay(t, ctx, r)
	assert.Equal(t, 0, i)
	assert.False(t, byLane, "sent before a reader held the role")

	for k := 1; k <= 3; k++ {
		got := recvLater(ctx, r)
		waitsOnLane(t, r)
		require.NoError(t, w.Send(ctx, wayMsg(k, 8), nil))
		g := <-got
		require.NoError(t, g.err)
		assert.Equal(t, k, g.i)
		assert.True(t, g.byLane, "message %d: sent to a waiting reader", k)
	}
	require.NoError(t, w.Send(ctx, wayMsg(4, 8), nil)) // the reader is busy
	i, byLane = recvWay(t, ctx, r)
	assert.Equal(t, 4, i)
	assert.True(t, byLane, "sent to a busy reader, none other")

	r2 := anotherFair(t, r, mem, false)
	got := recvLater(ctx, r2)
	require.Eventually(t, func() bool { return r2.shared.Waiting() == 1 }, 10*time.Second, 50*time.Microsecond)
	time.Sleep(2 * peerCheck)                          // the writer's look at other readers is that old at most
	require.NoError(t, w.Send(ctx, wayMsg(5, 8), nil)) // the role's reader is busy
	g := <-got
	require.NoError(t, g.err)
	assert.Equal(t, 5, g.i)
	assert.False(t, g.byLane)
	got = recvLater(ctx, r)
	waitsOnLane(t, r)
	require.NoError(t, w.Send(ctx, wayMsg(6, 8), nil))
	g = <-got
	require.NoError(t, g.err)
	assert.Equal(t, 6, g.i)
	assert.True(t, g.byLane, "sent to the waiting role's reader")
}

// A reader whose wait the writer claimed waits on the lane for the entry,
// however long after laneSleep it comes: it does not go to the socket and
// leave the entry behind.
func TestFairWayClaimedWaitGetsItsEntry(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	got := recvLater(ctx, r)
	waitsOnLane(t, r)

	w.sem.lock()
	l := w.taken()
	require.True(t, w.handsOver(l, l.Tail(), true, false), "the writer claims the wait")
	time.Sleep(laneSleep + 50*time.Millisecond)
	publishClaimed(t, ctx, w, l)
	claimedArrives(t, got)
}

// Beyond laneWaiters readers waiting on lanes at once, a reader waits on
// its socket, parked, without saying it waits on the lane: the writer
// sends there.
func TestFairWayParksBeyondItsThreads(t *testing.T) {
	w, r, _, ctx := fairRoles(t)

	laneSleepers.Add(laneWaiters) // every lane wait is taken
	defer laneSleepers.Add(-laneWaiters)
	r.sleep = time.Hour // a reader that waited on the lane would not park
	got := recvLater(ctx, r)
	require.Eventually(t, func() bool { return r.shared.Waiting() == 1 }, 10*time.Second, 50*time.Microsecond, "the reader never waited on the socket")
	assert.Equal(t, uint32(waitParked), r.lane.Load().readerWord(readerWaits).Load(), "a parked reader does not wait on the lane")
	assert.Equal(t, 1, r.Waiting())
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	g := <-got
	require.NoError(t, g.err)
	assert.Equal(t, 1, g.i)
	assert.False(t, g.byLane)
}

// A reader without the role that finds no lane wait to be had, and so
// waits on the socket without trying for the role, is a lane wait
// refused: a Pipe's writer holding one gives it up (see Lane.waitRoom).
// One that does not wait is not (a try, or a receive of a message the
// socket holds already), nor one that waits there for another reason
// (another process holds the role).
func TestFairWayTurnedAwayReaderCountsAsRefused(t *testing.T) {
	w, r, mem, ctx := fairRoles(t)
	w2 := anotherFair(t, w, mem, true) // without the role: by the socket
	waits := func(r *Way) {
		t.Helper()
		require.Eventually(t, func() bool { return r.shared.Waiting() == 1 }, 10*time.Second, 50*time.Microsecond, "the reader never waited on the socket")
	}
	r2 := anotherFair(t, r, mem, false) // another process's reader
	refused := laneWaitsRefused.Load()
	got := recvLater(ctx, r2)
	waits(r2)
	assert.Equal(t, refused, laneWaitsRefused.Load(), "a reader without the role, another's, refused")
	require.NoError(t, w2.Send(ctx, wayMsg(1, 8), nil))
	assert.Equal(t, 1, within(t, got, "the message never came").i)

	r.LetGo()
	require.False(t, holds(r))
	laneSleepers.Add(laneWaiters) // every lane wait is taken
	busy := true
	t.Cleanup(func() {
		if busy {
			laneSleepers.Add(-laneWaiters)
		}
	})
	_, err := r.TryRecv(ctx)
	require.ErrorIs(t, err, ErrWouldBlock)
	assert.Equal(t, refused, laneWaitsRefused.Load(), "a try refused")

	got = recvLater(ctx, r)
	waits(r)
	assert.NotEqual(t, refused, laneWaitsRefused.Load(), "a lane wait refused")
	require.NoError(t, w.Send(ctx, wayMsg(2, 8), nil))
	assert.Equal(t, 2, within(t, got, "the message never came").i)

	require.False(t, holds(r), "turned away, it did not try for the role")
	require.NoError(t, w2.Send(ctx, wayMsg(3, 8), nil))
	refused = laneWaitsRefused.Load()
	i, byLane := recvWay(t, ctx, r)
	assert.Equal(t, 3, i)
	assert.False(t, byLane)
	assert.Equal(t, refused, laneWaitsRefused.Load(), "a receive of a message there refused")

	// Lane waits free again, the role another's: r waits on the socket
	// for the role, not for want of a lane wait.
	laneSleepers.Add(-laneWaiters)
	busy = false
	got = recvLater(ctx, r2)
	waitsOnLane(t, r2)
	require.NoError(t, w.Send(ctx, wayMsg(4, 8), nil))
	assert.True(t, within(t, got, "the message never came").byLane)
	got = recvLater(ctx, r)
	waits(r)
	assert.Equal(t, refused, laneWaitsRefused.Load(), "a reader without the role, another's, refused")
	require.NoError(t, w2.Send(ctx, wayMsg(5, 8), nil))
	assert.Equal(t, 5, within(t, got, "the message never came").i)
}

// A message that a writer without the role sent by the socket comes
// before one that the role's writer sends after it, to a reader waiting on
// the lane all along: once the socket has had a message since the reader
// found it empty, the lane takes none (as a pool's notice of a worker's
// exit must follow the worker's last reply), until the reader has found
// it empty again.
func TestFairWayOtherWritersComeFirst(t *testing.T) {
	w, r, mem, ctx := fairRoles(t)
	w2 := anotherFair(t, w, mem, true)

	for k := 1; k <= 20; k += 2 {
		got := recvLater(ctx, r)
		waitsOnLane(t, r)
		require.NoError(t, w2.Send(ctx, wayMsg(k, 8), nil))
		w.sem.lock()
		l := w.lane.Load()
		lane := w.handsOver(l, l.Tail(), false, false)
		w.sem.unlock()
		assert.False(t, lane, "message %d: the lane would take it", k+1)
		require.NoError(t, w.Send(ctx, wayMsg(k+1, 8), nil))
		g := <-got
		require.NoError(t, g.err)
		assert.Equal(t, k, g.i, "the other writer's message first")
		i, _ := recvWay(t, ctx, r)
		assert.Equal(t, k+1, i)
	}
	assert.False(t, holds(w2), "the other writer took the role")

	// The reader, having found the socket empty since, is handed the
	// next message by the lane again.
	got := recvLater(ctx, r)
	waitsOnLane(t, r)
	require.NoError(t, w.Send(ctx, wayMsg(100, 8), nil))
	g := <-got
	require.NoError(t, g.err)
	assert.Equal(t, 100, g.i)
	assert.True(t, g.byLane, "the lane serves again")
}

// TryRecv takes what there is, by the lane or the socket, and returns
// ErrWouldBlock for nothing, or while a receive of this process is under
// way; TrySend sends.
func TestFairWayTryRecv(t *testing.T) {
	leakcheck.Check(t)
	w, r, _ := fairPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := r.TryRecv(ctx)
	assert.ErrorIs(t, err, ErrWouldBlock)
	require.NoError(t, w.TrySend(ctx, wayMsg(1, 8), nil))
	tryRecvOne(t, ctx, r, 1)

	got := recvLater(ctx, r)
	waitsOnLane(t, r)
	_, err = r.TryRecv(ctx)
	assert.ErrorIs(t, err, ErrWouldBlock, "a receive is under way")
	require.NoError(t, w.TrySend(ctx, wayMsg(2, 8), nil))
	g := <-got
	require.NoError(t, g.err)
	assert.Equal(t, 2, g.i)
	assert.True(t, g.byLane)

	// An entry in the lane, taken by a TryRecv: one a reader that waited
	// was handed and did not take (its wait ended first).
	w.sem.lock()
	l := w.taken()
	require.NoError(t, w.sendEntry(ctx, l, []byte{kindValue}, wayMsg(3, 8), false, monoNow()))
	w.sem.unlock()
	assert.True(t, tryRecvOne(t, ctx, r, 3), "by the lane")
}

// tryRecvOne checks that a TryRecv on r takes message i and the next one
// finds nothing, and reports whether i came by the lane.
func tryRecvOne(t *testing.T, ctx context.Context, r *Way, i int) (byLane bool) {
	t.Helper()
	m, err := r.TryRecv(ctx)
	require.NoError(t, err)
	assert.Equal(t, wayMsg(i, 8), m.Data)
	byLane = m.ByLane()
	m.Done()
	_, err = r.TryRecv(ctx)
	assert.ErrorIs(t, err, ErrWouldBlock)
	return byLane
}

// A pipe's TryRecv looks at the socket, for a message of a writer without
// the role, which nothing in the lane marks.
func TestWayTryRecvLooksAtTheSocket(t *testing.T) {
	leakcheck.Check(t)
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w2 := another(t, w, mem, true)
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil)) // the roles
	recvIndex(t, ctx, r)
	require.NoError(t, w2.Send(ctx, wayMsg(1, 8), nil))
	tryRecvOne(t, ctx, r, 1)
}

// While the lane's reader is busy (it holds the role, and receives
// nothing), another reader of the same end gets every message, also
// those sent while it is between two receives: none waits in the lane
// for the busy one.
func TestFairWayBusyReaderKeepsNothing(t *testing.T) {
	w, r, mem, ctx := fairRoles(t) // r takes the reader's role
	r2 := anotherFair(t, r, mem, false)
	makeBusy(t, ctx, w, r) // and keeps it while it receives nothing
	require.True(t, holds(r))

	const n = 20
	got := make(chan gotMsg, n)
	wait, cancelWait := context.WithTimeout(ctx, 5*time.Second)
	defer cancelWait()
	go func() {
		for range n {
			m, err := r2.Recv(wait)
			if err != nil {
				got <- gotMsg{err: err}
				return
			}
			got <- gotMsg{i: int(binary.LittleEndian.Uint32(m.Data)), byLane: m.ByLane()}
			m.Done()
		}
	}()
	require.Eventually(t, func() bool { return r2.shared.Waiting() == 1 }, 10*time.Second, 50*time.Microsecond)
	time.Sleep(2 * peerCheck) // the writer's look at other readers is that old at most
	for i := 1; i <= n; i++ {
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
	}
	for i := 1; i <= n; i++ {
		g := <-got
		require.NoError(t, g.err, "message %d waits for the busy reader", i)
		assert.Equal(t, i, g.i)
	}
	assert.False(t, holds(r2))
}

// A reader that only tries (TryRecv, a queue's TryGet) counts as another
// reader from its first try: what the writer sends while the role's
// reader is busy goes by the socket, where its tries find it, not to the
// lane, where it would wait for the busy one.
func TestFairWayTryingReaderKeepsNothingWaiting(t *testing.T) {
	w, r, mem, ctx := fairRoles(t) // r takes the reader's role
	r2 := anotherFair(t, r, mem, false)
	makeBusy(t, ctx, w, r) // and keeps it while it receives nothing
	_, err := r2.TryRecv(ctx)
	require.ErrorIs(t, err, ErrWouldBlock)
	time.Sleep(2 * peerCheck) // the writer's look at other readers is that old at most

	const n = 20
	for i := 1; i <= n; i++ {
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
	}
	for i := 1; i <= n; i++ {
		var m Msg
		require.Eventually(t, func() bool {
			m, err = r2.TryRecv(ctx)
			return err == nil
		}, 5*time.Second, 100*time.Microsecond, "message %d waits for the busy reader", i)
		assert.Equal(t, wayMsg(i, 8), m.Data)
		assert.False(t, m.ByLane())
		m.Done()
	}
	assert.False(t, holds(r2))
}

// A message the role's writer sent by the socket while the reader was
// busy (the lane held one already) comes before the writer's next one,
// which may go by the lane: the reader takes the lane's first, then the
// socket's, before it waits on the lane.
func TestFairWaySocketBeforeLane(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	for k := 1; k <= 30; k += 3 {
		// One by the lane first: the reader has found the socket empty.
		got := recvLater(ctx, r)
		waitsOnLane(t, r)
		require.NoError(t, w.Send(ctx, wayMsg(k, 8), nil))
		g := <-got
		require.NoError(t, g.err)
		require.True(t, g.byLane)
		k++

		// The reader is busy: the first by the lane, the second, the
		// lane not empty, by the socket.
		require.NoError(t, w.Send(ctx, wayMsg(k, 8), nil))
		require.NoError(t, w.Send(ctx, wayMsg(k+1, 8), nil))
		i, byLane := recvWay(t, ctx, r)
		require.Equal(t, k, i)
		require.True(t, byLane)
		k++
		got = recvLater(ctx, r)
		waited := false
		require.Eventually(t, func() bool {
			select {
			case g = <-got:
				return true
			default:
			}
			if r.lane.Load().readerWord(readerWaits).Load() == waitOnLane && !waited {
				waited = true // it waits on the lane: the next goes there
				require.NoError(t, w.Send(ctx, wayMsg(k+1, 8), nil))
			}
			return false
		}, 10*time.Second, 20*time.Microsecond)
		require.NoError(t, g.err)
		assert.Equal(t, k, g.i, "the socket's message first")
		assert.False(t, g.byLane)
		if !waited {
			require.NoError(t, w.Send(ctx, wayMsg(k+1, 8), nil))
		}
		i, _ = recvWay(t, ctx, r)
		require.Equal(t, k+1, i)
	}
}

// A claim whose writer died before it published leaves the reader
// waiting for nothing only until it sees that no process holds the
// writer's role; a writer that takes the role over gives the wait back.
func TestFairWayDeadWritersClaim(t *testing.T) {
	w, r, mem, ctx := fairRoles(t)
	waits := r.lane.Load().readerWord(readerWaits)

	// Its writer gone, a claim stays: the reader waits for its entry,
	// then, the role free, for the socket.
	require.NoError(t, w.Close())
	waits.Store(waitClaimed)
	got := recvLater(ctx, r)
	w2 := anotherFair(t, w, mem, true)
	w2.tried = time.Now() // it sends without the role, for now
	require.NoError(t, w2.Send(ctx, wayMsg(1, 8), nil))
	g := within(t, got, "the reader waits for a dead writer's entry")
	assert.Equal(t, 1, g.i)

	// A writer that takes the role over gives a dead writer's claim
	// back, and hands the reader its next message by the lane.
	got = recvLater(ctx, r)
	waitsOnLane(t, r)
	waits.Store(waitClaimed)
	w2.tried = time.Time{}
	require.NoError(t, w2.Send(ctx, wayMsg(2, 8), nil))
	g = within(t, got, "the reader waits for a dead writer's entry")
	assert.Equal(t, 2, g.i)
	assert.True(t, g.byLane)
}

// publishClaimed publishes message 1 on l as the entry whose wait the
// writer w claimed, and ends the call w holds meanwhile (its sem).
func publishClaimed(t *testing.T, ctx context.Context, w *Way, l *Lane) {
	t.Helper()
	require.NoError(t, w.sendEntry(ctx, l, []byte{kindValue}, wayMsg(1, 8), true, monoNow()))
	w.sem.unlock()
}

// claimedArrives checks that the receive got took message 1, the claimed
// entry, by the lane.
func claimedArrives(t *testing.T, got <-chan gotMsg) {
	t.Helper()
	g := within(t, got, "the claimed entry was left in the lane")
	assert.Equal(t, 1, g.i)
	assert.True(t, g.byLane)
}

// claimOutlived returns a fair pair whose reader's receive, waiting on
// the lane, ended with its context after the writer claimed the wait and
// before it published: the writer holds its call (sem) and the lane l,
// for the test to publish on.
func claimOutlived(t *testing.T) (w, r *Way, l *Lane, ctx context.Context) {
	t.Helper()
	w, r, _, ctx = fairRoles(t)
	short, cancelShort := context.WithCancel(ctx)
	got := recvLater(short, r)
	waitsOnLane(t, r)
	w.sem.lock()
	l = w.taken()
	require.True(t, w.handsOver(l, l.Tail(), true, false), "the writer claims the wait")
	cancelShort()
	require.ErrorIs(t, (<-got).err, context.Canceled)
	return w, r, l, ctx
}

// A receive that ends while the writer it was claimed by has not yet
// published leaves the claim to the next receive, which waits for the
// entry on the lane, even with no lane wait to be had.
func TestFairWayClaimOutlivesItsReceive(t *testing.T) {
	w, r, l, ctx := claimOutlived(t)
	laneSleepers.Add(laneWaiters) // no lane wait to be had
	defer laneSleepers.Add(-laneWaiters)
	got := recvLater(ctx, r)
	time.Sleep(10 * time.Millisecond)
	publishClaimed(t, ctx, w, l)
	claimedArrives(t, got)
}

// A reader that has waited on the lane for its sleep waits on the socket,
// as waitParked: the writer sends there, though the reader is alone. A
// receive that ends while parked leaves the reader busy, not parked.
func TestFairWayParksAfterItsSleep(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	r.sleep = 5 * time.Millisecond
	waits := r.lane.Load().readerWord(readerWaits)
	parked := func() bool { return waits.Load() == waitParked }
	got := recvLater(ctx, r)
	require.Eventually(t, parked, 10*time.Second, 50*time.Microsecond, "the reader never parked")
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	g := within(t, got, "the message was left in the lane")
	assert.Equal(t, 1, g.i)
	assert.False(t, g.byLane)

	short, cancelShort := context.WithCancel(ctx)
	got = recvLater(short, r)
	require.Eventually(t, parked, 10*time.Second, 50*time.Microsecond, "the reader never parked")
	cancelShort()
	require.ErrorIs(t, (<-got).err, context.Canceled)
	require.NoError(t, w.Send(ctx, wayMsg(2, 8), nil)) // busy, and alone
	i, byLane := recvWay(t, ctx, r)
	assert.Equal(t, 2, i)
	assert.True(t, byLane, "the reader is not parked any more")
}

// A reader that lets go of its role says no reader holds it: the writer
// sends by the socket until one takes it again.
func TestFairWayLetGoEndsBusyClaims(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	waits := r.lane.Load().readerWord(readerWaits)
	assert.Equal(t, uint32(waitBusy), waits.Load())
	r.LetGo()
	assert.Equal(t, uint32(waitNone), waits.Load())
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	i, byLane := recvWay(t, ctx, r)
	assert.Equal(t, 1, i)
	assert.False(t, byLane, "sent while no reader held the role")
	require.NoError(t, w.Send(ctx, wayMsg(2, 8), nil)) // r holds it again
	i, byLane = recvWay(t, ctx, r)
	assert.Equal(t, 2, i)
	assert.False(t, byLane, "the socket had a message since the reader found it empty")
}

// A reader killed waiting on the lane leaves its state behind: the next
// reader, with no lane wait to be had, waits on its socket, and the
// writer sends there, not into the lane.
func TestFairWayDeadReadersWait(t *testing.T) {
	w, r, mem, ctx := fairRoles(t)
	require.NoError(t, r.Close())
	// As a reader killed in its wait leaves it (r's mapping is gone).
	w.lane.Load().readerWord(readerWaits).Store(waitOnLane)

	r2 := anotherFair(t, r, mem, false)
	laneSleepers.Add(laneWaiters)
	defer laneSleepers.Add(-laneWaiters)
	got := recvLater(ctx, r2)
	require.Eventually(t, func() bool { return r2.shared.Waiting() == 1 }, 10*time.Second, 50*time.Microsecond)
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	g := within(t, got, "the message was left in the lane")
	assert.Equal(t, 1, g.i)
}

// A reader whose last messages came by the socket (here: each with a
// descriptor, which the lane never takes) waits for the next on the
// socket, parked, every time; once the writer has sent by the socket a
// message that the lane would have taken from a reader waiting there, the
// reader waits on the lane again, and the writer's next such message
// comes by it.
func TestFairWayWaitsWhereMessagesCome(t *testing.T) {
	leakcheck.Check(t)
	w, r, _ := fairPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	null := devNull(t)
	waits := func() uint32 {
		l := r.lane.Load()
		if l == nil {
			return waitNone
		}
		return l.readerWord(readerWaits).Load()
	}
	// recv receives the next message, sent with fds once the reader
	// waits, and returns where the reader waited for it.
	recv := func(k int, fds []int) (where uint32, byLane bool) {
		got := make(chan gotMsg, 1)
		go func() {
			m, err := r.Recv(ctx)
			if err == nil {
				g := gotMsg{i: int(binary.LittleEndian.Uint32(m.Data)), data: append([]byte(nil), m.Data...), byLane: m.ByLane()}
				m.Done()
				got <- g
				return
			}
			got <- gotMsg{err: err}
		}()
		require.Eventually(t, func() bool {
			v := waits()
			return v == waitParked || v == waitOnLane || k < socketRun
		}, 10*time.Second, 20*time.Microsecond)
		where = waits()
		require.NoError(t, w.Send(ctx, wayMsg(k, 8), fds))
		g := within(t, got, "the message never came")
		assert.Equal(t, k, g.i)
		return where, g.byLane
	}
	const n = 40
	for k := range n {
		where, _ := recv(k, []int{null})
		if k >= socketRun {
			require.EqualValues(t, waitParked, where, "message %d: a reader whose messages need descriptors waits on the socket", k)
		}
	}
	l := w.lane.Load()
	assert.Zero(t, l.readerWord(laneMisses).Load(), "a message with descriptors is no miss of the lane")

	where, byLane := recv(n, nil)
	assert.EqualValues(t, waitParked, where)
	assert.False(t, byLane)
	assert.EqualValues(t, 1, l.readerWord(laneMisses).Load(), "the lane would have taken it from a reader waiting there")
	for k := n + 1; k < n+4; k++ {
		where, byLane := recv(k, nil)
		assert.EqualValues(t, waitOnLane, where, "message %d: the writer missed the lane: the reader waits there", k)
		assert.True(t, byLane, "message %d", k)
	}
	// Descriptors again: on the socket, once the run says so, the miss
	// seen.
	for k := n + 4; k < n+8+socketRun; k++ {
		where, _ := recv(k, []int{null})
		if k >= n+4+socketRun {
			assert.EqualValues(t, waitParked, where, "message %d", k)
		}
	}
}

// A reader that decided to wait on the socket waits there, even if the
// writer counts a lane miss before it waits: by then the message that
// missed is on the socket, whose nudge came before any wait on the lane,
// and a reader that waited on the lane after all would sleep past it
// (with no look at the socket since, and its waitsAt left behind).
func TestFairWayWaitsWhereItDecided(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	null := devNull(t)
	l := r.lane.Load()
	r.missSeen = l.readerWord(laneMisses).Load()
	onceBeforeWaitFair(t, func() {
		l.readerWord(laneMisses).Add(1)
		assert.NoError(t, w.Send(ctx, wayMsg(5, 8), []int{null}))
	})
	waits := l.sent.waits.Load()
	got := recvAfter(ctx, r, socketRun) // on the socket
	assert.Equal(t, 5, within(t, got, "the message never came").i)
	assert.Equal(t, waits, l.sent.waits.Load(), "the reader waited on the lane")
}

// onceBeforeWaitFair has the first fair Way's reader that decided where
// it waits run f, between its decision and its wait, until the test's
// end.
func onceBeforeWaitFair(t *testing.T, f func()) {
	var once sync.Once
	hook := func() { once.Do(f) }
	beforeWaitFair.Store(&hook)
	t.Cleanup(func() { beforeWaitFair.Store(nil) })
}

// A message by the socket that a writer counts and nudges after the
// reader decided to wait on the lane, and before it armed its sleep (its
// Nudge finds no sleep to wake), is received without a sleep: the reader
// looks at the count once armed, not a sleepSlice later.
func TestFairWayMissesNoNudgeBeforeItsSleep(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	null := devNull(t)
	onceBeforeWaitFair(t, func() { assert.NoError(t, w.Send(ctx, wayMsg(5, 8), []int{null})) })
	var sleeps atomic.Int32
	slept := func() { sleeps.Add(1) }
	beforeSleep.Store(&slept)
	t.Cleanup(func() { beforeSleep.Store(nil) })
	g := within(t, recvLater(ctx, r), "the message never came") // waits on the lane
	assert.Equal(t, 5, g.i)
	assert.False(t, g.byLane)
	assert.Zero(t, sleeps.Load(), "the reader slept with the socket's message there")
}

// A claim whose entry does not come (a writer stopped before it
// published, or a peer's word) keeps the reader from the socket for a
// slice at most: a message there is received.
func TestFairWayStalledClaimLetsTheSocketIn(t *testing.T) {
	w, r, mem, ctx := fairRoles(t)
	w2 := anotherFair(t, w, mem, true)
	got := recvLater(ctx, r)
	waitsOnLane(t, r)
	w.sem.lock()
	l := w.taken()
	require.True(t, w.handsOver(l, l.Tail(), true, false), "the writer claims the wait")
	w.sem.unlock() // and publishes nothing
	require.NoError(t, w2.Send(ctx, wayMsg(1, 8), nil))
	g := within(t, got, "the reader waits for a claimed entry that does not come, not for the socket")
	assert.Equal(t, 1, g.i)
	assert.False(t, g.byLane)
}

// A send with a done context sends nothing, by the lane or the socket.
func TestFairWayDoneContextSendsNothing(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	got := recvLater(ctx, r) // one by the lane: the reader found the socket empty
	waitsOnLane(t, r)
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	require.True(t, within(t, got, "the lane's message").byLane)
	// The reader is busy and alone: the lane would take the next.
	done, cancel := context.WithCancel(ctx)
	cancel()
	sent := w.lane.Load().Sent()
	require.ErrorIs(t, w.Send(done, wayMsg(1, 8), nil), context.Canceled)
	require.ErrorIs(t, w.TrySend(done, wayMsg(1, 8), nil), context.Canceled)
	assert.Equal(t, sent, w.lane.Load().Sent(), "nothing in the lane")
	_, err := r.TryRecv(ctx)
	assert.ErrorIs(t, err, ErrWouldBlock, "nothing on the socket")
	require.NoError(t, w.Send(ctx, wayMsg(2, 8), nil))
	i, byLane := recvWay(t, ctx, r)
	assert.Equal(t, 2, i)
	assert.True(t, byLane)
}

// A reader whose receive ended with a claim outstanding keeps its role
// while it receives nothing, until it has taken the claimed entry: the
// entry may name blocks that only its pins map.
func TestFairWayClaimKeepsTheRole(t *testing.T) {
	w, r, l, ctx := claimOutlived(t)
	for range 3 {
		r.letGoIdle() // as its idle timer does, with no receive since
	}
	assert.True(t, holds(r), "the reader let go of its role with a claim outstanding")
	publishClaimed(t, ctx, w, l)
	i, byLane := recvWay(t, ctx, r)
	assert.Equal(t, 1, i)
	assert.True(t, byLane)
	r.letGoIdle()
	r.letGoIdle()
	assert.False(t, holds(r), "the entry taken, an idle reader lets go")
}

//go:build linux

package sock

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
)

// roomWord returns the address of the futex a writer of w's lane sleeps
// on while it waits for room: its taken bell's flag.
func roomWord(w *Way) uintptr { return uintptr(unsafe.Pointer(w.lane.Load().taken.asleep)) }

// fillLane sends WayEntries messages on w, 1 to WayEntries, which fill
// its lane while its reader takes none.
func fillLane(t *testing.T, ctx context.Context, w *Way) {
	t.Helper()
	for i := 1; i <= WayEntries; i++ {
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
	}
	require.Equal(t, uint32(WayEntries), w.lane.Load().Tail()-w.lane.Load().Taken(), "the lane is full")
}

// sendIntoFull sends message WayEntries+1 on w in a goroutine, and returns
// its error on the channel.
func sendIntoFull(ctx context.Context, w *Way) <-chan error {
	errc := make(chan error, 1)
	go func() { errc <- w.Send(ctx, wayMsg(WayEntries+1, 8), nil) }()
	return errc
}

// drainLane receives messages 1 to WayEntries+1 on r, in order, each by
// the lane, failing the test at the first that is not (from any
// goroutine).
func drainLane(t *testing.T, ctx context.Context, r *Way) {
	t.Helper()
	for i := 1; i <= WayEntries+1; i++ {
		m, err := r.Recv(ctx)
		if !assert.NoError(t, err, "message %d", i) {
			return
		}
		ok := assert.Equal(t, wayMsg(i, 8), m.Data, "message %d", i) && assert.True(t, m.ByLane(), "message %d by the lane", i)
		m.Done()
		if !ok {
			return
		}
	}
}

// intoFull makes a mapped pair, fills its lane, and starts a send into
// it on ctx, once prepare has set the writer up; it returns the pair,
// the slices the writers begin on timers (see roomSlices), and the
// send's error.
func intoFull(t *testing.T, ctx context.Context, prepare func(w *Way)) (w, r *Way, slices func() []time.Duration, errc <-chan error) {
	t.Helper()
	w, r, _ = mappedPair(t, ctx)
	prepare(w)
	fillLane(t, ctx, w)
	slices = roomSlices(t)
	return w, r, slices, sendIntoFull(ctx, w)
}

// roomSlices records the slices that writers without a lane wait begin
// (roomStep), until the test ends.
func roomSlices(t *testing.T) func() []time.Duration {
	var mu sync.Mutex
	var slices []time.Duration
	step := func(slice time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		slices = append(slices, slice)
	}
	roomStep.Store(&step)
	t.Cleanup(func() { roomStep.Store(nil) })
	return func() []time.Duration {
		mu.Lock()
		defer mu.Unlock()
		return append([]time.Duration(nil), slices...)
	}
}

// Pipe writers that wait for room in full lanes hold at most laneWaiters
// threads of the process asleep on their lanes: the others wait on
// timers, costing no thread of their own. Each sees room once its reader
// takes, and every message arrives in order, by the lane.
func TestPipeWritersWaitForRoomBeyondTheirThreads(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 3 * laneWaiters
	ws, rs := make([]*Way, n), make([]*Way, n)
	words := map[uintptr]bool{}
	for i := range n {
		ws[i], rs[i], _ = mappedPair(t, ctx)
		ws[i].sleep = time.Hour // those with a lane wait keep it
		words[roomWord(ws[i])] = true
		fillLane(t, ctx, ws[i])
	}
	slices := roomSlices(t)
	errs := make([]<-chan error, n)
	for i, w := range ws {
		errs[i] = sendIntoFull(ctx, w)
	}
	require.Eventually(t, func() bool {
		return asleepOn(t, words) == laneWaiters && len(slices()) >= n-laneWaiters
	}, 10*time.Second, time.Millisecond, "laneWaiters writers asleep on their lanes, the others on timers")
	for range 10 {
		time.Sleep(5 * time.Millisecond)
		require.LessOrEqual(t, asleepOn(t, words), laneWaiters, "lanes with a thread asleep")
	}
	time.Sleep(laneSleep) // past the default patience, waits refused meanwhile
	require.Equal(t, int32(laneWaiters), laneSleepers.Load(), "the writers with a lane wait keep it")
	for i := range n {
		select {
		case err := <-errs[i]:
			t.Fatalf("writer %d sent into a full lane: %v", i, err)
		default:
		}
	}
	var drains sync.WaitGroup
	for i, r := range rs {
		drains.Go(func() { // at once: a writer on a timer sees room a slice late
			drainLane(t, ctx, r)
			assert.NoError(t, <-errs[i], "writer %d", i)
		})
	}
	drains.Wait()
}

// A Pipe writer that holds a lane wait keeps it past its sleep while no
// other wait was refused one: it sleeps on its lane throughout, where
// the reader's take wakes it.
func TestPipeWriterKeepsItsLaneWaitUnasked(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, r, slices, errc := intoFull(t, ctx, func(w *Way) { w.sleep = 10 * time.Millisecond })
	words := map[uintptr]bool{roomWord(w): true}
	require.Eventually(t, func() bool { return asleepOn(t, words) == 1 }, 5*time.Second, 100*time.Microsecond, "the writer asleep on its lane")
	for range 20 {
		time.Sleep(5 * time.Millisecond)
		require.Equal(t, int32(1), laneSleepers.Load(), "the writer's lane wait")
	}
	assert.Empty(t, slices(), "the writer on a timer")
	require.Empty(t, errc, "the send is done before any room")
	drainLane(t, ctx, r)
	require.NoError(t, <-errc)
}

// A Pipe writer that holds a lane wait gives it up at the end of its
// sleep once another wait was refused one, and waits on timers, once a
// send: no thread of its process sleeps on its lane again. It sees the
// reader's take at a slice's end.
func TestPipeWriterGivesUpItsLaneWaitWhenAsked(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	laneSleepers.Add(laneWaiters - 1) // all but the writer's
	defer laneSleepers.Add(-(laneWaiters - 1))
	w, r, slices, errc := intoFull(t, ctx, func(w *Way) { w.sleep = 20 * time.Millisecond })
	words := map[uintptr]bool{roomWord(w): true}
	require.Eventually(t, func() bool { return asleepOn(t, words) == 1 }, 5*time.Second, 100*time.Microsecond, "the writer asleep on its lane")
	require.False(t, takeLaneWait(), "a lane wait free beside the writer's")
	require.Eventually(t, func() bool { return len(slices()) > 0 }, 5*time.Second, 100*time.Microsecond, "the writer on a timer after its sleep")
	assert.Equal(t, int32(laneWaiters-1), laneSleepers.Load(), "its lane wait given back")
	for range 10 {
		time.Sleep(5 * time.Millisecond)
		require.Zero(t, asleepOn(t, words), "a thread asleep on the lane again")
	}
	require.Empty(t, errc, "the send is done before any room")
	drainLane(t, ctx, r)
	require.NoError(t, <-errc)
}

// A Pipe writer that keeps its lane wait past its patience sees its
// context's end at once: from its second patience on, the end nudges its
// sleep, which would otherwise see it only at its first slice's end, as
// a wait's first slice does (here each patience ends before the first
// slice does, so nothing else nudges it).
func TestPipeWriterKeepingItsLaneWaitSeesItsContextEnd(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	nudges := countNudges(t)
	require.Less(t, 5*time.Millisecond, sleepSlice)
	sent, cancelSend := context.WithCancel(ctx)
	defer cancelSend()
	w, _, _, errc := intoFull(t, sent, func(w *Way) { w.sleep = 5 * time.Millisecond })
	secondWait(t, w)
	// Cancelled while it sleeps: a writer awake between two waits as the
	// cancel sets the context's error, before the cancel reaches the
	// nudge, would see the end itself and disarm the nudge unrun.
	words := map[uintptr]bool{roomWord(w): true}
	require.Eventually(t, func() bool { return asleepOn(t, words) == 1 }, 5*time.Second, 50*time.Microsecond, "the writer asleep on its lane")
	cancelSend()
	select {
	case err := <-errc:
		assert.ErrorIs(t, err, context.Canceled)
	case <-time.After(5 * time.Second):
		t.Fatal("the send still waits")
	}
	assert.Positive(t, nudges.Load(), "the context's end nudged the sleep")
}

// A Pipe writer that kept its lane wait past its patience leaves
// nothing armed on its context once its send is done: the context's end
// after its Way has closed and unmapped the lane nudges nothing there.
func TestPipeWriterLeavesNothingArmedOnItsContext(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	nudges := countNudges(t)
	sent, cancelSend := context.WithCancel(ctx)
	defer cancelSend()
	w, r, _, errc := intoFull(t, sent, func(w *Way) { w.sleep = 5 * time.Millisecond })
	secondWait(t, w)
	time.Sleep(20 * time.Millisecond) // a few patiences more
	drainLane(t, ctx, r)
	require.NoError(t, <-errc)
	require.NoError(t, w.Close())
	require.Nil(t, w.lane.Load().mem, "the lane unmapped")
	cancelSend()
	time.Sleep(50 * time.Millisecond) // for the context's callbacks
	assert.Zero(t, nudges.Load(), "a nudge after the send")
}

// countNudges counts the nudges that waits' contexts make as they end
// (afterNudge), until the test ends.
func countNudges(t *testing.T) *atomic.Int32 {
	var nudges atomic.Int32
	hook := func() { nudges.Add(1) }
	afterNudge.Store(&hook)
	t.Cleanup(func() { afterNudge.Store(nil) })
	return &nudges
}

// secondWait waits until w's writer, waiting for room with a lane wait,
// has begun its second wait on the lane's bell: its first patience is
// over.
func secondWait(t *testing.T, w *Way) {
	t.Helper()
	bell := w.lane.Load().taken
	words := map[uintptr]bool{uintptr(unsafe.Pointer(bell.asleep)): true}
	require.Eventually(t, func() bool { return asleepOn(t, words) == 1 }, 5*time.Second, 100*time.Microsecond, "the writer asleep on its lane")
	first := bell.waits.Load()
	require.Eventually(t, func() bool { return bell.waits.Load()-first >= 1 }, 5*time.Second, 100*time.Microsecond, "the writer's second wait")
}

// A Pipe writer waiting for room without a lane wait begins with a slice
// of roomFirst, and doubles it each time one runs out with no room, up
// to maxSleepSlice: its first slices go 0.1, 0.2, 0.4 ms and on.
func TestPipeWriterRoomSlicesGrow(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	noLaneWait(t)
	_, r, slices, errc := intoFull(t, ctx, func(*Way) {})
	require.Eventually(t, func() bool { return len(slices()) >= 6 }, 5*time.Second, time.Millisecond)
	got := slices()[:6]
	for i, s := range got {
		assert.Equal(t, roomSlice<<i, s, "slice %d of %v", i, got)
	}
	drainLane(t, ctx, r)
	require.NoError(t, <-errc)
}

// The slices stop growing at maxSleepSlice: one of 0.9 s that runs out
// is followed by one of a second, not 1.8 s.
func TestPipeWriterRoomSlicesStopAtASecond(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	noLaneWait(t)
	_, r, slices, errc := intoFull(t, ctx, func(w *Way) { w.lane.Load().roomFirst = 900 * time.Millisecond })
	require.Eventually(t, func() bool { return len(slices()) >= 2 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []time.Duration{900 * time.Millisecond, maxSleepSlice}, slices()[:2])
	drainLane(t, ctx, r)
	require.NoError(t, <-errc)
}

// A writer waiting for room on a timer sees at once, long before its
// slice ends, its context's end, its Way's Close, and its readers' end
// (the reader's socket closed, as at the reader's death).
func TestPipeWriterWaitingForRoomSeesEveryEnd(t *testing.T) {
	const slice = time.Hour
	start := func(t *testing.T) (cancel context.CancelFunc, w, r *Way, errc <-chan error) {
		leakcheck.Check(t)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		t.Cleanup(cancel)
		noLaneWait(t)
		var slices func() []time.Duration
		w, r, slices, errc = intoFull(t, ctx, func(w *Way) { w.lane.Load().roomFirst = slice })
		require.Eventually(t, func() bool { return len(slices()) == 1 }, 5*time.Second, 100*time.Microsecond)
		return cancel, w, r, errc
	}
	returns := func(t *testing.T, errc <-chan error) error {
		t.Helper()
		select {
		case err := <-errc:
			return err
		case <-time.After(5 * time.Second):
			t.Fatal("the send still waits")
			return nil
		}
	}
	t.Run("context", func(t *testing.T) {
		cancel, _, _, errc := start(t)
		cancel()
		assert.ErrorIs(t, returns(t, errc), context.Canceled)
	})
	t.Run("close", func(t *testing.T) {
		_, w, _, errc := start(t)
		closed := make(chan error, 1)
		go func() { closed <- w.Close() }()
		assert.ErrorIs(t, returns(t, errc), ErrClosed)
		assert.NoError(t, <-closed)
	})
	t.Run("readers gone", func(t *testing.T) {
		_, _, r, errc := start(t)
		require.NoError(t, r.Close())
		require.NoError(t, r.shared.Close())
		assert.ErrorIs(t, returns(t, errc), ErrClosed)
	})
}

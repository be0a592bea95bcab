//go:build linux

package sock

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
)

// mappedPair returns a pipe direction's two Ways and a descriptor of
// its lane (see wayPair), with their lanes mapped and their roles taken,
// by one message there.
func mappedPair(t *testing.T, ctx context.Context) (w, r *Way, mem *fd.FD) {
	t.Helper()
	w, r, mem = wayPair(t)
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	require.True(t, m.ByLane())
	m.Done()
	return w, r, mem
}

// sleepWord returns the address of the futex a reader of r's lane sleeps
// on: its sent bell's flag.
func sleepWord(r *Way) uintptr { return uintptr(unsafe.Pointer(r.lane.Load().sent.asleep)) }

// asleepOn counts the words at addrs on which a thread of this process
// is asleep in futex(2), as /proc says of each thread: its system call's
// number and first argument. It counts words, not threads: the threads
// are read one after another, and a waiter whose sleep ends between two
// reads may sleep again on its word in a thread read later (its
// goroutine moved to another thread meanwhile), which a count of
// threads would take for two.
func asleepOn(t *testing.T, addrs map[uintptr]bool) int {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	require.NoError(t, err)
	asleep := map[uintptr]bool{}
	for _, task := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + task.Name() + "/syscall")
		if err != nil {
			continue // the thread is gone
		}
		f := strings.Fields(string(b))
		if len(f) < 2 || f[0] != strconv.Itoa(unix.SYS_FUTEX) {
			continue
		}
		a, err := strconv.ParseUint(strings.TrimPrefix(f[1], "0x"), 16, 64)
		if err == nil && addrs[uintptr(a)] {
			asleep[uintptr(a)] = true
		}
	}
	return len(asleep)
}

// wakesLeft takes the wake frames c's socket holds, and returns how many
// there were; a message there fails the test.
func wakesLeft(t *testing.T, ctx context.Context, c *Conn) int {
	t.Helper()
	for n := 0; ; n++ {
		m, err := c.recvOrWake(ctx, false)
		switch {
		case errors.Is(err, ErrWouldBlock):
			return n
		case err == nil:
			m.Done()
			t.Fatalf("a message on the socket after %d wakes", n)
		case !errors.Is(err, errWoken):
			t.Fatal(err)
		}
	}
}

// noLaneWait takes every lane wait of the process until the test ends:
// a Pipe's reader spins and parks.
func noLaneWait(t *testing.T) {
	laneSleepers.Add(laneWaiters)
	t.Cleanup(func() { laneSleepers.Add(-laneWaiters) })
}

// countLooks counts Pipe readers' last looks at their lanes before they
// receive on their sockets (parkLooked), until the test ends.
func countLooks(t *testing.T) *atomic.Int32 {
	var looks atomic.Int32
	count := func(step int) {
		if step == parkLooked {
			looks.Add(1)
		}
	}
	parkStep.Store(&count)
	t.Cleanup(func() { parkStep.Store(nil) })
	return &looks
}

// parked reports whether r's reader says it waits on its socket.
func parked(r *Way) bool { return r.lane.Load().readerWord(readerWaits).Load() == waitParked }

// Pipe readers that wait hold at most laneWaiters threads of the process
// asleep on their lanes: the others spin, then wait on their sockets,
// costing no thread of their own, and the writer's next entry wakes
// each; every reader takes its message by the lane.
func TestPipeReadersParkBeyondTheirThreads(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 3 * laneWaiters
	ws, rs := make([]*Way, n), make([]*Way, n)
	words := map[uintptr]bool{}
	for i := range n {
		ws[i], rs[i], _ = mappedPair(t, ctx)
		rs[i].sleep = time.Hour // those with a lane wait keep it
		words[sleepWord(rs[i])] = true
	}
	type got struct {
		i      int
		byLane bool
		err    error
	}
	results := make(chan got, n)
	for i, r := range rs {
		go func() {
			m, err := r.Recv(ctx)
			if err != nil {
				results <- got{i: i, err: err}
				return
			}
			results <- got{i: int(m.Data[0]), byLane: m.ByLane()}
			m.Done()
		}()
	}
	require.Eventually(t, func() bool {
		k := 0
		for _, r := range rs {
			if parked(r) {
				k++
			}
		}
		return k == n-laneWaiters && asleepOn(t, words) == laneWaiters
	}, 10*time.Second, time.Millisecond, "laneWaiters readers asleep on their lanes, the others parked")
	for range 10 { // a sleeper between two slices is awake for a moment
		time.Sleep(5 * time.Millisecond)
		require.LessOrEqual(t, asleepOn(t, words), laneWaiters, "lanes with a thread asleep")
	}
	for i, w := range ws {
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
	}
	seen := make([]bool, n)
	for range n {
		g := <-results
		require.NoError(t, g.err, "reader %d", g.i)
		assert.True(t, g.byLane, "reader %d took its message by the lane", g.i)
		seen[g.i] = true
	}
	for i, ok := range seen {
		assert.True(t, ok, "reader %d got its own message", i)
	}
}

// parkedAfterSleep makes a mapped pair whose reader waits on the lane for
// 20 ms and then parks for one long slice, and returns once it has
// parked: the pair, the word a lane wait of the reader sleeps on, and
// the receive's outcome (see parkReceive).
func parkedAfterSleep(t *testing.T, ctx context.Context) (w, r *Way, words map[uintptr]bool, done <-chan gotMsg) {
	t.Helper()
	w, r, _ = mappedPair(t, ctx)
	r.sleep = 20 * time.Millisecond
	r.parkFirst = time.Hour // the wake, not a slice's end, brings it back
	return w, r, map[uintptr]bool{sleepWord(r): true}, parkReceive(t, ctx, r)
}

// A Pipe reader that holds a lane wait gives it up after its sleep and
// parks on its socket; the writer's entry wakes it there.
func TestPipeReaderParksAfterItsSleep(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, r, words, done := parkedAfterSleep(t, ctx)
	assert.Zero(t, asleepOn(t, words), "a parked reader sleeps on no lane")
	assert.Equal(t, 1, r.Waiting(), "one call waits")
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	g := <-done
	require.NoError(t, g.err)
	assert.True(t, g.byLane, "the message by the lane")
	assert.Equal(t, wayMsg(1, 8), g.data)
	assert.False(t, parked(r))
}

// The writer's entries reach a reader that parks as they are published,
// wherever the publish falls in the reader's Dekker's pattern: before
// the reader says it parks, or between that and its last look at the
// lane, the reader's look sees them; after that look, the writer sees
// the word and wakes the reader, once, not once an entry. The reader
// says it is parked no more once it is back. A wake that the reader did
// not wait for is skipped by its next receive. The reader's slices on
// the socket last an hour here: a lost wake would hang it.
func TestPipeParkingReaderMissesNoEntry(t *testing.T) {
	for _, c := range []struct {
		name  string
		step  int
		stale int // wakes left on the socket: sent, and not waited for
	}{
		{"before it says so", parkSaying, 0},
		{"before its last look", parkSaid, 1},
		{"after its last look", parkLooked, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			w, r, _ := mappedPair(t, ctx)
			r.parkFirst = time.Hour
			noLaneWait(t) // the reader parks
			var once sync.Once
			publish := func(step int) {
				if step != c.step {
					return
				}
				once.Do(func() {
					for i := 1; i <= 3; i++ {
						require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
					}
				})
			}
			parkStep.Store(&publish)
			defer parkStep.Store(nil)
			for i := 1; i <= 3; i++ {
				m, err := r.Recv(ctx)
				require.NoError(t, err, "the entries published as the reader parked")
				assert.True(t, m.ByLane())
				assert.Equal(t, wayMsg(i, 8), m.Data)
				m.Done()
			}
			parkStep.Store(nil)
			assert.False(t, parked(r), "the reader is back")
			assert.Equal(t, c.stale, wakesLeft(t, ctx, r.shared), "wakes left on the socket")

			// A wake left on the socket is no message.
			require.NoError(t, w.shared.wake())
			require.NoError(t, w.Send(ctx, wayMsg(4, 8), nil))
			m, err := r.Recv(ctx)
			require.NoError(t, err)
			assert.Equal(t, wayMsg(4, 8), m.Data)
			m.Done()
			_, err = r.TryRecv(ctx)
			assert.ErrorIs(t, err, ErrWouldBlock, "the wake is no message")
			assert.Zero(t, r.shared.poll()&unix.POLLIN, "the wake was taken off the socket")
		})
	}
}

// A writer looks at the reader's word only once it has published: a
// reader that parks right after that look (here, within it) finds the
// entry in its last look at the lane, and does not wait on the socket.
func TestPipeWriterLooksAfterItPublishes(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, r, _ := mappedPair(t, ctx)
	r.parkFirst = time.Hour // a lost wake hangs the reader
	noLaneWait(t)
	var done <-chan gotMsg
	var once sync.Once
	recvWithin := func(step int) {
		if step != wakeLooked {
			return
		}
		once.Do(func() {
			done = recvLater(ctx, r)
			// The receive ends, or parks on the socket.
			deadline := time.Now().Add(time.Second)
			for len(done) == 0 && !(parked(r) && r.shared.Waiting() == 1) && time.Now().Before(deadline) {
				time.Sleep(100 * time.Microsecond)
			}
		})
	}
	parkStep.Store(&recvWithin)
	defer parkStep.Store(nil)
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	g := within(t, done, "the reader parked past the entry")
	assert.Equal(t, wayMsg(1, 8), g.data)
	assert.True(t, g.byLane)
}

// The park/publish race without hooks, for two seconds: a reader with no
// lane wait to be had spins and parks while its writer publishes at
// points spread over the spin and the park. No entry is missed (the
// reader's slices on the socket last an hour: a lost wake would hang it).
// The two run in parallel, on two Ps at least (with one, the reader would
// run only once the writer blocks, never parked as it sends), and one
// round in 64 waits for the reader to park before it sends.
func TestPipeParkRace(t *testing.T) {
	leakcheck.Check(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(max(2, runtime.GOMAXPROCS(0))))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := mappedPair(t, ctx)
	r.parkFirst = time.Hour
	noLaneWait(t)
	got := make(chan error, 1)
	rounds, parkedAt := 0, 0
	for start := time.Now(); time.Since(start) < 2*time.Second; rounds++ {
		go func() {
			m, err := r.Recv(ctx)
			if err == nil {
				m.Done()
			}
			got <- err
		}()
		for spin := rounds % 128 * 1024; spin > 0; spin-- {
		}
		if rounds%64 == 63 { // some sends find it parked, on one CPU too
			for deadline := time.Now().Add(time.Second); !parked(r) && time.Now().Before(deadline); {
				time.Sleep(50 * time.Microsecond)
			}
		}
		if parked(r) {
			parkedAt++
		}
		require.NoError(t, w.Send(ctx, wayMsg(rounds, 8), nil))
		select {
		case err := <-got:
			require.NoError(t, err)
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: the reader missed the entry", rounds)
		}
	}
	t.Logf("%d rounds, the reader parked at %d of the sends", rounds, parkedAt)
	assert.Positive(t, parkedAt, "the sends found the reader parked")
}

// A parked reader's wait ends at its writer's end, its context's end and
// its own Close, as a wait on the lane does.
func TestPipeParkedReaderSeesEveryEnd(t *testing.T) {
	for _, c := range []struct {
		name string
		end  func(w, r *Way, cancel context.CancelFunc)
		want error
	}{
		{"the writer's end", func(w, _ *Way, _ context.CancelFunc) { _ = w.shared.Close() }, ErrClosed},
		{"the context's end", func(_, _ *Way, cancel context.CancelFunc) { cancel() }, context.Canceled},
		{"the reader's close", func(_, r *Way, _ context.CancelFunc) { _ = r.shared.Close(); _ = r.Close() }, ErrClosed},
	} {
		t.Run(c.name, func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			w, r, _ := mappedPair(t, ctx)
			r.sleep = time.Millisecond
			recvCtx, stop := context.WithCancel(ctx)
			defer stop()
			done := recvErr(recvCtx, r)
			require.Eventually(t, func() bool { return parked(r) }, 5*time.Second, time.Millisecond)
			start := time.Now()
			c.end(w, r, stop)
			select {
			case err := <-done:
				assert.ErrorIs(t, err, c.want)
				t.Logf("seen %v later", time.Since(start))
			case <-time.After(5 * time.Second):
				t.Fatal("the parked reader still waits")
			}
		})
	}
}

// A wake frame is no message: a receive skips it, and a parked reader's
// receive returns errWoken for it. One that carries anything more (bytes,
// descriptors, another flag) is malformed, and what it carried is closed.
func TestConnWakeFrames(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, peer := rawPair(t)
	defer unix.Close(peer)
	wake := make([]byte, headerLen)
	header{flags: flagWake}.put(wake)
	message := append(make([]byte, headerLen), "after"...)

	require.NoError(t, unix.Sendmsg(peer, wake, nil, nil, 0))
	_, err := c.TryRecv(ctx)
	assert.ErrorIs(t, err, ErrWouldBlock, "a wake alone")
	for range 3 {
		require.NoError(t, unix.Sendmsg(peer, wake, nil, nil, 0))
	}
	require.NoError(t, unix.Sendmsg(peer, message, nil, nil, 0))
	m, err := c.Recv(ctx)
	require.NoError(t, err)
	assert.Equal(t, "after", string(m.Data), "the wakes before it skipped")
	m.Done()

	require.NoError(t, unix.Sendmsg(peer, wake, nil, nil, 0))
	_, err = c.recvOrWake(ctx, true)
	assert.ErrorIs(t, err, errWoken)
	_, err = c.TryRecv(ctx)
	assert.ErrorIs(t, err, ErrWouldBlock, "the wake was taken")

	for _, bad := range []struct {
		name   string
		h      header
		tail   string
		rights bool
	}{
		{"with bytes", header{flags: flagWake}, "x", false},
		{"with a descriptor", header{flags: flagWake, direct: 1}, "", true},
		{"tagged", header{flags: flagWake | flagTag}, "0000", false},
		{"with a count", header{flags: flagWake, carried: 1}, "", false},
	} {
		b := make([]byte, headerLen)
		bad.h.put(b)
		b = append(b, bad.tail...)
		var oob []byte
		if bad.rights {
			f, err := os.Open(os.DevNull)
			require.NoError(t, err)
			oob = unix.UnixRights(int(f.Fd()))
			require.NoError(t, unix.Sendmsg(peer, b, oob, nil, 0))
			require.NoError(t, f.Close())
		} else {
			require.NoError(t, unix.Sendmsg(peer, b, nil, nil, 0))
		}
		_, err := c.recvOrWake(ctx, true)
		assert.ErrorIs(t, err, ErrMalformed, bad.name)
		assert.NotErrorIs(t, err, errWoken, bad.name)
	}
	require.NoError(t, unix.Sendmsg(peer, message, nil, nil, 0))
	m, err = c.Recv(ctx)
	require.NoError(t, err, "the connection goes on")
	assert.Equal(t, "after", string(m.Data))
	m.Done()
}

// parkReceive starts a receive on r, returns once r is parked on its
// socket, and the receive's outcome on the channel: its message's bytes,
// whether it came by the lane, or its error.
func parkReceive(t *testing.T, ctx context.Context, r *Way) <-chan gotMsg {
	t.Helper()
	done := recvLater(ctx, r)
	require.Eventually(t, func() bool { return parked(r) && r.shared.Waiting() == 1 }, 5*time.Second, 100*time.Microsecond)
	return done
}

// A message that comes by the socket (a writer without the lane's role
// sends there) reaches a parked reader.
func TestPipeParkedReaderGetsASocketMessage(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, r, mem := mappedPair(t, ctx)
	r.parkFirst = time.Hour
	noLaneWait(t)
	done := parkReceive(t, ctx, r)
	w2 := another(t, w, mem, true) // the role is w's: w2 sends by the socket
	require.NoError(t, w2.Send(ctx, wayMsg(1, 8), nil))
	g := <-done
	require.NoError(t, g.err)
	assert.Equal(t, wayMsg(1, 8), g.data)
	assert.False(t, g.byLane)
}

// An entry published with no wake after it (its writer killed between
// the two, or its wake's send failed) is taken by the parked reader at
// its slice's end; if its writer's end is gone meanwhile, before the
// reader says so.
func TestPipeParkedReaderTakesAnEntryWithoutItsWake(t *testing.T) {
	for _, gone := range []bool{false, true} {
		t.Run(fmt.Sprint("writer gone ", gone), func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			w, r, _ := mappedPair(t, ctx)
			noLaneWait(t)
			r.parkFirst = 20 * time.Millisecond
			if gone {
				r.parkFirst = time.Hour // the end wakes it
			}
			done := parkReceive(t, ctx, r)
			start := time.Now()
			require.NoError(t, w.lane.Load().TrySend(append([]byte{kindValue}, wayMsg(1, 8)...)))
			if gone {
				require.NoError(t, w.shared.Close())
			}
			g := <-done
			require.NoError(t, g.err)
			assert.Equal(t, wayMsg(1, 8), g.data)
			assert.True(t, g.byLane)
			t.Logf("taken %v after its publish", time.Since(start))
			if gone {
				m, err := r.Recv(ctx)
				if err == nil {
					m.Done()
				}
				assert.ErrorIs(t, err, ErrClosed, "then the end")
			}
		})
	}
}

// A reader that parks while another process receives on the same end
// without the role (one it handed the end to while it received) gets
// its entries all the same, though the other takes the wakes: at its
// slices' ends at the latest.
func TestPipeParkedReaderBesideAnotherReceiver(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w, r, mem := mappedPair(t, ctx)
	// Another process's end: a socket description of its own, and its
	// own descriptor of the lane.
	sockDup, err := r.shared.sock.Dup()
	require.NoError(t, err)
	c2, err := New(sockDup, "pipe")
	require.NoError(t, err)
	t.Cleanup(func() { _ = c2.Close() })
	memDup, err := mem.Dup()
	require.NoError(t, err)
	r2 := NewWay(c2, memDup, false)
	t.Cleanup(func() { _ = r2.Close() })
	otherCtx, stopOther := context.WithCancel(ctx)
	other := make(chan error, 1)
	go func() {
		m, err := r2.Recv(otherCtx)
		if err == nil {
			m.Done()
			err = errors.New("the other receiver got a message")
		}
		other <- err
	}()
	noLaneWait(t)
	for i := 1; i <= 5; i++ {
		done := parkReceive(t, ctx, r)
		start := time.Now()
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
		g := within(t, done, fmt.Sprintf("entry %d: the parked reader still waits", i))
		assert.Equal(t, wayMsg(i, 8), g.data)
		t.Logf("entry %d taken %v after its send", i, time.Since(start))
	}
	stopOther()
	assert.ErrorIs(t, <-other, context.Canceled)
}

// A wake into a full socket returns at once: it does not wait for room.
func TestConnWakeIntoAFullSocket(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, peer := rawPair(t)
	defer unix.Close(peer)
	for {
		err := c.TrySend(ctx, make([]byte, 4096), nil)
		if errors.Is(err, ErrWouldBlock) {
			break
		}
		require.NoError(t, err)
	}
	woke := make(chan error, 1)
	go func() { woke <- c.wake() }()
	select {
	case err := <-woke:
		assert.ErrorIs(t, err, ErrWouldBlock)
	case <-time.After(time.Second):
		t.Fatal("the wake waits for room")
	}
}

// A parked reader's slices on the socket grow as its wait goes on,
// from its first (parkSlice) up to maxParkSlice, and a receive's first
// is the first again: a thousand idle readers wake ever more rarely,
// and a lost wake costs a receive that follows a long one no more than
// the first slice.
func TestPipeParkedReaderSlicesGrow(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, r, _ := mappedPair(t, ctx)
	noLaneWait(t)
	looks := countLooks(t)
	for i := 1; i <= 2; i++ {
		looks.Store(0)
		done := parkReceive(t, ctx, r)
		wait := 700 * time.Millisecond // 10+20+40+80+160+320 ms: 6 slices, or 7
		if i == 2 {
			wait = 100 * time.Millisecond // 10+20+40 ms, and into the fourth
		}
		time.Sleep(wait)
		n := looks.Load()
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
		g := <-done
		require.NoError(t, g.err)
		switch i {
		case 1:
			assert.InDelta(t, 6.5, n, 1.6, "slices of a wait of %v", wait)
		case 2:
			assert.GreaterOrEqual(t, n, int32(3), "slices of the next receive's wait of %v", wait)
		}
	}
}

// A reader that has parked in a receive does not take a lane wait again
// in it: at each slice's end it spins and parks again. An idle reader
// holds a lane wait once a receive, for its sleep, not once a slice.
func TestPipeParkedReaderTakesNoLaneWaitAgain(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, r, words, done := parkedAfterSleep(t, ctx)
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); {
		require.Zero(t, asleepOn(t, words), "asleep on the lane after its park")
		require.Zero(t, laneSleepers.Load(), "lane waits held")
		time.Sleep(time.Millisecond)
	}
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	g := <-done
	require.NoError(t, g.err)
	assert.True(t, g.byLane)

	// The next receive takes a lane wait again.
	next := recvLater(ctx, r)
	require.Eventually(t, func() bool { return asleepOn(t, words) == 1 }, 5*time.Second, 100*time.Microsecond)
	require.NoError(t, w.Send(ctx, wayMsg(2, 8), nil))
	require.NoError(t, (<-next).err)
}

// endsAfterPublish is a context that ends once the lane l has an entry
// past last: a writer's deadline that passes between its publish and its
// wake.
type endsAfterPublish struct {
	context.Context
	l    *Lane
	last uint32
}

func (c endsAfterPublish) Err() error {
	if c.l.Sent() != c.last {
		return context.Canceled
	}
	return c.Context.Err()
}

// A writer whose context ends between its publish and its wake wakes the
// parked reader all the same: the entry is sent, and the wake is owed.
func TestPipeWakeOwesNothingToTheWritersContext(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, r, _ := mappedPair(t, ctx)
	r.parkFirst = time.Hour // a lost wake hangs the reader
	noLaneWait(t)
	done := parkReceive(t, ctx, r)
	l := w.lane.Load()
	require.NoError(t, w.Send(endsAfterPublish{ctx, l, l.Sent()}, wayMsg(1, 8), nil))
	g := within(t, done, "the parked reader was not woken")
	assert.Equal(t, wayMsg(1, 8), g.data)
}

// A receive whose context ends while it is parked returns the context's
// error at once, after one park, however long the slice.
func TestPipeParkedReaderMeetsItsDeadline(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, r, _ := mappedPair(t, ctx)
	r.parkFirst = time.Hour
	noLaneWait(t)
	parks := countLooks(t)
	short, stop := context.WithTimeout(ctx, 30*time.Millisecond)
	defer stop()
	start := time.Now()
	_, err := r.Recv(short)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, time.Since(start), time.Second)
	assert.Equal(t, int32(1), parks.Load(), "parks")
}

// A parked reader's slices stop growing at maxParkSlice.
func TestPipeParkedReaderSlicesStopAtASecond(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, r, _ := mappedPair(t, ctx)
	r.parkFirst = 900 * time.Millisecond // then a second, not 1.8 s
	noLaneWait(t)
	looks := countLooks(t)
	done := parkReceive(t, ctx, r)
	time.Sleep(2300 * time.Millisecond) // looks at 0, 0.9 and 1.9 s (else 2.7 s)
	n := looks.Load()
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	require.NoError(t, (<-done).err)
	assert.Equal(t, int32(3), n, "looks at the lane in 2.3 s")
}

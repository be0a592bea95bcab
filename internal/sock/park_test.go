//go:build linux

package sock

import (
	"context"
	"os"
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

	"github.com/tensormp/tensormp/internal/leakcheck"
)

// mappedPair returns a pipe direction's two Ways (see wayPair) with
// their lanes mapped and their roles taken, by one message there.
func mappedPair(t *testing.T, ctx context.Context) (w, r *Way) {
	t.Helper()
	w, r, _ = wayPair(t)
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	require.True(t, m.ByLane())
	m.Done()
	return w, r
}

// sleepWord returns the address of the futex a reader of r's lane sleeps
// on: its sent bell's flag.
func sleepWord(r *Way) uintptr { return uintptr(unsafe.Pointer(r.lane.Load().sent.asleep)) }

// asleepOn counts the threads of this process asleep in futex(2) on one
// of the words at addrs, as /proc says of each: its system call's number
// and first argument.
func asleepOn(t *testing.T, addrs map[uintptr]bool) int {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	require.NoError(t, err)
	n := 0
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
			n++
		}
	}
	return n
}

// parked reports whether r's reader says it waits on its socket.
func parked(r *Way) bool { return r.lane.Load().readerWord(readerWaits).Load() == waitParked }

// Pipe readers that wait hold at most laneWaiters threads of the process
// asleep on their lanes: the others spin, then wait on their sockets,
// parked on the runtime's poller, and the writer's next entry wakes
// each; every reader takes its message by the lane.
func TestPipeReadersParkBeyondTheirThreads(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 3 * laneWaiters
	ws, rs := make([]*Way, n), make([]*Way, n)
	words := map[uintptr]bool{}
	for i := range n {
		ws[i], rs[i] = mappedPair(t, ctx)
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
	time.Sleep(20 * time.Millisecond)
	assert.Equal(t, laneWaiters, asleepOn(t, words), "threads asleep on the lanes")
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

// A Pipe reader that holds a lane wait gives it up after its sleep and
// parks on its socket; the writer's entry wakes it there.
func TestPipeReaderParksAfterItsSleep(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, r := mappedPair(t, ctx)
	r.sleep = 20 * time.Millisecond
	words := map[uintptr]bool{sleepWord(r): true}
	done := make(chan error, 1)
	go func() {
		m, err := r.Recv(ctx)
		if err == nil {
			if !m.ByLane() || m.Data[0] != 1 {
				err = assert.AnError
			}
			m.Done()
		}
		done <- err
	}()
	require.Eventually(t, func() bool { return parked(r) }, 5*time.Second, time.Millisecond)
	assert.Zero(t, asleepOn(t, words), "a parked reader sleeps on no lane")
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	require.NoError(t, <-done, "the message by the lane")
	assert.False(t, parked(r))
}

// The writer's entries reach a reader that parks as they are published:
// those published before the reader says it parks are seen by the
// reader's last look at the lane, and those published after it by the
// writer, who wakes the reader once, not once an entry. The reader says
// it is parked no more once it is back. A wake that the reader did not
// wait for is skipped by its next receive.
func TestPipeParkingReaderMissesNoEntry(t *testing.T) {
	for _, c := range []struct {
		name string
		hook *atomic.Pointer[func()]
	}{
		{"before it says so", &beforePark},
		{"after its last look", &beforeParkedRecv},
	} {
		t.Run(c.name, func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			w, r := mappedPair(t, ctx)
			laneSleepers.Add(laneWaiters) // no lane wait to be had: the reader parks
			defer laneSleepers.Add(-laneWaiters)
			var once sync.Once
			publish := func() {
				once.Do(func() {
					for i := 1; i <= 3; i++ {
						require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
					}
				})
			}
			c.hook.Store(&publish)
			defer c.hook.Store(nil)
			for i := 1; i <= 3; i++ {
				m, err := r.Recv(ctx)
				require.NoError(t, err, "the entries published as the reader parked")
				assert.True(t, m.ByLane())
				assert.Equal(t, wayMsg(i, 8), m.Data)
				m.Done()
			}
			c.hook.Store(nil)
			assert.False(t, parked(r), "the reader is back")
			assert.Zero(t, r.shared.poll()&unix.POLLIN, "no wake is left on the socket")

			// A wake left on the socket is no message.
			require.NoError(t, w.shared.wake(ctx))
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
			w, r := mappedPair(t, ctx)
			r.sleep = time.Millisecond
			recvCtx, stop := context.WithCancel(ctx)
			defer stop()
			done := make(chan error, 1)
			go func() {
				m, err := r.Recv(recvCtx)
				if err == nil {
					m.Done()
				}
				done <- err
			}()
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

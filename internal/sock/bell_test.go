//go:build linux

package sock_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/sock"
)

func init() {
	reexec.Register("sock.bell-peer", bellPeer)
}

// bellTrips is how many hand-offs each direction of the ping-pong makes.
// Every pauseEvery-th waits a pause first, longer than any spin, so that
// the other side sleeps; the others come at once or after a short pause.
const (
	bellTrips  = 20000
	pauseEvery = 50
	pause      = time.Millisecond
)

// mostTimeouts is how many sleeps of a ping-pong may end by their
// timeout rather than a ring (a machine that stalls a process for a whole
// sleep slice): a lost wake-up makes each of the bellTrips/pauseEvery
// sleeps one.
const mostTimeouts = bellTrips / pauseEvery / 10

// napBeforeRing pauses before the i-th ring as the ping-pong does.
func napBeforeRing(i uint32) {
	switch {
	case i%pauseEvery == 0:
		time.Sleep(pause)
	case rand.IntN(16) == 0:
		time.Sleep(time.Duration(rand.IntN(100)) * time.Microsecond)
	}
}

// bellMemory returns a shared page, as a memfd the peer maps too (fd 3 in
// a peer started with it in ExtraFiles), and the two bells in it: the
// parent rings ping, the peer pong.
func bellMemory(t *testing.T) (f *os.File, ping, pong *sock.Bell) {
	t.Helper()
	fd, err := unix.MemfdCreate("tensormp-bell-test", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	f = os.NewFile(uintptr(fd), "bell")
	t.Cleanup(func() { _ = f.Close() })
	require.NoError(t, f.Truncate(4096))
	ping, pong, unmap, err := mapBells(fd)
	require.NoError(t, err)
	t.Cleanup(unmap)
	return f, ping, pong
}

func mapBells(fd int) (ping, pong *sock.Bell, unmap func(), err error) {
	mem, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, nil, nil, err
	}
	unmap = func() { _ = unix.Munmap(mem) }
	if ping, err = sock.NewBell(mem[:128]); err == nil {
		pong, err = sock.NewBell(mem[128:256])
	}
	if err != nil {
		unmap()
		return nil, nil, nil, err
	}
	return ping, pong, unmap, nil
}

// bellPeer answers each ring of the ping bell (fd 3) with one of the pong
// bell, sometimes after a pause so that the parent sleeps, until the ping
// word reaches the count in its first argument, and fails if more than
// mostTimeouts of its own sleeps timed out; with "mute" it never answers,
// and waits to be killed.
func bellPeer() int {
	ping, pong, unmap, err := mapBells(3)
	if err != nil {
		return fail(err)
	}
	defer unmap()
	if os.Args[1] == "mute" {
		time.Sleep(time.Minute)
		return 1
	}
	n, err := strconv.Atoi(os.Args[1])
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	timeouts := 0
	counting := func() error { timeouts++; return nil }
	for last := uint32(0); last < uint32(n); {
		if last, err = ping.Wait(ctx, last, counting); err != nil {
			return fail(err)
		}
		napBeforeRing(last)
		pong.Ring()
	}
	if timeouts > mostTimeouts {
		return fail(fmt.Errorf("%d of the peer's sleeps timed out: wake-ups were lost", timeouts))
	}
	return 0
}

func fail(err error) int {
	os.Stderr.WriteString(err.Error() + "\n")
	return 1
}

// startBellPeer starts bellPeer with arg on f's bells.
func startBellPeer(t *testing.T, f *os.File, arg string) (wait func() error, kill func(), hangup *os.File) {
	t.Helper()
	return startPeer(t, "sock.bell-peer", nil, []*os.File{f}, arg)
}

// startPeer starts the helper name with files as its descriptors from 3 on,
// and the write end of a pipe after them, whose read end, returned, hangs
// up when the helper dies: the kernel's word that it is gone, as a queue's
// socket is a lane's. Its standard output goes to stdout, if not nil, which
// is whole once wait has returned. The helper is killed at the test's end.
func startPeer(t *testing.T, name string, stdout io.Writer, files []*os.File, args ...string) (wait func() error, kill func(), hangup *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	cmd, err := reexec.Command(context.Background(), name, args...)
	require.NoError(t, err)
	cmd.ExtraFiles = append(slices.Clip(files), w)
	cmd.Stdout = stdout
	err = cmd.Start()
	_ = w.Close()
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
	})
	wait = func() error {
		select {
		case err := <-done:
			done <- err
			return err
		case <-time.After(2 * time.Minute):
			return errors.New("the peer did not exit")
		}
	}
	return wait, func() { _ = cmd.Process.Kill() }, r
}

// hungUp returns an alive for Bell.Wait that reports errGone once the
// other end of r is closed in every process.
func hungUp(r *os.File) func() error {
	return func() error {
		p := []unix.PollFd{{Fd: int32(r.Fd()), Events: unix.POLLIN}}
		if _, err := unix.Poll(p, 0); err == unix.EINTR {
			return nil // a signal (the helper's SIGCHLD, say): ask again later
		} else if err != nil {
			return err
		}
		if p[0].Revents&unix.POLLHUP != 0 {
			return errGone
		}
		return nil
	}
}

var errGone = errors.New("the peer is gone")

// Every ring wakes its waiter, whether the waiter spins or sleeps and
// whatever the pauses between them: a ping-pong across two processes makes
// every one of its hand-offs, each side's word moving by exactly one each
// time, and the sleeps end by a ring, not by their timeout.
func TestBellLosesNoRing(t *testing.T) {
	f, ping, pong := bellMemory(t)
	wait, _, hangup := startBellPeer(t, f, strconv.Itoa(bellTrips))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	timeouts, peerAlive := 0, hungUp(hangup)
	counting := func() error { timeouts++; return peerAlive() }
	for i := uint32(1); i <= bellTrips; i++ {
		napBeforeRing(i)
		ping.Ring()
		got, err := pong.Wait(ctx, i-1, counting)
		require.NoError(t, err, "hand-off %d", i)
		require.Equal(t, i, got, "hand-off %d", i)
	}
	require.NoError(t, wait())
	assert.LessOrEqual(t, timeouts, mostTimeouts, "sleeps that timed out: wake-ups were lost")
}

// A waiter whose peer is gone hears it from alive within a sleep slice or
// so of the peer's death, not never; its context ends a wait too.
func TestBellWaitEnds(t *testing.T) {
	f, _, pong := bellMemory(t)
	_, kill, hangup := startBellPeer(t, f, "mute")
	alive := hungUp(hangup)
	require.NoError(t, alive(), "the peer is alive")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	time.AfterFunc(50*time.Millisecond, kill)
	start := time.Now()
	_, err := pong.Wait(ctx, pong.Load(), alive)
	assert.ErrorIs(t, err, errGone)
	assert.Less(t, time.Since(start), 5*time.Second)

	never := func() error { return nil }
	short, cancelShort := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancelShort()
	_, err = pong.Wait(short, pong.Load(), never)
	assert.ErrorIs(t, err, context.DeadlineExceeded)

	cancelled, cancelNow := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancelNow)
	_, err = pong.Wait(cancelled, pong.Load(), never)
	assert.ErrorIs(t, err, context.Canceled)
}

// A waiter whose peer stays silent asks alive ever more rarely, each
// sleep slice twice the last, from 10 ms up to a second: a thread that
// goes back to sleep holds its process's scheduler slot until the runtime
// takes it back, which a busy goroutine of a process on one CPU pays for.
// Its context still ends the wait at once, however long the slice.
func TestBellSleepsLongerAsItWaits(t *testing.T) {
	_, _, pong := bellMemory(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const asked = 8 // at about 10, 30, 70, 150, 310, 630, 1270 and 2270 ms
	var asks []time.Time
	var cancelled time.Time
	alive := func() error { // called by the waiter, on this goroutine
		asks = append(asks, time.Now())
		if len(asks) == asked {
			cancelled = time.Now().Add(30 * time.Millisecond)
			time.AfterFunc(30*time.Millisecond, cancel)
		}
		return nil
	}
	start := time.Now()
	_, err := pong.Wait(ctx, pong.Load(), alive)
	require.ErrorIs(t, err, context.Canceled)
	require.Len(t, asks, asked, "asked again after the cancellation, or not asked as slices ended")
	gap := func(i int) time.Duration { return asks[i].Sub(asks[i-1]) }
	// A first slice of 10 ms, then 20, 40, 80 and 160: begun short (a
	// dead peer is seen within about as long as the wait had lasted),
	// then doubled.
	assert.Less(t, asks[0].Sub(start), 60*time.Millisecond, "the first slice was long: %v", asks)
	assert.Less(t, asks[4].Sub(asks[0]), 600*time.Millisecond, "the first slices were long: %v", asks)
	assert.GreaterOrEqual(t, gap(4), 140*time.Millisecond, "the slices did not double: %v", asks)
	// Then 320 and 640 ms, and a second, not 1.28 s nor less.
	assert.Less(t, gap(7), 1150*time.Millisecond, "the slices grew past a second: %v", asks)
	assert.GreaterOrEqual(t, gap(7), 900*time.Millisecond, "the slices stopped short of a second: %v", asks)
	// The next slice, a second, is cut short by the cancellation.
	assert.Less(t, time.Since(cancelled), 150*time.Millisecond, "the cancellation was seen at the slice's end")
}

// A wait that ends as its context does, past its first slice, with the
// context's callback racing its return, is done with the bell's memory
// once it has returned: the lane it waited on may be unmapped at once.
func TestLaneClosedAsItsWaitEnds(t *testing.T) {
	for range 60 {
		f, err := sock.CreateLane(8, 64)
		require.NoError(t, err)
		l, err := sock.OpenLane(f)
		require.NoError(t, err)
		// Past the first slice (10 ms), whose end arms the callback.
		ctx, cancel := context.WithTimeout(context.Background(), 11*time.Millisecond)
		_, err = l.Recv(ctx, nil, func() error { return nil })
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NoError(t, l.Close()) // unmaps the bells: a Nudge still to come would fault
		require.NoError(t, f.Close())
	}
	time.Sleep(20 * time.Millisecond) // for a late Nudge to land, if any
}

// A bell's memory must be whole and aligned.
func TestNewBellRefusesBadMemory(t *testing.T) {
	mem := make([]byte, 512)
	_, err := sock.NewBell(mem[:64])
	assert.Error(t, err, "too short")
	_, err = sock.NewBell(mem[1:200])
	assert.Error(t, err, "not aligned")
}

// Signals that keep interrupting a waiter's sleep do not hide a dead peer
// from it: alive is asked once a sleep slice has gone by, however often
// the sleep was cut short.
func TestBellSignalsDoNotHideADeadPeer(t *testing.T) {
	f, _, pong := bellMemory(t)
	wait, kill, hangup := startBellPeer(t, f, "mute")
	kill()
	_ = wait()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tid := make(chan int, 1)
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		tid <- unix.Gettid()
		_, err := pong.Wait(ctx, pong.Load(), hungUp(hangup))
		done <- err
	}()
	waiter := <-tid
	tick := time.NewTicker(2 * time.Millisecond) // more often than a sleep slice
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			assert.ErrorIs(t, err, errGone)
			return
		case <-tick.C:
			_ = unix.Tgkill(os.Getpid(), waiter, unix.SIGURG) // Go's own preemption signal
		}
	}
}

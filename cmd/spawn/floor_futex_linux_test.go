package main

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
)

// futexServer is serveFutex running in this process, as the worker runs
// it, on the page of a floor this process's test holds as the parent.
type futexServer struct {
	ended chan struct{} // closed when serveFutex returns
	err   error         // what it returned, once ended
}

// startFutexServer makes a floor and starts serveFutex on its worker
// ends. The floor is closed and the server waited for at the end of t,
// which fails if a floor page is still mapped then.
func startFutexServer(t *testing.T) (*floor, *futexServer) {
	t.Helper()
	leakcheck.Check(t)
	f, peer, page, err := newFloor()
	require.NoError(t, err)
	srv := &futexServer{ended: make(chan struct{})}
	go func() {
		defer close(srv.ended)
		srv.err = serveFutex(peer, page)
	}()
	t.Cleanup(func() {
		f.close()
		srv.within(t, 5*time.Second, "after the floor closed")
		_ = peer.Close()
		assert.Zero(t, floorPageMappings(t), "floor pages mapped after the test")
	})
	return f, srv
}

// within fails t unless the server has returned nil by d from now.
func (s *futexServer) within(t *testing.T, d time.Duration, when string) {
	t.Helper()
	select {
	case <-s.ended:
		assert.NoError(t, s.err)
	case <-time.After(d):
		t.Errorf("serveFutex still running %v %s", d, when)
	}
}

// floorPageMappings counts this process's mappings of floor pages.
func floorPageMappings(t *testing.T) int {
	maps, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	return strings.Count(string(maps), "/memfd:tensormp-floor-page")
}

// trips makes n round trips on f with trip and returns their median,
// failing t if they take more than 10 s in all.
func trips(t *testing.T, f *floor, n int, trip func() (time.Duration, error)) time.Duration {
	t.Helper()
	var ds []time.Duration
	var err error
	done := make(chan struct{})
	go func() {
		defer close(done)
		ds, err = sample(nil, n, 0, trip)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		// Shut the parent's end, which ends the wait under way, so that
		// nothing uses f once t is over.
		_ = unix.Shutdown(f.s, unix.SHUT_RDWR)
		<-done
		t.Fatalf("%d round trips still running after 10 s", n)
	}
	require.NoError(t, err)
	return time.Duration(pct(ds, 50) * 1000)
}

// TestFloorPage: the worker answers futex and spin calls at once (not at
// its FUTEX_WAIT timeout), in any order, and stops when told.
func TestFloorPage(t *testing.T) {
	f, srv := startFutexServer(t)
	for _, c := range []struct {
		name string
		trip func() (time.Duration, error)
	}{
		{"futex", f.futexRoundTrip}, {"spin", f.spinRoundTrip}, {"futex after spin", f.futexRoundTrip},
		{"spin", f.spinRoundTrip}, {"futex after spin", f.futexRoundTrip},
	} {
		p50 := trips(t, f, 200, c.trip)
		t.Logf("%s: p50 %v", c.name, p50)
		assert.Less(t, p50, futexTimeout/10, c.name)
	}
	assert.Equal(t, 2, floorPageMappings(t), "the parent's and the worker's mapping")
	f.stopPage()
	srv.within(t, time.Second, "after the stop, its socket open")
}

// TestServeFutexEndsWithTheParent: a worker whose parent is gone, with no
// stop, returns within a FUTEX_WAIT timeout and a second, whether it
// slept or spun for the next call.
func TestServeFutexEndsWithTheParent(t *testing.T) {
	for _, c := range []struct {
		name string
		last func(*floor) (time.Duration, error)
	}{
		{"asleep", (*floor).futexRoundTrip},
		{"spinning", (*floor).spinRoundTrip},
	} {
		t.Run(c.name, func(t *testing.T) {
			f, srv := startFutexServer(t)
			trips(t, f, 10, func() (time.Duration, error) { return c.last(f) })
			require.NoError(t, unix.Close(f.s)) // as the parent's exit would
			f.s = -1
			srv.within(t, futexTimeout+time.Second, "after the parent's end closed")
		})
	}
}

// TestSpinningWorkerSleeps: a worker left spinning by the last call falls
// asleep once no call comes, instead of taking a CPU.
func TestSpinningWorkerSleeps(t *testing.T) {
	f, _ := startFutexServer(t)
	trips(t, f, 10, f.spinRoundTrip)
	time.Sleep(spinFor + 50*time.Millisecond)
	var before, after unix.Rusage
	require.NoError(t, unix.Getrusage(unix.RUSAGE_SELF, &before))
	const window = 300 * time.Millisecond
	time.Sleep(window)
	require.NoError(t, unix.Getrusage(unix.RUSAGE_SELF, &after))
	used := time.Duration(after.Utime.Nano() + after.Stime.Nano() - before.Utime.Nano() - before.Stime.Nano())
	t.Logf("CPU time over %v idle: %v", window, used)
	assert.Less(t, used, window/4)
	d := trips(t, f, 1, f.spinRoundTrip)
	assert.Less(t, d, futexTimeout/2, "a call wakes a worker asleep after spinning")
}

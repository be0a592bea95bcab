//go:build linux

package sock

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/reexec"
)

func init() {
	reexec.Register("sock.poller-after-emfile", pollerAfterEMFILE)
	reexec.Register("sock.poller-started-once", pollerStartedOnce)
}

// The package's poller, whose start fails while the process has no
// descriptor to spare, starts at a later call once it has: a process
// that ran out of descriptors once can still park its callers.
func TestPollerStartsOnceDescriptorsAreBack(t *testing.T) {
	runHelper(t, "sock.poller-after-emfile")
}

// Callers that start the poller at once start one: one more epoll
// instance in the process than it had before.
func TestPollerStartsOnce(t *testing.T) {
	runHelper(t, "sock.poller-started-once")
}

// runHelper runs the helper registered as name in a process of its own,
// whose poller nothing has started, and fails the test unless it exits
// 0: its exit code says which of its steps failed.
func runHelper(t *testing.T, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd, err := reexec.Command(ctx, name)
	require.NoError(t, err)
	require.NoError(t, cmd.Run(), "the helper's exit code says which step failed")
}

// pollerStartedOnce is the helper of TestPollerStartsOnce.
func pollerStartedOnce() int {
	if thePoller.started.Load() {
		return 10
	}
	time.Sleep(time.Millisecond) // the runtime's own epoll instance starts with its first timer
	before, err := epollInstances()
	if err != nil {
		return 11
	}
	// The callers pass the look at started while the start is held
	// up, as all but the first do when they come at once.
	var wg sync.WaitGroup
	var failed atomic.Bool
	thePoller.startMu.Lock()
	for range 8 {
		wg.Go(func() {
			if startPoller() != nil {
				failed.Store(true)
			}
		})
	}
	time.Sleep(50 * time.Millisecond)
	thePoller.startMu.Unlock()
	wg.Wait()
	after, err := epollInstances()
	switch {
	case failed.Load() || err != nil:
		return 12
	case after != before+1:
		return 13 // none, or more than one
	}
	return 0
}

// epollInstances counts this process's descriptors of epoll instances
// (the runtime's own among them).
func epollInstances() (int, error) {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range entries {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && target == "anon_inode:[eventpoll]" {
			n++
		}
	}
	return n, nil
}

// pollerAfterEMFILE is the helper of TestPollerStartsOnceDescriptorsAreBack:
// its exit code says which step failed.
func pollerAfterEMFILE() int {
	if thePoller.started.Load() {
		return 10 // started already: the test proves nothing
	}
	var lim unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &lim) != nil {
		return 11
	}
	// The lowest free descriptor becomes the limit: no new one fits.
	free, err := unix.Dup(0)
	if err != nil {
		return 12
	}
	_ = unix.Close(free)
	if unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: uint64(free), Max: lim.Max}) != nil {
		return 13
	}
	err = startPoller()
	if unix.Setrlimit(unix.RLIMIT_NOFILE, &lim) != nil {
		return 14
	}
	if !errors.Is(err, unix.EMFILE) || thePoller.started.Load() {
		return 15 // the start did not fail as it should have
	}
	if startPoller() != nil || !thePoller.started.Load() {
		return 16 // the failure stuck
	}
	return 0
}

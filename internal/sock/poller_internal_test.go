//go:build linux

package sock

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/reexec"
)

func init() { reexec.Register("sock.poller-after-emfile", pollerAfterEMFILE) }

// The package's poller, whose start fails while the process has no
// descriptor to spare, starts at a later call once it has: a process
// that ran out of descriptors once can still park its callers. In a
// process of its own, whose poller nothing has started.
func TestPollerStartsOnceDescriptorsAreBack(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd, err := reexec.Command(ctx, "sock.poller-after-emfile")
	require.NoError(t, err)
	require.NoError(t, cmd.Run(), "the helper's exit code says which step failed")
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

//go:build linux

package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mp"
)

// The behaviours of torch's test_multiprocessing_spawn.py.

// sleep waits d, or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func init() {
	mp.Register("spawn.success", spawnSuccess)
	mp.Register("spawn.raise-rank1", spawnRaiseRank1)
	mp.Register("spawn.raise-all", spawnRaiseAll)
	mp.Register("spawn.exit", spawnExit)
	mp.Register("spawn.signal", spawnSignal)
	mp.Register("spawn.signal-twice", spawnSignalTwice)
	mp.Register("spawn.later-failure", spawnLaterFailure)
}

// spawnSuccess succeeds at once: TestSpawnBehaviours' group that joins
// without error.
func spawnSuccess(ctx context.Context, w *mp.Worker) error { return nil }

// spawnRaiseRank1 fails on rank 1 and sleeps elsewhere until the group
// stops it: TestSpawnBehaviours' one failing worker.
func spawnRaiseRank1(ctx context.Context, w *mp.Worker) error {
	if w.Rank() == 1 {
		return errors.New("ValueError: legitimate failure")
	}
	return sleep(ctx, time.Minute)
}

// spawnRaiseAll fails on every rank: TestSpawnBehaviours' group whose
// first failure is the one reported.
func spawnRaiseAll(ctx context.Context, w *mp.Worker) error {
	return fmt.Errorf("rank %d failed", w.Rank())
}

// spawnExit exits with status 123 instead of returning:
// TestSpawnBehaviours' worker that exits.
func spawnExit(ctx context.Context, w *mp.Worker) error {
	os.Exit(123)
	return nil
}

// spawnSignal sends itself SIGTERM on rank 0 and returns once its context
// is cancelled, which is how a group stops its workers; other ranks sleep
// until stopped. For TestSpawnBehaviours.
func spawnSignal(ctx context.Context, w *mp.Worker) error {
	if w.Rank() == 0 {
		_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
		<-ctx.Done()
		return ctx.Err()
	}
	return sleep(ctx, time.Minute)
}

// spawnSignalTwice sends itself SIGTERM twice on rank 0: the first
// cancels its context, the second kills it, as torch's test expects of
// one. For TestSpawnBehaviours.
func spawnSignalTwice(ctx context.Context, w *mp.Worker) error {
	if w.Rank() == 0 {
		_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
		<-ctx.Done()
		_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
		time.Sleep(time.Minute) // the signal's default action ends this
	}
	return sleep(ctx, time.Minute)
}

// spawnQueues are spawn.later-failure's: rank 0's pid goes to rank 1 on
// one, rank 1's word that it watches rank 0 back on the other.
type spawnQueues struct{ Pid, Watching *mp.Queue }

// spawnLaterFailure has rank 0 succeed and rank 1 fail after it, with
// other ranks sleeping until the group stops them: TestSpawnBehaviours'
// failure that comes after another worker's success.
func spawnLaterFailure(ctx context.Context, w *mp.Worker) error {
	var q spawnQueues
	if err := w.Args(&q); err != nil {
		return err
	}
	switch w.Rank() {
	case 0:
		// Says who it is, waits until rank 1 watches it, and
		// succeeds.
		if err := q.Pid.Put(ctx, os.Getpid()); err != nil {
			return err
		}
		return q.Watching.Get(ctx, new(string))
	case 1:
		// Fails once rank 0 has exited: a pidfd names the process
		// itself, not a pid another may take over.
		var pid int
		if err := q.Pid.Get(ctx, &pid); err != nil {
			return err
		}
		pidfd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			return err
		}
		defer unix.Close(pidfd)
		if err := q.Watching.Put(ctx, "watching"); err != nil {
			return err
		}
		exited := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		for {
			if n, err := unix.Poll(exited, 30_000); err != unix.EINTR {
				if err != nil || n == 0 {
					return fmt.Errorf("waiting for rank 0 to exit: %v", err)
				}
				break
			}
		}
		return errors.New("failed after another worker succeeded")
	}
	return sleep(ctx, time.Minute) // stopped by the group
}

func TestSpawnBehaviours(t *testing.T) {
	cases := []struct {
		name  string
		check func(t *testing.T, err error, g *mp.Group)
	}{
		{"spawn.success", func(t *testing.T, err error, g *mp.Group) { assert.NoError(t, err) }},
		{"spawn.raise-rank1", func(t *testing.T, err error, g *mp.Group) {
			var we *mp.WorkerError
			require.ErrorAs(t, err, &we)
			assert.Equal(t, 1, we.Rank)
			assert.Contains(t, we.Msg, "ValueError: legitimate failure")
		}},
		{"spawn.raise-all", func(t *testing.T, err error, g *mp.Group) {
			var we *mp.WorkerError
			require.ErrorAs(t, err, &we)
			assert.Equal(t, fmt.Sprintf("rank %d failed", we.Rank), we.Msg, "the first failure, whichever rank")
		}},
		{"spawn.exit", func(t *testing.T, err error, g *mp.Group) {
			var xe *mp.ExitError
			require.ErrorAs(t, err, &xe)
			assert.Equal(t, 123, xe.Code)
		}},
		{"spawn.signal", func(t *testing.T, err error, g *mp.Group) {
			var we *mp.WorkerError
			require.ErrorAs(t, err, &we)
			assert.Equal(t, 0, we.Rank)
			assert.Contains(t, we.Msg, "SIGTERM")
		}},
		{"spawn.signal-twice", func(t *testing.T, err error, g *mp.Group) {
			var xe *mp.ExitError
			require.ErrorAs(t, err, &xe)
			assert.Equal(t, 0, xe.Rank)
			assert.Equal(t, syscall.SIGTERM, xe.Signal)
		}},
		{"spawn.later-failure", func(t *testing.T, err error, g *mp.Group) {
			var we *mp.WorkerError
			require.ErrorAs(t, err, &we)
			assert.Equal(t, 1, we.Rank)
			assert.Equal(t, "failed after another worker succeeded", we.Msg)
			first := g.State()[0]
			assert.True(t, first.Exited)
			assert.Equal(t, 0, first.Code, "rank 0 succeeded before rank 1 failed")
			assert.NoError(t, first.Err)
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			q, err := mp.NewQueue()
			require.NoError(t, err)
			defer q.Close()
			watching, err := mp.NewQueue()
			require.NoError(t, err)
			defer watching.Close()
			g, err := mp.Spawn(ctx, c.name, 3, mp.WithGrace(time.Second), mp.WithArgs(spawnQueues{Pid: q, Watching: watching}))
			require.NoError(t, err)
			pids := g.Pids()
			started := make([]procStart, len(pids))
			for i, pid := range pids {
				started[i] = startOf(pid) // 0 for one that is reaped already
			}
			c.check(t, g.Join(), g)
			for i, pid := range pids {
				// Its pid may name another process by now.
				assert.True(t, started[i] == 0 || startOf(pid) != started[i], "worker %d reaped", pid)
			}
		})
	}
}

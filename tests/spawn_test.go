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

func registerSpawnWorkers() {
	mp.Register("spawn.success", func(ctx context.Context, w *mp.Worker) error { return nil })
	mp.Register("spawn.raise-rank1", func(ctx context.Context, w *mp.Worker) error {
		if w.Rank() == 1 {
			return errors.New("ValueError: legitimate failure")
		}
		return sleep(ctx, time.Minute)
	})
	mp.Register("spawn.raise-all", func(ctx context.Context, w *mp.Worker) error {
		return fmt.Errorf("rank %d failed", w.Rank())
	})
	mp.Register("spawn.exit", func(ctx context.Context, w *mp.Worker) error {
		os.Exit(123)
		return nil
	})
	// SIGTERM cancels a worker's context (it is how a group stops its
	// workers); a second one kills it, as torch's test expects of one.
	mp.Register("spawn.signal", func(ctx context.Context, w *mp.Worker) error {
		if w.Rank() == 0 {
			_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
			<-ctx.Done()
			return ctx.Err()
		}
		return sleep(ctx, time.Minute)
	})
	mp.Register("spawn.signal-twice", func(ctx context.Context, w *mp.Worker) error {
		if w.Rank() == 0 {
			_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
			<-ctx.Done()
			_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
			time.Sleep(time.Minute) // the signal's default action ends this
		}
		return sleep(ctx, time.Minute)
	})
	mp.Register("spawn.later-failure", func(ctx context.Context, w *mp.Worker) error {
		var q *mp.Queue
		if err := w.Args(&q); err != nil {
			return err
		}
		switch w.Rank() {
		case 0:
			return q.Put(ctx, os.Getpid()) // and succeeds at once
		case 1:
			// Fails once rank 0 has exited and been reaped.
			var pid int
			if err := q.Get(ctx, &pid); err != nil {
				return err
			}
			for syscall.Kill(pid, 0) == nil {
				if err := sleep(ctx, time.Millisecond); err != nil {
					return err
				}
			}
			return errors.New("failed after another worker succeeded")
		}
		return sleep(ctx, time.Minute) // stopped by the group
	})
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
			assert.Contains(t, we.Err, "ValueError: legitimate failure")
		}},
		{"spawn.raise-all", func(t *testing.T, err error, g *mp.Group) {
			var we *mp.WorkerError
			require.ErrorAs(t, err, &we)
			assert.Equal(t, fmt.Sprintf("rank %d failed", we.Rank), we.Err, "the first failure, whichever rank")
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
			assert.Contains(t, we.Err, "SIGTERM")
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
			assert.Equal(t, "failed after another worker succeeded", we.Err)
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
			g, err := mp.Spawn(ctx, c.name, 3, mp.WithGrace(time.Second), mp.WithArgs(q))
			require.NoError(t, err)
			pids := g.Pids()
			c.check(t, g.Join(), g)
			for _, pid := range pids {
				assert.ErrorIs(t, syscall.Kill(pid, 0), syscall.ESRCH, "worker %d reaped", pid)
			}
		})
	}
}

package mp_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mp"
)

func init() {
	mp.Register("deaf", workerDeaf)
	mp.Register("stubborn", workerStubborn)
	mp.Register("graceful", workerGraceful)
	mp.Register("own-sigterm", ownSIGTERM)
	mp.Register("rank-args", workerRankArgs)
}

// workerDeaf says "ready" on its queue, and when its context is cancelled
// says so and why, but does not return: it dies of SIGTERM after the
// grace period. For TestStopEndsDeafWorkersAfterGrace and
// TestOutsideSIGTERM.
func workerDeaf(ctx context.Context, w *mp.Worker) error {
	var q *mp.Queue
	if err := w.Args(&q); err != nil {
		return err
	}
	go func() {
		<-ctx.Done()
		_ = q.Put(context.Background(), "cancelled: "+context.Cause(ctx).Error())
	}()
	if err := q.Put(ctx, "ready"); err != nil {
		return err
	}
	time.Sleep(time.Hour)
	return nil
}

// workerStubborn ignores SIGTERM altogether and says "ready" on its queue:
// only SIGKILL ends it. For TestStopEndsDeafWorkersAfterGrace.
func workerStubborn(ctx context.Context, w *mp.Worker) error {
	var q *mp.Queue
	if err := w.Args(&q); err != nil {
		return err
	}
	signal.Ignore(syscall.SIGTERM)
	if err := q.Put(ctx, "ready"); err != nil {
		return err
	}
	time.Sleep(time.Hour)
	return nil
}

// workerGraceful says "ready <rank>" on its queue, waits for its context
// to be cancelled, and cleans up by saying "stopped <rank>" before it
// returns. For TestStopIsGraceful and TestOutsideSIGTERMIsGraceful.
func workerGraceful(ctx context.Context, w *mp.Worker) error {
	var q *mp.Queue
	if err := w.Args(&q); err != nil {
		return err
	}
	if err := q.Put(ctx, fmt.Sprintf("ready %d", w.Rank())); err != nil {
		return err
	}
	<-ctx.Done()
	// Cleaning up after the stop: the queue still works.
	return q.Put(context.Background(), fmt.Sprintf("stopped %d", w.Rank()))
}

// rankArgs are rank-args' arguments, a value of its own for each rank.
type rankArgs struct {
	Out   *mp.Queue
	Shard string
}

// workerRankArgs puts "<rank>:<shard>" on Out, the shard its own
// arguments name: TestRankArgs.
func workerRankArgs(ctx context.Context, w *mp.Worker) error {
	var a rankArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	return a.Out.Put(ctx, fmt.Sprintf("%d:%s", w.Rank(), a.Shard))
}

// TestGroupContextEndsAtTheFirstFailure: a Get waiting, under the group's
// context, for a worker that dies returns at once, and the context's cause
// is the worker's failure.
func TestGroupContextEndsAtTheFirstFailure(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	g, err := mp.Spawn(context.Background(), "sleep", 2, mp.WithGrace(time.Second))
	require.NoError(t, err)
	assert.NoError(t, g.Err(), "no failure yet")
	select {
	case <-g.Done():
		t.Fatal("Done closed while the workers run")
	default:
	}
	got := make(chan error, 1)
	go func() {
		var v int
		got <- q.Get(g.Context(), &v)
	}()
	waitFor(t, "the Get waits", func() bool {
		gets, _ := mp.Waiting(q)
		return gets == 1
	})
	require.NoError(t, syscall.Kill(g.Pids()[1], syscall.SIGKILL))
	start := time.Now()
	err = <-got
	took := time.Since(start)
	require.ErrorIs(t, err, context.Canceled)
	var xe *mp.ExitError
	require.True(t, errors.As(context.Cause(g.Context()), &xe), "cause %v", context.Cause(g.Context()))
	assert.Equal(t, 1, xe.Rank)
	assert.Equal(t, syscall.SIGKILL, xe.Signal)
	assert.Less(t, took, 2*time.Second, "the Get ended with the worker, not later")
	<-g.Done()
	assert.Equal(t, context.Cause(g.Context()), g.Err())
	assert.Equal(t, g.Err(), g.Join())
}

// A Get or Put whose context is done already takes and sends nothing,
// every time, even with a message waiting.
func TestDoneContextTakesNothing(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	require.NoError(t, q.Put(context.Background(), 1))
	done, cancel := context.WithCancel(context.Background())
	cancel()
	for range 200 {
		var v int
		require.ErrorIs(t, q.Get(done, &v), context.Canceled)
		require.ErrorIs(t, q.Put(done, 2), context.Canceled)
	}
	var v int
	require.NoError(t, q.Get(context.Background(), &v))
	assert.Equal(t, 1, v, "the waiting message is still there, and only it")
}

// A Get that runs out of time returns only once its context is done, so
// that context.Cause is set.
func TestDeadlineHasACause(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	why := errors.New("the trainer gave up")
	for range 20 {
		ctx, cancel := context.WithTimeoutCause(context.Background(), 5*time.Millisecond, why)
		var v int
		err := q.Get(ctx, &v)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, why, context.Cause(ctx), "the context was done when Get returned")
		cancel()
	}
}

// Sending to a pipe whose other end is closed everywhere is ErrClosed.
func TestPipeSendAfterPeerClosed(t *testing.T) {
	leakcheck.Check(t)
	a, b, err := mp.NewPipe()
	require.NoError(t, err)
	defer a.Close()
	require.NoError(t, b.Close())
	assert.ErrorIs(t, a.Send(context.Background(), "hello"), mp.ErrClosed)
}

// Stopping a group cancels each worker's context: a worker that watches
// it returns, cleaning up, within the grace period and is not killed.
func TestStopIsGraceful(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	ctx := context.Background()
	g, err := mp.Spawn(ctx, "graceful", 2, mp.WithArgs(q), mp.WithGrace(time.Minute))
	require.NoError(t, err)
	for range 2 {
		var s string
		require.NoError(t, q.Get(ctx, &s))
		require.Contains(t, s, "ready")
	}
	for _, st := range g.State() {
		assert.False(t, st.Exited, "worker %d exited before the stop", st.Rank)
	}
	stop := errors.New("stopped by the test")
	g.Stop(stop)
	assert.ErrorIs(t, g.Join(), stop)
	got := map[string]bool{}
	for range 2 {
		var s string
		require.NoError(t, q.Get(ctx, &s))
		got[s] = true
	}
	assert.Equal(t, map[string]bool{"stopped 0": true, "stopped 1": true}, got)
	for _, st := range g.State() {
		assert.True(t, st.Exited)
		assert.Zero(t, st.Signal, "worker %d was killed", st.Rank)
		assert.Equal(t, 0, st.Code, "worker %d returned cleanly", st.Rank)
		assert.NoError(t, st.Err)
		assert.Equal(t, g.Pids()[st.Rank], st.Pid)
	}
}

// A worker deaf to its context dies of SIGTERM once the grace period is
// over, and one that ignores SIGTERM is killed with SIGKILL after that.
func TestStopEndsDeafWorkersAfterGrace(t *testing.T) {
	for _, c := range []struct {
		worker string
		signal syscall.Signal
	}{
		{"deaf", syscall.SIGTERM},
		{"stubborn", syscall.SIGKILL},
	} {
		t.Run(c.worker, func(t *testing.T) {
			leakcheck.Check(t)
			q, err := mp.NewQueue()
			require.NoError(t, err)
			defer q.Close()
			g, err := mp.Spawn(context.Background(), c.worker, 1, mp.WithArgs(q), mp.WithGrace(200*time.Millisecond))
			require.NoError(t, err)
			var s string
			require.NoError(t, q.Get(context.Background(), &s))
			require.Equal(t, "ready", s)
			// JoinContext gives up without stopping anyone.
			jctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			assert.ErrorIs(t, g.JoinContext(jctx), context.DeadlineExceeded)
			assert.False(t, g.State()[0].Exited, "JoinContext left the worker running")

			stop := errors.New("stop")
			stopped := time.Now()
			g.Stop(stop)
			assert.ErrorIs(t, g.JoinContext(context.Background()), stop)
			// A lower bound only: a loaded machine makes it later, never
			// sooner.
			assert.GreaterOrEqual(t, time.Since(stopped), 200*time.Millisecond, "the worker lived out its grace")
			st := g.State()[0]
			assert.True(t, st.Exited)
			assert.Equal(t, c.signal, st.Signal)
			assert.Equal(t, -1, st.Code)
			var xe *mp.ExitError
			require.ErrorAs(t, st.Err, &xe)
			assert.Equal(t, c.signal, xe.Signal)
		})
	}
}

// A SIGTERM from outside the group (a user, a supervisor, a container
// runtime) cancels a worker's context as the group's own stop does. A
// worker deaf to it dies of SIGTERM after the grace period, and a second
// SIGTERM ends it at once, grace or not. So does a worker that asked for
// SIGTERM itself (own-sigterm): its own channel gets the signal, and
// neither that request nor one it makes during the grace keeps it alive.
func TestOutsideSIGTERM(t *testing.T) {
	for _, w := range []struct {
		name string
		says string // once its context is cancelled
	}{
		{"deaf", "cancelled: SIGTERM cancelled the worker's context"},
		{"own-sigterm", "own channel: terminated"},
	} {
		for _, c := range []struct {
			name  string
			grace time.Duration
			twice bool
		}{
			{"after the grace period", 200 * time.Millisecond, false},
			{"a second one at once", time.Hour, true},
		} {
			t.Run(w.name+"/"+c.name, func(t *testing.T) {
				leakcheck.Check(t)
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				g, q := spawnReady(ctx, t, w.name, c.grace, "ready")
				var s string

				pid := g.Pids()[0]
				sent := time.Now()
				require.NoError(t, syscall.Kill(pid, syscall.SIGTERM))
				require.NoError(t, q.Get(ctx, &s))
				assert.Equal(t, w.says, s)
				if c.twice {
					require.NoError(t, syscall.Kill(pid, syscall.SIGTERM))
				}
				// Within the minute of ctx, far less than the hour's grace
				// of the second case.
				err := g.JoinContext(ctx)
				var xe *mp.ExitError
				require.ErrorAs(t, err, &xe)
				assert.Equal(t, syscall.SIGTERM, xe.Signal, "died of SIGTERM, not of an exit code: %v", err)
				assert.Equal(t, 0, xe.Rank)
				assert.Equal(t, pid, xe.Pid)
				if !c.twice {
					// A lower bound only: a loaded machine makes it
					// later, never sooner.
					assert.GreaterOrEqual(t, time.Since(sent), c.grace, "the worker lived out its grace")
				}
			})
		}
	}
}

// ownSIGTERM is a worker that asks to be notified of SIGTERM itself, as a
// program with its own shutdown does, and once its context is cancelled
// asks again, from its shutdown path. It says what its own channel got,
// and stays deaf to its context. For TestOutsideSIGTERM.
func ownSIGTERM(ctx context.Context, w *mp.Worker) error {
	var q *mp.Queue
	if err := w.Args(&q); err != nil {
		return err
	}
	own := make(chan os.Signal, 1)
	signal.Notify(own, syscall.SIGTERM)
	if err := q.Put(ctx, "ready"); err != nil {
		return err
	}
	<-ctx.Done()
	late := make(chan os.Signal, 1)
	signal.Notify(late, syscall.SIGTERM)
	word := "nothing on its own channel"
	select {
	case sig := <-own:
		word = "own channel: " + sig.String()
	case <-time.After(10 * time.Second):
	}
	_ = q.Put(context.Background(), word)
	time.Sleep(time.Hour)
	return nil
}

// spawnReady spawns one worker of name, with grace and a queue to talk on
// as its arguments, and waits for its first word, want.
func spawnReady(ctx context.Context, t *testing.T, name string, grace time.Duration, want string) (*mp.Group, *mp.Queue) {
	t.Helper()
	q, err := mp.NewQueue()
	require.NoError(t, err)
	t.Cleanup(func() { _ = q.Close() })
	g, err := mp.Spawn(ctx, name, 1, mp.WithArgs(q), mp.WithGrace(grace))
	require.NoError(t, err)
	var s string
	require.NoError(t, q.Get(ctx, &s))
	require.Equal(t, want, s)
	return g, q
}

// A worker that returns on its cancelled context after an outside
// SIGTERM ends as it returns: cleanly here, with its error in
// TestSpawnBehaviours' spawn.signal.
func TestOutsideSIGTERMIsGraceful(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g, q := spawnReady(ctx, t, "graceful", time.Hour, "ready 0")
	var s string
	require.NoError(t, syscall.Kill(g.Pids()[0], syscall.SIGTERM))
	require.NoError(t, q.Get(ctx, &s))
	assert.Equal(t, "stopped 0", s)
	require.NoError(t, g.JoinContext(ctx))
	st := g.State()[0]
	assert.Equal(t, 0, st.Code)
	assert.Zero(t, st.Signal)
}

// WithRankArgs gives each worker a value of its own.
func TestRankArgs(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	shards := []string{"a", "b", "c"}
	err = mp.Run(context.Background(), "rank-args", 3, mp.WithRankArgs(func(rank int) any {
		return rankArgs{Out: q, Shard: shards[rank]}
	}))
	require.NoError(t, err)
	got := map[string]bool{}
	for range 3 {
		var s string
		require.NoError(t, q.Get(context.Background(), &s))
		got[s] = true
	}
	assert.Equal(t, map[string]bool{"0:a": true, "1:b": true, "2:c": true}, got)
}

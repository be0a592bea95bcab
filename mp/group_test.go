package mp_test

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mp"
)

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
	go func() {
		time.Sleep(100 * time.Millisecond)
		_ = syscall.Kill(g.Pids()[1], syscall.SIGKILL)
	}()
	start := time.Now()
	var v int
	err = q.Get(g.Context(), &v)
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

// A worker deaf to its context is killed once the grace period is over.
func TestStopKillsAfterGrace(t *testing.T) {
	leakcheck.Check(t)
	g, err := mp.Spawn(context.Background(), "stubborn", 1, mp.WithGrace(200*time.Millisecond))
	require.NoError(t, err)
	// JoinContext gives up without stopping anyone.
	jctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, g.JoinContext(jctx), context.DeadlineExceeded)
	assert.False(t, g.State()[0].Exited, "JoinContext left the worker running")

	g.Stop(errors.New("stop"))
	assert.Error(t, g.JoinContext(context.Background()))
	st := g.State()[0]
	assert.True(t, st.Exited)
	assert.Equal(t, syscall.SIGKILL, st.Signal)
	assert.Equal(t, -1, st.Code)
	var xe *mp.ExitError
	require.ErrorAs(t, st.Err, &xe)
	assert.Equal(t, syscall.SIGKILL, xe.Signal)
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

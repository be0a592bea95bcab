package mp_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// Tensors by a queue's lane: a getter that waits in Get with nothing
// before it is handed the next value through shared memory, tensors of
// segments it pins named by identity, as a pipe's reader is.

func init() {
	mp.Register("queue-lane-answer", workerQueueLaneAnswer)
	mp.Register("queue-lane-keep", workerQueueLaneKeep)
	mp.Register("queue-get-one", workerQueueGetOne)
}

type queueLaneArgs struct {
	In, Out *mp.Queue
	N       int
	Wait    bool // queue-lane-keep: then waits in a Get, not on its context
	Check   bool // queue-count: checks what each tensor holds
}

// workerQueueLaneAnswer takes N tensors from In, checks each (tensor i
// holds i), releases it and answers with a new tensor of its own that
// holds i+1; then it puts how many of its answers went by the lane.
func workerQueueLaneAnswer(ctx context.Context, w *mp.Worker) error {
	var a queueLaneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	before := sock.LentSent()
	for i := range a.N {
		var x *tensor.Tensor
		if err := a.In.Get(ctx, &x); err != nil {
			return err
		}
		v, err := tensor.Values[int64](x)
		_ = x.Release()
		if err != nil {
			return err
		}
		if len(v) != 512 || v[0] != int64(i) || v[511] != int64(i) {
			return a.Out.Put(ctx, -1)
		}
		y, err := tensor.On(device.CPU()).Shared().Full(tensor.Int64, float64(i+1), 512)
		if err != nil {
			return err
		}
		err = a.Out.Put(ctx, y)
		_ = y.Release()
		if err != nil {
			return err
		}
	}
	return a.Out.Put(ctx, int(sock.LentSent()-before))
}

// Tensors go there and back through two queues by their lanes, each
// side's new tensors named by identity once the other pins their
// segment, and each arrives whole.
func TestQueueLaneRoundTrip(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	in, out := newQueue(t), newQueue(t)
	const n = 300
	g, err := mp.Spawn(ctx, "queue-lane-answer", 1, mp.WithArgs(queueLaneArgs{In: in, Out: out, N: n}))
	require.NoError(t, err)
	before := sock.LentSent()
	for i := range n {
		x := newInts(t, i)
		err := in.Put(ctx, x)
		require.NoError(t, x.Release())
		require.NoError(t, err)
		var y *tensor.Tensor
		require.NoError(t, out.Get(ctx, &y), "answer %d", i)
		checkInts(t, y, i+1)
		require.NoError(t, y.Release())
	}
	var theirs int
	require.NoError(t, out.Get(ctx, &theirs))
	require.NoError(t, g.Join())
	mine := int(sock.LentSent() - before)
	t.Logf("by the lane: %d of %d tensors there, %d of %d back", mine, n, theirs, n)
	assert.Positive(t, mine, "tensors to a waiting getter went by the lane")
	assert.Positive(t, theirs, "answers to a waiting getter went by the lane")
	require.Eventually(t, func() bool { return shm.DefaultPool().InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back")
}

// workerQueueLaneKeep takes N tensors from In, keeping each, and puts its
// count on Out after each; then it waits to be killed.
func workerQueueLaneKeep(ctx context.Context, w *mp.Worker) error {
	var a queueLaneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	kept := make([]*tensor.Tensor, 0, a.N)
	defer func() {
		for _, x := range kept {
			_ = x.Release()
		}
	}()
	for i := range a.N {
		var x *tensor.Tensor
		if err := a.In.Get(ctx, &x); err != nil {
			return err
		}
		kept = append(kept, x)
		if err := a.Out.Put(ctx, i+1); err != nil {
			return err
		}
	}
	if a.Wait {
		var x *tensor.Tensor
		_ = a.In.Get(ctx, &x)
		return errors.New("a Get that should have waited to be killed")
	}
	<-ctx.Done()
	return nil
}

// A getter killed holding tensors that came by the lane gives them all
// back: its holds die with it, and the putter's loans come back once no
// process pins for the lane.
func TestQueueLaneGetterKilled(t *testing.T) {
	const n = 100
	ctx, k, g := startKeeper(t, n, false)
	pool := shm.DefaultPool()
	lent := putAcked(t, ctx, k, n)
	t.Logf("%d of %d tensors went by the lane", lent, n)
	assert.Positive(t, lent, "tensors to a waiting getter went by the lane")
	assert.Equal(t, n, pool.InUse(), "the getter holds them")
	kill(t, g)
	require.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back once the getter is killed")
}

// A getter killed while it waits on the lane leaves its wait and its
// pins' list behind: a tensor put after it died goes to the next getter
// (here the putting process itself) whole, not named for the dead
// getter's pins.
func TestQueueLaneGetterKilledWaiting(t *testing.T) {
	const n = 100
	ctx, k, g := startKeeper(t, n, true)
	lent := putAcked(t, ctx, k, n)
	require.Positive(t, lent, "tensors went by the lane")
	time.Sleep(20 * time.Millisecond) // the getter waits in its Get
	kill(t, g)
	takeBack(t, ctx, k, n, "the tensor put after the getter died")
	require.Eventually(t, func() bool { return shm.DefaultPool().InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back")
}

// workerQueueGetOne gets one tensor from In and puts on Out 1 if it holds
// 512 int64s, each N, -1 if it does not, and -2 if the Get failed.
func workerQueueGetOne(ctx context.Context, w *mp.Worker) error {
	var a queueLaneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	var x *tensor.Tensor
	if err := a.In.Get(ctx, &x); err != nil {
		return errors.Join(err, a.Out.Put(ctx, -2))
	}
	v, err := tensor.Values[int64](x)
	_ = x.Release()
	if err != nil || len(v) != 512 {
		return a.Out.Put(ctx, -1)
	}
	for _, e := range v {
		if e != int64(a.N) {
			return a.Out.Put(ctx, -1)
		}
	}
	return a.Out.Put(ctx, 1)
}

// The same, with another process, which maps none of the dead getter's
// pins, as the next getter: it gets the tensor whole, sent with its
// descriptor, as the putter asks the kernel whether the role's getter
// lives (its last spin on the lane is too old to say).
func TestQueueLaneGetterKilledWaitingNextProcess(t *testing.T) {
	const n = 20
	ctx, k, g := startKeeper(t, n, true)
	require.Positive(t, putAcked(t, ctx, k, n), "tensors went by the lane")
	time.Sleep(20 * time.Millisecond) // the getter waits in its Get
	kill(t, g)
	x := newInts(t, n)
	err := k.in.Put(ctx, x)
	require.NoError(t, x.Release())
	require.NoError(t, err)
	next, err := mp.Spawn(ctx, "queue-get-one", 1, mp.WithArgs(queueLaneArgs{In: k.in, Out: k.out, N: n}))
	require.NoError(t, err)
	var got int
	require.NoError(t, k.out.Get(ctx, &got))
	assert.Equal(t, 1, got, "the next getter got the tensor put after the first died whole (-2: its Get failed)")
	require.NoError(t, next.Join())
	require.Eventually(t, func() bool { return shm.DefaultPool().InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back")
}

// A tensor put while the queue's only getter is busy is not named for
// that getter's pins: another process that gets it, once the busy one has
// let go of its role (here the putting process itself), gets it whole.
func TestQueueLaneBusyGetterKeepsNoTensor(t *testing.T) {
	const n = 20
	ctx, k, g := startKeeper(t, n, false)
	lent := putAcked(t, ctx, k, n)
	t.Logf("%d of %d tensors went by the lane", lent, n)
	takeBack(t, ctx, k, n, "the tensor put while the getter was busy") // the getter is busy for good
	kill(t, g)
}

// startKeeper spawns a queue-lane-keep worker that takes n tensors and
// then waits to be killed (in a Get, with wait), and returns a context
// for the test and the worker's two queues.
func startKeeper(t *testing.T, n int, wait bool) (context.Context, *keeper, *mp.Group) {
	t.Helper()
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	k := &keeper{in: newQueue(t), out: newQueue(t)}
	g, err := mp.Spawn(ctx, "queue-lane-keep", 1, mp.WithArgs(queueLaneArgs{In: k.in, Out: k.out, N: n, Wait: wait}))
	require.NoError(t, err)
	return ctx, k, g
}

// keeper is a queue-lane-keep worker's two queues: tensors to it, counts
// from it.
type keeper struct{ in, out *mp.Queue }

// takeBack puts a new tensor that holds v to the keeper's queue and gets
// it back in this process, as another getter, whole.
func takeBack(t *testing.T, ctx context.Context, k *keeper, v int, what string) {
	t.Helper()
	x := newInts(t, v)
	err := k.in.Put(ctx, x)
	require.NoError(t, x.Release())
	require.NoError(t, err)
	var y *tensor.Tensor
	require.NoError(t, k.in.Get(ctx, &y), what)
	checkInts(t, y, v)
	require.NoError(t, y.Release())
}

// putAcked puts n new tensors (tensor i holds i) to the keeper, each once
// it has counted the one before, and returns how many went by the lane.
func putAcked(t *testing.T, ctx context.Context, k *keeper, n int) int {
	t.Helper()
	before := sock.LentSent()
	for i := range n {
		x := newInts(t, i)
		err := k.in.Put(ctx, x)
		require.NoError(t, x.Release())
		require.NoError(t, err)
		var got int
		require.NoError(t, k.out.Get(ctx, &got))
		require.Equal(t, i+1, got)
	}
	return int(sock.LentSent() - before)
}

// newQueue returns a new queue that the test's end closes.
func newQueue(t testing.TB) *mp.Queue {
	t.Helper()
	q, err := mp.NewQueue()
	require.NoError(t, err)
	t.Cleanup(func() { _ = q.Close() })
	return q
}

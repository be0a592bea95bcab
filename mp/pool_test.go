package mp_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// Functions the pool tests run in workers. Package-level, so that every
// process of the test binary registers them before mp.Init.
var (
	square    = mp.RegisterFunc("test.square", squareItem)
	scale     = mp.RegisterFunc("test.scale", scaleInPlace)
	pidOf     = mp.RegisterFunc("test.pid", pidAfter)
	dieOnWord = mp.RegisterFunc("test.die-on-word", killOnWord)
	setup     = mp.RegisterFunc("test.setup", keepSetup)
	setupOf   = mp.RegisterFunc("test.setup-of", keptSetup)
)

// squareItem squares x; it fails for a negative x and panics for 1000.
// The item function of most pool tests: TestPoolMapKeepsOrder,
// TestPoolItemErrorsNameTheItem, TestPoolImap and
// TestPoolBrokenByAFailingInitializer.
func squareItem(ctx context.Context, x int) (int, error) {
	if x < 0 {
		return 0, fmt.Errorf("negative item %d", x)
	}
	if x == 1000 {
		panic("a thousand")
	}
	return x * x, nil
}

// scaleInPlace doubles a tensor in place and returns a new tensor, born
// shared, holding its sum: TestPoolTensorsTravelWithoutCopying.
func scaleInPlace(ctx context.Context, x *tensor.Tensor) (*tensor.Tensor, error) {
	vals, err := tensor.Data[float32](x)
	if err != nil {
		return nil, err
	}
	var sum float32
	for i := range vals {
		vals[i] *= 2
		sum += vals[i]
	}
	return tensor.FromSlice([]float32{sum}, 1)
}

// pidAfter returns its worker's pid and sleeps ms milliseconds first;
// it kills its own process for ms == -9, and after -ms milliseconds
// for ms <= -100. For the tests that watch which worker runs an item or
// kill one under it: TestPoolReplacesAKilledWorker,
// TestPoolGivesBackWhatADeadWorkerNeverTook, TestPoolInitializerAndMaxTasks
// and TestPoolTerminateAndCancel.
func pidAfter(ctx context.Context, ms int) (int, error) {
	if ms == -9 || ms <= -100 {
		time.Sleep(time.Duration(max(-ms, 0)) * time.Millisecond)
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	select {
	case <-time.After(time.Duration(ms) * time.Millisecond):
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	return os.Getpid(), nil
}

// killOnWord says on Started that it runs, and kills its worker once
// a word comes on Word: TestPoolGivesBackWhatADeadWorkerNeverTook.
func killOnWord(ctx context.Context, a wordArgs) (int, error) {
	if err := a.Started.Put(ctx, os.Getpid()); err != nil {
		return 0, err
	}
	var word string
	if err := a.Word.Get(ctx, &word); err != nil {
		return 0, err
	}
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

// initialized is the initializer's argument, in a worker.
var initialized atomic.Value

// keepSetup is the pools' initializer: it keeps s in initialized, and
// refuses "fail". For TestPoolInitializerAndMaxTasks and
// TestPoolBrokenByAFailingInitializer.
func keepSetup(ctx context.Context, s string) (struct{}, error) {
	if s == "fail" {
		return struct{}{}, errors.New("setup refused")
	}
	initialized.Store(s)
	return struct{}{}, nil
}

// keptSetup returns what the initializer kept in its worker:
// TestPoolInitializerAndMaxTasks.
func keptSetup(ctx context.Context, _ int) (string, error) {
	s, _ := initialized.Load().(string)
	return s, nil
}

type wordArgs struct{ Started, Word *mp.Queue }

func newPool(t *testing.T, n int, opts ...mp.PoolOption) *mp.Pool {
	t.Helper()
	p, err := mp.NewPool(context.Background(), n, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Terminate() })
	return p
}

func TestPoolMapKeepsOrder(t *testing.T) {
	leakcheck.Check(t)
	p := newPool(t, 2)
	ctx := context.Background()
	items := make([]int, 50)
	for i := range items {
		items[i] = i
	}
	for _, chunk := range []int{1, 3, 100} {
		got, err := mp.Map(ctx, p, square, items, mp.ChunkSize(chunk))
		require.NoError(t, err, "chunk %d", chunk)
		require.Len(t, got, len(items))
		for i, v := range got {
			assert.Equal(t, i*i, v, "chunk %d, item %d", chunk, i)
		}
	}
	empty, err := mp.Map(ctx, p, square, nil)
	require.NoError(t, err)
	assert.Empty(t, empty)
	v, err := mp.Apply(ctx, p, square, 12)
	require.NoError(t, err)
	assert.Equal(t, 144, v)
	require.NoError(t, p.Close())
	_, err = mp.Map(ctx, p, square, items)
	assert.ErrorIs(t, err, mp.ErrClosed)
}

func TestPoolTensorsTravelWithoutCopying(t *testing.T) {
	leakcheck.Check(t)
	p := newPool(t, 2)
	xs := make([]*tensor.Tensor, 8)
	for i := range xs {
		x, err := tensor.On(tensor.In(context.Background()).Place()).Shared().Full(tensor.Float32, float64(i), 1000)
		require.NoError(t, err)
		xs[i] = x
	}
	sums, err := mp.Map(context.Background(), p, scale, xs, mp.ChunkSize(3))
	require.NoError(t, err)
	for i, x := range xs {
		v, err := tensor.At[float32](x, 999)
		require.NoError(t, err)
		assert.Equal(t, float32(2*i), v, "the worker's write is in the caller's tensor %d", i)
		s, err := tensor.At[float32](sums[i], 0)
		require.NoError(t, err)
		assert.Equal(t, float32(2000*i), s)
		require.NoError(t, sums[i].Release())
		require.NoError(t, x.Release())
	}
	require.NoError(t, p.Close())
}

func TestPoolItemErrorsNameTheItem(t *testing.T) {
	leakcheck.Check(t)
	p := newPool(t, 2)
	ctx := context.Background()
	items := []int{0, 1, 2, 3, 4, 5, -6, 7}
	_, err := mp.Map(ctx, p, square, items, mp.ChunkSize(3))
	var ie *mp.ItemError
	require.ErrorAs(t, err, &ie)
	assert.Equal(t, 6, ie.Index)
	assert.Contains(t, []int{0, 1}, ie.Rank)
	assert.ErrorContains(t, err, "negative item -6")

	_, err = mp.Apply(ctx, p, square, 1000)
	require.ErrorAs(t, err, &ie)
	assert.ErrorContains(t, err, "panic: a thousand")

	got, err := mp.Map(ctx, p, square, []int{3, 4})
	require.NoError(t, err, "the pool goes on after item errors")
	assert.Equal(t, []int{9, 16}, got)
	require.NoError(t, p.Close())
}

func TestPoolImap(t *testing.T) {
	leakcheck.Check(t)
	p := newPool(t, 2)
	ctx := context.Background()
	var got []int
	for v, err := range mp.Imap(ctx, p, square, slices.Values([]int{5, 4, 3, 2, 1, 0})) {
		require.NoError(t, err)
		got = append(got, v)
	}
	assert.Equal(t, []int{25, 16, 9, 4, 1, 0}, got)

	got = got[:0]
	for v, err := range mp.ImapUnordered(ctx, p, square, slices.Values([]int{5, 4, 3, 2, 1, 0}), mp.ChunkSize(2)) {
		require.NoError(t, err)
		got = append(got, v)
	}
	slices.Sort(got)
	assert.Equal(t, []int{0, 1, 4, 9, 16, 25}, got)

	// An early break lets go of what is still running; the pool goes on.
	n := 0
	for _, err := range mp.Imap(ctx, p, square, func(yield func(int) bool) {
		for i := 0; ; i++ {
			if !yield(i) {
				return
			}
		}
	}) {
		require.NoError(t, err)
		if n++; n == 10 {
			break
		}
	}
	var errs []error
	for _, err := range mp.Imap(ctx, p, square, slices.Values([]int{1, -2, 3})) {
		errs = append(errs, err)
	}
	require.Len(t, errs, 2, "the error ends the iteration")
	assert.NoError(t, errs[0])
	var ie *mp.ItemError
	require.ErrorAs(t, errs[1], &ie)
	assert.Equal(t, 1, ie.Index)
	require.NoError(t, p.Close())
}

func TestPoolReplacesAKilledWorker(t *testing.T) {
	leakcheck.Check(t)
	p := newPool(t, 2)
	ctx := context.Background()
	_, err := mp.Map(ctx, p, pidOf, []int{0, 0, 0, -9, 0, 0}, mp.ChunkSize(1))
	var ie *mp.ItemError
	require.ErrorAs(t, err, &ie)
	assert.Equal(t, 3, ie.Index)
	var ee *mp.ExitError
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, syscall.SIGKILL, ee.Signal)
	assert.Equal(t, ie.Rank, ee.Rank)

	// Its replacement serves the next call; every item is answered.
	pids, err := mp.Map(ctx, p, pidOf, make([]int, 20), mp.ChunkSize(1))
	require.NoError(t, err)
	assert.NotContains(t, pids, 0)
	require.NoError(t, p.Close())
}

func TestPoolGivesBackWhatADeadWorkerNeverTook(t *testing.T) {
	leakcheck.Check(t)
	p := newPool(t, 1)
	ctx := context.Background()
	var a wordArgs
	var err error
	a.Started, err = mp.NewQueue()
	require.NoError(t, err)
	defer a.Started.Close()
	a.Word, err = mp.NewQueue()
	require.NoError(t, err)
	defer a.Word.Close()
	// The one worker holds two chunks: the first kills it, the second
	// waits in its queue and must be run by the replacement, not failed.
	killed := make(chan error, 1)
	go func() {
		_, err := mp.Apply(ctx, p, dieOnWord, a)
		killed <- err
	}()
	var first int
	require.NoError(t, a.Started.Get(ctx, &first), "the worker runs the first chunk")
	second := make(chan int, 1)
	go func() {
		pid, err := mp.Apply(ctx, p, pidOf, 0)
		assert.NoError(t, err)
		second <- pid
	}()
	waitFor(t, "the worker holds the second chunk too", func() bool { return mp.PoolHeld(p)[0] == 2 })
	require.NoError(t, a.Word.Put(ctx, "die"))
	pid := <-second
	assert.NotZero(t, pid)
	err = <-killed
	var ie *mp.ItemError
	require.ErrorAs(t, err, &ie)
	var ee *mp.ExitError
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, syscall.SIGKILL, ee.Signal)
	assert.Equal(t, first, ee.Pid)
	assert.NotEqual(t, first, pid, "the replacement ran the second chunk")
	require.NoError(t, p.Close())
}

func TestPoolInitializerAndMaxTasks(t *testing.T) {
	leakcheck.Check(t)
	p := newPool(t, 2, mp.WithInitializer(setup, "ready"), mp.WithMaxTasks(2))
	ctx := context.Background()
	got, err := mp.Map(ctx, p, setupOf, make([]int, 6), mp.ChunkSize(1))
	require.NoError(t, err)
	assert.Equal(t, slices.Repeat([]string{"ready"}, 6), got, "every worker, replacements too, ran the initializer")
	pids, err := mp.Map(ctx, p, pidOf, make([]int, 12), mp.ChunkSize(1))
	require.NoError(t, err)
	slices.Sort(pids)
	assert.GreaterOrEqual(t, len(slices.Compact(pids)), 6, "a worker serves at most two chunks")
	require.NoError(t, p.Close())
}

func TestPoolBrokenByAFailingInitializer(t *testing.T) {
	leakcheck.Check(t)
	p := newPool(t, 1, mp.WithInitializer(setup, "fail"))
	_, err := mp.Map(context.Background(), p, square, []int{1, 2, 3})
	require.ErrorIs(t, err, mp.ErrPoolBroken)
	assert.ErrorContains(t, err, "setup refused")
	_, err = mp.Apply(context.Background(), p, square, 2)
	assert.ErrorIs(t, err, mp.ErrPoolBroken)
	require.NoError(t, p.Terminate())
}

func TestPoolTerminateAndCancel(t *testing.T) {
	leakcheck.Check(t)
	p := newPool(t, 2, mp.WithSpawnOptions(mp.WithGrace(time.Second)))
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := mp.Map(ctx, p, pidOf, []int{60_000, 60_000})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, time.Since(start), 5*time.Second)

	done := make(chan error, 1)
	go func() {
		_, err := mp.Map(context.Background(), p, pidOf, []int{60_000, 60_000, 60_000})
		done <- err
	}()
	// Each worker still runs a chunk of the abandoned call, and holds
	// one of this call's besides, which it will never begin.
	waitFor(t, "the workers hold the call's chunks", func() bool {
		held := mp.PoolHeld(p)
		return held[0] == 2 && held[1] == 2
	})
	require.NoError(t, p.Terminate())
	select {
	case err := <-done:
		assert.ErrorIs(t, err, mp.ErrClosed)
	case <-time.After(10 * time.Second):
		t.Fatal("a call outlived Terminate")
	}
}

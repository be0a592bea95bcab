package loader_test

import (
	"context"
	"fmt"
	"iter"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/loader"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

func TestMain(m *testing.M) {
	testmain.Run(m, testmain.WithSession(), testmain.WithStandInGPU(cudastub.Config{Devices: 1}))
}

// numbered is a map-style dataset of N samples: sample i holds a tensor
// of four i's made in its batch, i itself, and the pid of the process
// that read it. It fails at FailAt, and kills its worker at KillAt (once
// the file KillWhen exists, if it names one).
type numbered struct{ numberedArgs }

type numberedArgs struct {
	N        int
	FailAt   int
	KillAt   int
	KillWhen string
	SleepMs  int
}

type sample struct {
	X    *tensor.Tensor
	Y    int64
	Pid  int
	Info loader.WorkerInfo
	Init bool
}

type batch struct {
	X, Y, Pid *tensor.Tensor
	Info      struct{ ID, NumWorkers, Seed *tensor.Tensor }
	Init      *tensor.Tensor
}

var workerInitRan atomic.Bool

func (d numbered) Len() int { return d.N }

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func (d numbered) Get(ctx context.Context, i int) (sample, error) {
	if d.SleepMs > 0 {
		select {
		case <-time.After(time.Duration(d.SleepMs) * time.Millisecond):
		case <-ctx.Done():
			return sample{}, ctx.Err()
		}
	}
	info, inWorker := loader.Info(ctx)
	switch {
	case i == d.FailAt:
		return sample{}, fmt.Errorf("sample %d is unreadable", i)
	case i == d.KillAt && inWorker:
		for d.KillWhen != "" && !exists(d.KillWhen) {
			select {
			case <-time.After(time.Millisecond):
			case <-ctx.Done():
				return sample{}, ctx.Err()
			}
		}
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	x, err := loader.Zeros(ctx, tensor.Float32, 4)
	if err != nil {
		return sample{}, err
	}
	if err := tensor.Fill(x, func(int) float32 { return float32(i) }); err != nil {
		return sample{}, err
	}
	return sample{X: x, Y: int64(i), Pid: os.Getpid(), Info: info, Init: workerInitRan.Load()}, nil
}

var (
	numbers = loader.Register("test.numbered", func(ctx context.Context, a numberedArgs) (loader.Dataset[sample], error) {
		return numbered{a}, nil
	})
	// stream yields 0 to N-1, each worker the ones congruent to its id.
	stream = loader.RegisterIterable("test.stream", func(ctx context.Context, n int) (loader.Iterable[int64], error) {
		return streamSet(n), nil
	})
)

type streamSet int

func (s streamSet) All(ctx context.Context) iter.Seq2[int64, error] {
	return func(yield func(int64, error) bool) {
		id, step := 0, 1
		if info, ok := loader.Info(ctx); ok {
			id, step = info.ID, info.NumWorkers
		}
		for i := id; i < int(s); i += step {
			if !yield(int64(i), nil) {
				return
			}
		}
	}
}

func init() {
	loader.RegisterWorkerInit("test.init", func(ctx context.Context, info loader.WorkerInfo) error {
		workerInitRan.Store(true)
		return nil
	})
	loader.RegisterCollate("test.sum", func(ctx context.Context, samples []int64) (int64, error) {
		var s int64
		for _, v := range samples {
			s += v
		}
		return s, nil
	})
}

// epoch reads one epoch, releasing each batch once checked.
func epoch(t *testing.T, l *loader.Loader[batch]) (ys []int64, pids []int64) {
	t.Helper()
	for b, err := range l.Epoch(context.Background()) {
		require.NoError(t, err)
		y, err := tensor.Values[int64](b.Y)
		require.NoError(t, err)
		x, err := tensor.Values[float32](b.X)
		require.NoError(t, err)
		require.Equal(t, []int{len(y), 4}, b.X.Shape())
		for i, v := range y {
			assert.Equal(t, slices.Repeat([]float32{float32(v)}, 4), x[4*i:4*i+4], "sample %d's tensor", v)
		}
		p, err := tensor.Values[int64](b.Pid)
		require.NoError(t, err)
		ys, pids = append(ys, y...), append(pids, p...)
		require.NoError(t, loader.Release(b))
	}
	return ys, pids
}

func seq(n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(i)
	}
	return out
}

func TestLoaderDeliversInOrder(t *testing.T) {
	leakcheck.Check(t)
	for _, workers := range []int{0, 1, 2} {
		t.Run(fmt.Sprint(workers, " workers"), func(t *testing.T) {
			l, err := loader.New[batch](numbers, numberedArgs{N: 50, FailAt: -1, KillAt: -1}, loader.Options{BatchSize: 8, NumWorkers: workers})
			require.NoError(t, err)
			defer l.Close()
			assert.Equal(t, 7, l.Len())
			ys, pids := epoch(t, l)
			assert.Equal(t, seq(50), ys)
			if workers > 0 {
				assert.NotContains(t, pids, int64(os.Getpid()), "read in the workers")
			} else {
				assert.Equal(t, slices.Repeat([]int64{int64(os.Getpid())}, 50), pids)
			}

			l, err = loader.New[batch](numbers, numberedArgs{N: 50, FailAt: -1, KillAt: -1}, loader.Options{BatchSize: 8, NumWorkers: workers, DropLast: true})
			require.NoError(t, err)
			defer l.Close()
			assert.Equal(t, 6, l.Len())
			ys, _ = epoch(t, l)
			assert.Equal(t, seq(48), ys, "drop-last leaves out the short batch")
		})
	}
}

func TestLoaderShuffleIsReproducible(t *testing.T) {
	leakcheck.Check(t)
	read := func(seed int64) [][]int64 {
		l, err := loader.New[batch](numbers, numberedArgs{N: 40, FailAt: -1, KillAt: -1},
			loader.Options{BatchSize: 5, NumWorkers: 2, Shuffle: true, Seed: seed, PersistentWorkers: true})
		require.NoError(t, err)
		defer l.Close()
		var epochs [][]int64
		for range 2 {
			ys, _ := epoch(t, l)
			epochs = append(epochs, ys)
		}
		return epochs
	}
	a, b, c := read(7), read(7), read(8)
	assert.Equal(t, a, b, "the same seed, the same orders")
	assert.NotEqual(t, a[0], a[1], "each epoch its own order")
	assert.NotEqual(t, a[0], c[0], "another seed, another order")
	for _, ys := range a {
		assert.ElementsMatch(t, seq(40), ys)
	}
}

func TestLoaderPersistentWorkers(t *testing.T) {
	leakcheck.Check(t)
	pidsOf := func(persistent bool) (first, second []int64) {
		l, err := loader.New[batch](numbers, numberedArgs{N: 16, FailAt: -1, KillAt: -1},
			loader.Options{BatchSize: 4, NumWorkers: 2, PersistentWorkers: persistent})
		require.NoError(t, err)
		defer l.Close()
		_, first = epoch(t, l)
		_, second = epoch(t, l)
		slices.Sort(first)
		slices.Sort(second)
		return slices.Compact(first), slices.Compact(second)
	}
	a, b := pidsOf(true)
	assert.Equal(t, a, b, "the same workers serve both epochs")

	// An epoch broken off early leaves its late batches behind, not in
	// the next epoch.
	l, err := loader.New[batch](numbers, numberedArgs{N: 40, FailAt: -1, KillAt: -1},
		loader.Options{BatchSize: 4, NumWorkers: 2, PersistentWorkers: true})
	require.NoError(t, err)
	defer l.Close()
	for _, err := range l.Epoch(context.Background()) {
		require.NoError(t, err)
		break
	}
	ys, _ := epoch(t, l)
	assert.Equal(t, seq(40), ys)
	a, b = pidsOf(false)
	for _, p := range b {
		assert.NotContains(t, a, p, "new workers each epoch")
	}
}

func TestLoaderWorkerErrorNamesTheSample(t *testing.T) {
	leakcheck.Check(t)
	l, err := loader.New[batch](numbers, numberedArgs{N: 40, FailAt: 13, KillAt: -1}, loader.Options{BatchSize: 4, NumWorkers: 2})
	require.NoError(t, err)
	defer l.Close()
	var got []int64
	var last error
	for b, err := range l.Epoch(context.Background()) {
		if err != nil {
			last = err
			break
		}
		y, _ := tensor.Values[int64](b.Y)
		got = append(got, y...)
		require.NoError(t, loader.Release(b))
	}
	var se *loader.SampleError
	require.ErrorAs(t, last, &se)
	assert.Equal(t, 13, se.Index)
	assert.Contains(t, []int{0, 1}, se.Worker)
	assert.ErrorContains(t, last, "sample 13 is unreadable")
	assert.Equal(t, seq(12), got, "the batches before the failing one arrive")

	// The next epoch starts new workers and fails at the same sample,
	// after the same batches.
	got, last = nil, nil
	for b, err := range l.Epoch(context.Background()) {
		if err != nil {
			last = err
			break
		}
		y, _ := tensor.Values[int64](b.Y)
		got = append(got, y...)
		require.NoError(t, loader.Release(b))
	}
	require.ErrorAs(t, last, &se, "the second epoch fails too")
	assert.Equal(t, 13, se.Index)
	assert.Equal(t, seq(12), got, "the batches before the failing one arrive again")
}

func TestLoaderWorkerKilledMidEpoch(t *testing.T) {
	leakcheck.Check(t)
	l, err := loader.New[batch](numbers, numberedArgs{N: 64, FailAt: -1, KillAt: 20}, loader.Options{BatchSize: 8, NumWorkers: 2})
	require.NoError(t, err)
	defer l.Close()
	var last error
	for b, err := range l.Epoch(context.Background()) {
		if err != nil {
			last = err
			break
		}
		require.NoError(t, loader.Release(b))
	}
	var se *loader.SampleError
	require.ErrorAs(t, last, &se)
	assert.Equal(t, 16, se.Index, "the first sample of the batch the worker was reading")
	var ee *mp.ExitError
	require.ErrorAs(t, last, &ee)
	assert.Equal(t, syscall.SIGKILL, ee.Signal)
	assert.Equal(t, se.Worker, ee.Rank)
}

func TestLoaderCancelStopsTheWorkers(t *testing.T) {
	leakcheck.Check(t)
	l, err := loader.New[batch](numbers, numberedArgs{N: 64, FailAt: -1, KillAt: -1, SleepMs: 100_000},
		loader.Options{BatchSize: 4, NumWorkers: 2, PersistentWorkers: true})
	require.NoError(t, err)
	defer l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(300*time.Millisecond, cancel)
	start := time.Now()
	var last error
	for _, err := range l.Epoch(ctx) {
		last = err
	}
	require.ErrorIs(t, last, context.Canceled)
	assert.Less(t, time.Since(start), 300*time.Millisecond+time.Second, "returns within a second of the cancel")
}

func TestLoaderTimeout(t *testing.T) {
	leakcheck.Check(t)
	l, err := loader.New[batch](numbers, numberedArgs{N: 8, FailAt: -1, KillAt: -1, SleepMs: 100_000},
		loader.Options{BatchSize: 4, NumWorkers: 1, Timeout: 200 * time.Millisecond})
	require.NoError(t, err)
	defer l.Close()
	var last error
	for _, err := range l.Epoch(context.Background()) {
		last = err
	}
	assert.ErrorContains(t, last, "no batch for 200ms")
}

func TestLoaderIterable(t *testing.T) {
	leakcheck.Check(t)
	for _, drop := range []bool{false, true} {
		l, err := loader.New[*tensor.Tensor](stream, 20, loader.Options{BatchSize: 3, DropLast: drop})
		require.NoError(t, err)
		var all []int64
		for b, err := range l.Epoch(context.Background()) {
			require.NoError(t, err)
			v, err := tensor.Values[int64](b)
			require.NoError(t, err)
			all = append(all, v...)
			require.NoError(t, b.Release())
		}
		require.NoError(t, l.Close())
		if drop {
			assert.Equal(t, seq(18), all, "in the caller, one pass")
		} else {
			assert.Equal(t, seq(20), all, "in the caller, one pass")
		}

		l, err = loader.New[*tensor.Tensor](stream, 20, loader.Options{BatchSize: 3, NumWorkers: 2, DropLast: drop})
		require.NoError(t, err)
		assert.Equal(t, -1, l.Len())
		var got [][]int64
		for b, err := range l.Epoch(context.Background()) {
			require.NoError(t, err)
			v, err := tensor.Values[int64](b)
			require.NoError(t, err)
			got = append(got, v)
			require.NoError(t, b.Release())
		}
		require.NoError(t, l.Close())
		// Worker 0 reads the even numbers, worker 1 the odd; batches
		// alternate between them, as torch's do.
		want := [][]int64{{0, 2, 4}, {1, 3, 5}, {6, 8, 10}, {7, 9, 11}, {12, 14, 16}, {13, 15, 17}}
		if !drop {
			want = append(want, []int64{18}, []int64{19})
		}
		assert.Equal(t, want, got, "drop last %v", drop)
	}
}

func TestLoaderWorkerInitInfoAndCollate(t *testing.T) {
	leakcheck.Check(t)
	l, err := loader.New[batch](numbers, numberedArgs{N: 12, FailAt: -1, KillAt: -1},
		loader.Options{BatchSize: 3, NumWorkers: 2, WorkerInit: "test.init", Seed: 3})
	require.NoError(t, err)
	defer l.Close()
	seeds := map[int]int64{}
	for b, err := range l.Epoch(context.Background()) {
		require.NoError(t, err)
		inits, err := tensor.Values[bool](b.Init)
		require.NoError(t, err)
		assert.Equal(t, []bool{true, true, true}, inits, "the worker init ran first")
		ids, err := tensor.Values[int64](b.Info.ID)
		require.NoError(t, err)
		ns, err := tensor.Values[int64](b.Info.NumWorkers)
		require.NoError(t, err)
		ss, err := tensor.Values[int64](b.Info.Seed)
		require.NoError(t, err)
		for i, id := range ids {
			assert.EqualValues(t, 2, ns[i])
			seeds[int(id)] = ss[i]
		}
		require.NoError(t, loader.Release(b))
	}
	require.Len(t, seeds, 2)
	assert.NotEqual(t, seeds[0], seeds[1], "each worker its own seed")

	sums, err := loader.New[int64](stream, 10, loader.Options{BatchSize: 5, NumWorkers: 1, Collate: "test.sum"})
	require.NoError(t, err)
	defer sums.Close()
	var got []int64
	for s, err := range sums.Epoch(context.Background()) {
		require.NoError(t, err)
		got = append(got, s)
	}
	assert.Equal(t, []int64{0 + 1 + 2 + 3 + 4, 5 + 6 + 7 + 8 + 9}, got)

	_, err = loader.New[batch](numbers, numberedArgs{N: 12}, loader.Options{Collate: "test.sum"})
	assert.ErrorContains(t, err, "takes int64 samples")
}

func TestLoaderCopiesBatchesToTheTargetPlace(t *testing.T) {
	leakcheck.Check(t)
	l, err := loader.New[batch](numbers, numberedArgs{N: 6, FailAt: -1, KillAt: -1},
		loader.Options{BatchSize: 3, NumWorkers: 1, Place: device.GPU(0)})
	require.NoError(t, err)
	defer l.Close()
	n := 0
	for b, err := range l.Epoch(context.Background()) {
		require.NoError(t, err)
		assert.Equal(t, device.GPU(0), b.X.Place())
		assert.Equal(t, device.GPU(0), b.Y.Place())
		host, err := b.Y.To(device.CPU())
		require.NoError(t, err)
		y, err := tensor.Values[int64](host)
		require.NoError(t, err)
		assert.Equal(t, []int64{int64(3 * n), int64(3*n + 1), int64(3*n + 2)}, y)
		require.NoError(t, host.Release())
		require.NoError(t, loader.Release(b))
		n++
	}
	assert.Equal(t, 2, n)
}

func TestSamplers(t *testing.T) {
	for _, drop := range []bool{false, true} {
		var all []int
		per := -1
		for rank := range 3 {
			s, err := loader.Distributed(10, rank, 3, true, 5, drop)
			require.NoError(t, err)
			got := slices.Collect(s.Indices(1))
			assert.Len(t, got, s.Len())
			if per >= 0 {
				assert.Equal(t, per, len(got), "every rank the same length")
			}
			per = len(got)
			again := slices.Collect(s.Indices(1))
			assert.Equal(t, got, again, "an epoch's share is reproducible")
			all = append(all, got...)
		}
		slices.Sort(all)
		if drop {
			assert.Len(t, all, 9)
			assert.Len(t, slices.Compact(all), 9, "shares are disjoint")
		} else {
			assert.Len(t, all, 12, "padded to divide evenly")
			assert.Len(t, slices.Compact(all), 10, "every index is in some share")
		}
	}
	_, err := loader.Distributed(10, 3, 3, false, 0, false)
	assert.Error(t, err)

	b := loader.BatchSampler{Sampler: loader.Sequential(10), Size: 4}
	assert.Equal(t, 3, b.Len())
	assert.Equal(t, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}}, slices.Collect(b.Batches(0)))
	b.DropLast = true
	assert.Equal(t, 2, b.Len())
	assert.Equal(t, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}, slices.Collect(b.Batches(0)))

	r := loader.Random(20, 1)
	assert.Equal(t, slices.Collect(r.Indices(3)), slices.Collect(loader.Random(20, 1).Indices(3)))
	assert.NotEqual(t, slices.Collect(r.Indices(3)), slices.Collect(r.Indices(4)))
}

func TestLoaderUnderFileSystemLeavesNothing(t *testing.T) {
	prev := strategy.Get()
	require.NoError(t, strategy.Set(strategy.FileSystem))
	defer func() { require.NoError(t, strategy.Set(prev)) }()
	leakcheck.Check(t) // this session's named segments included
	// The worker dies once a batch has arrived: a death noticed
	// first ends the epoch before any.
	arrived := filepath.Join(t.TempDir(), "arrived")
	l, err := loader.New[batch](numbers, numberedArgs{N: 64, FailAt: -1, KillAt: 40, KillWhen: arrived}, loader.Options{BatchSize: 8, NumWorkers: 2})
	require.NoError(t, err)
	defer l.Close()
	var kept []batch // held past the worker's death, then released
	var last error
	for b, err := range l.Epoch(context.Background()) {
		if err != nil {
			last = err
			break
		}
		kept = append(kept, b)
		require.NoError(t, os.WriteFile(arrived, nil, 0o600))
	}
	var ee *mp.ExitError
	require.ErrorAs(t, last, &ee)
	require.NotEmpty(t, kept)
	for _, b := range kept {
		y, err := tensor.Values[int64](b.Y)
		require.NoError(t, err, "a dead worker's batches stay readable")
		assert.Len(t, y, 8)
		require.NoError(t, loader.Release(b))
	}
}

package mp_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

func init() {
	mp.Register("report", workerReport)
	mp.Register("fail", workerFail)
	mp.Register("exit", workerExit)
	mp.Register("signal", workerSignal)
	mp.Register("panic", workerPanic)
	mp.Register("sleep", workerSleep)
	mp.Register("put-and-exit", workerPutAndExit)
	mp.Register("send-many", workerSendMany)
	mp.Register("low-fd-limit", workerLowFDLimit)
	mp.Register("backstop-fails", workerBackstopFails)
}

// backstopFails is how many times the backstop-fails worker's backstop
// wait fails on its own (see mp.BackstopFailsEnv).
const backstopFails = 3

// workerBackstopFails waits until its backstop's wait on the control
// socket has failed backstopFails times, lives on past them and puts how
// many on its queue, and then shuts its control socket's reading side, as
// a parent gone ends it: the backstop, waiting there again, ends the
// worker (code 3) before the function's own end, an error, 10 s later.
func workerBackstopFails(ctx context.Context, w *mp.Worker) error {
	var q *mp.Queue
	if err := w.Args(&q); err != nil {
		return err
	}
	deadline := time.Now().Add(10 * time.Second)
	for mp.BackstopFailures() < backstopFails {
		if time.Now().After(deadline) {
			return fmt.Errorf("the backstop's wait failed %d times in 10 s, not %d", mp.BackstopFailures(), backstopFails)
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // past the last failure's pause
	if err := q.Put(ctx, mp.BackstopFailures()); err != nil {
		return err
	}
	if err := mp.ShutControlReads(w); err != nil {
		return err
	}
	time.Sleep(10 * time.Second)
	return errors.New("the backstop did not end the worker")
}

// A worker's backstop ends the worker only when its control socket ends
// (its parent is gone): a wait on the socket that fails otherwise (the
// worker's descriptors exhausted, so that the receive cannot park, say)
// is waited again a little later, and the worker lives on; the wait that
// follows still ends it when the socket ends.
func TestWorkerBackstopWaitsAgainAfterItsOwnFailure(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	q := newQueue(t)
	g, err := mp.Spawn(ctx, "backstop-fails", 1, mp.WithArgs(q), mp.WithEnv(fmt.Sprintf("%s=%d", mp.BackstopFailsEnv, backstopFails)))
	require.NoError(t, err)
	var failed int
	require.NoError(t, q.Get(g.Context(), &failed), "the worker lived past its backstop's failures")
	assert.Equal(t, backstopFails, failed)
	var xe *mp.ExitError
	require.ErrorAs(t, g.Join(), &xe, "the backstop ended the worker")
	assert.Equal(t, 3, xe.Code, "the backstop's code")
}

type spawnArgs struct {
	Results *mp.Queue
	Work    *mp.Queue
	Pipe    *mp.Pipe
	Weights *tensor.Tensor
	Label   string
	FailAt  int
}

type report struct {
	Rank, World int
	Place       string
	Strategy    string
	Label       string
	Sum         float64
}

// sleep waits d, or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// workerReport sums the shared weights past the ranks' elements, writes
// 100+rank into its own element, answers the parent's word on Pipe (rank
// 0, when there is a Pipe), logs a line and puts a report of its rank,
// place and strategy on Results; then changes its own default place and
// strategy, which the parent must not see. For
// TestSpawnSuccessArgsAndPlaces and TestSpawnInheritsDefaultPlace.
func workerReport(ctx context.Context, w *mp.Worker) error {
	var a spawnArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	rest, err := a.Weights.Narrow(0, 3, 5) // ranks write into [0, 3)
	if err != nil {
		return err
	}
	vals, err := tensor.Values[float32](rest)
	if err != nil {
		return err
	}
	var sum float64
	for _, v := range vals {
		sum += float64(v)
	}
	if err := tensor.Set[float32](a.Weights, float32(100+w.Rank()), w.Rank()); err != nil {
		return err
	}
	if a.Pipe != nil && w.Rank() == 0 {
		var hello string
		if err := a.Pipe.Recv(ctx, &hello); err != nil {
			return err
		}
		if err := a.Pipe.Send(ctx, hello+" back"); err != nil {
			return err
		}
	}
	w.Logger().Info("reporting", "sum", sum)
	err = a.Results.Put(ctx, report{
		Rank: w.Rank(), World: w.WorldSize(), Place: device.Default().String(),
		Strategy: strategy.Get().String(), Label: a.Label, Sum: sum,
	})
	// A worker's own device state is its own: changing it affects
	// neither the parent nor the other workers.
	_ = device.SetDefault(device.GPU(99))
	_ = strategy.Set(strategy.FileSystem)
	return err
}

// workerFail fails on rank 1 and sleeps elsewhere until the group stops
// it: TestWorkerErrorStopsOthers.
func workerFail(ctx context.Context, w *mp.Worker) error {
	if w.Rank() == 1 {
		return errors.New("rank one gives up")
	}
	return sleep(ctx, time.Minute) // stopped by the group
}

// workerExit exits with status 7 on rank 0 and sleeps elsewhere until the
// group stops it: TestExitCodeAndSignal's exit code.
func workerExit(ctx context.Context, w *mp.Worker) error {
	if w.Rank() == 0 {
		os.Exit(7)
	}
	return sleep(ctx, time.Minute)
}

// workerSignal kills itself with SIGKILL: TestExitCodeAndSignal's signal.
func workerSignal(ctx context.Context, w *mp.Worker) error {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	time.Sleep(time.Minute)
	return nil
}

// workerPanic panics: TestExitCodeAndSignal's panic, which reaches the
// parent as a WorkerError.
func workerPanic(ctx context.Context, w *mp.Worker) error {
	panic("worker panicked")
}

// workerSleep sleeps until its context is cancelled: the workers that
// TestCancelStopsWorkers cancels and that TestGroupContextEndsAtTheFirstFailure
// kills.
func workerSleep(ctx context.Context, w *mp.Worker) error {
	return sleep(ctx, time.Minute)
}

// workerPutAndExit puts a tensor of its own on the queue and exits at once,
// with the tensor's descriptor still in flight: TestSenderMayExitAfterPut.
func workerPutAndExit(ctx context.Context, w *mp.Worker) error {
	var q *mp.Queue
	if err := w.Args(&q); err != nil {
		return err
	}
	x, err := tensor.Full(tensor.Float32, float64(w.Rank()+1), 1024)
	if err != nil {
		return err
	}
	return q.Put(ctx, x) // and exit at once: the descriptor is in flight
}

// workerSendMany puts 100 tensors, each on a segment of its own and so
// with a descriptor of its own, on the queue in one message: the sender of
// TestDescriptorLimitIsAnError.
func workerSendMany(ctx context.Context, w *mp.Worker) error {
	var q *mp.Queue
	if err := w.Args(&q); err != nil {
		return err
	}
	var ts []*tensor.Tensor
	for range 100 {
		// A segment of its own each, so a descriptor each.
		a, err := shm.Create(4<<10, shm.KeepFD|shm.Unlink)
		if err != nil {
			return err
		}
		s, err := tensor.NewStorage(device.CPU(), a)
		if err != nil {
			return errors.Join(err, a.Release())
		}
		x, err := tensor.FromStorage(s, tensor.Uint8, 0, []int{4 << 10}, []int{1})
		if err != nil {
			return err
		}
		ts = append(ts, x)
	}
	return q.Put(ctx, ts)
}

// workerLowFDLimit lowers its descriptor limit to 20 above the number of
// descriptors leakcheck.Count finds open (a limit on descriptor numbers:
// room for 20 new ones at most) and gets workerSendMany's message of
// 100, which must fail, and returns that error: the receiver of
// TestDescriptorLimitIsAnError.
func workerLowFDLimit(ctx context.Context, w *mp.Worker) error {
	var q *mp.Queue
	if err := w.Args(&q); err != nil {
		return err
	}
	lim := unix.Rlimit{Cur: uint64(leakcheck.Count() + 20), Max: uint64(leakcheck.Count() + 20)}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	var got []*tensor.Tensor
	err := q.Get(ctx, &got)
	if err == nil {
		return errors.New("receiving 100 descriptors under a limit of 20 succeeded")
	}
	return err
}

func TestSpawnSuccessArgsAndPlaces(t *testing.T) {
	leakcheck.Check(t)
	results, err := mp.NewQueue()
	require.NoError(t, err)
	defer results.Close()
	mine, theirs, err := mp.NewPipe()
	require.NoError(t, err)
	defer mine.Close()
	weights, err := tensor.Full(tensor.Float32, 1, 8)
	require.NoError(t, err)
	defer weights.Release()

	var logs bytes.Buffer
	var mu sync.Mutex
	out := writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return logs.Write(p) })
	g, err := mp.Spawn(context.Background(), "report", 3,
		mp.WithArgs(spawnArgs{Results: results, Pipe: theirs, Weights: weights, Label: "hello"}),
		mp.WithPlace(func(r int) device.Place { return device.GPU(r) }),
		mp.WithOutput(out, out))
	require.NoError(t, err)
	require.NoError(t, theirs.Close())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, mine.Send(ctx, "hi"))
	var back string
	require.NoError(t, mine.Recv(ctx, &back))
	assert.Equal(t, "hi back", back)
	require.NoError(t, g.Join())

	seen := map[int]report{}
	for range 3 {
		var r report
		require.NoError(t, results.Get(ctx, &r))
		seen[r.Rank] = r
	}
	for rank := range 3 {
		r := seen[rank]
		assert.Equal(t, 3, r.World)
		assert.Equal(t, device.GPU(rank).String(), r.Place, "the per-rank place option")
		assert.Equal(t, strategy.Get().String(), r.Strategy, "the parent's strategy")
		assert.Equal(t, "hello", r.Label)
		assert.Equal(t, 5.0, r.Sum)
		v, err := tensor.At[float32](weights, rank)
		require.NoError(t, err)
		assert.Equal(t, float32(100+rank), v, "each worker wrote into the shared weights")
	}
	for rank := range 3 {
		assert.Contains(t, logs.String(), fmt.Sprintf("worker.%d: reporting", rank), "a named logger per worker")
	}
	assert.Equal(t, device.CPU(), device.Default(), "workers changing their default place leave the parent's alone")
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		assert.Regexp(t, `worker\.\d: reporting: sum=5`, line, "whole lines, never interleaved")
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

func TestSpawnInheritsDefaultPlace(t *testing.T) {
	leakcheck.Check(t)
	old := device.Default()
	require.NoError(t, device.SetDefault(device.GPU(5)))
	defer device.SetDefault(old)
	results, err := mp.NewQueue()
	require.NoError(t, err)
	defer results.Close()
	w, err := tensor.On(device.CPU()).Full(tensor.Float32, 1, 8)
	require.NoError(t, err)
	defer w.Release()
	require.NoError(t, mp.Run(context.Background(), "report", 1, mp.WithArgs(spawnArgs{Results: results, Weights: w})))
	var r report
	require.NoError(t, results.Get(context.Background(), &r))
	assert.Equal(t, "gpu:5", r.Place)
}

func TestWorkerErrorStopsOthers(t *testing.T) {
	leakcheck.Check(t)
	start := time.Now()
	err := mp.Run(context.Background(), "fail", 3, mp.WithGrace(time.Second))
	var we *mp.WorkerError
	require.ErrorAs(t, err, &we)
	assert.Equal(t, 1, we.Rank)
	assert.Equal(t, "rank one gives up", we.Msg)
	assert.NotZero(t, we.Pid)
	assert.Less(t, time.Since(start), 30*time.Second, "the sleeping workers were stopped")
}

func TestExitCodeAndSignal(t *testing.T) {
	leakcheck.Check(t)
	err := mp.Run(context.Background(), "exit", 2)
	var xe *mp.ExitError
	require.ErrorAs(t, err, &xe)
	assert.Equal(t, 0, xe.Rank)
	assert.Equal(t, 7, xe.Code)

	err = mp.Run(context.Background(), "signal", 1)
	require.ErrorAs(t, err, &xe)
	assert.Equal(t, syscall.SIGKILL, xe.Signal)
	assert.Contains(t, err.Error(), "killed by signal")

	err = mp.Run(context.Background(), "panic", 1)
	var we *mp.WorkerError
	require.ErrorAs(t, err, &we)
	assert.Contains(t, we.Msg, "panic: worker panicked")
}

func TestCancelStopsWorkers(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithCancel(context.Background())
	g, err := mp.Spawn(ctx, "sleep", 2, mp.WithGrace(500*time.Millisecond))
	require.NoError(t, err)
	cancel()
	err = g.Join()
	assert.ErrorIs(t, err, context.Canceled)
	for _, st := range g.State() {
		// Exited is set once the worker is reaped; its pid may name
		// another process by now.
		assert.True(t, st.Exited, "worker %d reaped", st.Rank)
	}
}

func TestSpawnErrors(t *testing.T) {
	_, err := mp.Spawn(context.Background(), "no-such-worker", 1)
	assert.ErrorContains(t, err, "no worker registered")
	_, err = mp.Spawn(context.Background(), "report", 0)
	assert.Error(t, err)
}

func TestSenderMayExitAfterPut(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	require.NoError(t, mp.Run(context.Background(), "put-and-exit", 2, mp.WithArgs(q)))
	sum := float32(0)
	for range 2 {
		var x *tensor.Tensor
		require.NoError(t, q.Get(context.Background(), &x), "the tensor outlives its sender")
		v, err := tensor.At[float32](x, 1023)
		require.NoError(t, err)
		sum += v
		require.NoError(t, x.Release())
	}
	assert.Equal(t, float32(3), sum)
}

func TestDescriptorLimitIsAnError(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	// Another process sends, so that the references its message holds on
	// its pooled blocks, lost with the message, go with that process.
	g, err := mp.Spawn(context.Background(), "low-fd-limit", 1, mp.WithArgs(q))
	require.NoError(t, err)
	require.NoError(t, mp.Run(context.Background(), "send-many", 1, mp.WithArgs(q)))
	err = g.Join()
	var we *mp.WorkerError
	require.ErrorAs(t, err, &we)
	assert.Contains(t, we.Msg, "ulimit -n", "the error says how to raise the limit")
}

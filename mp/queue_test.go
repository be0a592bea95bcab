package mp_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

func TestMain(m *testing.M) {
	testmain.Run(m, testmain.WithSession())
}

func init() {
	mp.Register("fill", workerFill)
	mp.Register("bare-storage", workerBareStorage)
}

type fillArgs struct {
	Q, Progress *mp.Queue
	N           int
}

// fillStep is what the fill worker reports on Progress: Put I waits
// for room, or is done.
type fillStep struct {
	I       int
	Waiting bool
}

// workerFill puts 0 to N-1 on Q, and says on Progress when a Put waits for
// room and when it is done: TestQueueCapacityAcrossProcesses.
func workerFill(ctx context.Context, w *mp.Worker) error {
	var a fillArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	for i := range a.N {
		put := make(chan error, 1)
		go func() { put <- a.Q.Put(ctx, i) }()
		tick := time.NewTicker(100 * time.Microsecond)
		said := false
		var err error
	waiting:
		for {
			select {
			case err = <-put:
				break waiting
			case <-tick.C:
				if _, puts := mp.Waiting(a.Q); puts > 0 && !said {
					said = true
					if err := a.Progress.Put(ctx, fillStep{I: i, Waiting: true}); err != nil {
						return err
					}
				}
			}
		}
		tick.Stop()
		if err != nil {
			return err
		}
		if err := a.Progress.Put(ctx, fillStep{I: i}); err != nil {
			return err
		}
	}
	return nil
}

// workerBareStorage checks that it got a shared storage of 100 bytes and
// writes 42 into its last byte, for the parent to see:
// TestBareStorageAcrossProcesses.
func workerBareStorage(ctx context.Context, w *mp.Worker) error {
	var s *tensor.Storage
	if err := w.Args(&s); err != nil {
		return err
	}
	if s == nil || s.Size() != 100 || !s.IsShared() {
		return fmt.Errorf("received storage %v", s)
	}
	t, err := tensor.FromStorage(s, tensor.Uint8, 0, []int{100}, []int{1})
	if err != nil {
		return err
	}
	return tensor.Set[uint8](t, 42, 99) // the parent sees it
}

type message struct {
	Step    int
	Tensors []*tensor.Tensor
	Blob    []byte
}

func TestQueueInProcess(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	ctx := context.Background()

	x, err := tensor.Arange(tensor.Float64, 10)
	require.NoError(t, err)
	defer x.Release()
	require.NoError(t, q.Put(ctx, message{Step: 1, Tensors: []*tensor.Tensor{x}}))
	var got message
	require.NoError(t, q.Get(ctx, &got))
	assert.Equal(t, 1, got.Step)
	assert.Same(t, x.Storage(), got.Tensors[0].Storage(), "a tensor sent out and back is the same storage")
}

func TestQueueManyDescriptorsAndLargePayload(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	ctx := context.Background()

	var m message
	for i := range 300 {
		x, err := tensor.Full(tensor.Int32, float64(i), 4)
		require.NoError(t, err)
		m.Tensors = append(m.Tensors, x)
	}
	defer func() {
		for _, x := range m.Tensors {
			x.Release()
		}
	}()
	m.Blob = make([]byte, 1<<20)
	for i := range m.Blob {
		m.Blob[i] = byte(i * 7)
	}
	require.NoError(t, q.Put(ctx, m))
	var got message
	require.NoError(t, q.Get(ctx, &got))
	require.Len(t, got.Tensors, 300, "more than 253 descriptors in one message")
	for i, x := range got.Tensors {
		v, err := tensor.At[int32](x, 3)
		require.NoError(t, err)
		require.Equal(t, int32(i), v)
	}
	assert.Equal(t, m.Blob, got.Blob, "a payload larger than a socket message spills and comes back whole")
}

func TestQueueDeadlineAndClose(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	var v int
	assert.ErrorIs(t, q.Get(ctx, &v), context.DeadlineExceeded)

	getWaits := func() {
		t.Helper()
		waitFor(t, "the Get waits", func() bool {
			gets, _ := mp.Waiting(q)
			return gets == 1
		})
	}
	cctx, ccancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- q.Get(cctx, &v) }()
	getWaits()
	ccancel()
	assert.ErrorIs(t, <-errc, context.Canceled)

	go func() { errc <- q.Get(context.Background(), &v) }()
	getWaits()
	require.NoError(t, q.Close())
	select {
	case err := <-errc:
		assert.ErrorIs(t, err, mp.ErrClosed, "Close wakes a blocked Get")
	case <-time.After(5 * time.Second):
		t.Fatal("Get still blocked after Close")
	}
	assert.ErrorIs(t, q.Put(context.Background(), 1), mp.ErrClosed)

	// A deadline still works after an earlier call was cancelled.
	q2, err := mp.NewQueue()
	require.NoError(t, err)
	defer q2.Close()
	require.NoError(t, q2.Put(context.Background(), 42))
	require.NoError(t, q2.Get(context.Background(), &v))
	assert.Equal(t, 42, v)
}

func TestPipeDuplex(t *testing.T) {
	leakcheck.Check(t)
	a, b, err := mp.NewPipe()
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, a.Send(ctx, "ping"))
	require.NoError(t, b.Send(ctx, "pong"))
	var s string
	require.NoError(t, b.Recv(ctx, &s))
	assert.Equal(t, "ping", s)
	require.NoError(t, a.Recv(ctx, &s))
	assert.Equal(t, "pong", s)
	require.NoError(t, a.Close())
	err = b.Recv(ctx, &s)
	assert.True(t, errors.Is(err, mp.ErrClosed), "the other end's close is EOF: %v", err)
	require.NoError(t, b.Close())
}

// TestCloseRacingPutOfAQueue: a queue sent in a message while another
// goroutine closes it, and a third opens files that would take over a
// freed descriptor number: the Put fails cleanly, or the receiver gets a
// working queue; never a closed descriptor, nor another file.
func TestCloseRacingPutOfAQueue(t *testing.T) {
	leakcheck.Check(t)
	ctx := context.Background()
	carrier, err := mp.NewQueue()
	require.NoError(t, err)
	defer carrier.Close()
	stop := make(chan struct{})
	churned := make(chan struct{})
	go func() {
		defer close(churned)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if f, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
				_ = unix.Close(f)
			}
		}
	}()
	defer func() { close(stop); <-churned }()
	sent := 0
	for i := range 300 {
		q, err := mp.NewQueue()
		require.NoError(t, err)
		closed := make(chan struct{})
		go func() { defer close(closed); _ = q.Close() }()
		switch i % 3 {
		case 0:
			<-closed // closed before the Put
		case 1:
			runtime.Gosched() // racing it
		}
		err = carrier.Put(ctx, q)
		<-closed
		if err != nil {
			assert.ErrorContains(t, err, "closed", "a Put that loses the race says why")
			continue
		}
		sent++
		var got *mp.Queue
		require.NoError(t, carrier.Get(ctx, &got), "a queue that was sent arrives as a queue")
		require.NoError(t, got.Put(ctx, 7), "and works")
		var v int
		require.NoError(t, got.Get(ctx, &v))
		assert.Equal(t, 7, v)
		require.NoError(t, got.Close())
	}
	t.Logf("%d of 300 queues sent before their Close", sent)
}

// TestConcurrentGetsInOneProcess: goroutines of one process taking from
// one queue each decode their own message, inline or spilled, never one
// another's bytes.
func TestConcurrentGetsInOneProcess(t *testing.T) {
	leakcheck.Check(t)
	ctx := context.Background()
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	const n = 200
	// A failure anywhere stops every goroutine: the Gets would otherwise
	// wait for messages that never come.
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		for i := range n {
			size := 100 + i%7*3000 // inline, and past 64 KiB spilled
			if i%50 == 0 {
				size = 30000
			}
			msg := make([]int64, size)
			for j := range msg {
				msg[j] = int64(i)
			}
			if err := q.Put(ctx, msg); err != nil {
				t.Errorf("Put %d: %v", i, err)
				stop()
				return
			}
		}
	}()
	var wg sync.WaitGroup
	var mu sync.Mutex
	seen := map[int64]bool{}
	received := 0
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				if received == n {
					mu.Unlock()
					stop() // wakes the other Gets
					return
				}
				mu.Unlock()
				var msg []int64
				if err := q.Get(ctx, &msg); err != nil {
					if ctx.Err() == nil {
						t.Errorf("Get: %v", err)
						stop()
					}
					return
				}
				for _, v := range msg {
					if v != msg[0] {
						t.Errorf("message %d holds a %d: another message's bytes", msg[0], v)
						break
					}
				}
				mu.Lock()
				if seen[msg[0]] {
					t.Errorf("message %d delivered twice", msg[0])
				}
				seen[msg[0]] = true
				received++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	assert.Len(t, seen, n)
}

// A queue with a capacity holds that many messages across processes: a
// worker's Put waits while it is full and goes on when the parent takes
// one; TryPut and TryGet never wait.
func TestQueueCapacityAcrossProcesses(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	q, err := mp.NewQueue(mp.WithCapacity(3))
	require.NoError(t, err)
	defer q.Close()
	assert.Equal(t, 3, q.Cap())
	progress, err := mp.NewQueue()
	require.NoError(t, err)
	defer progress.Close()

	var v int
	assert.ErrorIs(t, q.TryGet(ctx, &v), mp.ErrEmpty)

	g, err := mp.Spawn(ctx, "fill", 1, mp.WithArgs(fillArgs{Q: q, Progress: progress, N: 5}))
	require.NoError(t, err)
	var step fillStep
	for want := range 3 {
		require.NoError(t, progress.Get(ctx, &step))
		assert.Equal(t, fillStep{I: want}, step)
	}
	// The worker's fourth Put waits, as the worker sees: the queue holds
	// three.
	require.NoError(t, progress.Get(ctx, &step))
	require.Equal(t, fillStep{I: 3, Waiting: true}, step)
	assert.ErrorIs(t, progress.TryGet(ctx, &step), mp.ErrEmpty, "a fourth Put went through a queue of capacity 3")
	assert.ErrorIs(t, q.TryPut(ctx, 99), mp.ErrFull)

	require.NoError(t, q.Get(ctx, &v))
	assert.Equal(t, 0, v)
	require.NoError(t, progress.Get(ctx, &step), "a Get made room for the fourth Put")
	assert.Equal(t, fillStep{I: 3}, step)
	for want := 1; want < 5; want++ {
		require.NoError(t, q.Get(ctx, &v))
		assert.Equal(t, want, v)
	}
	require.NoError(t, g.Join())
	for step.I != 4 || step.Waiting { // the fifth Put may have waited too
		require.NoError(t, progress.Get(ctx, &step))
	}

	// Every place is free again.
	for i := range 3 {
		require.NoError(t, q.TryPut(ctx, i))
	}
	assert.ErrorIs(t, q.TryPut(ctx, 3), mp.ErrFull)
	for range 3 {
		require.NoError(t, q.TryGet(ctx, &v))
	}
	assert.ErrorIs(t, q.TryGet(ctx, &v), mp.ErrEmpty)
}

func TestQueueCapacityLimits(t *testing.T) {
	_, err := mp.NewQueue(mp.WithCapacity(-1))
	assert.Error(t, err)
	_, err = mp.NewQueue(mp.WithCapacity(mp.MaxCapacity + 1))
	assert.Error(t, err)
}

// A bare storage travels to a worker as shared memory: the worker's write
// is the parent's.
func TestBareStorageAcrossProcesses(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.Zeros(tensor.Uint8, 100)
	require.NoError(t, err)
	defer x.Release()
	require.NoError(t, mp.Run(context.Background(), "bare-storage", 1, mp.WithArgs(x.Storage())))
	v, err := tensor.Values[uint8](x)
	require.NoError(t, err)
	assert.Equal(t, uint8(42), v[99])
}

// A queue whose capacity arrives damaged is refused, and its descriptors
// are closed.
func TestQueueWithABadCapacityIsRefused(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue(mp.WithCapacity(7))
	require.NoError(t, err)
	defer q.Close()
	data, fds, err := reduction.Marshal(struct{ Q *mp.Queue }{q})
	require.NoError(t, err)
	require.Len(t, fds, 5, "both socket ends, both ends of the places pipe, and the lane")
	i := bytes.LastIndex(data, []byte{7, 0, 0, 0})
	require.GreaterOrEqual(t, i, 0)
	data[i] = 0
	var got struct{ Q *mp.Queue }
	err = reduction.Unmarshal(data, fds, &got)
	assert.ErrorContains(t, err, "a queue of capacity 0")
	assert.Nil(t, got.Q)
}

// A Put that waits for another goroutine's Put to end takes its turn, in
// a process on one CPU too, where a goroutine that loops on Put could
// otherwise take the queue's end again before the woken one runs, each
// time: a lock that lets the running goroutine barge failed 21 to 78 of
// these 100 Puts by their 20 ms deadline, where the queue's end, handed
// to its waiters in turn, fails none.
func TestQueuePutTakesItsTurn(t *testing.T) {
	leakcheck.Check(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Add(2)
	go func() { // a reader, which keeps the queue from filling
		defer wg.Done()
		for ctx.Err() == nil {
			var v int
			_ = q.Get(ctx, &v)
		}
	}()
	go func() { // a putter in a tight loop
		defer wg.Done()
		for ctx.Err() == nil {
			_ = q.Put(ctx, 1)
		}
	}()
	time.Sleep(20 * time.Millisecond)
	failed := 0
	for range 100 {
		put, done := context.WithTimeout(ctx, 20*time.Millisecond)
		if err := q.Put(put, 2); err != nil {
			require.ErrorIs(t, err, context.DeadlineExceeded)
			failed++
		}
		done()
	}
	assert.LessOrEqual(t, failed, 5, "Puts that never got their turn")
}

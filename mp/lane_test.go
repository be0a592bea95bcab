package mp_test

import (
	"context"
	"errors"
	"fmt"
	"runtime/metrics"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// Tensors by a pipe's lane: a block of the writer's pool whose segment
// the reader maps already goes by shared memory, named by identity, lent
// by its producer until the reader holds it. These tests kill each side
// with such messages in the lane.

func init() {
	mp.Register("lane-produce", workerLaneProduce)
	mp.Register("lane-take", workerLaneTake)
	mp.Register("lane-check", workerLaneCheck)
	mp.Register("lane-hand-on", workerLaneHandOn)
	mp.Register("lane-backlog", workerLaneBacklog)
}

type laneArgs struct {
	Pipe   *mp.Pipe
	Status *mp.Queue
	N      int  // tensors to send after the first, or to take
	Quick  bool // lane-check: release each tensor unread
	Batch  int  // lane-check: after the first, Batch tensors a message
	Take   int  // lane-backlog: how many of the N it takes
	// Close: lane-take closes its end once it gets a value from it; nil,
	// it waits to be killed.
	Close *mp.Queue
}

// newInts returns a new shared tensor of 512 int64s, each v.
func newInts(t testing.TB, v int) *tensor.Tensor {
	t.Helper()
	x, err := tensor.On(device.CPU()).Shared().Full(tensor.Int64, float64(v), 512)
	require.NoError(t, err)
	return x
}

// checkInts checks that x holds 512 int64s, each v.
func checkInts(t testing.TB, x *tensor.Tensor, v int) {
	t.Helper()
	got, err := tensor.Values[int64](x)
	require.NoError(t, err)
	require.Len(t, got, 512)
	for i, g := range got {
		if g != int64(v) {
			require.Equal(t, int64(v), g, "element %d of tensor %d", i, v)
		}
	}
}

// workerLaneProduce sends a new tensor (by the socket: the first of its
// segment), waits for the other end to have taken it, sends N more
// (by the lane), releasing each, and puts how many went by the lane; it
// then waits to be killed.
func workerLaneProduce(ctx context.Context, w *mp.Worker) error {
	var a laneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	before := sock.LentSent()
	for i := 0; i <= a.N; i++ {
		x, err := tensor.On(device.CPU()).Shared().Full(tensor.Int64, float64(i), 512)
		if err != nil {
			return err
		}
		err = a.Pipe.Send(ctx, x)
		_ = x.Release()
		if err != nil {
			return err
		}
		if i == 0 {
			var taken int
			if err := a.Pipe.Recv(ctx, &taken); err != nil {
				return err
			}
		}
	}
	if err := a.Status.Put(ctx, int(sock.LentSent()-before)); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

// workerLaneTake takes the first tensor, says so, takes N more and keeps
// them, says so, and then waits to be killed, or with Close, closes its
// end once Close gives it a value, says so, and releases what it kept
// once Close gives it another.
func workerLaneTake(ctx context.Context, w *mp.Worker) error {
	var a laneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	var kept []*tensor.Tensor
	for i := 0; i <= a.N; i++ {
		var x *tensor.Tensor
		if err := a.Pipe.Recv(ctx, &x); err != nil {
			return err
		}
		kept = append(kept, x)
		if i == 0 || i == a.N {
			if err := a.Status.Put(ctx, i); err != nil {
				return err
			}
		}
	}
	if a.Close != nil {
		var now int
		if err := a.Close.Get(ctx, &now); err != nil {
			return err
		}
		if err := a.Pipe.Close(); err != nil {
			return err
		}
		if err := a.Status.Put(ctx, -2); err != nil { // closed, still holding
			return err
		}
		if err := a.Close.Get(ctx, &now); err != nil {
			return err
		}
		for _, x := range kept {
			_ = x.Release()
		}
		return a.Status.Put(ctx, -1)
	}
	<-ctx.Done()
	return nil
}

// workerLaneCheck takes the first tensor, says so, and takes N more, the
// i-th of which must hold i, releasing each; it puts how many did not.
// With a Batch, it takes N batches, tensor k of the i-th holding
// i*Batch+k. With Quick it releases each unread, and then puts what it
// spent on the N too: the lock calls its attaches made
// (shm.AttachLocks), its heap objects and bytes, and its CPU time.
func workerLaneCheck(ctx context.Context, w *mp.Worker) error {
	var a laneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	bad := 0
	var locks uint64
	var heap heapAllocs
	var cpu time.Duration
	for i := 0; i <= a.N; i++ {
		if i == 1 {
			locks = shm.AttachLocks()
			heap.start()
			cpu = testmain.ProcessCPU()
		}
		if a.Batch > 0 && i > 0 {
			var xs []*tensor.Tensor
			if err := a.Pipe.Recv(ctx, &xs); err != nil {
				return err
			}
			if len(xs) != a.Batch {
				return fmt.Errorf("a batch of %d tensors, not %d", len(xs), a.Batch)
			}
			for k, x := range xs {
				if a.Quick {
					if err := x.Release(); err != nil {
						return err
					}
				} else if err := checkLane(x, i*a.Batch+k, &bad); err != nil {
					return err
				}
			}
			continue
		}
		var x *tensor.Tensor
		if err := a.Pipe.Recv(ctx, &x); err != nil {
			return err
		}
		if a.Quick {
			if err := x.Release(); err != nil {
				return err
			}
		} else if err := checkLane(x, i, &bad); err != nil {
			return err
		}
		if i == 0 {
			if err := a.Status.Put(ctx, 0); err != nil {
				return err
			}
		}
	}
	locks = shm.AttachLocks() - locks
	objects, bytes := heap.since()
	cpu = testmain.ProcessCPU() - cpu
	if err := a.Status.Put(ctx, bad); err != nil || !a.Quick {
		return err
	}
	return a.Status.Put(ctx, [4]uint64{locks, objects, bytes, uint64(cpu)})
}

// heapAllocs counts the heap allocations a process makes, in objects and
// bytes, from start to since.
type heapAllocs struct{ objects, bytes uint64 }

// heapAllocMetrics are what readHeapAllocs reads: the heap objects,
// counted as testing's allocs/op counts them (tiny ones one by one, which
// the first metric counts by the block they share), and bytes.
var heapAllocMetrics = []string{"/gc/heap/allocs:objects", "/gc/heap/tiny/allocs:objects", "/gc/heap/allocs:bytes"}

func readHeapAllocs() heapAllocs {
	ms := make([]metrics.Sample, len(heapAllocMetrics))
	for i, name := range heapAllocMetrics {
		ms[i].Name = name
	}
	metrics.Read(ms)
	return heapAllocs{ms[0].Value.Uint64() + ms[1].Value.Uint64(), ms[2].Value.Uint64()}
}

func (h *heapAllocs) start() { *h = readHeapAllocs() }

// since returns the objects and bytes allocated since start.
func (h *heapAllocs) since() (objects, bytes uint64) {
	now := readHeapAllocs()
	return now.objects - h.objects, now.bytes - h.bytes
}

// workerLaneBacklog takes the first tensor, says so, and once Close gives
// it a value takes Take of the N that the lane holds by then, the i-th of
// which must hold i, releasing each; it puts how many did not, and the
// lock calls its attaches made for them (shm.AttachLocks). Once Close
// gives it another, it closes its end and says so (-1); it then waits to
// be killed.
func workerLaneBacklog(ctx context.Context, w *mp.Worker) error {
	var a laneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	bad := 0
	var x *tensor.Tensor
	if err := a.Pipe.Recv(ctx, &x); err != nil {
		return err
	}
	if err := checkLane(x, 0, &bad); err != nil {
		return err
	}
	if err := a.Status.Put(ctx, 0); err != nil {
		return err
	}
	var now int
	if err := a.Close.Get(ctx, &now); err != nil {
		return err
	}
	before := shm.AttachLocks()
	for i := 1; i <= a.Take; i++ {
		if err := a.Pipe.Recv(ctx, &x); err != nil {
			return err
		}
		if err := checkLane(x, i, &bad); err != nil {
			return err
		}
	}
	calls := shm.AttachLocks() - before
	if err := a.Status.Put(ctx, bad); err != nil {
		return err
	}
	if err := a.Status.Put(ctx, calls); err != nil {
		return err
	}
	if err := a.Close.Get(ctx, &now); err != nil {
		return err
	}
	if err := a.Pipe.Close(); err != nil {
		return err
	}
	if err := a.Status.Put(ctx, -1); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

// workerLaneHandOn takes a tensor, and once Close gives it a value, a
// second, which it keeps; it sends its end of the pipe back on Status, and
// releases the tensor it kept once Close gives it another value.
func workerLaneHandOn(ctx context.Context, w *mp.Worker) error {
	var a laneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	var x, kept *tensor.Tensor
	if err := a.Pipe.Recv(ctx, &x); err != nil {
		return err
	}
	_ = x.Release()
	if err := a.Status.Put(ctx, 0); err != nil {
		return err
	}
	var now int
	if err := a.Close.Get(ctx, &now); err != nil { // more waits behind the next
		return err
	}
	if err := a.Pipe.Recv(ctx, &kept); err != nil {
		return err
	}
	if err := a.Status.Put(ctx, a.Pipe); err != nil { // lets go of the lane
		return err
	}
	if err := a.Close.Get(ctx, &now); err != nil {
		return err
	}
	return errors.Join(kept.Release(), a.Pipe.Close())
}

// checkLane counts in bad a tensor x, which it releases, that does not
// hold i in every element.
func checkLane(x *tensor.Tensor, i int, bad *int) error {
	v, err := tensor.Values[int64](x)
	_ = x.Release()
	if err != nil {
		return err
	}
	for _, e := range v {
		if e != int64(i) {
			*bad++
			break
		}
	}
	return nil
}

// sendNew sends p's worker new tensors 0 to n, releasing each once
// sent, and waits after the first for the worker's word that it took it
// (and pinned its segment).
func sendNew(t *testing.T, ctx context.Context, p *mp.Pipe, status *mp.Queue, n int) {
	t.Helper()
	for i := 0; i <= n; i++ {
		x := newInts(t, i)
		err := p.Send(ctx, x)
		require.NoError(t, x.Release())
		require.NoError(t, err)
		if i == 0 {
			var first int
			require.NoError(t, status.Get(ctx, &first))
		}
	}
}

// startLane spawns worker with a laneArgs of one end of a new pipe and
// returns the other end and the status queue.
func startLane(t *testing.T, ctx context.Context, worker string, n int, close *mp.Queue) (*mp.Pipe, *mp.Queue, *mp.Group) {
	t.Helper()
	return startLaneWith(t, ctx, worker, laneArgs{N: n, Close: close})
}

// startLaneWith is startLane with the rest of the worker's laneArgs in a.
func startLaneWith(t *testing.T, ctx context.Context, worker string, a laneArgs) (*mp.Pipe, *mp.Queue, *mp.Group) {
	t.Helper()
	mine, theirs, err := mp.NewPipe()
	require.NoError(t, err)
	t.Cleanup(func() { _ = mine.Close() })
	status, err := mp.NewQueue()
	require.NoError(t, err)
	t.Cleanup(func() { _ = status.Close() })
	a.Pipe, a.Status = theirs, status
	g, err := mp.Spawn(ctx, worker, 1, mp.WithArgs(a))
	require.NoError(t, err)
	require.NoError(t, theirs.Close())
	return mine, status, g
}

// kill SIGKILLs g's worker and waits for it.
func kill(t *testing.T, g *mp.Group) {
	t.Helper()
	require.NoError(t, syscall.Kill(g.Pids()[0], syscall.SIGKILL))
	var xe *mp.ExitError
	require.ErrorAs(t, g.Join(), &xe)
}

// A stream of new tensors, each released by its producer once sent, goes
// by the lane once the reader maps their segment, and each arrives
// whole.
func TestPipeNewTensors(t *testing.T) {
	leakcheck.Check(t)
	p, g := startPipeWorker(t, "pipe-first")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n = 2000
	before := sock.LentSent()
	for i := range n {
		x := newInts(t, i)
		err := p.Send(ctx, x)
		require.NoError(t, x.Release())
		require.NoError(t, err)
		var first int64
		require.NoError(t, p.Recv(ctx, &first))
		require.Equal(t, int64(i), first)
	}
	lent := int(sock.LentSent() - before)
	t.Logf("%d of %d tensors went by the lane", lent, n)
	assert.Greater(t, lent, n*9/10, "tensors of a segment the reader maps go by the lane")
	assert.Eventually(t, func() bool { return shm.DefaultPool().InUse() == 0 }, 5*time.Second, 10*time.Millisecond,
		"every block comes back to the producer once the reader has taken it, the pipe still open")
	require.NoError(t, p.Close())
	require.NoError(t, g.Join())
}

// A producer that streams new tensors faster than its reader takes them,
// releasing each once sent, never reuses a block the lane still names:
// each arrives holding what it was sent with.
func TestPipeLaneStreamKeepsBlocks(t *testing.T) {
	for _, batch := range []int{0, 8} {
		t.Run(fmt.Sprintf("batch %d", batch), func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			n := 3000
			if batch > 0 {
				n /= batch
			}
			mine, theirs, err := mp.NewPipe()
			require.NoError(t, err)
			defer mine.Close()
			status, err := mp.NewQueue()
			require.NoError(t, err)
			defer status.Close()
			g, err := mp.Spawn(ctx, "lane-check", 1, mp.WithArgs(laneArgs{Pipe: theirs, Status: status, N: n, Batch: batch}))
			require.NoError(t, err)
			require.NoError(t, theirs.Close())
			before := sock.LentSent()
			for i := 0; i <= n; i++ {
				var v any
				xs := []*tensor.Tensor{newInts(t, i)}
				v = xs[0]
				if batch > 0 && i > 0 {
					xs = xs[:0]
					for k := range batch {
						xs = append(xs, newInts(t, i*batch+k))
					}
					v = xs
				}
				err := mine.Send(ctx, v)
				for _, x := range xs {
					require.NoError(t, x.Release())
				}
				require.NoError(t, err)
				if i == 0 {
					var first int
					require.NoError(t, status.Get(ctx, &first))
				}
			}
			var bad int
			require.NoError(t, status.Get(ctx, &bad))
			assert.Zero(t, bad, "tensors whose block was reused in flight")
			lent := int(sock.LentSent() - before)
			t.Logf("%d of %d messages went by the lane", lent, n)
			// A message goes by the lane once every block of it is of a
			// segment the reader pinned; while the reader falls behind
			// and the writer's pool grows new segments, more go by the
			// socket, and more so for batches.
			least := n / 2
			if batch > 0 {
				least = n / 4
			}
			assert.Greater(t, lent, least)
			require.NoError(t, g.Join())
		})
	}
}

// A receiver that waits past its lane wait (laneSleep, 100 ms) waits on
// its socket, parked, and the sender's next entry wakes it there: each
// tensor sent after a pause still goes by the lane, and arrives whole.
func TestPipeLaneWakesAParkedReceiver(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n = 4
	mine, status, g := startLaneWith(t, ctx, "lane-check", laneArgs{N: n})
	before := sock.LentSent()
	for i := 0; i <= n; i++ {
		if i > 0 {
			time.Sleep(250 * time.Millisecond) // the receiver parks meanwhile
		}
		start := time.Now()
		x := newInts(t, i)
		err := mine.Send(ctx, x)
		require.NoError(t, x.Release())
		require.NoError(t, err)
		if i == 0 {
			var first int
			require.NoError(t, status.Get(ctx, &first)) // its segment pinned
		}
		t.Logf("tensor %d sent in %v", i, time.Since(start))
	}
	var bad int
	require.NoError(t, status.Get(ctx, &bad))
	assert.Zero(t, bad, "tensors that arrived holding something else")
	assert.Equal(t, n, int(sock.LentSent()-before), "every tensor after the first went by the lane")
	require.NoError(t, g.Join())
}

// A producer killed with its tensors in the lane, released on its side,
// costs the reader nothing: each arrives whole, then ErrClosed; also
// when the reader is slow to take each (past its idle look, which drops
// the pins of segments whose producers have let go of them).
func TestPipeLaneProducerKilled(t *testing.T) {
	for _, c := range []struct {
		name  string
		n     int
		pause time.Duration // the reader works on what it took
	}{{"reader keeps up", 100, 0}, {"slow reader", 4, 250 * time.Millisecond}} {
		t.Run(c.name, func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			p, status, g := startLane(t, ctx, "lane-produce", c.n, nil)
			var first *tensor.Tensor
			require.NoError(t, p.Recv(ctx, &first))
			checkInts(t, first, 0)
			require.NoError(t, first.Release())
			require.NoError(t, p.Send(ctx, 1))
			var lent int
			require.NoError(t, status.Get(ctx, &lent))
			require.Equal(t, c.n, lent, "every tensor after the first went by the lane")
			kill(t, g)
			for i := 1; i <= c.n; i++ {
				var x *tensor.Tensor
				require.NoError(t, p.Recv(ctx, &x), "tensor %d", i)
				checkInts(t, x, i)
				require.NoError(t, x.Release())
				time.Sleep(c.pause)
			}
			var x *tensor.Tensor
			assert.ErrorIs(t, p.Recv(ctx, &x), mp.ErrClosed)
		})
	}
}

// A reader killed holding some of a producer's tensors and with the rest
// untaken in the lane gives every block back, though the producer sends
// nothing more.
func TestPipeLaneReaderKilled(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n, taken = 200, 80
	p, status, g := startLane(t, ctx, "lane-take", taken, nil)
	pool := shm.DefaultPool()
	before := sock.LentSent()
	sendNew(t, ctx, p, status, n)
	var last int
	require.NoError(t, status.Get(ctx, &last))
	require.Equal(t, taken, last)
	assert.Equal(t, n, int(sock.LentSent()-before), "every tensor after the first went by the lane")
	assert.Greater(t, pool.InUse(), n-taken, "the lane's and the reader's hold them")
	kill(t, g)
	start := time.Now()
	require.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back once the reader is killed")
	t.Logf("blocks back %v after the kill", time.Since(start))
	assert.Less(t, time.Since(start), time.Second)
}

// A reader that finds a backlog of tensors in the lane locks their slots
// together, one call per run of neighbouring blocks, not one per tensor,
// and each arrives whole. Having taken all of them, or only some, with the
// rest locked ahead and untaken, it gives every block back once it closes
// its end, alive, and again once killed.
func TestPipeLaneBacklogLocksInRuns(t *testing.T) {
	const n = 100
	for _, take := range []int{n, 30} {
		t.Run(fmt.Sprint("take ", take), func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			start, err := mp.NewQueue()
			require.NoError(t, err)
			defer start.Close()
			mine, status, g := startLaneWith(t, ctx, "lane-backlog", laneArgs{N: n, Take: take, Close: start})
			pool := shm.DefaultPool()
			before := sock.LentSent()
			sendNew(t, ctx, mine, status, n)
			require.Equal(t, n, int(sock.LentSent()-before), "every tensor after the first waits in the lane")
			require.NoError(t, start.Put(ctx, 1))
			var bad, calls int
			require.NoError(t, status.Get(ctx, &bad))
			require.NoError(t, status.Get(ctx, &calls))
			assert.Zero(t, bad, "tensors that did not hold their values")
			assert.LessOrEqual(t, calls, n/10, "lock calls for %d tensors taken", take)
			require.NoError(t, start.Put(ctx, 2))
			var closed int
			require.NoError(t, status.Get(ctx, &closed))
			require.Equal(t, -1, closed)
			require.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
				"every block comes back once the reader, alive, has closed its end")
			kill(t, g)
			assert.Zero(t, pool.InUse(), "and once it is killed")
		})
	}
}

// A reader that closes its end with tensors untaken in the lane gives
// them back: a message never taken holds nothing once no process can
// take it.
func TestPipeLaneReaderClosesWithUntaken(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n, taken = 100, 10
	closeNow, err := mp.NewQueue()
	require.NoError(t, err)
	defer closeNow.Close()
	p, status, g := startLane(t, ctx, "lane-take", taken, closeNow)
	pool := shm.DefaultPool()
	sendNew(t, ctx, p, status, n)
	var got int
	require.NoError(t, status.Get(ctx, &got))
	require.Equal(t, taken, got)
	assert.Greater(t, pool.InUse(), n-taken, "the lane's and the reader's hold them")
	require.NoError(t, closeNow.Put(ctx, 1))
	require.NoError(t, status.Get(ctx, &got))
	require.Equal(t, -2, got)
	require.Eventually(t, func() bool { return pool.InUse() == taken+1 }, 5*time.Second, 5*time.Millisecond,
		"the untaken tensors come back once the reader has closed its end; those it keeps stay its")
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, taken+1, pool.InUse(), "the reader holds what it kept")
	require.NoError(t, closeNow.Put(ctx, 1))
	require.NoError(t, status.Get(ctx, &got))
	require.Equal(t, -1, got)
	require.NoError(t, g.Join())
	require.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back once the reader lets go of them")
}

// BenchmarkPipeTensorStream streams new shared 4 KiB tensors one way
// through a pipe, each released once sent, to a worker that checks each:
// alone, and beside a goroutine of the sending process that waits all the
// while in a Recv on another pipe, on which nothing comes. Run with -cpu 1
// (GOMAXPROCS=1, as in a process on one CPU), the second measures what
// the idle wait takes from the stream: a thread that goes back to sleep
// in the kernel holds the process's only P until the runtime takes it
// back (see sock's maxSleepSlice).
func BenchmarkPipeTensorStream(b *testing.B) {
	b.Run("alone", func(b *testing.B) { benchPipeTensorStream(b, false, 1) })
	b.Run("beside-an-idle-receive", func(b *testing.B) { benchPipeTensorStream(b, true, 1) })
	b.Run("16-a-message", func(b *testing.B) { benchPipeTensorStream(b, false, 16) })
}

// benchPipeTensorStream streams b.N tensors after a first, batch to a
// message (a slice of them) if batch > 1; ns/op is a tensor's.
func benchPipeTensorStream(b *testing.B, idle bool, batch int) {
	ctx := context.Background()
	mine, theirs, err := mp.NewPipe()
	require.NoError(b, err)
	defer mine.Close()
	status, err := mp.NewQueue()
	require.NoError(b, err)
	defer status.Close()
	if idle {
		quiet, other, err := mp.NewPipe()
		require.NoError(b, err)
		waitCtx, stop := context.WithCancel(ctx)
		waited := make(chan error, 1)
		go func() {
			var v int
			waited <- quiet.Recv(waitCtx, &v)
		}()
		defer func() {
			stop()
			assert.ErrorIs(b, <-waited, context.Canceled)
			_, _ = quiet.Close(), other.Close()
		}()
	}
	n := b.N // messages after the first
	args := laneArgs{Pipe: theirs, Status: status, N: n, Quick: true}
	if batch > 1 {
		n = (b.N + batch - 1) / batch
		args.N, args.Batch = n, batch
	}
	g, err := mp.Spawn(ctx, "lane-check", 1, mp.WithArgs(args))
	require.NoError(b, err)
	require.NoError(b, theirs.Close())
	made := tensor.On(device.CPU()).Shared()
	xs := make([]*tensor.Tensor, batch)
	b.ReportAllocs()
	b.ResetTimer()
	cpu := testmain.ProcessCPU()
	for i := 0; i <= n; i++ {
		k := batch
		if i == 0 {
			k = 1
		}
		for j := range k {
			if xs[j], err = made.Zeros(tensor.Int64, 512); err != nil {
				b.Fatal(err)
			}
		}
		if k == 1 {
			err = mine.Send(ctx, xs[0])
		} else {
			err = mine.Send(ctx, xs)
		}
		for _, x := range xs[:k] {
			_ = x.Release()
		}
		if err != nil {
			b.Fatal(err)
		}
		if i == 0 {
			var first int
			require.NoError(b, status.Get(ctx, &first))
		}
	}
	var bad int
	var reader [4]uint64 // the reader's lock calls, heap objects, heap bytes and CPU time
	require.NoError(b, status.Get(ctx, &bad))
	b.StopTimer()
	cpu = testmain.ProcessCPU() - cpu
	require.Zero(b, bad)
	require.NoError(b, status.Get(ctx, &reader))
	tensors := float64(n * batch)
	b.ReportMetric(float64(reader[0])/tensors, "locks/op")
	b.ReportMetric(float64(reader[1])/tensors, "reader-allocs/op")
	b.ReportMetric(float64(reader[2])/tensors, "reader-B/op")
	b.ReportMetric(float64(reader[3])/tensors, "reader-cpu-ns/op")
	b.ReportMetric(float64(cpu.Nanoseconds())/tensors, "writer-cpu-ns/op")
	require.NoError(b, g.Join())
}

// A reader that hands its end on keeps the tensors it took by the lane:
// it takes its own holds on them before it lets go of the lane, so that
// the next reader's acks, which return the writer's loans, leave them
// held.
func TestPipeLaneHandedOnKeepsWhatItTook(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	release, err := mp.NewQueue()
	require.NoError(t, err)
	defer release.Close()
	p, status, g := startLane(t, ctx, "lane-hand-on", 0, release)
	pool := shm.DefaultPool()
	before := sock.LentSent()
	sendNew(t, ctx, p, status, 1)
	require.NoError(t, p.Send(ctx, 7)) // waits behind the kept tensor
	require.NoError(t, release.Put(ctx, 1))
	var theirs *mp.Pipe
	require.NoError(t, status.Get(ctx, &theirs))
	defer theirs.Close()
	require.Equal(t, uint64(1), sock.LentSent()-before, "the kept tensor went by the lane")
	var n int
	require.NoError(t, theirs.Recv(ctx, &n)) // this process reads the lane now, and acks
	require.Equal(t, 7, n)
	require.NoError(t, p.Send(ctx, 8)) // settles the writer's loans
	require.NoError(t, theirs.Recv(ctx, &n))
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, 1, pool.InUse(), "the worker holds the tensor it kept, the loan returned")
	require.NoError(t, release.Put(ctx, 1))
	require.NoError(t, g.Join())
	assert.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond)
}

// A reader that hands its end on stops the writer naming blocks by
// identity for it: what the writer sends next goes by the socket and
// reaches the next reader. A tensor the lane carried before, untaken, is
// the first reader's to take: the next one gets an error wrapping
// mmapalloc.ErrNotMapped for it, even where its process maps the segment
// too, unless its process made the block (here, where one process is
// writer and both readers), which takes it back whole; and every block
// goes back to its producer.
func TestPipeLaneHandedOnUntaken(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a, b, err := mp.NewPipe()
	require.NoError(t, err)
	defer a.Close()
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	pool := shm.DefaultPool()
	x0 := newInts(t, 0)
	require.NoError(t, a.Send(ctx, x0))
	require.NoError(t, x0.Release()) // else the receive finds this process's own storage
	var y0 *tensor.Tensor
	require.NoError(t, b.Recv(ctx, &y0)) // b pins the segment
	defer y0.Release()                   // and this process keeps mapping it
	before := sock.LentSent()
	x1 := newInts(t, 1)
	require.NoError(t, a.Send(ctx, x1))
	require.NoError(t, x1.Release())
	require.Equal(t, uint64(1), sock.LentSent()-before, "by the lane")

	require.NoError(t, q.Put(ctx, b)) // hands the end on
	var b2 *mp.Pipe
	require.NoError(t, q.Get(ctx, &b2))
	defer b2.Close()
	x2 := newInts(t, 2)
	require.NoError(t, a.Send(ctx, x2))
	require.NoError(t, x2.Release())
	assert.Equal(t, uint64(1), sock.LentSent()-before, "by the socket, once the end is handed on")
	require.NoError(t, b.Close())

	var y *tensor.Tensor
	require.NoError(t, b2.Recv(ctx, &y), "the lane's tensor, whose block this process made")
	checkInts(t, y, 1)
	require.NoError(t, y.Release())
	require.NoError(t, b2.Recv(ctx, &y))
	checkInts(t, y, 2)
	require.NoError(t, y.Release())
	require.NoError(t, y0.Release())
	assert.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back to the producer")
}

// A reader killed a while after the writer's last send, the writer's
// settling timer having looked meanwhile, gives its blocks back all the
// same.
func TestPipeLaneReaderKilledLater(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n, taken = 50, 20
	p, status, g := startLane(t, ctx, "lane-take", taken, nil)
	pool := shm.DefaultPool()
	sendNew(t, ctx, p, status, n)
	var last int
	require.NoError(t, status.Get(ctx, &last))
	time.Sleep(200 * time.Millisecond) // the settling timer has looked, the reader alive
	kill(t, g)
	require.Eventually(t, func() bool { return pool.InUse() == 0 }, time.Second, 5*time.Millisecond,
		"every block back within a second of the kill")
}

package mp_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// BenchmarkQueueNewTensor4K is the per-tensor cost of sending tensors
// made outside shared memory, in one process: make a 4 KiB tensor, share
// and send it, receive it, release both ends.
func BenchmarkQueueNewTensor4K(b *testing.B) { benchStream(b, tensor.On(device.CPU())) }

// BenchmarkQueueStream4K is the single-tensor stream's per-tensor cost in
// one process: the same for tensors made in shared memory, as a producer
// that sends everything it makes would.
func BenchmarkQueueStream4K(b *testing.B) { benchStream(b, tensor.On(device.CPU()).Shared()) }

// benchStream sends 4 KiB tensors that f makes, one per message.
func benchStream(b *testing.B, f tensor.Factory) {
	q, ctx := benchQueue(b)
	b.ReportAllocs()
	for b.Loop() {
		x, err := f.Zeros(tensor.Uint8, 4<<10)
		if err != nil {
			b.Fatal(err)
		}
		if err := q.Put(ctx, x); err != nil {
			b.Fatal(err)
		}
		var y *tensor.Tensor
		if err := q.Get(ctx, &y); err != nil {
			b.Fatal(err)
		}
		_ = y.Release()
		_ = x.Release()
	}
}

// benchQueue returns a queue that b closes at its end.
func benchQueue(b *testing.B) (*mp.Queue, context.Context) {
	q, err := mp.NewQueue()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = q.Close() })
	return q, context.Background()
}

// BenchmarkQueueSharedTensor is one hop of an already-shared tensor.
func BenchmarkQueueSharedTensor(b *testing.B) {
	q, ctx := benchQueue(b)
	x, err := tensor.On(device.CPU()).Zeros(tensor.Uint8, 1<<20)
	if err != nil {
		b.Fatal(err)
	}
	defer x.Release()
	b.ReportAllocs()
	for b.Loop() {
		if err := q.Put(ctx, x); err != nil {
			b.Fatal(err)
		}
		var y *tensor.Tensor
		if err := q.Get(ctx, &y); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPutMany4K is the batched stream's per-tensor cost in one
// process: make 16 tensors of 4 KiB in shared memory, send them in one
// message, receive them, release both ends. ns/op is per tensor.
func BenchmarkPutMany4K(b *testing.B) {
	const batch = 16
	q, ctx := benchQueue(b)
	born := tensor.On(device.CPU()).Shared()
	xs := make([]*tensor.Tensor, batch)
	var ys []*tensor.Tensor
	var err error
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if i%batch != 0 {
			continue
		}
		for j := range xs {
			if xs[j], err = born.Zeros(tensor.Uint8, 4<<10); err != nil {
				b.Fatal(err)
			}
		}
		if err := mp.PutMany(ctx, q, xs); err != nil {
			b.Fatal(err)
		}
		if ys, err = mp.GetMany(ctx, q, ys[:0]); err != nil {
			b.Fatal(err)
		}
		if len(ys) != batch {
			b.Fatalf("got %d tensors, sent %d", len(ys), batch)
		}
		for j := range xs {
			_ = ys[j].Release()
			_ = xs[j].Release()
		}
	}
}

// BenchmarkQueueTensorStream streams new shared 4 KiB tensors one way
// through a queue, each released once put, to a worker that gets and
// releases each: spawn bench's stream case, as a benchmark. lent/op is
// the share of tensors that went by the queue's lane, named by identity;
// the others went by its socket, with a descriptor each.
func BenchmarkQueueTensorStream(b *testing.B) {
	b.ReportAllocs()
	before := sock.LentSent()
	streamToCounter(b, b.N, false, b.ResetTimer)
	b.StopTimer()
	b.ReportMetric(float64(sock.LentSent()-before)/float64(b.N), "lent/op")
}

// A stream of new tensors through a queue, each released once put,
// reaches the worker whole and in order, and every block comes back to
// the pool once the worker has released them.
func TestQueueTensorStreamArrivesInOrder(t *testing.T) {
	leakcheck.Check(t)
	streamToCounter(t, 2000, true, func() {})
	require.Eventually(t, func() bool { return shm.DefaultPool().InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back")
}

// streamToCounter puts n new shared tensors of 512 int64s on a queue to
// a queue-count worker, releasing each once put, after calling start;
// with check, tensor i holds i, and the worker checks each.
func streamToCounter(t testing.TB, n int, check bool, start func()) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	in, out := newQueue(t), newQueue(t)
	g, err := mp.Spawn(ctx, "queue-count", 1, mp.WithArgs(queueLaneArgs{In: in, Out: out, N: n, Check: check}))
	require.NoError(t, err)
	start()
	for i := range n {
		var x *tensor.Tensor
		if check {
			x, err = tensor.On(device.CPU()).Shared().Full(tensor.Int64, float64(i), 512)
		} else {
			x, err = tensor.On(device.CPU()).Shared().Zeros(tensor.Int64, 512)
		}
		require.NoError(t, err)
		err = in.Put(ctx, x)
		_ = x.Release()
		require.NoError(t, err)
	}
	var got int
	require.NoError(t, out.Get(ctx, &got))
	require.Equal(t, n, got, "tensors the worker got whole and in order")
	require.NoError(t, g.Join())
}

func init() { mp.Register("queue-count", workerQueueCount) }

// workerQueueCount gets N tensors from In, releasing each, and puts on
// Out how many it got before the first that was not whole (with Check,
// tensor i holds i in each of its 512 elements): streamToCounter.
func workerQueueCount(ctx context.Context, w *mp.Worker) error {
	var a queueLaneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	good := -1
	for i := range a.N {
		var x *tensor.Tensor
		if err := a.In.Get(ctx, &x); err != nil {
			return err
		}
		if a.Check && good < 0 {
			v, err := tensor.Values[int64](x)
			if err != nil || len(v) != 512 || v[0] != int64(i) || v[511] != int64(i) {
				good = i
			}
		}
		if err := x.Release(); err != nil {
			return err
		}
	}
	if good < 0 {
		good = a.N
	}
	return a.Out.Put(ctx, good)
}

func init() { mp.Register("queue-echo", workerQueueEcho) }

// workerQueueEcho puts back on Out each tensor it gets from In, until it
// gets a nil tensor: BenchmarkQueueTensorRoundTrip. It keeps the storage
// mapped (each tensor it gets is a view of the last one's), as a worker
// serving the same tensor would, and releases it at the end.
func workerQueueEcho(ctx context.Context, w *mp.Worker) error {
	var a queueLaneArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	var last *tensor.Tensor
	defer func() {
		if last != nil {
			_ = last.Release()
		}
	}()
	for {
		var x *tensor.Tensor
		if err := a.In.Get(ctx, &x); err != nil || x == nil {
			return err
		}
		last = x
		if err := a.Out.Put(ctx, x); err != nil {
			return err
		}
	}
}

// startQueueEcho starts the queue-echo worker on two new queues, which t
// closes at its end, and returns them and the worker.
func startQueueEcho(t testing.TB) (in, out *mp.Queue, g *mp.Group) {
	t.Helper()
	in, out = newQueue(t), newQueue(t)
	g, err := mp.Spawn(context.Background(), "queue-echo", 1, mp.WithArgs(queueLaneArgs{In: in, Out: out}))
	require.NoError(t, err)
	return in, out, g
}

// A tensor put to the echo worker comes back whole on its own storage,
// trip after trip, and a nil tensor ends the worker; every block comes
// back to the pool.
func TestQueueEchoBackToItsProducer(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	in, out, g := startQueueEcho(t)
	x := newInts(t, 7)
	for range 3 {
		require.NoError(t, in.Put(ctx, x))
		var y *tensor.Tensor
		require.NoError(t, out.Get(ctx, &y))
		require.Same(t, x.Storage(), y.Storage())
		checkInts(t, y, 7)
	}
	require.NoError(t, in.Put(ctx, (*tensor.Tensor)(nil)))
	require.NoError(t, g.Join())
	require.NoError(t, x.Release())
	require.Eventually(t, func() bool { return shm.DefaultPool().InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back")
}

// BenchmarkQueueTensorRoundTrip is the round trip of a shared 4 KiB
// tensor to a worker and back through two queues, as spawn bench's
// roundtrip case. The way there goes by the queue's lane once the worker
// pins the segment and waits in Get (or comes back to it within the
// putter's patience), and the way back, the tensor returned to the
// process that made it, by the other queue's lane: lent/op and
// returned/op report the shares of trips that did.
func BenchmarkQueueTensorRoundTrip(b *testing.B) {
	ctx := context.Background()
	in, out, g := startQueueEcho(b)
	defer func() {
		if err := in.Put(ctx, (*tensor.Tensor)(nil)); err != nil {
			b.Error(err)
		}
		if err := g.Join(); err != nil {
			b.Error(err)
		}
	}()
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
	if err != nil {
		b.Fatal(err)
	}
	defer x.Release()
	b.ReportAllocs()
	before, back := sock.LentSent(), sock.ReturnsTaken()
	for b.Loop() {
		if err := in.Put(ctx, x); err != nil {
			b.Fatal(err)
		}
		var y *tensor.Tensor
		if err := out.Get(ctx, &y); err != nil {
			b.Fatal(err)
		}
		if y.Storage() != x.Storage() {
			b.Fatal("the tensor came back on other memory")
		}
	}
	b.ReportMetric(float64(sock.LentSent()-before)/float64(b.N), "lent/op")       // trips there by the lane
	b.ReportMetric(float64(sock.ReturnsTaken()-back)/float64(b.N), "returned/op") // and back
}

package mp_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/sock"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

func init() {
	mp.Register("pipe-echo", workerPipeEcho)
	mp.Register("pipe-sum", workerPipeSum)
	mp.Register("pipe-close-late", workerPipeCloseLate)
}

type pipeCloseArgs struct {
	Pipe   *mp.Pipe
	Closed *mp.Queue
	At     int64 // when to close, wall clock in nanoseconds
	Die    bool  // to die (SIGKILL) instead, its end open
}

// workerPipeCloseLate closes its end, on which it neither sent nor
// received, At the time it was given, and puts when it did (wall clock,
// in nanoseconds), or, with Die, puts the time and kills itself:
// TestPipeCloseWakesAPeerLongAsleep.
func workerPipeCloseLate(ctx context.Context, w *mp.Worker) error {
	var a pipeCloseArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	time.Sleep(time.Until(time.Unix(0, a.At)))
	at := time.Now().UnixNano()
	if a.Die {
		if err := a.Closed.Put(ctx, at); err != nil {
			return err
		}
		return syscall.Kill(os.Getpid(), syscall.SIGKILL)
	}
	if err := a.Pipe.Close(); err != nil {
		return err
	}
	return a.Closed.Put(ctx, at)
}

// A process that has waited long on a Pipe, and so sleeps a second at a
// time, sees the other end's Close at once, even where that end never
// used the lanes (and so never mapped them): its Close nudges the waiter,
// which finds the socket's other end gone. So does a reader waiting for
// a message, and a writer waiting for room in a full lane. Where the
// other end's process dies instead (SIGKILL), its end closed by the
// kernel, the package's poller sees the socket's hang-up and nudges the
// waiter.
func TestPipeCloseWakesAPeerLongAsleep(t *testing.T) {
	for _, c := range []struct {
		name string
		die  bool
		wait func(ctx context.Context, p *mp.Pipe) error
	}{
		{"reader", false, pipeRecvOne},
		{"writer", false, pipeSendUntilFull},
		{"reader-of-the-dead", true, pipeRecvOne},
		{"writer-to-the-dead", true, pipeSendUntilFull},
	} {
		t.Run(c.name, func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			mine, theirs, err := mp.NewPipe()
			require.NoError(t, err)
			defer mine.Close()
			closed, err := mp.NewQueue()
			require.NoError(t, err)
			defer closed.Close()
			// 1.6 s on: a reader waits on its socket by then (past its
			// lane wait, 100 ms); a writer waiting for room sleeps in
			// slices of a second past 1.27 s, the next to end 2.27 s
			// into the wait.
			start := time.Now()
			g, err := mp.Spawn(ctx, "pipe-close-late", 1, mp.WithArgs(pipeCloseArgs{Pipe: theirs, Closed: closed, At: start.Add(1600 * time.Millisecond).UnixNano(), Die: c.die}))
			require.NoError(t, err)
			require.NoError(t, theirs.Close())
			err = c.wait(ctx, mine)
			returned := time.Now()
			require.ErrorIs(t, err, mp.ErrClosed)
			var at int64
			require.NoError(t, closed.Get(ctx, &at))
			if err := g.Join(); c.die {
				require.Error(t, err, "the worker killed itself")
			} else {
				require.NoError(t, err)
			}
			late := returned.Sub(time.Unix(0, at))
			t.Logf("closed %v after the spawn; seen %v later", time.Unix(0, at).Sub(start), late)
			assert.Less(t, late, 300*time.Millisecond, "the end was seen at the end of a sleep slice")
		})
	}
}

func pipeRecvOne(ctx context.Context, p *mp.Pipe) error {
	var v int
	return p.Recv(ctx, &v)
}

// pipeSendUntilFull sends until the lane is full, and then waits for
// room.
func pipeSendUntilFull(ctx context.Context, p *mp.Pipe) error {
	for n := 0; ; n++ {
		if err := p.Send(ctx, n); err != nil {
			return err
		}
	}
}

type pipeSumArgs struct {
	Pipe *mp.Pipe
	Out  *mp.Queue
	N    int
}

// workerPipeSum receives N ints on its pipe and puts their sum:
// TestPipeEndHandedOn.
func workerPipeSum(ctx context.Context, w *mp.Worker) error {
	var a pipeSumArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	defer a.Pipe.Close()
	sum := 0
	for range a.N {
		var n int
		if err := a.Pipe.Recv(ctx, &n); err != nil {
			return err
		}
		sum += n
	}
	return a.Out.Put(ctx, sum)
}

type pipeEchoArgs struct {
	Pipe    *mp.Pipe
	In, Out *mp.Queue // nil, or a second echo by queue, for the benchmark
	Ints    bool      // the pipe carries ints, not pipeMsgs
}

// pipeMsg is what the pipe tests send: one of its fields set.
type pipeMsg struct {
	N int
	S string
	T *tensor.Tensor
	Q *mp.Queue
}

// workerPipeEcho sends back every value it receives on its pipe (and on
// its queue), until the other end is closed: TestPipeAcrossProcesses and
// BenchmarkRoundTrip.
func workerPipeEcho(ctx context.Context, w *mp.Worker) error {
	var a pipeEchoArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	defer a.Pipe.Close()
	done := make(chan error, 1)
	if a.In != nil {
		go func() {
			for {
				var n int
				if err := a.In.Get(ctx, &n); err != nil {
					done <- nil // the test is over
					return
				}
				if err := a.Out.Put(ctx, n); err != nil {
					done <- err
					return
				}
			}
		}()
	} else {
		done <- nil
	}
	for a.Ints {
		var n int
		err := a.Pipe.Recv(ctx, &n)
		if errors.Is(err, mp.ErrClosed) {
			_ = a.In.Close() // ends the queue's echo
			return <-done
		}
		if err != nil {
			return err
		}
		if err := a.Pipe.Send(ctx, n); err != nil {
			return err
		}
	}
	for {
		var m pipeMsg
		err := a.Pipe.Recv(ctx, &m)
		if errors.Is(err, mp.ErrClosed) {
			if a.In != nil {
				_ = a.In.Close() // ends the queue's echo
			}
			return <-done
		}
		if err != nil {
			return err
		}
		err = a.Pipe.Send(ctx, m)
		if m.T != nil {
			_ = m.T.Release()
		}
		if m.Q != nil {
			_ = m.Q.Close()
		}
		if err != nil {
			return err
		}
	}
}

// startPipeEcho starts a pipe-echo worker on one end of a new pipe and
// returns the other.
func startPipeEcho(t testing.TB, in, out *mp.Queue) (*mp.Pipe, *mp.Group) {
	t.Helper()
	mine, theirs, err := mp.NewPipe()
	require.NoError(t, err)
	g, err := mp.Spawn(context.Background(), "pipe-echo", 1, mp.WithArgs(pipeEchoArgs{Pipe: theirs, In: in, Out: out, Ints: in != nil}))
	require.NoError(t, err)
	require.NoError(t, theirs.Close())
	return mine, g
}

// A pipe between two processes carries every kind of value there and
// back in order, whichever way each goes: small ones by the lane, tensors
// and queues (descriptors) and long strings by the socket. Once this end
// is closed, the worker's receive ends with ErrClosed and it exits; nothing
// is left behind.
func TestPipeAcrossProcesses(t *testing.T) {
	leakcheck.Check(t)
	p, g := startPipeEcho(t, nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	msg := func(i int) pipeMsg {
		switch i % 6 {
		case 1:
			x, err := tensor.On(device.CPU()).Shared().Full(tensor.Int64, float64(i), 512)
			require.NoError(t, err)
			return pipeMsg{T: x}
		case 2:
			return pipeMsg{S: strings.Repeat("x", i%1500)}
		case 3:
			return pipeMsg{Q: q}
		}
		return pipeMsg{N: i}
	}
	const n = 3000
	sent := make(chan error, 1)
	go func() {
		for i := range n {
			m := msg(i)
			err := p.Send(ctx, m)
			if m.T != nil {
				_ = m.T.Release()
			}
			if err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	for i := range n {
		var got pipeMsg
		require.NoError(t, p.Recv(ctx, &got), "message %d", i)
		switch i % 6 {
		case 1:
			require.NotNil(t, got.T, "message %d", i)
			v, err := tensor.Values[int64](got.T)
			require.NoError(t, err)
			assert.Equal(t, int64(i), v[0], "message %d", i)
			_ = got.T.Release()
		case 2:
			assert.Equal(t, strings.Repeat("x", i%1500), got.S, "message %d", i)
		case 3:
			require.NotNil(t, got.Q, "message %d", i)
			require.NoError(t, got.Q.Close())
		default:
			assert.Equal(t, i, got.N, "message %d", i)
		}
	}
	require.NoError(t, <-sent)
	require.NoError(t, p.Close())
	require.NoError(t, g.Join())
}

// A process that receives on an end and hands it on, keeping its own
// copy, leaves the lane to the process it gave it to: at once when it
// received before (sending the end lets go of the lane), and within a
// fraction of a second when it receives once more after (a reader that
// stops receiving lets go). That process receives what comes next, and
// the sender does not block on a full lane.
func TestPipeEndHandedOn(t *testing.T) {
	for _, after := range []bool{false, true} {
		t.Run(map[bool]string{false: "received before", true: "received after"}[after], func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			a, b, err := mp.NewPipe()
			require.NoError(t, err)
			defer a.Close()
			defer b.Close() // kept open while the worker uses its copy
			out, err := mp.NewQueue()
			require.NoError(t, err)
			defer out.Close()
			receive := func() {
				require.NoError(t, a.Send(ctx, -1))
				var first int
				require.NoError(t, b.Recv(ctx, &first)) // this process reads b's lane
				require.Equal(t, -1, first)
			}
			if !after {
				receive()
			}
			const n = 500
			g, err := mp.Spawn(ctx, "pipe-sum", 1, mp.WithArgs(pipeSumArgs{Pipe: b, Out: out, N: n}))
			require.NoError(t, err)
			if after {
				receive()
			}
			want := 0
			for i := range n {
				require.NoError(t, a.Send(ctx, i), "send %d", i)
				want += i
			}
			var sum int
			require.NoError(t, out.Get(ctx, &sum))
			assert.Equal(t, want, sum)
			require.NoError(t, g.Join())
		})
	}
}

// An end that closes with a value sent to it unread makes its peer's
// socket report the reset once: what it sent before closing still comes
// in order.
func TestPipePeerClosedWithUnread(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a, b, err := mp.NewPipe()
	require.NoError(t, err)
	defer a.Close()
	require.NoError(t, b.Send(ctx, 0))
	var n int
	require.NoError(t, a.Recv(ctx, &n))
	require.NoError(t, a.Send(ctx, strings.Repeat("x", 1000))) // b never reads it
	big := strings.Repeat("y", 1000)
	require.NoError(t, b.Send(ctx, big)) // by the socket
	require.NoError(t, b.Send(ctx, 2))   // by the lane
	require.NoError(t, b.Close())
	var s string
	require.NoError(t, a.Recv(ctx, &s))
	assert.Equal(t, big, s)
	require.NoError(t, a.Recv(ctx, &n))
	assert.Equal(t, 2, n)
	assert.ErrorIs(t, a.Recv(ctx, &n), mp.ErrClosed)
}

// BenchmarkRoundTrip is the round trip of an int between two processes:
// by a Pipe (its lane) and by a pair of Queues (sockets).
func BenchmarkRoundTrip(b *testing.B) {
	in, err := mp.NewQueue()
	require.NoError(b, err)
	out, err := mp.NewQueue()
	require.NoError(b, err)
	p, g := startPipeEcho(b, in, out)
	defer func() {
		_ = p.Close()
		_ = in.Close()
		_ = g.Join()
		_ = out.Close()
	}()
	ctx := context.Background()
	for _, c := range []struct {
		name string
		send func(int) error
		recv func(*int) error
	}{
		{"pipe", func(n int) error { return p.Send(ctx, n) }, func(n *int) error { return p.Recv(ctx, n) }},
		{"queues", func(n int) error { return in.Put(ctx, n) }, func(n *int) error { return out.Get(ctx, n) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				var n int
				if err := c.send(i); err != nil {
					b.Fatal(err)
				}
				if err := c.recv(&n); err != nil || n != i {
					b.Fatal(n, err)
				}
			}
		})
	}
}

// BenchmarkPipeTensorRoundTrip is the round trip of a shared 4 KiB tensor
// between two processes by a Pipe: by the lane once the worker pins its
// segment, and back by the lane, returned to the process that made it
// (returned/op reports the share of trips that were).
func BenchmarkPipeTensorRoundTrip(b *testing.B) {
	p, g := startPipeEcho(b, nil, nil)
	defer func() {
		_ = p.Close()
		_ = g.Join()
	}()
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
	require.NoError(b, err)
	defer x.Release()
	ctx := context.Background()
	b.ReportAllocs()
	back := sock.ReturnsTaken()
	for b.Loop() {
		if err := p.Send(ctx, pipeMsg{T: x}); err != nil {
			b.Fatal(err)
		}
		var m pipeMsg
		if err := p.Recv(ctx, &m); err != nil || m.T == nil || m.T.Storage() != x.Storage() {
			b.Fatal("the tensor did not come back on its storage: ", err)
		}
	}
	b.ReportMetric(float64(sock.ReturnsTaken()-back)/float64(b.N), "returned/op")
}

func init() { mp.Register("pipe-first", workerPipeFirst) }

// workerPipeFirst answers each tensor it receives on its pipe with the
// tensor's first value, until the other end is closed:
// TestPipeNewTensors and BenchmarkPipeNewTensor.
func workerPipeFirst(ctx context.Context, w *mp.Worker) error {
	return servePipe(ctx, w, func(x *tensor.Tensor) (any, error) {
		v, err := tensor.Values[int64](x)
		if err != nil {
			return nil, err
		}
		return v[0], nil
	})
}

// servePipe answers each tensor that comes on the worker's pipe (its
// argument) with what answer makes of it, releasing the tensor first,
// until the other end is closed.
func servePipe(ctx context.Context, w *mp.Worker, answer func(x *tensor.Tensor) (any, error)) error {
	var p *mp.Pipe
	if err := w.Args(&p); err != nil {
		return err
	}
	defer p.Close()
	for {
		var x *tensor.Tensor
		err := p.Recv(ctx, &x)
		if errors.Is(err, mp.ErrClosed) {
			return nil
		}
		if err != nil {
			return err
		}
		v, err := answer(x)
		_ = x.Release()
		if err != nil {
			return err
		}
		if err := p.Send(ctx, v); err != nil {
			return err
		}
	}
}

// startPipeWorker starts a worker of the registered name with the other
// end of a new pipe, and returns this process's end and the worker.
func startPipeWorker(t testing.TB, name string) (*mp.Pipe, *mp.Group) {
	t.Helper()
	mine, theirs, err := mp.NewPipe()
	require.NoError(t, err)
	g, err := mp.Spawn(context.Background(), name, 1, mp.WithArgs(theirs))
	require.NoError(t, err)
	require.NoError(t, theirs.Close())
	return mine, g
}

// BenchmarkPipeNewTensor is the round trip of a new shared 4 KiB tensor,
// released once sent, to a worker that answers with its first value.
func BenchmarkPipeNewTensor(b *testing.B) {
	p, g := startPipeWorker(b, "pipe-first")
	defer func() {
		_ = p.Close()
		_ = g.Join()
	}()
	ctx := context.Background()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		x, err := tensor.On(device.CPU()).Shared().Full(tensor.Int64, float64(i), 512)
		if err != nil {
			b.Fatal(err)
		}
		err = p.Send(ctx, x)
		_ = x.Release()
		if err != nil {
			b.Fatal(err)
		}
		var n int64
		if err := p.Recv(ctx, &n); err != nil || n != int64(i) {
			b.Fatal(n, err)
		}
	}
}

func init() { mp.Register("pipe-trip", workerPipeTrip) }

// workerPipeTrip answers each tensor it receives on its pipe, which it
// releases, with a shared 4 KiB tensor of its own whose first byte is one
// more than the received one's, until the other end is closed:
// TestPipeTensorTrip and BenchmarkPipeTensorTrip.
func workerPipeTrip(ctx context.Context, w *mp.Worker) error {
	y, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
	if err != nil {
		return err
	}
	defer y.Release()
	return servePipe(ctx, w, func(x *tensor.Tensor) (any, error) {
		y.Storage().Bytes()[0] = x.Storage().Bytes()[0] + 1
		return y, nil
	})
}

// startPipeTrip starts a pipe-trip worker and returns this process's end
// of its pipe, closed, and the worker joined, at the test's end.
func startPipeTrip(t testing.TB) *mp.Pipe {
	t.Helper()
	mine, g := startPipeWorker(t, "pipe-trip")
	t.Cleanup(func() {
		_ = mine.Close()
		assert.NoError(t, g.Join())
	})
	return mine
}

// A tensor of each side's, there and back through a pipe, each released
// by its receiver, is the sender's memory each time: the receiver sees
// what the sender wrote last. Once the worker maps this process's
// segment, this process's tensor goes by the lane.
func TestPipeTensorTrip(t *testing.T) {
	leakcheck.Check(t)
	p := startPipeTrip(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
	require.NoError(t, err)
	defer x.Release()
	before := sock.LentSent()
	const n = 200
	for i := range n {
		x.Storage().Bytes()[0] = byte(i)
		require.NoError(t, p.Send(ctx, x))
		var y *tensor.Tensor
		require.NoError(t, p.Recv(ctx, &y))
		require.Equal(t, byte(i+1), y.Storage().Bytes()[0], "trip %d", i)
		require.NoError(t, y.Release())
	}
	assert.Equal(t, uint64(n-1), sock.LentSent()-before, "every tensor after the first went by the lane")
}

// BenchmarkPipeTensorTrip is spawn bench's pipe_tensor_roundtrip: a
// shared 4 KiB tensor to a worker, which releases it and answers with one
// of its own, which this process releases. Once each side maps the
// other's segment, both go by the lanes.
func BenchmarkPipeTensorTrip(b *testing.B) {
	mine := startPipeTrip(b)
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
	require.NoError(b, err)
	defer x.Release()
	ctx := context.Background()
	before := sock.LentSent()
	b.ReportAllocs()
	for b.Loop() {
		if err := mine.Send(ctx, x); err != nil {
			b.Fatal(err)
		}
		var y *tensor.Tensor
		if err := mine.Recv(ctx, &y); err != nil {
			b.Fatal(err)
		}
		if err := y.Release(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(sock.LentSent()-before)/float64(b.N), "lent/op")
}

package dist

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// pair forms a group of two in this process, each rank with the extra
// options: what is tested is the protocol between them.
func pair(t *testing.T, ctx context.Context, extra ...Option) (g0, g1 *Group) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	store := l.Addr().String()
	require.NoError(t, l.Close())
	opts := func(r int) []Option {
		return []Option{WithRank(r, 2), WithStore(store), WithHeartbeat(200 * time.Millisecond), WithTimeout(10 * time.Second),
			WithSameHostShortcut(false)}
	}
	done := make(chan error, 1)
	go func() {
		var err error
		g1, err = Init(ctx, append(opts(1), extra...)...)
		done <- err
	}()
	g0, err = Init(ctx, append(opts(0), extra...)...)
	require.NoError(t, err)
	require.NoError(t, <-done)
	t.Cleanup(func() {
		_ = g1.Close()
		_ = g0.Close()
	})
	return g0, g1
}

// A value that does not decode is dropped at the getter's word, not put
// back at the head of the queue where it would fail every Get after:
// through Flight, and through the same-host shortcut (this process's two
// ranks are on one host).
func TestMalformedValueIsDropped(t *testing.T) {
	leakcheck.Check(t)
	// A tensor extension with garbage for metadata.
	bad := []byte{0xc7, 0x03, 0x54, 0x01, 0x02, 0x03}
	for _, tc := range []struct {
		name    string
		shared  bool
		putJunk func(t *testing.T, ctx context.Context, q *Queue)
	}{
		{"flight", false, func(t *testing.T, ctx context.Context, q *Queue) {
			s, err := q.open(ctx, "put")
			require.NoError(t, err)
			empty, err := emptyBatch()
			require.NoError(t, err)
			require.NoError(t, s.SendMsg(&outData{header: mustSchema()}))
			require.NoError(t, s.SendMsg(&outData{header: empty, meta: (&frame{Kind: kindValue, Data: bad}).marshal()}))
			f, err := newReader(s, 0).next()
			require.NoError(t, err)
			require.Equal(t, kindAck, f.Kind, "the owner queues what it cannot judge")
		}},
		{"same host", true, func(t *testing.T, ctx context.Context, q *Queue) {
			p, err := q.dialQueue(ctx, "put")
			require.NoError(t, err, "the ranks share a host")
			defer p.Close()
			require.NoError(t, p.Send(ctx, sharedValue{Data: bad}))
			var a sharedAnswer
			require.NoError(t, p.Recv(ctx, &a))
			require.Empty(t, a.Err, "the owner queues what it cannot judge")
			require.NoError(t, p.Send(ctx, sharedValue{}), "the putter still waits: the owner takes the value")
			require.NoError(t, p.Recv(ctx, &a), "the owner says the value is in")
			require.Empty(t, a.Err)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			g0, _ := pair(t, ctx, WithSameHostShortcut(tc.shared))
			q, err := g0.Queue(ctx, "q", WithOwner(1))
			require.NoError(t, err)
			tc.putJunk(t, ctx, q)

			x, err := tensor.Arange(tensor.Int64, 10)
			require.NoError(t, err)
			require.NoError(t, q.Put(ctx, x))

			var got *tensor.Tensor
			err = q.Get(ctx, &got)
			require.Error(t, err)
			assert.Contains(t, err.Error(), "dropped a malformed value")
			require.NoError(t, q.Get(ctx, &got), "the next Get gets the next value")
			assert.True(t, tensor.Equal(x, got))
			_ = got.Release()
			_ = x.Release()
			assert.NoError(t, g0.Err(), "a malformed value fails a Get, not the group")
		})
	}
}

// A value announcing more than WithMaxValue allows is refused before any
// memory is taken for it.
func TestMaxValue(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	g0, g1 := pair(t, ctx, WithMaxValue(1024))
	errs := make(chan error, 1)
	go func() {
		p, err := g1.Pipe(ctx, 0)
		if err == nil {
			x, _ := tensor.Zeros(tensor.Float32, 1024) // 4 KiB
			err = p.Send(ctx, x)
		}
		errs <- err
	}()
	p, err := g0.Pipe(ctx, 1)
	require.NoError(t, err)
	var got *tensor.Tensor
	err = p.Recv(ctx, &got)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "4096 bytes announced, more than the 1024 allowed")
	require.NoError(t, <-errs)
	require.NoError(t, p.Close())
}

// A value announced over the bound is refused before any memory is taken
// for it: a reader that took it first would have made a segment of its
// own for a body over 16 MiB, which the pool would keep for reuse.
func TestMaxValueTakesNoMemory(t *testing.T) {
	leakcheck.Check(t)
	const max = 16 << 20
	pool := shm.DefaultPool()
	segments, bytes, _ := pool.Stats()
	r := newReader(nil, max)
	_, err := r.alloc(frame{Kind: kindValue, Sizes: []int64{max + 1}})
	require.ErrorContains(t, err, fmt.Sprintf("%d bytes announced, more than the %d allowed", max+1, max))
	nowSegments, nowBytes, _ := pool.Stats()
	assert.Equal(t, segments, nowSegments, "segments")
	assert.Equal(t, bytes, nowBytes, "bytes of shared memory")

	// Within the bound, the same reader takes it.
	bodies, err := r.alloc(frame{Kind: kindValue, Sizes: []int64{max}})
	require.NoError(t, err)
	nowSegments, nowBytes, _ = pool.Stats()
	assert.Greater(t, nowBytes, bytes, "a body of 16 MiB takes memory the count sees")
	assert.GreaterOrEqual(t, nowSegments, segments)
	release(bodies)
}

// An offer nobody renews is released when its lease ends, and a pull
// that comes later is told so.
func TestOfferExpires(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const lease = 300 * time.Millisecond
	g0, g1 := pair(t, ctx, WithLease(lease))
	x, err := tensor.AllocSharedStorage(4096)
	require.NoError(t, err)
	ticket, err := g1.node.offers.add([]*tensor.Storage{x})
	require.NoError(t, err)

	bodies, err := g0.pull(ctx, 1, ticket)
	require.NoError(t, err, "within the lease")
	assert.Equal(t, int64(4096), bodies[0].Size())
	release(bodies)
	start := time.Now()
	assert.Eventually(t, x.Released, 5*lease, 10*time.Millisecond, "released when the lease ends")
	assert.GreaterOrEqual(t, time.Since(start), lease/2, "not before: the pull renewed it")
	_, err = g0.pull(ctx, 1, ticket)
	assert.ErrorIs(t, err, ErrLeaseExpired)
	assert.NoError(t, g0.Err(), "an expired lease fails a pull, not the group")
}

// The owner of a queue renews the leases of the values it holds, so a
// value by reference outlives many leases while it waits.
func TestOwnerRenewsLeases(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const lease = 300 * time.Millisecond
	g0, g1 := pair(t, ctx, WithLease(lease), WithReferenceAbove(1))
	q0, err := g0.Queue(ctx, "q", WithOwner(1))
	require.NoError(t, err)
	q1, err := g1.Queue(ctx, "q", WithOwner(1))
	require.NoError(t, err)
	x, err := tensor.Arange(tensor.Float32, 1000)
	require.NoError(t, err)
	require.NoError(t, q0.Put(ctx, x))
	assert.Equal(t, 1, offerCount(g0), "the putter keeps the value")
	assert.Len(t, g1.node.heldRefs(), 1, "the owner holds a ticket")

	time.Sleep(4 * lease)
	var got *tensor.Tensor
	require.NoError(t, q1.Get(ctx, &got))
	assert.True(t, tensor.Equal(x, got))
	_ = got.Release()
	assert.Eventually(t, func() bool { return offerCount(g0) == 0 }, time.Second, 10*time.Millisecond, "the getter let the putter's copy go")
}

// A value whose putter no longer has it fails one Get with
// ErrLeaseExpired and is dropped; the owner's renewals drop such values
// too.
func TestExpiredValueIsDropped(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	g0, g1 := pair(t, ctx, WithLease(time.Minute), WithReferenceAbove(1))
	q, err := g0.Queue(ctx, "q", WithOwner(1))
	require.NoError(t, err)
	a, err := tensor.Full(tensor.Int32, 1, 10)
	require.NoError(t, err)
	b, err := tensor.Full(tensor.Int32, 2, 10)
	require.NoError(t, err)
	require.NoError(t, q.Put(ctx, a))
	require.NoError(t, q.Put(ctx, b))
	held := g1.node.heldRefs()
	require.Len(t, held, 2)
	g0.node.offers.release(held[0].ticket) // a's lease ends

	var got *tensor.Tensor
	assert.ErrorIs(t, q.Get(ctx, &got), ErrLeaseExpired)
	require.NoError(t, q.Get(ctx, &got), "the next Get gets the next value")
	assert.True(t, tensor.Equal(b, got))
	_ = got.Release()

	// The owner's renewal finds the putter without the value and drops it.
	require.NoError(t, q.Put(ctx, a))
	held = g1.node.heldRefs()
	require.Len(t, held, 1)
	g0.node.offers.release(held[0].ticket)
	assert.False(t, g1.renew(held[0]))
	g1.node.dropRef(held[0])
	assert.Empty(t, g1.node.heldRefs())
	assert.NoError(t, g0.Err())
}

func offerCount(g *Group) int {
	g.node.offers.mu.Lock()
	defer g.node.offers.mu.Unlock()
	return len(g.node.offers.m)
}

// Through the same-host shortcut, a Put that waits for room and gives up
// leaves nothing behind on the owner, and a Get that gives up takes
// nothing.
func TestSameHostPutAndGetGiveUp(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	g0, _ := pair(t, ctx, WithSameHostShortcut(true))
	q, err := g0.Queue(ctx, "q", WithOwner(1), WithCapacity(1))
	require.NoError(t, err)
	_, ok := g0.sameHost(1)
	require.True(t, ok, "the ranks share a host")

	x, err := tensor.Arange(tensor.Int64, 10)
	require.NoError(t, err)
	defer x.Release()
	require.NoError(t, q.Put(ctx, x))
	short, stop := context.WithTimeout(ctx, 200*time.Millisecond)
	assert.ErrorIs(t, q.Put(short, x), context.DeadlineExceeded, "no room")
	stop()

	var got *tensor.Tensor
	require.NoError(t, q.Get(ctx, &got))
	assert.True(t, tensor.Equal(x, got))
	short, stop = context.WithTimeout(ctx, 200*time.Millisecond)
	assert.ErrorIs(t, q.Get(short, &got), context.DeadlineExceeded, "the Put that gave up left no value")
	stop()

	// The owner still serves: a Get that gave up took nothing.
	require.NoError(t, q.Put(ctx, x))
	require.NoError(t, q.Get(ctx, &got))
	assert.True(t, tensor.Equal(x, got))
	assert.NoError(t, g0.Err())
}

// A loan's bodies stay its lender's: nothing but end withdraws it, and
// end waits for the pull streaming them.
func TestLentOfferStaysTheLenders(t *testing.T) {
	leakcheck.Check(t)
	s, err := tensor.AllocSharedStorage(1 << 10)
	require.NoError(t, err)
	defer func() { _ = s.Release() }()
	o := newOffers(time.Minute)
	ticket, end, err := o.lend([]*tensor.Storage{s})
	require.NoError(t, err)

	o.release(ticket) // a getter's letGo
	_, ok := o.take(ticket)
	assert.False(t, ok, "a loan is not taken")
	_, ok = o.renew(ticket)
	assert.True(t, ok, "a loan is renewed while its lender waits")
	bodies, done, ok := o.pull(ticket)
	require.True(t, ok, "a loan is there to pull after a release")
	assert.Same(t, s, bodies[0])

	ended := make(chan struct{})
	go func() { end(); close(ended) }()
	select {
	case <-ended:
		t.Fatal("end returned while a pull streams the bodies")
	case <-time.After(50 * time.Millisecond):
	}
	_, _, ok = o.pull(ticket)
	assert.False(t, ok, "an ended loan is not pulled again")
	done()
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("end did not return after the last pull")
	}
	assert.False(t, s.Released(), "the bodies are the lender's")

	o.close()
	_, end2, err := o.lend([]*tensor.Storage{s})
	assert.ErrorIs(t, err, ErrClosed)
	assert.Nil(t, end2)
	assert.False(t, s.Released())
}

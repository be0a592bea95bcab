package dist

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/tensor"
)

// pair forms a group of two in this process: what is tested is the
// protocol between them.
func pair(t *testing.T, ctx context.Context, extra0 ...Option) (g0, g1 *Group) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	store := l.Addr().String()
	require.NoError(t, l.Close())
	opts := func(r int) []Option {
		return []Option{WithRank(r, 2), WithStore(store), WithHeartbeat(200 * time.Millisecond), WithTimeout(10 * time.Second)}
	}
	done := make(chan error, 1)
	go func() {
		var err error
		g1, err = Init(ctx, opts(1)...)
		done <- err
	}()
	g0, err = Init(ctx, append(opts(0), extra0...)...)
	require.NoError(t, err)
	require.NoError(t, <-done)
	t.Cleanup(func() {
		_ = g1.Close()
		_ = g0.Close()
	})
	return g0, g1
}

// A value that does not decode is dropped at the getter's word, not put
// back at the head of the queue where it would fail every Get after.
func TestMalformedValueIsDropped(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	g0, _ := pair(t, ctx)
	q, err := g0.Queue(ctx, "q", WithOwner(1))
	require.NoError(t, err)

	// A putter that sends a tensor extension with garbage for metadata.
	s, err := q.open(ctx, "put")
	require.NoError(t, err)
	bad := frame{Kind: kindValue, Data: []byte{0xc7, 0x03, 0x54, 0x01, 0x02, 0x03}}
	empty, err := emptyBatch()
	require.NoError(t, err)
	require.NoError(t, s.SendMsg(&outData{header: mustSchema()}))
	require.NoError(t, s.SendMsg(&outData{header: empty, meta: bad.marshal()}))
	f, err := newReader(s, 0).next()
	require.NoError(t, err)
	require.Equal(t, kindAck, f.Kind, "the owner queues what it cannot judge")

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
	assert.NoError(t, g0.Err(), "a malformed value fails a Get, not the group")
}

// A value announcing more than WithMaxValue allows is refused before any
// memory is taken for it.
func TestMaxValue(t *testing.T) {
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

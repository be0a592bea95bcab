package dist

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

// wirePipe is a msgStream pair joined by the codec's bytes, as gRPC
// carries them.
type wirePipe struct{ ch chan []byte }

func (p wirePipe) SendMsg(m any) error {
	bs, err := newFlightCodec().Marshal(m)
	if err != nil {
		return err
	}
	p.ch <- bs.Materialize()
	bs.Free()
	return nil
}

func (p wirePipe) RecvMsg(m any) error {
	return newFlightCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(<-p.ch)}, m)
}

func roundTrip[T any](t *testing.T, v T, chunk int) T {
	t.Helper()
	p := wirePipe{make(chan []byte, 4096)}
	require.NoError(t, newWriter(p, chunk).send(v))
	r := newReader(p, 0)
	f, err := r.next()
	require.NoError(t, err)
	var out T
	require.NoError(t, r.value(f, &out))
	return out
}

func TestValueChunkBoundaries(t *testing.T) {
	for _, n := range []int{DefaultChunk - 1, DefaultChunk, DefaultChunk + 1, 3*DefaultChunk + 5} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			data := make([]uint8, n)
			for i := range data {
				data[i] = uint8(i * 7)
			}
			in, err := tensor.FromSlice(data, n)
			require.NoError(t, err)
			out := roundTrip(t, in, DefaultChunk)
			assert.True(t, tensor.Equal(in, out))
			assert.True(t, out.IsShared(), "received into shared memory")
			require.NoError(t, out.Release())
		})
	}
}

func TestValueNested(t *testing.T) {
	type batch struct {
		X     *tensor.Tensor
		XT    *tensor.Tensor
		Empty *tensor.Tensor
		Label []string
		More  map[string]any
	}
	x, err := tensor.Arange(tensor.Float64, 12)
	require.NoError(t, err)
	x, err = x.Reshape(3, 4)
	require.NoError(t, err)
	xt, err := x.Transpose(0, 1)
	require.NoError(t, err)
	empty, err := tensor.Zeros(tensor.Int8, 2, 0)
	require.NoError(t, err)
	in := batch{X: x, XT: xt, Empty: empty, Label: []string{"a", "b"}, More: map[string]any{"n": int64(3)}}
	out := roundTrip(t, in, 16) // tiny chunks: many record batches
	assert.True(t, tensor.Equal(x, out.X))
	assert.True(t, tensor.Equal(xt, out.XT))
	assert.Equal(t, xt.Strides(), out.XT.Strides())
	assert.Same(t, out.X.Storage(), out.XT.Storage())
	assert.Equal(t, []int{2, 0}, out.Empty.Shape())
	assert.Equal(t, in.Label, out.Label)
	assert.EqualValues(t, 3, out.More["n"])
	require.NoError(t, out.X.Release())
}

// FuzzReader feeds the value reader hostile streams: frames, sizes and
// chunks in any order and of any length. Each must be an error or a
// value, never a panic, and a failed value must release its bodies.
func FuzzReader(f *testing.F) {
	p := wirePipe{make(chan []byte, 64)}
	x, _ := tensor.Arange(tensor.Int32, 100)
	_ = newWriter(p, 128).send(map[string]any{"x": x})
	var seed [][]byte
	for len(p.ch) > 0 {
		seed = append(seed, <-p.ch)
	}
	f.Add(bytes.Join(seed, []byte("\x00SPLIT\x00")))
	f.Fuzz(func(t *testing.T, stream []byte) {
		msgs := bytes.Split(stream, []byte("\x00SPLIT\x00"))
		if len(msgs) > 64 {
			return
		}
		in := wirePipe{make(chan []byte, len(msgs))}
		for _, m := range msgs {
			in.ch <- m
		}
		r := newReader(closingPipe{in}, 1<<20)
		fr, err := r.next()
		if err != nil {
			checkStreamError(t, err)
			return
		}
		var v any
		if err := r.value(fr, &v); err == nil {
			releaseAny(v)
		} else {
			checkStreamError(t, err)
		}
	})
}

// checkStreamError fails t unless err, a reader's for a hostile stream,
// wraps reduction.ErrMalformed or says that the stream ended.
func checkStreamError(t *testing.T, err error) {
	if !errors.Is(err, reduction.ErrMalformed) && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("an error for a hostile stream that does not wrap ErrMalformed: %v", err)
	}
}

// closingPipe ends with io.EOF once its messages are read.
type closingPipe struct{ wirePipe }

func (p closingPipe) RecvMsg(m any) error {
	select {
	case b := <-p.ch:
		return newFlightCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, m)
	default:
		return io.EOF
	}
}

func releaseAny(v any) {
	switch x := v.(type) {
	case *tensor.Tensor:
		_ = x.Release()
	case map[string]any:
		for _, e := range x {
			releaseAny(e)
		}
	case []any:
		for _, e := range x {
			releaseAny(e)
		}
	}
}

// A frame that declares more elements than it has bytes is refused before
// msgpack's decoder sees it: that decoder allocates a declared slice
// length at once (found by FuzzReader: 20 s of memclr for a 90-byte
// message).
func TestFrameDeclaringHugeArrayIsRefused(t *testing.T) {
	b := []byte{0x99, byte(kindValue), 0xc0, 0xdd, 0x02, 0x00, 0x00, 0x00, 0x00} // Sizes: 32M int64s
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := parseFrame(b)
	runtime.ReadMemStats(&after)
	require.Error(t, err)
	assert.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20), "refused without allocating")
}

// striped sends bodies as parts stripes of chunk bytes, each on a pipe of
// its own, and receives them as a striped pull does.
func striped(t *testing.T, bodies []*tensor.Storage, parts, chunk int) ([]*tensor.Storage, error) {
	t.Helper()
	readers := make([]*reader, parts)
	for k := range readers {
		p := wirePipe{make(chan []byte, 4096)}
		w := newWriter(p, chunk)
		w.stripe = stripe{k, parts}
		require.NoError(t, w.sendRaw(nil, bodies))
		readers[k] = newReader(p, 0)
	}
	head, err := readers[0].next()
	require.NoError(t, err)
	out, err := readers[0].alloc(head)
	require.NoError(t, err)
	for k, rd := range readers {
		if err := receiveStripe(rd, head, out, stripe{k, parts}, chunk); err != nil {
			release(out)
			return nil, err
		}
	}
	return out, nil
}

func TestStripedBodies(t *testing.T) {
	const chunk = minStripeChunk
	for _, sizes := range [][]int{
		{chunk - 1}, {chunk}, {chunk + 1}, {5*chunk + 3},
		{chunk + 1, 1, 2 * chunk, 0, 3*chunk - 1}, // numbering runs on across bodies
	} {
		for _, parts := range []int{2, 3, 4} {
			t.Run(fmt.Sprint(sizes, parts), func(t *testing.T) {
				var in []*tensor.Storage
				for i, n := range sizes {
					s, err := tensor.AllocSharedStorage(int64(n))
					require.NoError(t, err)
					for j := range s.Bytes() {
						s.Bytes()[j] = byte(j*7 + i)
					}
					in = append(in, s)
				}
				defer release(in)
				out, err := striped(t, in, parts, chunk)
				require.NoError(t, err)
				defer release(out)
				require.Len(t, out, len(in))
				for i := range in {
					assert.Equal(t, in[i].Bytes(), out[i].Bytes(), "body %d", i)
				}
			})
		}
	}
}

// A stream that carries another stripe's chunks, or chunks of another
// size, is an error, not a body with holes.
func TestStripeMismatchIsAnError(t *testing.T) {
	const chunk = minStripeChunk
	s, err := tensor.AllocSharedStorage(4 * chunk)
	require.NoError(t, err)
	defer func() { _ = s.Release() }()
	body := []*tensor.Storage{s}

	send := func(st stripe, chunk int) *reader {
		p := wirePipe{make(chan []byte, 64)}
		w := newWriter(p, chunk)
		w.stripe = st
		require.NoError(t, w.sendRaw(nil, body))
		return newReader(p, 0)
	}
	value := frame{Kind: kindValue, Sizes: []int64{4 * chunk}}
	for name, tc := range map[string]struct {
		rd   *reader
		head frame // the first stream's frame
		want string
	}{
		"another stripe":        {send(stripe{0, 2}, chunk), value, "chunk"},
		"another chunk size":    {send(stripe{1, 2}, 2*chunk), value, "chunk"},
		"every chunk":           {send(stripe{}, chunk), value, "chunk"},
		"another value's frame": {send(stripe{1, 2}, chunk), frame{Kind: kindValue, Sizes: []int64{chunk}}, "not the value's"},
	} {
		t.Run(name, func(t *testing.T) {
			out, err := tc.rd.alloc(tc.head)
			require.NoError(t, err)
			defer release(out)
			err = receiveStripe(tc.rd, tc.head, out, stripe{1, 2}, chunk)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestStripeTickets(t *testing.T) {
	offer := bytes.Repeat([]byte{0xab}, ticketLen)
	key, st, chunk, err := parseTicket(stripeTicket(offer, stripe{2, 3}, DefaultChunk))
	require.NoError(t, err)
	assert.Equal(t, offer, key)
	assert.Equal(t, stripe{2, 3}, st)
	assert.Equal(t, DefaultChunk, chunk)

	key, st, chunk, err = parseTicket(offer)
	require.NoError(t, err)
	assert.Equal(t, offer, key)
	assert.Equal(t, stripe{}, st, "a plain ticket asks for everything")
	assert.Zero(t, chunk)

	for name, tk := range map[string][]byte{
		"short":            offer[:ticketLen-1],
		"long":             append(stripeTicket(offer, stripe{0, 2}, DefaultChunk), 0),
		"one part":         stripeTicket(offer, stripe{0, 1}, DefaultChunk),
		"part past parts":  stripeTicket(offer, stripe{2, 2}, DefaultChunk),
		"too many parts":   stripeTicket(offer, stripe{0, MaxPullConns + 1}, DefaultChunk),
		"tiny chunks":      stripeTicket(offer, stripe{0, 2}, minStripeChunk-1),
		"chunks too large": stripeTicket(offer, stripe{0, 2}, maxMessage),
	} {
		_, _, _, err := parseTicket(tk)
		assert.Equal(t, codes.InvalidArgument, status.Code(err), name)
	}
}

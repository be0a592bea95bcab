package dist

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

// A frame is the app_metadata of one FlightData message: what the
// message is to tensormp. A value travels as a kindValue frame (the
// value, encoded by reduction's BodyEncoder, and its bodies' sizes), then
// each body in order as record batches of at most chunk bytes, each with
// a kindChunk frame that says where its bytes go.
type frame struct {
	//lint:ignore U1000 the tag tells msgpack to use the array form
	_msgpack struct{} `msgpack:",as_array"`

	Kind  frameKind
	Data  []byte  // kindValue: the encoded value; kindRequest: the request
	Sizes []int64 // kindValue: the bodies' sizes
	Body  int     // kindChunk: which body
	Off   int64   // kindChunk: where in it
	Len   int64   // kindChunk: how many bytes
	Err   string  // kindError, kindFail: what went wrong
	Rank  int     // kindFail: the rank it concerns; kindValue with a Ticket: the putter
	// Ticket, on a kindValue frame of a value put by reference, names
	// the putter's offer; no bodies follow (see ref.go).
	Ticket []byte
}

type frameKind uint8

const (
	kindValue     frameKind = iota + 1 // a value follows
	kindChunk                          // a piece of a body
	kindAck                            // the value was taken
	kindError                          // the request failed
	kindRequest                        // a request: Data says which
	kindHeartbeat                      // the watch stream is alive
	kindFail                           // the group failed: Err, Rank
	kindLeave                          // the rank leaves the group cleanly
)

func (f *frame) marshal() []byte {
	b, err := msgpack.Marshal(f)
	if err != nil {
		panic(fmt.Sprintf("dist: encoding a frame: %v", err)) // a frame of plain fields always encodes
	}
	return b
}

func parseFrame(b []byte) (frame, error) {
	var f frame
	if len(b) == 0 {
		return f, malformedf("a message without a frame")
	}
	if err := unmarshal(b, &f); err != nil {
		return f, malformedf("a frame: %w", err)
	}
	return f, nil
}

// unmarshal decodes msgpack bytes from a peer into v once
// reduction.CheckWellFormed passed them: msgpack's decoder allocates a
// declared slice length before reading it, and a peer may declare
// billions.
func unmarshal(b []byte, v any) error {
	if err := reduction.CheckWellFormed(b); err != nil {
		return err
	}
	return msgpack.Unmarshal(b, v)
}

// msgStream is the part of a gRPC stream, client or server, that carries
// messages.
type msgStream interface {
	SendMsg(m any) error
	RecvMsg(m any) error
}

// DefaultChunk is the size of the record batches a body travels in.
const DefaultChunk = 1 << 20

// maxBodies bounds the bodies one received value may announce.
const maxBodies = 1 << 16

// pinWait bounds how long a sender waits for gRPC to let go of a failed
// stream's pieces before it gives up the storages anyway.
const pinWait = 30 * time.Second

// writer sends values on one stream. Its first message is the stream's
// Arrow schema, and every value's frame rides on an empty record batch,
// so that a stock Flight reader reads the stream as record batches with
// app_metadata.
type writer struct {
	s       msgStream
	enc     *reduction.BodyEncoder
	chunk   int
	stripe  stripe // the chunks this stream carries; the zero stripe is all
	started bool
}

// A stripe is the share of a value's chunks one of the streams of a
// striped pull carries (see Group.pull): the chunks are numbered across
// the value's bodies in order, and stripe part of parts carries those
// whose number is part modulo parts. A stripe of parts 0 or 1 is all.
type stripe struct{ part, parts int }

// carries reports whether the stripe carries chunk number c.
func (s stripe) carries(c int) bool { return s.parts <= 1 || c%s.parts == s.part }

func newWriter(s msgStream, chunk int) *writer {
	if chunk <= 0 {
		chunk = DefaultChunk
	}
	return &writer{s: s, enc: reduction.NewBodyEncoder(), chunk: chunk}
}

// send sends v: its frame, then its bodies' chunks. The storages'
// memory goes to gRPC without a copy; send returns once gRPC holds none
// of it, so the caller may release the tensors after.
func (w *writer) send(v any) error {
	data, bodies, err := w.enc.Encode(v)
	if err != nil {
		return err
	}
	return w.sendRaw(data, bodies)
}

// sendRaw sends an encoded value and its bodies.
func (w *writer) sendRaw(data []byte, bodies []*tensor.Storage) (err error) {
	sizes := make([]int64, len(bodies))
	for i, s := range bodies {
		sizes[i] = s.Size()
	}
	return w.sendValue(frame{Kind: kindValue, Data: data, Sizes: sizes}, bodies)
}

// sendValue sends a value's frame, then its bodies.
func (w *writer) sendValue(head frame, bodies []*tensor.Storage) (err error) {
	p := newPins()
	defer func() {
		select {
		case <-p.released():
		case <-time.After(pinWait):
			if err == nil {
				err = errors.New("dist: gRPC still holds a sent tensor's memory")
			}
		}
	}()
	if !w.started {
		if err := w.s.SendMsg(&outData{header: mustSchema()}); err != nil {
			return err
		}
		w.started = true
	}
	empty, err := emptyBatch()
	if err != nil {
		return err
	}
	if err := w.s.SendMsg(&outData{header: empty, meta: head.marshal()}); err != nil {
		return err
	}
	var chunks int // numbered across the bodies, for the stripe
	for i, s := range bodies {
		if err := w.sendBody(i, s, p, &chunks); err != nil {
			return err
		}
	}
	return nil
}

// sendBody sends the chunks of body i that the writer's stripe carries;
// chunks counts the value's chunks so far.
func (w *writer) sendBody(i int, s *tensor.Storage, p *pins, chunks *int) error {
	b := s.Bytes()
	if b == nil {
		return fmt.Errorf("dist: sending %v: %w", s, tensor.ErrReleased)
	}
	stage := !zeroCopySafe(s)
	for off := 0; off < len(b); off += w.chunk {
		c := *chunks
		*chunks++
		if !w.stripe.carries(c) {
			continue
		}
		piece := b[off:min(off+w.chunk, len(b))]
		if stage {
			// A copy of its own per chunk: gRPC may hold it after
			// SendMsg returns.
			staged := make([]byte, len(piece))
			if err := mmapalloc.Guard(func() { copy(staged, piece) }); err != nil {
				return fmt.Errorf("dist: reading %v: %w", s, err)
			}
			piece = staged
		}
		header, body, err := batch(piece)
		if err != nil {
			return err
		}
		f := frame{Kind: kindChunk, Body: i, Off: int64(off), Len: int64(len(piece))}
		if err := w.s.SendMsg(&outData{header: header, meta: f.marshal(), body: body, pins: p}); err != nil {
			return err
		}
	}
	return nil
}

// emptyBatch is the Arrow IPC header of a record batch with no bytes.
var emptyBatch = sync.OnceValues(func() ([]byte, error) {
	h, _, err := batch([]byte{})
	return h, err
})

// zeroCopySafe reports whether gRPC may read s's memory outside a Guard:
// heap memory, and sealed memfds, which no peer can cut short. A named
// segment could be truncated by a peer, so its bytes are staged.
func zeroCopySafe(s *tensor.Storage) bool {
	if !s.IsShared() {
		return true
	}
	m, ok := s.Backing().(interface{ Sealed() bool })
	return ok && m.Sealed()
}

// exchange opens a DoExchange stream on c and commits it at once. Until
// a gRPC client stream commits (at its first answer, or once 256 KiB were
// sent on it) gRPC keeps every message sent on it for a transparent
// retry, even with retries off: it would hold the memory a writer lends
// it until the peer answers, while the writer waits for that memory
// before it reads the answer. A stream whose first attempt fails is then
// an error, not retried: dist reports it as such anyway.
func exchange(ctx context.Context, c flight.FlightServiceClient) (flight.FlightService_DoExchangeClient, error) {
	s, err := c.DoExchange(ctx)
	if err != nil {
		return nil, err
	}
	_ = s.Context() // commits: see grpc's clientStream.Context
	return s, nil
}

// reader receives values from one stream.
type reader struct {
	s   msgStream
	dec *reduction.BodyDecoder
	in  inData
	max int64 // bytes of bodies one value may announce; 0: the shm directory's free space
}

func newReader(s msgStream, max int64) *reader {
	return &reader{s: s, dec: reduction.NewBodyDecoder(), max: max}
}

// next returns the next frame on the stream, skipping schema messages.
func (r *reader) next() (frame, error) {
	for {
		r.in.dest = nil
		if err := r.s.RecvMsg(&r.in); err != nil {
			return frame{}, err
		}
		if len(r.in.meta) == 0 && len(r.in.body) == 0 {
			continue // a schema, for stock Flight readers
		}
		return parseFrame(r.in.meta)
	}
}

// value receives the bodies a kindValue frame announced, each copied
// once from gRPC's buffers into a fresh shared-memory storage, and
// decodes the value into v.
func (r *reader) value(f frame, v any) error {
	bodies, err := r.raw(f)
	if err != nil {
		return err
	}
	return r.dec.Decode(f.Data, bodies, v)
}

// raw receives the bodies a kindValue frame announced, without decoding
// the value. The caller owns them.
func (r *reader) raw(f frame) ([]*tensor.Storage, error) {
	bodies, err := r.alloc(f)
	if err != nil {
		return nil, err
	}
	if err := r.receive(bodies, stripe{}, 0); err != nil {
		release(bodies)
		return nil, err
	}
	return bodies, nil
}

// alloc checks the sizes a kindValue frame announced and returns fresh
// shared-memory storages of those sizes, which the caller owns.
func (r *reader) alloc(f frame) ([]*tensor.Storage, error) {
	if f.Kind != kindValue {
		return nil, malformedf("a frame of kind %d where a value was due", f.Kind)
	}
	if len(f.Sizes) > maxBodies {
		return nil, malformedf("a value with %d bodies", len(f.Sizes))
	}
	var total int64
	for i, n := range f.Sizes {
		if n < 0 || n > math.MaxInt64-total {
			return nil, malformedf("a value whose body %d has %d bytes", i, n)
		}
		total += n
	}
	// Memory is taken before the bytes arrive: a peer may not make this
	// host allocate more than it allows, or than it has, by announcing it.
	if r.max > 0 && total > r.max {
		return nil, malformedf("a value of %d bytes announced, more than the %d allowed", total, r.max)
	}
	if free, err := shmFree(); err == nil && uint64(total) > free {
		return nil, fmt.Errorf("dist: a value of %d bytes announced, and %s has %d bytes free", total, mmapalloc.Dir(), free)
	}
	bodies := make([]*tensor.Storage, 0, len(f.Sizes))
	ok := false
	defer func() {
		if !ok {
			for _, s := range bodies {
				_ = s.Release()
			}
		}
	}()
	for i, n := range f.Sizes {
		s, err := tensor.AllocSharedStorage(n)
		if err != nil {
			return nil, fmt.Errorf("dist: receiving body %d of %d bytes: %w", i, n, err)
		}
		bodies = append(bodies, s)
	}
	ok = true
	return bodies, nil
}

// receive receives into bodies the chunks that st carries, in order. A
// striped stream's chunks are chunk bytes each, but for a body's last;
// without a stripe any sizes are taken, each chunk where the last ended.
func (r *reader) receive(bodies []*tensor.Storage, st stripe, chunk int) error {
	var chunks int
	for i, s := range bodies {
		if err := r.body(i, s, st, chunk, &chunks); err != nil {
			return err
		}
	}
	return nil
}

// body receives the chunks of body i into s that st carries; chunks
// counts the value's chunks so far.
func (r *reader) body(i int, s *tensor.Storage, st stripe, chunk int, chunks *int) error {
	b := s.Bytes()
	var off int64
	for off < int64(len(b)) {
		want := int64(len(b)) - off // any length, unstriped
		if st.parts > 1 {
			want = min(want, int64(chunk))
			c := *chunks
			*chunks++
			if !st.carries(c) {
				off += want
				continue
			}
		}
		r.in.dest = func(meta []byte, n int) ([]byte, error) {
			f, err := parseFrame(meta)
			if err != nil {
				return nil, err
			}
			if f.Kind != kindChunk || f.Body != i || f.Off != off {
				return nil, malformedf("chunk (kind %d, body %d, offset %d) where body %d at offset %d was due", f.Kind, f.Body, f.Off, i, off)
			}
			if f.Len <= 0 || f.Len > want || st.parts > 1 && f.Len != want || int64(n) < f.Len || int64(n)-f.Len >= 64 {
				return nil, malformedf("chunk of %d bytes (%d with padding) at offset %d of body %d of %d bytes", f.Len, n, off, i, len(b))
			}
			return b[off : off+f.Len], nil
		}
		if err := r.s.RecvMsg(&r.in); err != nil {
			if errors.Is(err, io.EOF) {
				return fmt.Errorf("dist: the stream ended inside body %d: %w", i, io.ErrUnexpectedEOF)
			}
			return err
		}
		if r.in.body == nil {
			return malformedf("a message without a chunk inside body %d", i)
		}
		off += int64(len(r.in.body))
	}
	r.in.dest = nil
	return nil
}

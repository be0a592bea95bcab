package mp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/reduction"
)

// Extension types for queues and pipes inside values.
const (
	queueExt int8 = 0x51 // 'Q'
	pipeExt  int8 = 0x50 // 'P'
)

func init() {
	carry.Register(queueExt, (*Queue).encode, decodeQueue)
	carry.Register(pipeExt, (*Pipe).encode, decodePipe)
}

var (
	encoders = sync.Pool{New: func() any { return reduction.NewEncoder() }}
	decoders = sync.Pool{New: func() any { return reduction.NewDecoder() }}
)

// put encodes v and sends it on c, waiting for room unless not block.
func put(ctx context.Context, c *conn, v any, block bool) error {
	enc := encoders.Get().(*reduction.Encoder)
	defer encoders.Put(enc)
	data, fds, err := enc.Encode(v)
	if err != nil {
		return fmt.Errorf("mp: encoding %T: %w", v, err)
	}
	if err := c.send(ctx, data, fds, block); err != nil {
		enc.Discard() // no receiver will take what Encode held for it
		return err
	}
	enc.Done()
	return nil
}

// get receives a message on c and decodes it into v, waiting for one
// unless not block.
func get(ctx context.Context, c *conn, v any, block bool) error {
	data, fds, done, err := c.recv(ctx, block)
	if err != nil {
		return err
	}
	defer done()
	return decode(data, fds, v)
}

// decode decodes a received message into v. It owns fds.
func decode(data []byte, fds []int, v any) error {
	dec := decoders.Get().(*reduction.Decoder)
	defer decoders.Put(dec)
	if err := dec.Decode(data, fds, v); err != nil {
		return fmt.Errorf("mp: decoding into %T: %w", v, err)
	}
	return nil
}

// Queue is a many-producer, many-consumer queue between any processes
// that hold it: pass it to workers in Spawn's arguments, or inside any
// value sent through another Queue or a Pipe. Each message is delivered
// whole to exactly one Get. Tensors in a value travel as shared memory,
// their descriptors in the same sendmsg as the bytes, so a sender may exit
// as soon as Put returns.
//
// A Queue owns two descriptors (the two ends of a SOCK_SEQPACKET socket
// pair) in each process that holds it, four with a capacity; Close
// releases this process's.
type Queue struct {
	in  *conn // Put writes here
	out *conn // Get reads here

	// With a capacity, the free places: a pipe holding a byte for each.
	// Put takes one before it sends, Get gives one back as soon as it has
	// taken a message. Both nil without a capacity.
	free, freed *conn // the pipe's reading and writing ends
	capacity    int
}

// ErrFull is returned by TryPut when the queue has no room, and ErrEmpty
// by TryGet when it holds no message (torch's queue.Full and queue.Empty).
var (
	ErrFull  = errors.New("mp: queue full")
	ErrEmpty = errors.New("mp: queue empty")
)

// MaxCapacity is the largest capacity a Queue may have.
const MaxCapacity = 1 << 20

// QueueOption configures NewQueue.
type QueueOption func(*queueOptions)

type queueOptions struct{ capacity int }

// WithCapacity bounds the queue to n messages (torch's Queue(maxsize)),
// across every process that holds it: Put waits while n messages are in
// the queue. Without it, Put waits only while the socket's buffer is full.
//
// A place is taken by Put before it sends and given back by Get as soon as
// it has received: a process killed between the two (inside Put, or
// inside Get) leaves the queue one place smaller.
func WithCapacity(n int) QueueOption { return func(o *queueOptions) { o.capacity = n } }

// NewQueue returns a new, empty Queue.
func NewQueue(opts ...QueueOption) (*Queue, error) {
	checkInit("mp.NewQueue")
	var o queueOptions
	for _, opt := range opts {
		opt(&o)
	}
	if o.capacity < 0 || o.capacity > MaxCapacity {
		return nil, fmt.Errorf("mp: queue capacity %d is outside 1 to %d", o.capacity, MaxCapacity)
	}
	pair, err := socketPair()
	if err != nil {
		return nil, err
	}
	q, err := queueFrom(pair[0], pair[1])
	if err != nil || o.capacity == 0 {
		return q, err
	}
	if err := q.makePlaces(o.capacity); err != nil {
		_ = q.Close()
		return nil, err
	}
	return q, nil
}

func queueFrom(in, out *fd.FD) (*Queue, error) {
	ci, err := newConn(in, "queue")
	if err != nil {
		_ = out.Close()
		return nil, err
	}
	co, err := newConn(out, "queue")
	if err != nil {
		_ = ci.close()
		return nil, err
	}
	return &Queue{in: ci, out: co}, nil
}

// makePlaces gives q a capacity of n: a pipe holding n bytes.
func (q *Queue) makePlaces(n int) error {
	p, err := placesPipe(n)
	if err != nil {
		return fmt.Errorf("mp: a queue capacity of %d: %w%s", n, err, fdHint(err))
	}
	if err := fillPlaces(p[1], n); err != nil {
		_, _ = unix.Close(p[0]), unix.Close(p[1])
		return err
	}
	return q.adoptPlaces(fd.New(p[0]), fd.New(p[1]), n)
}

// fillPlaces writes n bytes, one per free place, into a places pipe.
func fillPlaces(w, n int) error {
	ones := make([]byte, min(n, 64<<10))
	for i := range ones {
		ones[i] = 1
	}
	for left := n; left > 0; {
		k, err := unix.Write(w, ones[:min(left, len(ones))])
		if err != nil {
			return fmt.Errorf("mp: filling a queue's places: %w", err)
		}
		left -= k
	}
	return nil
}

// adoptPlaces makes r and w, the ends of a places pipe, q's.
func (q *Queue) adoptPlaces(r, w *fd.FD, n int) error {
	free, err := newConn(r, "queue places")
	if err != nil {
		_ = w.Close()
		return err
	}
	freed, err := newConn(w, "queue places")
	if err != nil {
		_ = free.close()
		return err
	}
	q.free, q.freed, q.capacity = free, freed, n
	return nil
}

// Cap returns the queue's capacity, or 0 if it has none.
func (q *Queue) Cap() int { return q.capacity }

// Put sends v, which may hold tensors, queues and pipes anywhere inside
// it. It waits while the queue is full (see WithCapacity), until ctx ends.
func (q *Queue) Put(ctx context.Context, v any) error { return q.put(ctx, v, true) }

// TryPut sends v if the queue has room now, and returns ErrFull if not
// (torch's put_nowait).
func (q *Queue) TryPut(ctx context.Context, v any) error { return q.put(ctx, v, false) }

func (q *Queue) put(ctx context.Context, v any, block bool) error {
	if q.free != nil {
		if err := q.takePlace(ctx, block); err != nil {
			return fullErr(err)
		}
	}
	err := put(ctx, q.in, v, block)
	if err != nil && q.free != nil {
		q.givePlace()
	}
	return fullErr(err)
}

// Get receives the next value into v, a pointer, waiting until one
// arrives, ctx ends or q is closed (ErrClosed).
func (q *Queue) Get(ctx context.Context, v any) error { return q.get(ctx, v, true) }

// TryGet receives the next value into v if there is one now, and returns
// ErrEmpty if not (torch's get_nowait).
func (q *Queue) TryGet(ctx context.Context, v any) error { return q.get(ctx, v, false) }

func (q *Queue) get(ctx context.Context, v any, block bool) error {
	data, fds, done, err := q.take(ctx, block)
	if err != nil {
		return err
	}
	defer done()
	return decode(data, fds, v)
}

// take receives the next message, giving its place back at once; the
// caller decodes it (which takes fds over), then calls done.
func (q *Queue) take(ctx context.Context, block bool) (data []byte, fds []int, done func(), err error) {
	data, fds, done, err = q.out.recv(ctx, block)
	if errors.Is(err, errWouldBlock) {
		return nil, nil, nil, ErrEmpty
	}
	if err != nil {
		return nil, nil, nil, err
	}
	if q.free != nil {
		q.givePlace() // the message is out of the queue
	}
	return data, fds, done, nil
}

func fullErr(err error) error {
	if errors.Is(err, errWouldBlock) {
		return ErrFull
	}
	return err
}

// takePlace takes a byte from the places pipe.
func (q *Queue) takePlace(ctx context.Context, block bool) error {
	if err := q.free.lock(ctx, q.free.rmu, block); err != nil {
		return err
	}
	defer func() { <-q.free.rmu }()
	return q.free.io(ctx, unix.POLLIN, "taking a place in a queue", block, func(s int) error {
		var b [1]byte
		n, err := unix.Read(s, b[:])
		if err == nil && n == 0 {
			return io.EOF // every writing end closed: not while q holds one
		}
		return err
	}, nil)
}

// givePlace puts a byte back into the places pipe. It never waits: the
// pipe has room for every place.
func (q *Queue) givePlace() {
	_ = q.freed.io(context.Background(), unix.POLLOUT, "giving a place back to a queue", false, func(s int) error {
		_, err := unix.Write(s, []byte{1})
		return err
	}, nil)
}

// Close releases this process's hold on the queue and wakes its blocked
// Put and Get calls with ErrClosed. Other processes keep theirs.
func (q *Queue) Close() error {
	err := errors.Join(q.in.close(), q.out.close())
	if q.free != nil {
		err = errors.Join(err, q.free.close(), q.freed.close())
	}
	return err
}

// A queue travels as the indexes of its descriptors (in, out, and with a
// capacity the places pipe's ends) and, with a capacity, the capacity.
func (q *Queue) encode(enc *msgpack.Encoder) ([]byte, error) {
	if q.free == nil {
		return encodeConns(enc, q.in, q.out)
	}
	payload, err := encodeConns(enc, q.in, q.out, q.free, q.freed)
	if err != nil {
		return nil, err
	}
	return binary.LittleEndian.AppendUint32(payload, uint32(q.capacity)), nil
}

func decodeQueue(dec *msgpack.Decoder, n int) (*Queue, error) {
	bounded := n == 4*4+4
	if n != 4*2 && !bounded {
		return nil, fmt.Errorf("mp: a queue of %d bytes", n)
	}
	payload, err := carry.ReadExt(dec, n)
	if err != nil {
		return nil, err
	}
	want, capacity := 2, 0
	if bounded {
		want, capacity = 4, int(binary.LittleEndian.Uint32(payload[16:]))
		if capacity < 1 || capacity > MaxCapacity {
			return nil, fmt.Errorf("mp: a queue of capacity %d", capacity)
		}
	}
	fds, err := takeFDs(dec, payload, want)
	if err != nil {
		return nil, err
	}
	err = errors.Join(checkSocket(fds[0]), checkSocket(fds[1]))
	if err == nil && bounded {
		err = checkPlaces(fds[2], fds[3])
	}
	if err != nil {
		fd.CloseEach(fds)
		return nil, err
	}
	q, err := queueFrom(fds[0], fds[1])
	if err != nil {
		fd.CloseEach(fds[2:])
		return nil, err
	}
	if bounded {
		if err := q.adoptPlaces(fds[2], fds[3], capacity); err != nil {
			_ = q.Close()
			return nil, err
		}
	}
	return q, nil
}

// Pipe is one end of a duplex connection between two processes: what one
// end sends, the other receives, in order. NewPipe returns both ends; give
// one to another process through Spawn's arguments or a Queue.
type Pipe struct {
	c *conn
	// unwatch ends the watch on the process at the other end of an
	// endpoint's connection (see watchPeer); nil for other pipes.
	unwatch func()
}

// NewPipe returns the two connected ends of a new Pipe.
func NewPipe() (*Pipe, *Pipe, error) {
	checkInit("mp.NewPipe")
	pair, err := socketPair()
	if err != nil {
		return nil, nil, err
	}
	a, err := newConn(pair[0], "pipe")
	if err != nil {
		_ = pair[1].Close()
		return nil, nil, err
	}
	b, err := newConn(pair[1], "pipe")
	if err != nil {
		_ = a.close()
		return nil, nil, err
	}
	return &Pipe{c: a}, &Pipe{c: b}, nil
}

// Send sends v to the other end.
func (p *Pipe) Send(ctx context.Context, v any) error { return put(ctx, p.c, v, true) }

// Recv receives the next value from the other end into v. When the other
// end is closed in every process that held it, Recv returns ErrClosed.
func (p *Pipe) Recv(ctx context.Context, v any) error { return get(ctx, p.c, v, true) }

// Close releases this process's end and wakes blocked calls on it.
func (p *Pipe) Close() error {
	if p.unwatch != nil {
		p.unwatch()
	}
	return p.c.close()
}

func (p *Pipe) encode(enc *msgpack.Encoder) ([]byte, error) {
	return encodeConns(enc, p.c)
}

func decodePipe(dec *msgpack.Decoder, n int) (*Pipe, error) {
	if n != 4 {
		return nil, fmt.Errorf("mp: a pipe of %d bytes", n)
	}
	payload, err := carry.ReadExt(dec, n)
	if err != nil {
		return nil, err
	}
	fds, err := takeFDs(dec, payload, 1)
	if err != nil {
		return nil, err
	}
	if err := checkSocket(fds[0]); err != nil {
		fd.CloseEach(fds)
		return nil, err
	}
	c, err := newConn(fds[0], "pipe")
	if err != nil {
		return nil, err
	}
	return &Pipe{c: c}, nil
}

// encodeConns adds duplicates of the connections' descriptors to the
// message, which owns them until it is sent, and returns their indexes as
// the extension's payload.
func encodeConns(enc *msgpack.Encoder, conns ...*conn) ([]byte, error) {
	payload := make([]byte, 0, 4*len(conns))
	for _, c := range conns {
		dup, err := c.dupSocket()
		if err != nil {
			return nil, fmt.Errorf("mp: sending a queue or pipe: %w", err)
		}
		i, err := carry.AddFD(enc, dup)
		if err != nil {
			return nil, err
		}
		payload = binary.LittleEndian.AppendUint32(payload, uint32(i))
	}
	return payload, nil
}

// takeFDs takes the want descriptors whose indexes begin payload, owned
// by the caller.
func takeFDs(dec *msgpack.Decoder, payload []byte, want int) ([]*fd.FD, error) {
	fds := make([]*fd.FD, 0, want)
	for i := range want {
		f, err := carry.TakeFD(dec, int(binary.LittleEndian.Uint32(payload[4*i:])))
		if err != nil {
			fd.CloseEach(fds)
			return nil, err
		}
		fds = append(fds, f)
	}
	return fds, nil
}

// checkSocket checks that f, received for a queue or a pipe, is what
// NewQueue and NewPipe make: an AF_UNIX SOCK_SEQPACKET socket. A peer can
// put any descriptor it has in a queue's place; taken for one, it would
// fail only at first use.
func checkSocket(f *fd.FD) error {
	raw, err := f.Lend()
	if err != nil {
		return err
	}
	defer f.Return()
	if domain, typ, err := socketKind(raw); err != nil || domain != unix.AF_UNIX || typ != unix.SOCK_SEQPACKET {
		return fmt.Errorf("mp: a received queue or pipe: %s is not a queue's or pipe's socket (AF_UNIX, SOCK_SEQPACKET)", describeFD(raw))
	}
	return nil
}

// checkPlaces checks that r and w, received for a bounded queue's places,
// are the reading and the writing end of one pipe.
func checkPlaces(r, w *fd.FD) error {
	rr, err := r.Lend()
	if err != nil {
		return err
	}
	defer r.Return()
	rw, err := w.Lend()
	if err != nil {
		return err
	}
	defer w.Return()
	var rs, ws unix.Stat_t
	if unix.Fstat(rr, &rs) != nil || unix.Fstat(rw, &ws) != nil ||
		rs.Mode&unix.S_IFMT != unix.S_IFIFO || rs.Dev != ws.Dev || rs.Ino != ws.Ino ||
		!accessMode(rr, unix.O_RDONLY) || !accessMode(rw, unix.O_WRONLY) {
		return fmt.Errorf("mp: a received bounded queue: %s and %s are not the two ends of its places pipe", describeFD(rr), describeFD(rw))
	}
	return nil
}

// accessMode reports whether fd is open with access mode mode.
func accessMode(fd, mode int) bool {
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	return err == nil && fl&unix.O_ACCMODE == mode
}

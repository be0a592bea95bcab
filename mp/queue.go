package mp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
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

var encoders = sync.Pool{New: func() any { return reduction.NewEncoder() }}

// ErrClosed is returned by operations on a closed Queue, Pipe or
// connection, and to callers blocked in one when it is closed.
var ErrClosed = sock.ErrClosed

// ErrMalformed is wrapped by the errors for a message that tensormp did
// not frame, or whose value cannot be decoded (reduction.ErrMalformed, the
// same error): whatever it brought is closed, and the queue goes on.
var ErrMalformed = reduction.ErrMalformed

// put encodes v and sends it on c, waiting for room unless not block.
func put(ctx context.Context, c *sock.Conn, v any, block bool) error {
	if block {
		return send(ctx, v, c.Send)
	}
	return send(ctx, v, c.TrySend)
}

// send encodes v and sends it with sendMsg.
func send(ctx context.Context, v any, sendMsg func(context.Context, []byte, []int) error) error {
	enc := encoders.Get().(*reduction.Encoder)
	defer encoders.Put(enc)
	data, fds, err := enc.Encode(v)
	if err != nil {
		return fmt.Errorf("mp: encoding %T: %w", v, err)
	}
	if err := sendMsg(ctx, data, fds); err != nil {
		enc.Discard() // no receiver will take what Encode held for it
		return err
	}
	enc.Done()
	return nil
}

// get receives a message on c and decodes it into v, waiting for one
// unless not block.
func get(ctx context.Context, c *sock.Conn, v any, block bool) error {
	m, err := recv(ctx, c, block)
	if err != nil {
		return err
	}
	defer m.Done()
	return decode(m.Data, m.FDs, v)
}

// sendLane encodes v and sends it on the Way w, naming by identity the
// blocks its lane's reader maps (see carry.EncodeLane), waiting for room
// unless not block.
func sendLane(ctx context.Context, w *sock.Way, v any, block bool) error {
	w.Warm()
	s := laneSenders.Get().(*laneSender)
	s.ctx, s.w, s.block, s.err = ctx, w, block, nil
	err := carry.EncodeLane(v, w, s.fn)
	sendErr := s.err
	s.ctx, s.w, s.err = nil, nil, nil
	laneSenders.Put(s)
	if err != nil && err != sendErr {
		return fmt.Errorf("mp: encoding %T: %w", v, err)
	}
	return err
}

// A laneSender is sendLane's carry.SendFunc (fn, its send), pooled: a
// closure per Put would be two heap objects per value.
type laneSender struct {
	ctx   context.Context
	w     *sock.Way
	block bool
	err   error // what the Way's send returned
	fn    carry.SendFunc
}

var laneSenders = sync.Pool{New: func() any {
	s := new(laneSender)
	s.fn = s.send
	return s
}}

func (s *laneSender) send(data []byte, fds []int, lent []*shm.Block) error {
	if s.block {
		s.err = s.w.SendLent(s.ctx, data, fds, lent)
	} else {
		s.err = s.w.TrySendLent(s.ctx, data, fds, lent)
	}
	return s.err
}

// decodeMsg decodes m, received on a Way, into v, taking from its
// descriptors those the value keeps; the Way pins the segments of blocks
// that came with descriptors, and rebuilds those its lane named.
func decodeMsg(m sock.Msg, v any) error {
	var lane carry.Lane
	if w := m.Way(); w != nil {
		lane = w
	}
	if err := carry.DecodeFrom(m.Data, m.FDs, v, lane, m.ByLane()); err != nil {
		return fmt.Errorf("mp: decoding into %T: %w", v, err)
	}
	return nil
}

// recv receives a message on c, waiting for one unless not block.
func recv(ctx context.Context, c *sock.Conn, block bool) (sock.Msg, error) {
	if block {
		return c.Recv(ctx)
	}
	return c.TryRecv(ctx)
}

// decode decodes a received message into v, taking from fds the
// descriptors the value keeps (see carry.Decode).
func decode(data []byte, fds *fd.Set, v any) error {
	if err := carry.Decode(data, fds, v); err != nil {
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
// Beside its socket, a queue made by NewQueue has a lane in shared memory
// (see sock.NewFairWay) that hands a value from a putting process to a
// getting one through memory, with no system call while both are awake,
// when nothing is queued before it and the getting process waits in Get
// (or, put by a process answering a message, comes back to Get within
// 50 µs), or, for a value with no tensor, is the
// queue's only getting process (it takes the value at its next Get): the
// value a Pipe's lane would carry (no queue or pipe in it, tensors only of
// blocks of the putting process's pool in segments the getting one
// pinned, or of blocks the getting process made, about 2 KiB encoded).
// Everything else goes by the socket, which every getting process
// receives from, so that no value waits in the lane for a busy
// getter while another waits (one that starts getting meanwhile may wait
// up to about 0.3 s for it). One putting process and one getting process
// use the lane at a time; a value does not overtake one that another
// process finished putting before it, and each putting process's values
// keep their order.
//
// A Queue owns two descriptors (the two ends of a SOCK_SEQPACKET socket
// pair) in each process that holds it, four with a capacity, and a lane's
// memory descriptor, with two duplicates while it uses it; Close releases
// this process's.
type Queue struct {
	in  *sock.Conn // Put writes here
	out *sock.Conn // Get reads here
	// puts and gets are the lane's writing and reading sides in this
	// process, over in and out: Ways without a lane for a queue that
	// has none (one made before lanes, or by a foreign process).
	puts, gets *sock.Way

	// With a capacity, the free places: Put takes one before it sends,
	// Get gives one back as soon as it has taken a message. Nil without
	// a capacity.
	places *sock.Places
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
	pair, err := sock.Pair()
	if err != nil {
		return nil, err
	}
	lane, err := sock.CreateWayLane()
	if err != nil && !errors.Is(err, errors.ErrUnsupported) {
		fd.CloseEach(pair[:])
		return nil, err
	}
	q, err := queueFrom(pair[0], pair[1], lane)
	if err != nil || o.capacity == 0 {
		return q, err
	}
	if q.places, err = sock.NewPlaces(o.capacity); err != nil {
		_ = q.Close()
		return nil, err
	}
	return q, nil
}

// queueFrom returns the queue of the socket's ends in and out and the
// lane's memory lane, nil for none; it takes all three over.
func queueFrom(in, out, lane *fd.FD) (*Queue, error) {
	var reads *fd.FD
	if lane != nil {
		var err error
		if reads, err = lane.Dup(); err != nil {
			fd.CloseEach([]*fd.FD{in, out, lane})
			return nil, fmt.Errorf("mp: duplicating a queue's lane: %w%s", err, sock.FDHint(err))
		}
	}
	ci, err := sock.New(in, "queue")
	if err != nil {
		fd.CloseEach([]*fd.FD{out, lane, reads})
		return nil, err
	}
	co, err := sock.New(out, "queue")
	if err != nil {
		_ = ci.Close()
		fd.CloseEach([]*fd.FD{lane, reads})
		return nil, err
	}
	return &Queue{in: ci, out: co, puts: sock.NewFairWay(ci, lane, true), gets: sock.NewFairWay(co, reads, false)}, nil
}

// Cap returns the queue's capacity, or 0 if it has none.
func (q *Queue) Cap() int {
	if q.places == nil {
		return 0
	}
	return q.places.Cap()
}

// Put sends v, which may hold tensors, queues and pipes anywhere inside
// it. It waits while the queue is full (see WithCapacity), until ctx ends.
func (q *Queue) Put(ctx context.Context, v any) error { return q.put(ctx, v, true) }

// TryPut sends v if the queue has room now, and returns ErrFull if not
// (torch's put_nowait).
func (q *Queue) TryPut(ctx context.Context, v any) error { return q.put(ctx, v, false) }

func (q *Queue) put(ctx context.Context, v any, block bool) error {
	if q.places != nil {
		var err error
		if block {
			err = q.places.Take(ctx)
		} else {
			err = q.places.TryTake(ctx)
		}
		if err != nil {
			return fullErr(err)
		}
	}
	err := sendLane(ctx, q.puts, v, block)
	if err != nil && q.places != nil {
		q.places.Give()
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
	m, err := q.take(ctx, block)
	if err != nil {
		return err
	}
	defer m.Done()
	return decodeMsg(m, v)
}

// take receives the next message, giving its place back at once; the
// caller decodes it with decodeMsg (which takes its descriptors over),
// then calls its Done, which the queue's next take in this process waits
// for.
func (q *Queue) take(ctx context.Context, block bool) (sock.Msg, error) {
	var m sock.Msg
	var err error
	if block {
		m, err = q.gets.Recv(ctx)
	} else {
		m, err = q.gets.TryRecv(ctx)
	}
	if errors.Is(err, sock.ErrWouldBlock) {
		return sock.Msg{}, ErrEmpty
	}
	if err != nil {
		return sock.Msg{}, err
	}
	if q.places != nil {
		q.places.Give() // the message is out of the queue
	}
	return m, nil
}

func fullErr(err error) error {
	if errors.Is(err, sock.ErrWouldBlock) {
		return ErrFull
	}
	return err
}

// Close releases this process's hold on the queue and wakes its blocked
// Put and Get calls with ErrClosed. Other processes keep theirs.
func (q *Queue) Close() error {
	// The sockets first: that ends the calls that wait on them.
	err := errors.Join(q.in.Close(), q.out.Close(), q.puts.Close(), q.gets.Close())
	if q.places != nil {
		err = errors.Join(err, q.places.Close())
	}
	return err
}

// A queue travels as the indexes of its descriptors (in, out, with a
// capacity the places pipe's ends, and the lane's memory, if it has one)
// and, with a capacity, the capacity, between the places' and the lane's.
func (q *Queue) encode(enc *msgpack.Encoder) ([]byte, error) {
	payload, err := encodeConns(enc, q.in, q.out)
	if err != nil {
		return nil, err
	}
	if q.places != nil {
		r, w, err := q.places.Dup()
		if err != nil {
			return nil, fmt.Errorf("mp: sending a queue or pipe: %w", err)
		}
		if payload, err = addFDs(enc, payload, r, w); err != nil {
			return nil, err
		}
		payload = binary.LittleEndian.AppendUint32(payload, uint32(q.places.Cap()))
	}
	lane, err := q.gets.Dup()
	if err != nil || lane == nil {
		return payload, err
	}
	return addFDs(enc, payload, lane)
}

// The sizes of a queue's payload: its socket's two descriptors, and as
// many again with a capacity (the places' and the capacity itself), each
// with or without a lane's.
const (
	queuePlain   = 4 * 2
	queueLane    = queuePlain + 4
	queueBounded = 4*4 + 4
	queueBoth    = queueBounded + 4
)

func decodeQueue(dec *msgpack.Decoder, n int) (*Queue, error) {
	if n != queuePlain && n != queueLane && n != queueBounded && n != queueBoth {
		return nil, fmt.Errorf("mp: a queue of %d bytes", n)
	}
	payload, err := carry.ReadExt(dec, n)
	if err != nil {
		return nil, err
	}
	bounded := n >= queueBounded
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
	var lane *fd.FD
	if n == queueLane || n == queueBoth {
		if lane, err = carry.TakeFD(dec, int(binary.LittleEndian.Uint32(payload[n-4:]))); err != nil {
			fd.CloseEach(fds)
			return nil, err
		}
	}
	err = errors.Join(sock.CheckSocket(fds[0]), sock.CheckSocket(fds[1]))
	if err == nil && bounded {
		err = sock.CheckPlaces(fds[2], fds[3])
	}
	if err != nil {
		fd.CloseEach(append(fds, lane))
		return nil, err
	}
	// A lane that is not one is found at its first use, and the socket
	// serves alone.
	q, err := queueFrom(fds[0], fds[1], lane)
	if err != nil {
		fd.CloseEach(fds[2:])
		return nil, err
	}
	if bounded {
		if q.places, err = sock.AdoptPlaces(fds[2], fds[3], capacity); err != nil {
			_ = q.Close()
			return nil, err
		}
	}
	return q, nil
}

// Pipe is one end of a duplex connection between two processes: what one
// end sends, the other receives, in order. NewPipe returns both ends; give
// one to another process through Spawn's arguments or a Queue.
//
// Each direction of a pipe made by NewPipe has a lane in shared memory
// beside its socket (see sock.Way): a value that holds no queue or pipe,
// and no tensor but those of blocks of the sending process's own pool
// whose segments the receiving process maps already (it was sent a block
// of each before), or of blocks the receiving process made (sent back to
// it, which it keeps from reuse while the value waits), and fits a lane
// entry (about 2 KiB encoded, thirty tensors or so), goes from the
// sending process to the receiving one through memory, with no system
// call while both are awake; the rest goes by the socket, in order with
// it. The lane serves one sending process and one receiving process at a
// time, the first of each to use the end: another process that holds the
// same end uses the socket alone, and is heard at once (it wakes the
// receiving process), or at worst at the end of the receiver's sleep
// slice (10 ms early in a wait, up to a second in a long one). Tensors the
// lane carried to a receiving process that handed its end on, or closed
// it, before taking them, come to the next receiving process as errors
// wrapping mmapalloc.ErrNotMapped, unless that process made their blocks
// (then it gets them); what the sending process sends once the end is
// handed on goes by the socket.
//
// The receiving side of an end keeps the segments it pins mapped until
// Close, or until their producer lets go of them: at most 64 segments,
// and 1 GiB in all.
//
// A Pipe owns, in each process that holds it, its socket's descriptor
// and, made by NewPipe, each lane's memory descriptor; Close releases
// them.
type Pipe struct {
	c       *sock.Conn
	out, in *sock.Way // this end's sending and receiving directions
	// unwatch ends the watch on the process at the other end of an
	// endpoint's connection (see watchPeer); nil for other pipes.
	unwatch func()
}

// newPipe returns the end whose socket is c, and whose lanes' memories
// are out (this end writes it) and in (it reads it), nil for none. It
// takes all three over.
func newPipe(c *sock.Conn, out, in *fd.FD) *Pipe {
	return &Pipe{c: c, out: sock.NewWay(c, out, true), in: sock.NewWay(c, in, false)}
}

// NewPipe returns the two connected ends of a new Pipe.
func NewPipe() (*Pipe, *Pipe, error) {
	checkInit("mp.NewPipe")
	pair, err := sock.Pair()
	if err != nil {
		return nil, nil, err
	}
	var lanes [4]*fd.FD // a to b, b to a, and a duplicate of each
	var errs []error
	for i := range 2 {
		l, err := sock.CreateWayLane()
		if err == nil {
			lanes[i] = l
			lanes[i+2], err = l.Dup()
		}
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		fd.CloseEach(append(pair[:], lanes[:]...))
		return nil, nil, err
	}
	a, err := sock.New(pair[0], "pipe")
	if err != nil {
		fd.CloseEach(append([]*fd.FD{pair[1]}, lanes[:]...))
		return nil, nil, err
	}
	b, err := sock.New(pair[1], "pipe")
	if err != nil {
		_ = a.Close()
		fd.CloseEach(lanes[:])
		return nil, nil, err
	}
	return newPipe(a, lanes[0], lanes[3]), newPipe(b, lanes[1], lanes[2]), nil
}

// Send sends v to the other end.
func (p *Pipe) Send(ctx context.Context, v any) error { return sendLane(ctx, p.out, v, true) }

// Recv receives the next value from the other end into v. When the other
// end is closed in every process that held it, Recv returns ErrClosed
// once it has received what they sent: at once where the last of them
// closed it, and where the last died (SIGKILL included) at once or
// within 10 ms (a wait that has lasted 10 ms watches the socket for its
// other end's hang-up).
func (p *Pipe) Recv(ctx context.Context, v any) error {
	m, err := p.in.Recv(ctx)
	if err != nil {
		return err
	}
	defer m.Done()
	if err := carry.DecodeFrom(m.Data, m.FDs, v, p.in, m.ByLane()); err != nil {
		return fmt.Errorf("mp: decoding into %T: %w", v, err)
	}
	return nil
}

// Close releases this process's end and wakes blocked calls on it.
func (p *Pipe) Close() error {
	if p.unwatch != nil {
		p.unwatch()
	}
	err := p.c.Close() // first: it ends the receives that wait on it
	return errors.Join(err, p.out.Close(), p.in.Close())
}

// A pipe travels as the indexes of its descriptors: its socket, and for a
// pipe with lanes, the memories of the lane it writes and the lane it
// reads.
func (p *Pipe) encode(enc *msgpack.Encoder) ([]byte, error) {
	p.in.LetGo() // the process it goes to may take the lane
	payload, err := encodeConns(enc, p.c)
	if err != nil {
		return nil, err
	}
	out, err := p.out.Dup()
	if err != nil || out == nil {
		return payload, err
	}
	in, err := p.in.Dup()
	if err != nil || in == nil {
		fd.CloseEach([]*fd.FD{out, in})
		if err == nil {
			err = errors.New("mp: sending a pipe: it has a lane one way only")
		}
		return nil, err
	}
	return addFDs(enc, payload, out, in)
}

func decodePipe(dec *msgpack.Decoder, n int) (*Pipe, error) {
	if n != 4 && n != 4*3 {
		return nil, fmt.Errorf("mp: a pipe of %d bytes", n)
	}
	payload, err := carry.ReadExt(dec, n)
	if err != nil {
		return nil, err
	}
	fds, err := takeFDs(dec, payload, n/4)
	if err != nil {
		return nil, err
	}
	if err := sock.CheckSocket(fds[0]); err != nil {
		fd.CloseEach(fds)
		return nil, err
	}
	c, err := sock.New(fds[0], "pipe")
	if err != nil {
		fd.CloseEach(fds[1:])
		return nil, err
	}
	if n == 4 {
		return newPipe(c, nil, nil), nil
	}
	// A lane that is not one is found at its first use, and the socket
	// serves alone.
	return newPipe(c, fds[1], fds[2]), nil
}

// encodeConns adds duplicates of the connections' descriptors to the
// message, which owns them until it is sent, and returns their indexes as
// the extension's payload.
func encodeConns(enc *msgpack.Encoder, conns ...*sock.Conn) ([]byte, error) {
	payload := make([]byte, 0, 4*len(conns))
	for _, c := range conns {
		dup, err := c.Dup()
		if err != nil {
			return nil, fmt.Errorf("mp: sending a queue or pipe: %w", err)
		}
		if payload, err = addFDs(enc, payload, dup); err != nil {
			return nil, err
		}
	}
	return payload, nil
}

// addFDs adds fds, which the caller owned, to the message, which owns
// them from then on, and appends their indexes to payload.
func addFDs(enc *msgpack.Encoder, payload []byte, fds ...*fd.FD) ([]byte, error) {
	for k, f := range fds {
		i, err := carry.AddFD(enc, f)
		if err != nil {
			fd.CloseEach(fds[k+1:])
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

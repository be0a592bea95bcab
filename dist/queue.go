package dist

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"github.com/vmihailenco/msgpack/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

// Queue is a queue of the group, held by its owner rank: any rank may Put
// and Get. Values are anything package reduction carries, tensors
// anywhere inside; each tensor is a copy on the rank that gets it, in a
// pooled shared-memory block of that rank's host. A value leaves the
// owner only when its getter has it: a Get that fails on the way puts
// the value back at the head of the queue.
//
// Between the owner and another rank of its host, values go over the
// ranks' same-host connection instead (as Pipes do), and tensors are not
// copied: they travel as shared memory on package mp's descriptor path.
//
// A value whose tensors come to WithReferenceAbove bytes or more goes by
// reference: the owner holds only a ticket, and the getter pulls the
// tensors from the putter, which keeps a copy under a lease (WithLease)
// until then. Its tensors cross the network once, and the putter's Close
// waits (at most a lease) until they were taken.
//
// A Queue is safe for concurrent use.
type Queue struct {
	g     *Group
	name  string
	owner int
	cap   int
}

// QueueOption configures Group.Queue.
type QueueOption func(*Queue)

// WithOwner makes rank r hold the queue (default rank 0). The owner
// should be the rank that Gets most: values travel from the putter to
// the owner, and from the owner to the getter.
func WithOwner(r int) QueueOption { return func(q *Queue) { q.owner = r } }

// WithCapacity bounds the queue to n values (default 0: unbounded): Put
// waits for room. The first rank to use the queue sets its capacity.
func WithCapacity(n int) QueueOption { return func(q *Queue) { q.cap = n } }

// Queue returns the group's queue called name, made on its owner at first
// use.
func (g *Group) Queue(ctx context.Context, name string, opts ...QueueOption) (*Queue, error) {
	q := &Queue{g: g, name: name}
	for _, f := range opts {
		f(q)
	}
	if q.owner < 0 || q.owner >= g.world {
		return nil, fmt.Errorf("dist: queue %q: owner %d in a group of %d", name, q.owner, g.world)
	}
	if q.cap < 0 {
		return nil, fmt.Errorf("dist: queue %q: capacity %d", name, q.cap)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if q.owner == g.rank {
		if _, err := g.node.queue(name, q.cap); err != nil {
			return nil, err
		}
	}
	return q, nil
}

type queueReq struct {
	//lint:ignore U1000 the tag tells msgpack to use the array form
	_msgpack struct{} `msgpack:",as_array"`

	Cap int
}

func (q *Queue) request() []byte {
	b, _ := msgpack.Marshal(&queueReq{Cap: q.cap})
	return b
}

// Put puts v on the queue, waiting for room while ctx lasts. Its tensors
// are copied, unless the owner is another rank of this host: once Put
// returns, v's tensors are the caller's again. Between two ranks of one
// host they are shared as an mp.Queue shares them: the owner, and a
// getter on the same host, map the putter's memory.
func (q *Queue) Put(ctx context.Context, v any) error {
	ctx, cancel := q.g.opContext(ctx)
	defer cancel()
	if q.owner == q.g.rank {
		return q.putLocal(ctx, v)
	}
	if p, err := q.dialQueue(ctx, "put"); err == nil {
		return q.putShared(ctx, p, v)
	}
	w := newWriter(nil, q.g.o.chunk)
	data, bodies, err := w.enc.Encode(v)
	if err != nil {
		return err
	}
	var ticket []byte
	if above := q.g.o.refAbove; above > 0 && bodySize(bodies) >= above {
		// By reference: the bodies stay here, in a copy of our own.
		copies, err := snapshot(bodies)
		if err != nil {
			return fmt.Errorf("dist: put on queue %q: %w", q.name, err)
		}
		if ticket, err = q.g.node.offers.add(copies); err != nil {
			return err
		}
		// From here the offer is the lease's: should the owner have
		// queued it before a failure, its getter still finds it.
	}
	s, err := q.open(ctx, "put")
	if err != nil {
		return err
	}
	w.s = s
	if ticket != nil {
		err = w.sendValue(frame{Kind: kindValue, Data: data, Rank: q.g.rank, Ticket: ticket}, nil)
	} else {
		err = w.sendRaw(data, bodies)
	}
	if err != nil {
		return q.err(ctx, "put", err)
	}
	r := newReader(s, 0)
	f, err := r.next()
	if err != nil {
		return q.err(ctx, "put", err)
	}
	if f.Kind != kindAck {
		return fmt.Errorf("dist: put on queue %q: the owner answered with a frame of kind %d", q.name, f.Kind)
	}
	return nil
}

// Get takes the value at the head of the queue into v (a pointer),
// waiting for one while ctx lasts.
func (q *Queue) Get(ctx context.Context, v any) error {
	ctx, cancel := q.g.opContext(ctx)
	defer cancel()
	if q.owner == q.g.rank {
		return q.getLocal(ctx, v)
	}
	if p, err := q.dialQueue(ctx, "get"); err == nil {
		return q.getShared(ctx, p, v)
	}
	s, err := q.open(ctx, "get")
	if err != nil {
		return err
	}
	r := newReader(s, q.g.o.maxValue)
	f, err := r.next()
	if err != nil {
		return q.err(ctx, "get", err)
	}
	if f.Kind == kindError {
		return fmt.Errorf("dist: get on queue %q: %s", q.name, f.Err)
	}
	var bodies []*tensor.Storage
	if f.Ticket != nil {
		bodies, err = q.g.pull(ctx, f.Rank, f.Ticket)
	} else {
		bodies, err = r.raw(f)
	}
	answer := frame{Kind: kindAck}
	var derr error
	switch {
	case errors.Is(err, ErrLeaseExpired):
		// Gone for good: tell the owner to drop it.
		answer = frame{Kind: kindError, Err: err.Error()}
		derr = fmt.Errorf("dist: get on queue %q: %w", q.name, err)
	case err != nil && f.Ticket != nil:
		return fmt.Errorf("dist: get on queue %q: %w", q.name, err) // the owner keeps the value
	case err != nil:
		return q.err(ctx, "get", err) // the owner keeps the value
	default:
		if derr = r.dec.Decode(f.Data, bodies, v); derr != nil {
			// A value that does not decode would come back at every
			// Get: tell the owner to drop it.
			answer = frame{Kind: kindError, Err: derr.Error()}
			derr = fmt.Errorf("dist: get on queue %q: dropped a malformed value: %w", q.name, derr)
		}
	}
	// The value stays queued until the owner has the answer: wait for
	// the stream's end, which follows it, before letting the stream go.
	if err := s.SendMsg(&outData{meta: answer.marshal()}); err == nil {
		_ = s.CloseSend()
		var in inData
		_ = s.RecvMsg(&in)
	}
	if f.Ticket != nil && err == nil {
		q.g.letGo(ctx, f.Rank, f.Ticket) // pulled: the putter may let go
	}
	return derr
}

// bodySize returns how many bytes bodies hold together.
func bodySize(bodies []*tensor.Storage) int64 {
	var n int64
	for _, b := range bodies {
		n += b.Size()
	}
	return n
}

// open starts a put or get stream with the owner.
func (q *Queue) open(ctx context.Context, op string) (flight.FlightService_DoExchangeClient, error) {
	c, err := q.g.client(q.owner)
	if err != nil {
		return nil, err
	}
	s, err := exchange(ctx, c)
	if err != nil {
		return nil, q.err(ctx, op, err)
	}
	desc, _ := proto.Marshal(&flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{op, q.name}})
	if err := s.SendMsg(&outData{desc: desc, meta: (&frame{Kind: kindRequest, Data: q.request()}).marshal()}); err != nil {
		return nil, q.err(ctx, op, err)
	}
	return s, nil
}

func (q *Queue) err(ctx context.Context, op string, err error) error {
	if st, ok := status.FromError(err); ok && st.Code() == codes.InvalidArgument {
		return fmt.Errorf("dist: %s on queue %q: %s", op, q.name, st.Message())
	}
	return q.g.opErr(ctx, q.owner, op, err)
}

// putLocal puts v on a queue this rank owns: its bodies are copied into
// shared memory, as a remote putter's would be.
func (q *Queue) putLocal(ctx context.Context, v any) error {
	st, err := q.g.node.queue(q.name, q.cap)
	if err != nil {
		return err
	}
	data, bodies, err := reduction.NewBodyEncoder().Encode(v)
	if err != nil {
		return err
	}
	copies, err := snapshot(bodies)
	if err != nil {
		return fmt.Errorf("dist: put on queue %q: %w", q.name, err)
	}
	it := item{data: slices.Clone(data), bodies: copies}
	if err := st.reserve(ctx); err != nil {
		it.release()
		return err
	}
	st.push(it)
	return nil
}

func (q *Queue) getLocal(ctx context.Context, v any) error {
	st, err := q.g.node.queue(q.name, q.cap)
	if err != nil {
		return err
	}
	it, err := st.pop(ctx)
	if err != nil {
		return err
	}
	if it.ref == nil {
		return reduction.NewBodyDecoder().Decode(it.data, it.bodies, v)
	}
	bodies, err := q.g.pull(ctx, it.ref.rank, it.ref.ticket)
	if err != nil {
		if !errors.Is(err, ErrLeaseExpired) {
			st.pushFront(it)
		}
		return fmt.Errorf("dist: get on queue %q: %w", q.name, err)
	}
	err = reduction.NewBodyDecoder().Decode(it.data, bodies, v)
	q.g.letGo(ctx, it.ref.rank, it.ref.ticket)
	return err
}

package dist

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

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

// item is a queued value: its encoding and either its bodies, in this
// host's shared memory, or the reference to them on their putter.
//
// Bodies received from another host the queue owns until a getter has
// them. Bodies a same-host putter sent (shared) are mp's mappings of the
// putter's memory, which this process maps once however often it
// receives them, so another value or this rank's own tensors may hold
// the same Storage: the queue only drops its references, and the Go
// collector unmaps them when nobody else holds them, as for any tensor
// received through package mp.
type item struct {
	data   []byte
	bodies []*tensor.Storage
	shared bool
	ref    *valueRef
}

// valueRef is where a value put by reference waits: the putter's rank
// and the ticket of its offer.
type valueRef struct {
	rank   int
	ticket []byte
}

func (it item) release() {
	if !it.shared {
		release(it.bodies)
	}
}

// queueState is a queue on its owner.
type queueState struct {
	name      string
	world     int
	cap       int
	chunk     int
	maxValue  int64
	rank      int     // the owner's
	offers    *offers // where values of lendAbove bytes or more are lent to getters
	lendAbove int64
	mu        sync.Mutex
	items     []item
	reserved  int           // room promised to puts receiving their bodies
	changed   chan struct{} // closed and replaced at every change
	closed    bool
}

// queue returns the queue called name, made with capacity cap if new.
func (n *node) queue(name string, cap int) (*queueState, error) {
	if name == "" || len(name) > 4096 {
		return nil, status.Errorf(codes.InvalidArgument, "queue name of %d bytes", len(name))
	}
	if cap < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "queue %q of capacity %d", name, cap)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	q, ok := n.queues[name]
	if !ok {
		q = &queueState{name: name, world: n.g.world, cap: cap, chunk: n.g.o.chunk, maxValue: n.g.o.maxValue, changed: make(chan struct{}),
			rank: n.g.rank, offers: n.offers, lendAbove: n.g.o.refAbove}
		n.queues[name] = q
	}
	return q, nil
}

// parseQueueReq reads the capacity from a put or get stream's first
// frame.
func parseQueueReq(meta []byte) (int, error) {
	f, err := parseFrame(meta)
	var req queueReq
	if err == nil && f.Kind == kindRequest {
		err = unmarshal(f.Data, &req)
	}
	if err != nil || f.Kind != kindRequest {
		return 0, status.Error(codes.InvalidArgument, "malformed queue request")
	}
	return req.Cap, nil
}

func (q *queueState) notifyLocked() {
	close(q.changed)
	q.changed = make(chan struct{})
}

var errQueueClosed = errors.New("dist: the queue's owner is closing")

// reserve waits for room for one value and promises it.
func (q *queueState) reserve(ctx context.Context) error {
	for {
		q.mu.Lock()
		if q.closed {
			q.mu.Unlock()
			return errQueueClosed
		}
		if q.cap == 0 || len(q.items)+q.reserved < q.cap {
			q.reserved++
			q.mu.Unlock()
			return nil
		}
		ch := q.changed
		q.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

// unreserve gives back room that reserve promised.
func (q *queueState) unreserve() {
	q.mu.Lock()
	q.reserved--
	q.notifyLocked()
	q.mu.Unlock()
}

// push appends a value into room reserve promised.
func (q *queueState) push(it item) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.reserved--
	if q.closed {
		it.release()
		return
	}
	q.items = append(q.items, it)
	q.notifyLocked()
}

// pushFront puts back a value whose getter failed.
func (q *queueState) pushFront(it item) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		it.release()
		return
	}
	q.items = slices.Insert(q.items, 0, it)
	q.notifyLocked()
}

// pop takes the head, waiting for one.
func (q *queueState) pop(ctx context.Context) (item, error) {
	for {
		q.mu.Lock()
		if q.closed {
			q.mu.Unlock()
			return item{}, errQueueClosed
		}
		if len(q.items) > 0 {
			it := q.items[0]
			q.items[0] = item{}
			q.items = q.items[1:]
			q.notifyLocked()
			q.mu.Unlock()
			return it, nil
		}
		ch := q.changed
		q.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return item{}, context.Cause(ctx)
		}
	}
}

// close releases every queued value.
func (q *queueState) close() {
	q.mu.Lock()
	items := q.items
	q.items, q.closed = nil, true
	q.notifyLocked()
	q.mu.Unlock()
	for _, it := range items {
		it.release()
	}
}

// servePut receives one value into the queue: its frame, room for it,
// then its bodies; then the ack.
func (q *queueState) servePut(s flight.FlightService_DoExchangeServer) error {
	r := newReader(s, q.maxValue)
	f, err := r.next()
	if err != nil {
		return err
	}
	if f.Kind != kindValue {
		return status.Errorf(codes.InvalidArgument, "a frame of kind %d where a value was due", f.Kind)
	}
	if f.Ticket != nil {
		if f.Rank < 0 || f.Rank >= q.world || len(f.Ticket) > 64 || len(f.Sizes) > 0 {
			return status.Errorf(codes.InvalidArgument, "a value by reference on rank %d with a ticket of %d bytes", f.Rank, len(f.Ticket))
		}
		if err := q.reserve(s.Context()); err != nil {
			return err
		}
		q.push(item{data: f.Data, ref: &valueRef{rank: f.Rank, ticket: f.Ticket}})
		return s.SendMsg(&outData{meta: (&frame{Kind: kindAck}).marshal()})
	}
	if err := q.reserve(s.Context()); err != nil {
		return err
	}
	bodies, err := r.raw(f)
	if err != nil {
		q.unreserve()
		return status.Error(codes.InvalidArgument, err.Error())
	}
	q.push(item{data: f.Data, bodies: bodies})
	return s.SendMsg(&outData{meta: (&frame{Kind: kindAck}).marshal()})
}

// serveGet sends the head of the queue and removes it once the getter
// acknowledges it; a getter that fails first leaves it at the head. A
// value of lendAbove bytes or more is lent rather than sent on the
// stream: the getter pulls it with DoGet, as a value by reference, over
// as many connections as it pulls with.
func (q *queueState) serveGet(s flight.FlightService_DoExchangeServer) error {
	return q.handOut(s.Context(), func(it item) error {
		w := newWriter(s, q.chunk)
		var err error
		switch {
		case it.ref != nil:
			err = w.sendValue(frame{Kind: kindValue, Data: it.data, Rank: it.ref.rank, Ticket: it.ref.ticket}, nil)
		case q.lendAbove > 0 && bodySize(it.bodies) >= q.lendAbove:
			ticket, end, lerr := q.offers.lend(it.bodies)
			if lerr != nil {
				return lerr
			}
			defer end() // before the value is released or goes back to the head
			err = w.sendValue(frame{Kind: kindValue, Data: it.data, Rank: q.rank, Ticket: ticket}, nil)
		default:
			err = w.sendRaw(it.data, it.bodies)
		}
		if err != nil {
			return err
		}
		var in inData
		if err := s.RecvMsg(&in); err != nil {
			return err
		}
		f, err := parseFrame(in.meta)
		if err != nil || f.Kind != kindAck && f.Kind != kindError {
			return status.Error(codes.InvalidArgument, "no answer for a value")
		}
		return nil // taken, or refused as malformed by the getter's decoder
	})
}

// handOut takes the head of the queue, waiting while ctx lasts, and gives
// it to deliver. The value leaves the queue only when deliver returns nil:
// its getter has it, or dropped it for good (malformed, expired).
// Otherwise it goes back to the head.
func (q *queueState) handOut(ctx context.Context, deliver func(item) error) error {
	it, err := q.pop(ctx)
	if err != nil {
		return err
	}
	if err := deliver(it); err != nil {
		q.pushFront(it)
		return err
	}
	it.release()
	return nil
}

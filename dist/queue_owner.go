package dist

import (
	"context"
	"errors"
	"slices"
	"sync"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensormp/tensormp/tensor"
)

// A queue on its owner: the values it holds (queueState) and the put and
// get streams other ranks open to it (servePut, serveGet). The Queue
// every rank calls is in queue.go; the owner's end of the same-host
// shortcut is in local.go.

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

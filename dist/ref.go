package dist

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/tensor"
)

// Values by reference. A value whose tensors come to WithReferenceAbove
// bytes or more is not copied to its queue's owner: the putter copies its
// bodies into shared memory of its own host, an offer, and the owner
// queues the encoded value with a Flight ticket naming the offer. The
// getter redeems the ticket with DoGet on the putter, so the bodies cross
// the network once, putter to getter, and the owner holds none of them.
//
// An offer lives under a lease (WithLease). The owner renews the lease of
// every value it holds (Flight's RenewFlightEndpoint action), a DoGet
// holds it while it streams, and the getter releases the offer once it
// has the value (the action tensormp.release). An offer nobody renewed for
// a lease is released; a Get that comes for it later fails with
// ErrLeaseExpired, and the value is dropped.
//
// This file holds the putter's side: the offers and the DoGet and actions
// that serve them. The getter's and the owner's side is in ref_pull.go.

// ErrLeaseExpired is returned by a Get whose value was put by reference
// and whose putter let it go: nobody renewed its lease in time.
var ErrLeaseExpired = errors.New("dist: the lease on a value put by reference expired")

// Action types of the offers.
const (
	renewAction   = flight.RenewFlightEndpointActionType
	releaseAction = "tensormp.release"
)

// DefaultReferenceAbove is the size from which a value goes by reference.
const DefaultReferenceAbove = 8 << 20

// DefaultLease is how long an offer lives without a renewal.
const DefaultLease = 30 * time.Second

// offer is a value's bodies, kept by its putter for the getter, or lent
// by a queue's owner for the time a remote getter takes its value (see
// lend).
type offer struct {
	bodies  []*tensor.Storage
	expires time.Time
	timer   *time.Timer   // nil for a loan, which has no lease
	pulls   int           // DoGets streaming it now
	dropped bool          // released or expired while pulled: the last pull releases it
	lent    bool          // the bodies are the lender's: never released here
	idle    chan struct{} // a loan's: closed when it is dropped and its last pull ends
}

// offers are the values this rank put by reference and still keeps, and
// those its queues lend to getters now.
type offers struct {
	lease   time.Duration
	mu      sync.Mutex
	m       map[string]*offer
	changed chan struct{} // closed and replaced when m shrinks
	closed  bool
}

func newOffers(lease time.Duration) *offers {
	return &offers{lease: lease, m: map[string]*offer{}, changed: make(chan struct{})}
}

// ticketLen is the length of an offer's ticket.
const ticketLen = 16

// newTicket returns a fresh random ticket.
func newTicket() []byte {
	t := make([]byte, ticketLen)
	_, _ = rand.Read(t)
	return t
}

// add keeps bodies, which it takes over, under a new ticket.
func (o *offers) add(bodies []*tensor.Storage) ([]byte, error) {
	t := newTicket()
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		release(bodies)
		return nil, ErrClosed
	}
	of := &offer{bodies: bodies, expires: time.Now().Add(o.lease)}
	key := string(t)
	of.timer = time.AfterFunc(o.lease, func() { o.expire(key) })
	o.m[key] = of
	return t, nil
}

// lend offers bodies, which stay the caller's, under a new ticket, for a
// getter to pull while the caller waits for its answer; end withdraws the
// offer and returns once no DoGet streams the bodies any more, so that
// the caller may release them or hand them to the next getter.
func (o *offers) lend(bodies []*tensor.Storage) (ticket []byte, end func(), err error) {
	t := newTicket()
	key := string(t)
	of := &offer{bodies: bodies, lent: true, idle: make(chan struct{})}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return nil, nil, ErrClosed
	}
	o.m[key] = of
	return t, func() {
		o.mu.Lock()
		if o.m[key] == of && !of.dropped {
			of.dropped = true
			if of.pulls == 0 {
				o.removeLocked(key)
				close(of.idle)
			}
		}
		o.mu.Unlock()
		<-of.idle
	}, nil
}

// expire releases the offer if its lease ended and nobody pulls it;
// otherwise it waits for the lease's new end.
func (o *offers) expire(key string) {
	o.mu.Lock()
	of, ok := o.m[key]
	if !ok {
		o.mu.Unlock()
		return
	}
	if left := time.Until(of.expires); left > 0 || of.pulls > 0 {
		of.timer.Reset(max(left, o.lease/4))
		o.mu.Unlock()
		return
	}
	o.removeLocked(key)
	o.mu.Unlock()
	release(of.bodies)
}

// removeLocked forgets an offer; its caller releases the bodies.
func (o *offers) removeLocked(key string) {
	if of := o.m[key]; of != nil && of.timer != nil {
		of.timer.Stop()
	}
	delete(o.m, key)
	close(o.changed)
	o.changed = make(chan struct{})
}

// renew extends an offer's lease and returns its new end.
func (o *offers) renew(t []byte) (time.Time, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	of, ok := o.m[string(t)]
	if !ok || of.dropped {
		return time.Time{}, false
	}
	if of.lent {
		return time.Now().Add(o.lease), true // a loan lasts while its lender waits
	}
	of.expires = time.Now().Add(o.lease)
	return of.expires, true
}

// pull holds an offer for a DoGet; done lets it go.
func (o *offers) pull(t []byte) (bodies []*tensor.Storage, done func(), ok bool) {
	key := string(t)
	o.mu.Lock()
	defer o.mu.Unlock()
	of, ok := o.m[key]
	if !ok || of.dropped {
		return nil, nil, false
	}
	of.pulls++
	return of.bodies, func() {
		o.mu.Lock()
		of.pulls--
		of.expires = time.Now().Add(o.lease)
		last := of.dropped && of.pulls == 0
		if last {
			o.removeLocked(key)
			if of.lent {
				close(of.idle)
			}
		}
		o.mu.Unlock()
		if last && !of.lent {
			release(of.bodies)
		}
	}, true
}

// take removes an offer and returns its bodies to the caller, for a
// getter that is its putter.
func (o *offers) take(t []byte) ([]*tensor.Storage, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	of, ok := o.m[string(t)]
	if !ok || of.dropped || of.pulls > 0 || of.lent {
		return nil, false
	}
	o.removeLocked(string(t))
	return of.bodies, true
}

// release lets an offer go; a pulled one goes with its last pull. A
// loan is its lender's to end: releasing one does nothing.
func (o *offers) release(t []byte) {
	o.mu.Lock()
	of, ok := o.m[string(t)]
	if !ok || of.dropped || of.lent {
		o.mu.Unlock()
		return
	}
	if of.pulls > 0 {
		of.dropped = true
		o.mu.Unlock()
		return
	}
	o.removeLocked(string(t))
	o.mu.Unlock()
	release(of.bodies)
}

// drain waits, for at most d, until every offer was taken or let go.
func (o *offers) drain(ctx context.Context, d time.Duration) {
	awaitChange(ctx, d, func() (bool, <-chan struct{}) {
		o.mu.Lock()
		defer o.mu.Unlock()
		return len(o.m) == 0, o.changed
	})
}

// close releases every offer not being pulled; the pulls release theirs.
func (o *offers) close() {
	o.mu.Lock()
	o.closed = true
	var free [][]*tensor.Storage
	for key, of := range o.m {
		if of.lent {
			continue // its lender ends it
		}
		if of.pulls > 0 {
			of.dropped = true
			continue
		}
		of.timer.Stop()
		delete(o.m, key)
		free = append(free, of.bodies)
	}
	o.mu.Unlock()
	for _, b := range free {
		release(b)
	}
}

func release(bodies []*tensor.Storage) {
	for _, s := range bodies {
		_ = s.Release()
	}
}

// snapshot copies bodies into fresh shared memory of this host, which
// the caller owns: the caller's tensors are its own again at once.
func snapshot(bodies []*tensor.Storage) ([]*tensor.Storage, error) {
	out := make([]*tensor.Storage, 0, len(bodies))
	for _, b := range bodies {
		c, err := tensor.AllocSharedStorage(b.Size())
		if err == nil {
			err = mmapalloc.Guard(func() { copy(c.Bytes(), b.Bytes()) })
			if err != nil {
				_ = c.Release()
			}
		}
		if err != nil {
			release(out)
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// A striped pull's tickets are the offer's ticket followed by which
// stripe the stream carries and the getter's chunk size: part, parts
// (a byte each) and chunk (4 bytes, big-endian). A plain ticket asks for
// every chunk, in the putter's chunk size.
const stripeSuffix = 6

// minStripeChunk bounds the chunk size a getter may ask for from below:
// a peer may not make the putter send a value a few bytes at a time.
const minStripeChunk = 64 << 10

// stripeTicket returns the ticket that asks for stripe st of the offer
// ticket names, in chunks of chunk bytes.
func stripeTicket(ticket []byte, st stripe, chunk int) []byte {
	t := append(slices.Clip(ticket), byte(st.part), byte(st.parts))
	return binary.BigEndian.AppendUint32(t, uint32(chunk))
}

// parseTicket splits a DoGet ticket into the offer's ticket, the stripe
// asked for and the chunk size (0 for the putter's own).
func parseTicket(t []byte) (offer []byte, st stripe, chunk int, err error) {
	switch len(t) {
	case ticketLen:
		return t, stripe{}, 0, nil
	case ticketLen + stripeSuffix:
	default:
		return nil, stripe{}, 0, status.Errorf(codes.InvalidArgument, "a ticket of %d bytes", len(t))
	}
	suffix := t[ticketLen:]
	st = stripe{part: int(suffix[0]), parts: int(suffix[1])}
	chunk = int(binary.BigEndian.Uint32(suffix[2:]))
	if st.parts < 2 || st.parts > MaxPullConns || st.part >= st.parts || chunk < minStripeChunk || chunk > maxMessage/2 {
		return nil, stripe{}, 0, status.Errorf(codes.InvalidArgument, "stripe %d of %d in chunks of %d bytes", st.part, st.parts, chunk)
	}
	return t[:ticketLen], st, chunk, nil
}

// DoGet sends the bodies of an offer, or the stripe of them the ticket
// asks for.
func (n *node) DoGet(t *flight.Ticket, s flight.FlightService_DoGetServer) error {
	key, st, chunk, err := parseTicket(t.GetTicket())
	if err != nil {
		return err
	}
	bodies, done, ok := n.offers.pull(key)
	if !ok {
		return status.Error(codes.NotFound, "no such value: its lease expired or it was taken")
	}
	defer done()
	if chunk == 0 {
		chunk = n.g.o.chunk
	}
	w := newWriter(s, chunk)
	w.stripe = st
	return w.sendRaw(nil, bodies)
}

// doOfferAction serves the actions on offers; ok is false for others.
func (n *node) doOfferAction(a *flight.Action, s flight.FlightService_DoActionServer) (ok bool, err error) {
	switch a.Type {
	case renewAction:
		var req flight.RenewFlightEndpointRequest
		if err := proto.Unmarshal(a.Body, &req); err != nil || req.GetEndpoint().GetTicket() == nil {
			return true, status.Error(codes.InvalidArgument, "malformed RenewFlightEndpoint request")
		}
		exp, ok := n.offers.renew(req.Endpoint.Ticket.Ticket)
		if !ok {
			return true, status.Error(codes.NotFound, "no such value: its lease expired or it was taken")
		}
		body, err := proto.Marshal(&flight.FlightEndpoint{Ticket: req.Endpoint.Ticket, ExpirationTime: timestamppb.New(exp)})
		if err != nil {
			return true, err
		}
		return true, s.Send(&flight.Result{Body: body})
	case releaseAction:
		n.offers.release(a.Body)
		return true, nil
	}
	return false, nil
}

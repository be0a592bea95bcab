package dist

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensormp/tensormp/tensor"
)

// The taking side of a value by reference: a getter pulls the value's
// bodies from its putter (pull) and then lets the offer go (letGo), while
// the queue's owner renews the leases of the values it holds
// (renewLoop). The putter's offers and the DoGet that serves them are in
// ref.go.

// pull receives the bodies of a value put by reference on rank r, or
// lent by r, over the group's pull connections. A getter that is the
// putter takes them without a copy.
func (g *Group) pull(ctx context.Context, r int, ticket []byte) ([]*tensor.Storage, error) {
	if r == g.rank {
		bodies, ok := g.node.offers.take(ticket)
		if !ok {
			return nil, ErrLeaseExpired
		}
		return bodies, nil
	}
	var bodies []*tensor.Storage
	var err error
	if g.o.pullConns == 1 || g.o.chunk < minStripeChunk || g.o.chunk > maxMessage/2 {
		bodies, err = g.pullWhole(ctx, r, ticket)
	} else {
		bodies, err = g.pullStriped(ctx, r, ticket)
	}
	if status.Code(err) == codes.NotFound {
		return nil, fmt.Errorf("%w (put by rank %d)", ErrLeaseExpired, r)
	}
	if err != nil {
		return nil, g.opErr(ctx, r, "pull", err)
	}
	return bodies, nil
}

// pullWhole receives a value by reference on one stream. Its context
// ends with it, which ends what is left of the stream: a stream not read
// to its end would keep gRPC's resources until then.
func (g *Group) pullWhole(ctx context.Context, r int, ticket []byte) ([]*tensor.Storage, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	c, err := g.client(r)
	if err != nil {
		return nil, err
	}
	s, err := c.DoGet(ctx, &flight.Ticket{Ticket: ticket})
	if err != nil {
		return nil, err
	}
	rd := newReader(s, g.o.maxValue)
	f, err := rd.next()
	if err != nil {
		return nil, err
	}
	return rd.raw(f)
}

// pullStriped receives a value by reference on one stream per pull
// connection, each carrying a stripe of its chunks into the same
// storages. Every stream begins with the value's frame: the first
// stream's says what to allocate, and the others must say the same. The
// first stream to fail ends the others, and every stream ends with the
// pull, as pullWhole's does.
func (g *Group) pullStriped(ctx context.Context, r int, ticket []byte) ([]*tensor.Storage, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	parts := g.o.pullConns
	readers := make([]*reader, parts)
	for k := range readers {
		c, err := g.clientOn(r, k)
		if err != nil {
			return nil, err
		}
		s, err := c.DoGet(ctx, &flight.Ticket{Ticket: stripeTicket(ticket, stripe{k, parts}, g.o.chunk)})
		if err != nil {
			return nil, err
		}
		readers[k] = newReader(s, g.o.maxValue)
	}
	head, err := readers[0].next()
	if err != nil {
		return nil, err
	}
	bodies, err := readers[0].alloc(head)
	if err != nil {
		return nil, err
	}
	var (
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
	)
	for k, rd := range readers {
		wg.Go(func() {
			err := receiveStripe(rd, head, bodies, stripe{k, parts}, g.o.chunk)
			if err != nil {
				errOnce.Do(func() { firstErr = err })
				cancel()
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		release(bodies)
		return nil, firstErr
	}
	return bodies, nil
}

// receiveStripe receives stripe st, in chunks of chunk bytes, of a value
// whose frame is head into bodies; the stream of the first stripe has had
// its frame read already.
func receiveStripe(rd *reader, head frame, bodies []*tensor.Storage, st stripe, chunk int) error {
	if st.part > 0 {
		f, err := rd.next()
		if err != nil {
			return err
		}
		if f.Kind != kindValue || !slices.Equal(f.Sizes, head.Sizes) || len(f.Data) > 0 || len(f.Ticket) > 0 {
			return fmt.Errorf("dist: stripe %d of a pull began with a frame of kind %d and %d bodies, not the value's", st.part, f.Kind, len(f.Sizes))
		}
	}
	return rd.receive(bodies, st, chunk)
}

// letGo releases a pulled value on its putter, rank r. A failure is left
// to the lease.
func (g *Group) letGo(ctx context.Context, r int, ticket []byte) {
	if r == g.rank {
		g.node.offers.release(ticket)
		return
	}
	c, err := g.client(r)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, g.o.timeout)
	defer cancel()
	if s, err := c.DoAction(ctx, &flight.Action{Type: releaseAction, Body: ticket}); err == nil {
		for {
			if _, err := s.Recv(); err != nil {
				return
			}
		}
	}
}

// renewLoop renews, every third of a lease, the leases of the values by
// reference this rank's queues hold. A value whose putter no longer has
// it is dropped from its queue.
func (g *Group) renewLoop() {
	defer g.wg.Done()
	t := time.NewTicker(g.o.lease / 3)
	defer t.Stop()
	for {
		select {
		case <-g.ctx.Done():
			return
		case <-t.C:
		}
		for _, ref := range g.node.heldRefs() {
			if !g.renew(ref) {
				g.node.dropRef(ref)
			}
		}
	}
}

// renew renews one value's lease; it reports false only when the putter
// answered that it no longer has the value.
func (g *Group) renew(ref *valueRef) bool {
	c, err := g.client(ref.rank)
	if err != nil {
		return true
	}
	body, _ := proto.Marshal(&flight.RenewFlightEndpointRequest{Endpoint: &flight.FlightEndpoint{Ticket: &flight.Ticket{Ticket: ref.ticket}}})
	ctx, cancel := context.WithTimeout(g.ctx, g.o.lease/3)
	defer cancel()
	s, err := c.DoAction(ctx, &flight.Action{Type: renewAction, Body: body})
	if err == nil {
		_, err = s.Recv()
	}
	return status.Code(err) != codes.NotFound
}

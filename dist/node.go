package dist

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensormp/tensormp/mp"
)

// node is a rank's Flight service: the store and the watch streams on
// rank 0, the queues this rank owns, and the pipes other ranks open to it.
type node struct {
	flight.BaseFlightServer
	g     *Group
	store *storeData

	mu       sync.Mutex
	watchers map[int]*watcher // rank 0: the ranks watching, by rank
	left     map[int]bool     // rank 0: the ranks that left cleanly
	changed  chan struct{}    // closed and replaced when watchers or left change
	queues   map[string]*queueState
	pipes    map[int]chan *pipeConn // pipes opened to this rank, by the opener's rank
	offers   *offers                // values this rank put by reference
	local    map[int]chan *mp.Pipe  // same-host pipes dialled to this rank, by the dialler's rank
}

// watcher is rank 0's side of one rank's watch stream.
type watcher struct {
	mu sync.Mutex
	s  flight.FlightService_DoExchangeServer
}

func (w *watcher) send(f frame) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.s.SendMsg(&outData{meta: f.marshal()})
}

func newNode(g *Group) *node {
	n := &node{g: g, watchers: map[int]*watcher{}, left: map[int]bool{}, changed: make(chan struct{}),
		queues: map[string]*queueState{}, pipes: map[int]chan *pipeConn{}, offers: newOffers(g.o.lease),
		local: map[int]chan *mp.Pipe{}}
	if g.rank == 0 {
		n.store = newStoreData()
	}
	return n
}

func (n *node) notifyLocked() {
	close(n.changed)
	n.changed = make(chan struct{})
}

// DoAction serves the actions on this rank's offers, and the store on
// rank 0.
func (n *node) DoAction(a *flight.Action, s flight.FlightService_DoActionServer) error {
	if ok, err := n.doOfferAction(a, s); ok {
		return err
	}
	if n.store == nil {
		return status.Errorf(codes.FailedPrecondition, "rank %d serves no store", n.g.rank)
	}
	vals, err := n.store.doAction(s.Context(), a, n.g.o.timeout)
	if err != nil {
		return err
	}
	for _, v := range vals {
		if err := s.Send(&flight.Result{Body: v}); err != nil {
			return err
		}
	}
	return nil
}

// DoExchange serves tensormp's streams; the first message's descriptor
// path says which: watch, put, get or pipe.
func (n *node) DoExchange(s flight.FlightService_DoExchangeServer) error {
	var in inData
	if err := s.RecvMsg(&in); err != nil {
		return err
	}
	var d flight.FlightDescriptor
	if err := proto.Unmarshal(in.desc, &d); err != nil || len(d.Path) < 2 {
		return status.Error(codes.InvalidArgument, "a tensormp stream starts with a descriptor path")
	}
	switch d.Path[0] {
	case "watch":
		r, err := strconv.Atoi(d.Path[1])
		if err != nil || r <= 0 || r >= n.g.world || n.g.rank != 0 {
			return status.Errorf(codes.InvalidArgument, "watch of rank %q", d.Path[1])
		}
		return n.serveWatch(r, s)
	case "put", "get":
		c, err := parseQueueReq(in.meta)
		if err != nil {
			return err
		}
		q, err := n.queue(d.Path[1], c)
		if err != nil {
			return err
		}
		if d.Path[0] == "put" {
			return q.servePut(s)
		}
		return q.serveGet(s)
	case "pipe":
		r, err := strconv.Atoi(d.Path[1])
		if err != nil || r < 0 || r >= n.g.world || r == n.g.rank {
			return status.Errorf(codes.InvalidArgument, "pipe from rank %q", d.Path[1])
		}
		return n.servePipe(r, s)
	}
	return status.Errorf(codes.InvalidArgument, "unknown stream %q", d.Path[0])
}

// serveWatch is rank 0's side of rank r's watch stream: it answers once
// every rank watches, sends heartbeats, and fails the group if r goes
// without leaving.
func (n *node) serveWatch(r int, s flight.FlightService_DoExchangeServer) error {
	w := &watcher{s: s}
	n.mu.Lock()
	if _, dup := n.watchers[r]; dup {
		n.mu.Unlock()
		return status.Errorf(codes.AlreadyExists, "rank %d watches already", r)
	}
	n.watchers[r] = w
	n.notifyLocked()
	n.mu.Unlock()
	g := n.g

	recv := make(chan frame)
	ended := make(chan error, 1)
	quit := make(chan struct{})
	defer close(quit)
	go func() {
		for {
			var in inData
			if err := s.RecvMsg(&in); err != nil {
				ended <- err
				return
			}
			f, err := parseFrame(in.meta)
			if err != nil {
				ended <- err
				return
			}
			select {
			case recv <- f:
			case <-quit:
				return
			}
		}
	}()
	beat := time.NewTicker(g.o.heartbeat)
	defer beat.Stop()
	timeout := time.NewTimer(3 * g.o.heartbeat)
	defer timeout.Stop()
	lost := func(err error) error {
		n.mu.Lock()
		left := n.left[r]
		n.mu.Unlock()
		if !left {
			g.fail(&PeerError{Rank: r, Addr: g.peerAddr(r), Op: "watch", Err: fmt.Errorf("%w: %v", ErrPeerLost, err)}, true)
		}
		return nil
	}
	for {
		select {
		case f := <-recv:
			timeout.Reset(3 * g.o.heartbeat)
			switch f.Kind {
			case kindLeave:
				n.mu.Lock()
				n.left[r] = true
				n.notifyLocked()
				n.mu.Unlock()
				return nil
			case kindFail:
				g.fail(g.relayed(f), true)
				return nil
			}
		case err := <-ended:
			return lost(err)
		case <-timeout.C:
			return lost(fmt.Errorf("no word from it for %v", 3*g.o.heartbeat))
		case <-beat.C:
			if n.allWatching() {
				_ = w.send(frame{Kind: kindHeartbeat})
			}
		case <-g.ctx.Done():
			return nil // the failure was broadcast; closing the stream ends the rank's watch
		}
	}
}

// allWatching reports whether every other rank watches or has left.
func (n *node) allWatching() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.watchers) == n.g.world-1
}

// awaitWatched waits on rank 0 until every rank watches, then tells them
// the group is formed.
func (n *node) awaitWatched(ctx context.Context) error {
	for {
		n.mu.Lock()
		missing := []int{}
		for r := 1; r < n.g.world; r++ {
			if _, ok := n.watchers[r]; !ok {
				missing = append(missing, r)
			}
		}
		ch := n.changed
		n.mu.Unlock()
		if len(missing) == 0 {
			n.broadcast(frame{Kind: kindHeartbeat})
			return nil
		}
		select {
		case <-ch:
		case <-n.g.ctx.Done():
			return context.Cause(n.g.ctx)
		case <-ctx.Done():
			return fmt.Errorf("dist: the group of %d did not form: ranks %v registered but never watched: %w", n.g.world, missing, ctx.Err())
		}
	}
}

// awaitLeft waits on rank 0, for at most d, until every other rank has
// left or the group failed.
func (n *node) awaitLeft(ctx context.Context, d time.Duration) {
	awaitChange(ctx, d, func() (bool, <-chan struct{}) {
		n.mu.Lock()
		defer n.mu.Unlock()
		return len(n.left) >= n.g.world-1, n.changed
	})
}

// awaitChange waits, for at most d or until ctx ends, until done reports
// true; done also returns the channel closed at the next change.
func awaitChange(ctx context.Context, d time.Duration, done func() (bool, <-chan struct{})) {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		ok, ch := done()
		if ok {
			return
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return
		case <-t.C:
			return
		}
	}
}

// broadcast sends f to every watching rank.
func (n *node) broadcast(f frame) {
	n.mu.Lock()
	ws := make([]*watcher, 0, len(n.watchers))
	for _, w := range n.watchers {
		ws = append(ws, w)
	}
	n.mu.Unlock()
	for _, w := range ws {
		_ = w.send(f)
	}
}

// closeAll releases what the node holds: queued values, waiting pipes.
func (n *node) closeAll() {
	n.mu.Lock()
	qs := n.queues
	n.queues = map[string]*queueState{}
	n.mu.Unlock()
	for _, q := range qs {
		q.close()
	}
	n.offers.close()
}

// queueList returns the queues this rank owns.
func (n *node) queueList() []*queueState {
	n.mu.Lock()
	defer n.mu.Unlock()
	qs := make([]*queueState, 0, len(n.queues))
	for _, q := range n.queues {
		qs = append(qs, q)
	}
	return qs
}

// heldRefs returns the values by reference this rank's queues hold.
func (n *node) heldRefs() []*valueRef {
	var refs []*valueRef
	for _, q := range n.queueList() {
		q.mu.Lock()
		for _, it := range q.items {
			if it.ref != nil {
				refs = append(refs, it.ref)
			}
		}
		q.mu.Unlock()
	}
	return refs
}

// dropRef removes the value by reference ref from the queue holding it.
func (n *node) dropRef(ref *valueRef) {
	for _, q := range n.queueList() {
		q.mu.Lock()
		for i, it := range q.items {
			if it.ref == ref {
				q.items = slices.Delete(q.items, i, i+1)
				q.notifyLocked()
				break
			}
		}
		q.mu.Unlock()
	}
}

package dist

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"github.com/vmihailenco/msgpack/v5"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// How a rank joins the group and stays in it. At Init every rank claims
// its rank in rank 0's store, registers its address there (a peer) and
// reads every other rank's (rendezvous). A rank other than 0 then keeps
// a watch stream open to rank 0 (startWatch): both ends send heartbeats
// on it, a rank reports its failure or its leaving on it, and rank 0
// relays the group's first failure on it to every rank. Rank 0's end of
// the streams is node.serveWatch.

// peer is a rank as it registered in the store.
type peer struct {
	//lint:ignore U1000 the tag tells msgpack to use the array form
	_msgpack struct{} `msgpack:",as_array"`

	Addr  string
	Host  string
	PID   int
	Local string // the rank's mp endpoint, for ranks of its host
}

func rankKey(r int) string { return "tensormp/rank/" + strconv.Itoa(r) }

// rendezvous registers this rank in the store and waits for the others.
func (g *Group) rendezvous(ctx context.Context) error {
	st := g.Store()
	// Rank 0 may not listen yet: wait for it as long as ctx allows.
	var n int64
	for {
		var err error
		n, err = st.add(ctx, "tensormp/claim/"+strconv.Itoa(g.rank), 1, grpc.WaitForReady(true))
		if err == nil {
			break
		}
		if ctx.Err() != nil || !errors.Is(err, ErrPeerLost) {
			return fmt.Errorf("dist: rank %d reaching the store at %s: %w", g.rank, g.l.store, err)
		}
		select {
		case <-time.After(50 * time.Millisecond):
		case <-ctx.Done():
		}
	}
	if n != 1 {
		return fmt.Errorf("dist: rank %d is claimed by %d processes", g.rank, n)
	}
	me := &peer{Addr: g.lis.Addr().String(), Host: g.host, PID: os.Getpid()}
	if g.local != nil {
		me.Local = g.local.Addr()
	}
	reg, _ := msgpack.Marshal(me)
	if err := st.Set(ctx, rankKey(g.rank), reg); err != nil {
		return fmt.Errorf("dist: rank %d registering: %w", g.rank, err)
	}
	keys := make([]string, g.world)
	for r := range keys {
		keys[r] = rankKey(r)
	}
	peers := make([]peer, g.world)
	for r, k := range keys {
		v, err := st.Get(ctx, k, time.Until(deadline(ctx)))
		if err != nil {
			return g.missingErr(keys, err)
		}
		if err := unmarshal(v, &peers[r]); err != nil || peers[r].Addr == "" {
			return fmt.Errorf("dist: rank %d's registration is malformed", r)
		}
	}
	g.peersMu.Lock()
	g.peers = peers
	g.peersMu.Unlock()
	if g.rank == 0 {
		return g.node.awaitWatched(ctx)
	}
	return g.startWatch(ctx)
}

// missingErr names the ranks that did not register.
func (g *Group) missingErr(keys []string, cause error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	missing, err := g.Store().Missing(ctx, keys...)
	if err != nil {
		return fmt.Errorf("dist: the group of %d did not form: %w", g.world, cause)
	}
	ranks := make([]int, 0, len(missing))
	for _, k := range missing {
		r, _ := strconv.Atoi(k[len("tensormp/rank/"):])
		ranks = append(ranks, r)
	}
	return fmt.Errorf("dist: the group of %d did not form: ranks %v never registered: %w", g.world, ranks, cause)
}

func deadline(ctx context.Context) time.Time {
	d, ok := ctx.Deadline()
	if !ok {
		return time.Now().Add(time.Hour)
	}
	return d
}

// startWatch opens this rank's watch stream to rank 0 and serves it:
// heartbeats both ways, rank 0's news of a failure, and the loss of
// rank 0 itself.
func (g *Group) startWatch(ctx context.Context) error {
	c, err := g.client(0)
	if err != nil {
		return err
	}
	// The stream outlives the group's context: a failure this rank
	// reports on it must reach rank 0 before the stream is cancelled.
	wctx, wcancel := context.WithCancel(context.Background())
	g.watchEnd = wcancel
	s, err := c.DoExchange(wctx)
	if err != nil {
		return g.peerErr(0, "watch", err)
	}
	desc, _ := proto.Marshal(&flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{"watch", strconv.Itoa(g.rank)}})
	if err := s.SendMsg(&outData{desc: desc, meta: (&frame{Kind: kindHeartbeat, Rank: g.rank}).marshal()}); err != nil {
		return g.peerErr(0, "watch", err)
	}
	g.watchMu.Lock()
	g.watch = s
	g.watchMu.Unlock()
	g.wg.Add(1)
	go g.heartbeat()
	// Rank 0 answers once every rank watches: the group is formed.
	first := make(chan error, 1)
	go func() {
		var in inData
		err := s.RecvMsg(&in)
		if err == nil {
			var f frame
			if f, err = parseFrame(in.meta); err == nil && f.Kind == kindFail {
				err = g.relayed(f)
			}
		}
		first <- err
	}()
	select {
	case err := <-first:
		if err != nil {
			return fmt.Errorf("dist: rank %d joining: %w", g.rank, g.peerErr(0, "watch", err))
		}
	case <-ctx.Done():
		return fmt.Errorf("dist: rank %d waiting for the group to form: %w", g.rank, ctx.Err())
	}
	g.watchEnded = make(chan struct{})
	g.wg.Add(1)
	go g.watchRecv(s)
	return nil
}

// watchRecv reads rank 0's side of the watch stream until it ends.
func (g *Group) watchRecv(s flight.FlightService_DoExchangeClient) {
	defer g.wg.Done()
	defer close(g.watchEnded)
	got := make(chan struct{}, 1)
	lost := make(chan struct{})
	go func() { // the heartbeat bound
		t := time.NewTimer(3 * g.o.heartbeat)
		defer t.Stop()
		for {
			select {
			case <-got:
				t.Reset(3 * g.o.heartbeat)
			case <-t.C:
				close(lost)
				g.fail(fmt.Errorf("%w: no word from it for %v", ErrStoreLost, 3*g.o.heartbeat), false)
				return
			case <-g.ctx.Done():
				return
			}
		}
	}()
	for {
		var in inData
		err := s.RecvMsg(&in)
		if err != nil {
			select {
			case <-lost:
			default:
				if g.ctx.Err() == nil {
					g.fail(fmt.Errorf("%w: %v", ErrStoreLost, err), false)
				}
			}
			return
		}
		select {
		case got <- struct{}{}:
		default:
		}
		f, err := parseFrame(in.meta)
		if err != nil {
			g.fail(fmt.Errorf("%w: %v", ErrStoreLost, err), false)
			return
		}
		switch f.Kind {
		case kindFail:
			g.fail(g.relayed(f), false)
			return
		case kindLeave:
			g.fail(fmt.Errorf("%w: it left the group", ErrStoreLost), false)
			return
		}
	}
}

// relayed rebuilds a failure rank 0 told of.
func (g *Group) relayed(f frame) error {
	switch string(f.Data) {
	case "peer":
		return &PeerError{Rank: f.Rank, Addr: g.peerAddr(f.Rank), Op: "group", Err: fmt.Errorf("%w: %s", ErrPeerLost, f.Err)}
	case "rank":
		return &RankError{Rank: f.Rank, Err: errors.New(f.Err)}
	}
	return fmt.Errorf("dist: the group failed: %s", f.Err)
}

// heartbeat tells rank 0 this rank is alive, every heartbeat interval.
func (g *Group) heartbeat() {
	defer g.wg.Done()
	t := time.NewTicker(g.o.heartbeat)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			g.sendWatch(frame{Kind: kindHeartbeat, Rank: g.rank})
		case <-g.ctx.Done():
			return
		}
	}
}

// sendWatch sends f to rank 0 on the watch stream, if there is one.
func (g *Group) sendWatch(f frame) {
	g.watchMu.Lock()
	defer g.watchMu.Unlock()
	if g.watch == nil {
		return
	}
	if err := g.watch.SendMsg(&outData{meta: f.marshal()}); err != nil {
		return
	}
	if f.Kind == kindLeave || f.Kind == kindFail {
		_ = g.watch.CloseSend()
	}
}

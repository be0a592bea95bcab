package dist

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc"

	"github.com/tensormp/tensormp/mp"
)

// Group is this process's membership of a group of ranks: its Flight
// server, its connections to the others, and the group's fate. The first
// failure anywhere in the group (a rank lost, a rank's Abort) ends the
// group on every rank: Context is cancelled and Wait returns the cause.
// dist does no elastic membership: a failed group is restarted whole by
// the launcher's policy (torchrun --max-restarts, srun
// --kill-on-bad-exit).
//
// A Group owns its listener, its server and its connections; Close
// releases them.
type Group struct {
	rank, world int
	o           options
	l           launch
	host        string

	srv   *grpc.Server
	lis   net.Listener
	node  *node
	local *mp.Listener // the same-host endpoint, if one could be made

	peersMu sync.Mutex
	peers   []peer
	conns   map[connKey]*grpc.ClientConn

	ctx    context.Context
	cancel context.CancelCauseFunc
	failMu sync.Mutex
	err    error // the group's first failure
	done   chan struct{}

	watchMu    sync.Mutex
	watch      flight.FlightService_DoExchangeClient // rank > 0: the stream to rank 0
	watchEnd   context.CancelFunc                    // cancels the watch stream
	watchEnded chan struct{}                         // closed when watchRecv returns

	closeOnce sync.Once
	wg        sync.WaitGroup
}

// Init joins the group this process belongs to. It reads the launcher's
// environment (torchrun --no-python, Slurm srun, Kubeflow's PyTorchJob,
// MPI) unless options say the rank and store, starts this rank's Flight
// server, registers it in rank 0's store, and returns once every rank
// has registered and is watched, or with an error naming the ranks still
// missing when the timeout ends. Rank 0 serves the store at the store
// address.
func Init(ctx context.Context, opts ...Option) (*Group, error) {
	o := options{timeout: 5 * time.Minute, heartbeat: time.Second, chunk: DefaultChunk, refAbove: DefaultReferenceAbove,
		lease: DefaultLease, pullConns: DefaultPullConns, rank: -1, getenv: os.Getenv}
	for _, f := range opts {
		f(&o)
	}
	if o.lease <= 0 {
		return nil, fmt.Errorf("dist: a lease of %v", o.lease)
	}
	if o.pullConns < 1 || o.pullConns > MaxPullConns {
		return nil, fmt.Errorf("dist: %d connections per pull: must be 1 to %d", o.pullConns, MaxPullConns)
	}
	l, found, err := detect(o.getenv)
	if err != nil {
		return nil, err
	}
	if o.rank >= 0 {
		if o.world < 1 || o.rank >= o.world {
			return nil, fmt.Errorf("dist: rank %d of a group of %d", o.rank, o.world)
		}
		l.rank, l.world = o.rank, o.world
		if !found {
			l.launcher = "explicit"
		}
	} else if !found {
		return nil, errors.New("dist: no launcher environment (torchrun, Slurm, Kubeflow, MPI) and no WithRank")
	}
	if o.store != "" {
		l.store = o.store
	}
	if l.store == "" {
		return nil, fmt.Errorf("dist: %s: no store address: use WithStore", l.launcher)
	}
	if _, _, err := net.SplitHostPort(l.store); err != nil {
		return nil, fmt.Errorf("dist: store address %q: %w", l.store, err)
	}
	switch {
	case o.addr != "":
		l.bind = o.addr
	case l.bind != "":
	case l.remote:
		if l.bind, err = routeTo(l.store); err != nil {
			return nil, fmt.Errorf("dist: finding the address that reaches the store %s: %w", l.store, err)
		}
	default:
		l.bind = "127.0.0.1"
	}

	g := &Group{rank: l.rank, world: l.world, o: o, l: l, host: hostID(), conns: map[connKey]*grpc.ClientConn{}, done: make(chan struct{})}
	g.ctx, g.cancel = context.WithCancelCause(context.Background())
	if err := g.serve(); err != nil {
		return nil, err
	}
	g.listenLocal()
	ictx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	if err := g.rendezvous(ictx); err != nil {
		g.shutdown(0)
		return nil, err
	}
	return g, nil
}

// Rank returns this process's rank.
func (g *Group) Rank() int { return g.rank }

// Size returns the number of ranks.
func (g *Group) Size() int { return g.world }

// Addr returns the address this rank serves on.
func (g *Group) Addr() string { return g.lis.Addr().String() }

// Context returns a context cancelled when the group fails or closes;
// context.Cause gives the failure.
func (g *Group) Context() context.Context { return g.ctx }

// Store returns the group's store client.
func (g *Group) Store() *Store { return &Store{g: g} }

// Wait blocks until the group fails or this rank closes it, and returns
// the failure, or nil after a clean Close.
func (g *Group) Wait() error {
	<-g.done
	return g.Err()
}

// Err returns the group's failure so far, or nil.
func (g *Group) Err() error {
	g.failMu.Lock()
	defer g.failMu.Unlock()
	if errors.Is(g.err, ErrClosed) {
		return nil
	}
	return g.err
}

// Abort fails the group with err as this rank's failure: every rank's
// Context is cancelled and Wait returns a *RankError.
func (g *Group) Abort(err error) {
	g.fail(&RankError{Rank: g.rank, Err: err}, true)
}

// fail records the group's first failure and ends the group here; with
// report, it tells rank 0 (which tells everyone) or, on rank 0, every
// rank.
func (g *Group) fail(err error, report bool) {
	g.failMu.Lock()
	if g.err != nil {
		g.failMu.Unlock()
		return
	}
	g.err = err
	g.failMu.Unlock()
	// Tell the others before cancelling: the watch streams end with the
	// group's context, and the news must be on them first.
	if report && !errors.Is(err, ErrClosed) {
		f := frame{Kind: kindFail, Rank: g.rank, Err: err.Error()}
		var re *RankError
		var pe *PeerError
		switch {
		case errors.As(err, &pe):
			f.Rank, f.Err = pe.Rank, pe.Err.Error()
			f.Data = []byte("peer")
		case errors.As(err, &re):
			f.Data = []byte("rank")
		}
		if g.rank == 0 {
			g.node.broadcast(f)
		} else {
			g.sendWatch(f)
		}
	}
	g.cancel(err)
	close(g.done)
}

// Close leaves the group. It first waits, for at most a lease, until the
// values this rank put by reference were taken. Rank 0 then waits (at
// most the group's timeout) for the other ranks to leave first, since
// they may still use its store and queues. Close is idempotent and safe
// to call from any goroutine.
func (g *Group) Close() error {
	g.closeOnce.Do(func() {
		g.node.offers.drain(g.ctx, g.o.lease)
		if g.rank == 0 {
			g.node.awaitLeft(g.ctx, g.o.timeout)
		} else {
			g.sendWatch(frame{Kind: kindLeave, Rank: g.rank})
		}
		g.fail(ErrClosed, false)
		g.shutdown(5 * time.Second)
	})
	return nil
}

// shutdown stops the server (gracefully for up to grace) and closes the
// connections.
func (g *Group) shutdown(grace time.Duration) {
	g.cancel(ErrClosed)
	stopped := make(chan struct{})
	go func() { g.srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(grace):
		g.srv.Stop()
		<-stopped
	}
	if g.watchEnd != nil {
		if g.watchEnded != nil {
			// Rank 0 ends the stream once it has read this rank's last
			// word; give it that long before cutting the stream.
			select {
			case <-g.watchEnded:
			case <-time.After(3 * g.o.heartbeat):
			}
		}
		g.watchEnd()
	}
	if g.local != nil {
		_ = g.local.Close()
	}
	g.peersMu.Lock()
	for _, c := range g.conns {
		_ = c.Close()
	}
	g.conns = nil
	g.peersMu.Unlock()
	g.node.closeAll()
	g.wg.Wait()
}

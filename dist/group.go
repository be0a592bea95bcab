package dist

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"github.com/vmihailenco/msgpack/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensormp/tensormp/mp"
)

// Option configures Init.
type Option func(*options)

type options struct {
	rank, world int
	store       string
	addr        string
	timeout     time.Duration
	heartbeat   time.Duration
	chunk       int
	maxValue    int64
	refAbove    int64
	lease       time.Duration
	pullConns   int
	noLocal     bool
	serverTLS   *tls.Config
	clientTLS   *tls.Config
	token       string
	getenv      func(string) string
}

// WithRank sets this process's rank and the group's size, overriding a
// launcher's environment.
func WithRank(rank, world int) Option {
	return func(o *options) { o.rank, o.world = rank, world }
}

// WithStore sets where rank 0 serves the group's store, host:port.
func WithStore(addr string) Option { return func(o *options) { o.store = addr } }

// WithAddr sets the IP address this rank listens on. By default a rank
// listens on loopback, or, under a launcher, on the address its host
// uses to reach rank 0 (TENSORMP_DIST_ADDR overrides both).
func WithAddr(ip string) Option { return func(o *options) { o.addr = ip } }

// WithTimeout bounds how long the group may take to form, and a store
// Get or Wait that names no bound of its own. The default is 5 minutes.
func WithTimeout(d time.Duration) Option { return func(o *options) { o.timeout = d } }

// WithHeartbeat sets how often ranks and rank 0 tell each other they are
// alive. A rank not heard from for three intervals is lost: a process
// that dies is noticed at once (its connection closes), one whose host
// or link goes away within 3 × d. The default is 1 second.
func WithHeartbeat(d time.Duration) Option { return func(o *options) { o.heartbeat = d } }

// WithChunk sets the size of the record batches tensors travel in
// (default DefaultChunk, 1 MiB).
func WithChunk(n int) Option { return func(o *options) { o.chunk = n } }

// WithMaxValue bounds the bytes of tensors one received value may hold
// (default: what the shared-memory directory has free). A value is given
// its memory when its first message announces its size, before its bytes
// arrive; the bound keeps a peer from making this host allocate more.
func WithMaxValue(n int64) Option { return func(o *options) { o.maxValue = n } }

// WithTLS serves and dials with TLS: server is this rank's listener's
// configuration, client the one it dials its peers with.
func WithTLS(server, client *tls.Config) Option {
	return func(o *options) { o.serverTLS, o.clientTLS = server, client }
}

// WithToken makes every call carry "authorization: Bearer token", as
// Flight's token authentication does, and refuses calls that do not.
func WithToken(token string) Option { return func(o *options) { o.token = token } }

// WithReferenceAbove sends a queued value whose tensors come to n bytes or
// more by reference (default DefaultReferenceAbove; 0: never): its owner
// queues a ticket, and the getter pulls the tensors from the putter. A
// queue's owner also lends a value that large, which it holds itself, to
// a getter on another host, which pulls it the same way.
func WithReferenceAbove(n int64) Option { return func(o *options) { o.refAbove = n } }

// WithSameHostShortcut turns the same-host shortcut on (the default) or
// off: with it, a Pipe between ranks of one host is an mp.Pipe, and a
// Put or Get on a queue whose owner is another rank of this host goes
// over one.
func WithSameHostShortcut(on bool) Option { return func(o *options) { o.noLocal = !on } }

// WithLease sets how long a putter keeps a value by reference that nobody
// renews (default DefaultLease). The queue's owner renews its values
// every third of it, so a lease ends only when the owner is gone or the
// value was dropped.
func WithLease(d time.Duration) Option { return func(o *options) { o.lease = d } }

// WithPullConns sets over how many connections a getter pulls a value by
// reference from its putter (default DefaultPullConns; at most
// MaxPullConns). Each connection carries every n-th chunk of the value,
// so that receiving, which one gRPC connection does on one goroutine,
// runs on several cores. The extra connections are dialled at the first
// pull from a rank.
func WithPullConns(n int) Option { return func(o *options) { o.pullConns = n } }

// DefaultPullConns is the connections a pull uses unless WithPullConns
// says otherwise.
const DefaultPullConns = 2

// MaxPullConns bounds WithPullConns.
const MaxPullConns = 16

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

// peer is a rank as it registered in the store.
type peer struct {
	//lint:ignore U1000 the tag tells msgpack to use the array form
	_msgpack struct{} `msgpack:",as_array"`

	Addr  string
	Host  string
	PID   int
	Local string // the rank's mp endpoint, for ranks of its host
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

// serve starts this rank's Flight server: on the store's port for rank 0,
// on a free port for the others.
func (g *Group) serve() error {
	port := "0"
	if g.rank == 0 {
		_, port, _ = net.SplitHostPort(g.l.store)
	}
	addr := net.JoinHostPort(g.l.bind, port)
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("dist: rank %d listening on %s: %w", g.rank, addr, err)
	}
	sopts := []grpc.ServerOption{
		grpc.ForceServerCodecV2(newFlightCodec()),
		grpc.MaxRecvMsgSize(maxMessage),
		grpc.InitialWindowSize(window), grpc.InitialConnWindowSize(window),
		grpc.WriteBufferSize(ioBuffer), grpc.ReadBufferSize(ioBuffer),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 2 * time.Second, Timeout: 3 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
	}
	if g.o.serverTLS != nil {
		sopts = append(sopts, grpc.Creds(credentials.NewTLS(g.o.serverTLS)))
	}
	if g.o.token != "" {
		sopts = append(sopts, grpc.ChainUnaryInterceptor(tokenUnary(g.o.token)), grpc.ChainStreamInterceptor(tokenStream(g.o.token)))
	}
	g.lis = lis
	g.srv = grpc.NewServer(sopts...)
	g.node = newNode(g)
	flight.RegisterFlightServiceServer(g.srv, g.node)
	g.wg.Add(2)
	go func() {
		defer g.wg.Done()
		_ = g.srv.Serve(lis)
	}()
	go g.renewLoop()
	return nil
}

// maxMessage bounds a received gRPC message: a chunk and its headers,
// with room for peers that chunk larger than tensormp does.
const maxMessage = 64 << 20

// window is gRPC's flow-control window per stream and per connection.
const window = 16 << 20

// ioBuffer is the size of gRPC's socket buffers: 64 HTTP/2 frames per
// write and read, rather than two.
const ioBuffer = 1 << 20

// connKey names a connection to a rank: line 0 carries every call, lines
// 1 and up the extra stripes of pulls.
type connKey struct{ rank, line int }

// client returns a Flight client of rank r, dialling it on first use.
func (g *Group) client(r int) (flight.FlightServiceClient, error) {
	return g.clientOn(r, 0)
}

// clientOn returns a Flight client of rank r on connection line,
// dialling it on first use.
func (g *Group) clientOn(r, line int) (flight.FlightServiceClient, error) {
	g.peersMu.Lock()
	defer g.peersMu.Unlock()
	if g.conns == nil {
		return nil, ErrClosed
	}
	if c, ok := g.conns[connKey{r, line}]; ok {
		return flight.NewFlightServiceClient(c), nil
	}
	addr := g.l.store
	if r != 0 || g.peers != nil {
		if r < 0 || r >= len(g.peers) {
			return nil, fmt.Errorf("dist: no rank %d in a group of %d", r, g.world)
		}
		addr = g.peers[r].Addr
	}
	creds := insecure.NewCredentials()
	if g.o.clientTLS != nil {
		creds = credentials.NewTLS(g.o.clientTLS)
	}
	dopts := []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithInitialWindowSize(window), grpc.WithInitialConnWindowSize(window),
		grpc.WithWriteBufferSize(ioBuffer), grpc.WithReadBufferSize(ioBuffer),
		grpc.WithDisableRetry(), // a retried message would hold tensors' memory in gRPC
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second}, MinConnectTimeout: 5 * time.Second}),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(newFlightCodec()), grpc.MaxCallRecvMsgSize(maxMessage)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 3 * time.Second, PermitWithoutStream: true}),
	}
	if g.o.token != "" {
		dopts = append(dopts, grpc.WithPerRPCCredentials(tokenCreds{g.o.token, g.o.clientTLS != nil}))
	}
	c, err := grpc.NewClient("passthrough:///"+addr, dopts...)
	if err != nil {
		return nil, fmt.Errorf("dist: dialling rank %d at %s: %w", r, addr, err)
	}
	g.conns[connKey{r, line}] = c
	return flight.NewFlightServiceClient(c), nil
}

// peerAddr returns rank r's address, or "".
func (g *Group) peerAddr(r int) string {
	g.peersMu.Lock()
	defer g.peersMu.Unlock()
	if r >= 0 && r < len(g.peers) {
		return g.peers[r].Addr
	}
	if r == 0 {
		return g.l.store
	}
	return ""
}

// peerErr turns a failed call with rank r into the group's failure, if
// the group failed, or a *PeerError when the peer is unreachable.
func (g *Group) peerErr(r int, op string, err error) error {
	if err == nil {
		return nil
	}
	if cause := context.Cause(g.ctx); cause != nil {
		return cause
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.Canceled, codes.Aborted:
		return &PeerError{Rank: r, Addr: g.peerAddr(r), Op: op, Err: fmt.Errorf("%w: %v", ErrPeerLost, err)}
	}
	return fmt.Errorf("dist: %s with rank %d: %w", op, r, err)
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

// opContext returns a context that ends with ctx or with the group.
func (g *Group) opContext(ctx context.Context) (context.Context, context.CancelFunc) {
	c, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(g.ctx, func() { cancel(context.Cause(g.ctx)) })
	return c, func() { stop(); cancel(context.Canceled) }
}

// opErr is the error of an operation with rank r that failed with err
// under ctx (from opContext).
func (g *Group) opErr(ctx context.Context, r int, op string, err error) error {
	if err == nil {
		return nil
	}
	if cause := context.Cause(g.ctx); cause != nil {
		return cause
	}
	if ctx.Err() != nil {
		if c := context.Cause(ctx); c != nil {
			return c
		}
		return ctx.Err()
	}
	if errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return g.peerErr(r, op, err)
}

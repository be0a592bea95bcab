package dist

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
)

// This rank's Flight server, started at Init (serve); its connections to
// the other ranks, dialled at first use (clientOn); and how a failed call
// with a rank becomes an error (peerErr, opErr): the group's failure if
// the group has failed, a *PeerError if the rank is unreachable.

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

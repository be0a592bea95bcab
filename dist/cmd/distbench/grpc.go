package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
)

// The grpc case is the engine's own floor: the child streams each tensor
// to the parent as -chunk byte messages over -conns gRPC streams, one per
// connection, each carrying every -conns-th chunk as a striped pull does,
// with the windows and socket buffers package dist sets, and nothing
// else. The child hands gRPC its buffer without a copy and the parent
// drops what it receives, so neither end copies outside gRPC and the
// kernel. dist's cases do all of this plus Arrow's framing, the putter's
// copy into an offer and the getter's copy into shared memory.
//
// The child dials the parent, as in the tcp case, and serves the streams
// on the connections it dialled; the parent is the gRPC client, as the
// getter is in dist's cases.

// As package dist sets them (see its serve and client).
const (
	grpcWindow   = 16 << 20
	grpcIOBuffer = 1 << 20
	grpcMaxMsg   = 64 << 20
)

// pullStream is the floor's one method: the client sends an empty
// message and the server answers with the whole stream.
var pullStream = grpc.StreamDesc{StreamName: "Pull", ServerStreams: true}

const pullMethod = "/distbench.Floor/Pull"

// piece is a message of the floor's stream: bytes lent to gRPC on the
// way out, or what gRPC received on the way in.
type piece struct{ b mem.BufferSlice }

// rawCodec passes pieces to and from gRPC as they are.
type rawCodec struct{}

func (rawCodec) Name() string { return "distbench-raw" }

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	p, ok := v.(*piece)
	if !ok {
		return nil, fmt.Errorf("distbench: cannot marshal %T", v)
	}
	return p.b, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	p, ok := v.(*piece)
	if !ok {
		return fmt.Errorf("distbench: cannot unmarshal into %T", v)
	}
	p.b = nil
	if data.Len() > 0 {
		data.Ref() // gRPC frees data once Unmarshal returns: keep it for the caller
		p.b = data
	}
	return nil
}

func benchGRPC(size, n int, addr string) (result, error) {
	l, ch, err := listenFor("grpc", size, n, addr)
	if err != nil {
		return result{}, err
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var (
		mu       sync.Mutex
		got      int // bytes received on every stream
		start    time.Time
		cpu0     time.Duration
		childCPU time.Duration
	)
	// count adds n received bytes; the clock starts once the first -warm
	// tensors are in.
	count := func(n int) {
		mu.Lock()
		defer mu.Unlock()
		got += n
		if start.IsZero() && got >= warm*size {
			start, cpu0 = time.Now(), cpu()
		}
	}
	errs := make(chan error, conns)
	for range conns {
		c, err := l.Accept()
		if err != nil {
			return result{}, err
		}
		go func() {
			used, err := pullFloor(ctx, c, count)
			mu.Lock()
			childCPU = max(childCPU, used) // each stream reports the whole child's
			mu.Unlock()
			errs <- err
		}()
	}
	for range conns {
		if err := <-errs; err != nil {
			cancel()
			_ = ch.wait()
			return result{}, err
		}
	}
	elapsed, used := time.Since(start), cpu()-cpu0
	if err := ch.wait(); err != nil {
		return result{}, err
	}
	if got != n*size {
		return result{}, fmt.Errorf("got %d bytes, sent %d", got, n*size)
	}
	return newResult("grpc", size, n-warm, elapsed, used+childCPU), nil
}

// pullFloor reads one of the floor's streams as a gRPC client on c,
// which it closes, counting what arrives; it returns the child's CPU time
// that the stream's trailer reports.
func pullFloor(ctx context.Context, c net.Conn, count func(int)) (time.Duration, error) {
	var once sync.Once
	dial := func(context.Context, string) (net.Conn, error) {
		err := errors.New("distbench: the floor's connection is gone")
		var got net.Conn
		once.Do(func() { got, err = c, nil })
		return got, err
	}
	cc, err := grpc.NewClient("passthrough:///floor",
		grpc.WithContextDialer(dial),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(grpcWindow), grpc.WithInitialConnWindowSize(grpcWindow),
		grpc.WithWriteBufferSize(grpcIOBuffer), grpc.WithReadBufferSize(grpcIOBuffer),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawCodec{}), grpc.MaxCallRecvMsgSize(grpcMaxMsg)))
	if err != nil {
		_ = c.Close()
		return 0, err
	}
	defer cc.Close() // the child's server waits for the parent to hang up
	s, err := cc.NewStream(ctx, &pullStream, pullMethod)
	if err != nil {
		return 0, err
	}
	if err := s.SendMsg(&piece{}); err != nil {
		return 0, err
	}
	if err := s.CloseSend(); err != nil {
		return 0, err
	}
	for {
		var p piece
		err := s.RecvMsg(&p)
		if err == io.EOF {
			break
		}
		if err != nil {
			return 0, err
		}
		count(p.b.Len())
		p.b.Free()
	}
	used, err := strconv.ParseInt(firstOf(s.Trailer().Get("cpu")), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("the child's CPU time: %w", err)
	}
	return time.Duration(used), nil
}

func firstOf(vs []string) string {
	if len(vs) == 0 {
		return ""
	}
	return vs[0]
}

// childGRPC dials the parent at target -conns times and serves the
// floor's streams on those connections: n tensors of size bytes, chunk
// bytes to a message, every conns-th chunk on each stream.
func childGRPC(size, n int, target string) error {
	buf := make([]byte, size)
	for i := range buf {
		buf[i] = byte(i)
	}
	var cpu0 atomic.Int64 // the child's CPU time when the first stream passed the warm-up
	cpu0.Store(-1)
	errs := make(chan error, conns)
	for part := range conns {
		c, err := net.Dial("tcp", target)
		if err != nil {
			return err
		}
		go func() { errs <- serveFloor(c, buf, n, stripe{part, conns}, &cpu0) }()
	}
	for range conns {
		if err := <-errs; err != nil {
			return err
		}
	}
	return nil
}

// stripe is the share of the chunks one of the floor's streams carries:
// chunk number c if c%parts == part.
type stripe struct{ part, parts int }

func (s stripe) carries(c int) bool { return c%s.parts == s.part }

// serveFloor serves one floor stream on c: stripe st of n copies of buf.
func serveFloor(c net.Conn, buf []byte, n int, st stripe, cpu0 *atomic.Int64) error {
	done := make(chan error, 1)
	pull := func(s grpc.ServerStream) error {
		var req piece
		if err := s.RecvMsg(&req); err != nil {
			return err
		}
		var chunks int
		for i := range n {
			if i == warm {
				cpu0.CompareAndSwap(-1, int64(cpu()))
			}
			for off := 0; off < len(buf); off += chunk {
				c := chunks
				chunks++
				if !st.carries(c) {
					continue
				}
				// A SliceBuffer lends buf: gRPC writes from it, no copy.
				p := piece{b: mem.BufferSlice{mem.SliceBuffer(buf[off:min(off+chunk, len(buf))])}}
				if err := s.SendMsg(&p); err != nil {
					return err
				}
			}
		}
		s.SetTrailer(metadata.Pairs("cpu", strconv.FormatInt(int64(cpu())-cpu0.Load(), 10)))
		return nil
	}
	desc := grpc.ServiceDesc{
		ServiceName: "distbench.Floor",
		HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{{StreamName: pullStream.StreamName, ServerStreams: true,
			Handler: func(_ any, s grpc.ServerStream) error {
				err := pull(s)
				done <- err
				return err
			}}},
	}
	srv := grpc.NewServer(
		grpc.ForceServerCodecV2(rawCodec{}),
		grpc.MaxRecvMsgSize(grpcMaxMsg),
		grpc.InitialWindowSize(grpcWindow), grpc.InitialConnWindowSize(grpcWindow),
		grpc.WriteBufferSize(grpcIOBuffer), grpc.ReadBufferSize(grpcIOBuffer))
	srv.RegisterService(&desc, struct{}{})
	go func() { _ = srv.Serve(&oneConn{c: c, closed: make(chan struct{})}) }()
	var err error
	select {
	case err = <-done:
		srv.GracefulStop() // returns once the parent has read the trailer and hung up
	case <-time.After(5 * time.Minute):
		srv.Stop()
		err = errors.New("the parent never pulled the stream")
	}
	return err
}

// oneConn is a net.Listener that yields one connection, then blocks until
// it is closed.
type oneConn struct {
	mu     sync.Mutex
	c      net.Conn
	closed chan struct{}
	once   sync.Once
}

func (l *oneConn) Accept() (net.Conn, error) {
	l.mu.Lock()
	c := l.c
	l.c = nil
	l.mu.Unlock()
	if c != nil {
		return c, nil
	}
	<-l.closed
	return nil, net.ErrClosed
}

func (l *oneConn) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

func (l *oneConn) Addr() net.Addr { return &net.TCPAddr{} }

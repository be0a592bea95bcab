package dist

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/protobuf/proto"

	"github.com/tensormp/tensormp/mp"
)

// Pipe is a two-way channel between two ranks over one Flight DoExchange
// stream. Values are anything package reduction carries; each tensor is
// a copy on the receiving rank, in a pooled shared-memory block of its
// host.
//
// Between two ranks of one host a Pipe is an mp.Pipe instead, over the
// ranks' named endpoints: tensors are shared, not copied, exactly as
// between mp's processes (a write on one side is seen on the other).
//
// Send and Recv may be called from two goroutines at once. A call whose
// ctx ends before it is done breaks the pipe: the stream cannot be
// resumed mid-value. Close ends it; the peer's Recv then returns io.EOF.
type Pipe struct {
	g    *Group
	peer int

	local *mp.Pipe // between ranks of one host

	sendMu sync.Mutex
	w      *writer
	recvMu sync.Mutex
	r      *reader

	closeSend func() error
	end       context.CancelFunc
	once      sync.Once
}

// pipeConn is a pipe stream another rank opened to this one, waiting for
// this rank's Pipe call.
type pipeConn struct {
	s    flight.FlightService_DoExchangeServer
	done chan struct{} // closed when the Pipe closes
}

// Pipe returns a pipe to rank peer. Both ranks call Pipe with each
// other's rank; the lower rank dials, the higher one waits (while ctx
// lasts) for it.
func (g *Group) Pipe(ctx context.Context, peer int) (*Pipe, error) {
	if peer < 0 || peer >= g.world || peer == g.rank {
		return nil, fmt.Errorf("dist: a pipe from rank %d to rank %d in a group of %d", g.rank, peer, g.world)
	}
	p := &Pipe{g: g, peer: peer}
	if addr, ok := g.sameHost(peer); ok && g.rank < peer {
		lp, err := g.dialLocal(ctx, peer, addr, localHello{Op: "pipe"})
		if err == nil {
			p.local = lp
			return p, nil
		}
		// No shortcut after all: the peer waits on both paths.
	}
	if g.rank < peer {
		sctx, cancel := context.WithCancel(g.ctx)
		c, err := g.client(peer)
		if err != nil {
			cancel()
			return nil, err
		}
		s, err := exchange(sctx, c)
		if err != nil {
			cancel()
			return nil, g.peerErr(peer, "pipe", err)
		}
		desc, _ := proto.Marshal(&flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{"pipe", strconv.Itoa(g.rank)}})
		if err := s.SendMsg(&outData{desc: desc}); err != nil {
			cancel()
			return nil, g.peerErr(peer, "pipe", err)
		}
		p.w, p.r = newWriter(s, g.o.chunk), newReader(s, g.o.maxValue)
		p.closeSend, p.end = s.CloseSend, cancel
		return p, nil
	}
	ch := g.node.pipeChan(peer)
	select {
	case lp := <-g.node.localChan(peer):
		p.local = lp
		return p, nil
	case pc := <-ch:
		p.w, p.r = newWriter(pc.s, g.o.chunk), newReader(pc.s, g.o.maxValue)
		var once sync.Once
		p.closeSend = func() error { once.Do(func() { close(pc.done) }); return nil }
		p.end = func() { _ = p.closeSend() }
		return p, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("dist: waiting for rank %d's pipe: %w", peer, ctx.Err())
	case <-g.ctx.Done():
		return nil, context.Cause(g.ctx)
	}
}

// Send sends v. Its tensors' memory goes to the network without a copy;
// once Send returns they are the caller's again.
func (p *Pipe) Send(ctx context.Context, v any) error {
	if p.local != nil {
		ctx, cancel := p.g.opContext(ctx)
		defer cancel()
		return p.localErr(ctx, "pipe send", p.local.Send(ctx, v))
	}
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	stop := context.AfterFunc(ctx, p.end)
	defer stop()
	if err := p.w.send(v); err != nil {
		return p.err(ctx, "pipe send", err)
	}
	return nil
}

// Recv receives the next value into v, a pointer.
func (p *Pipe) Recv(ctx context.Context, v any) error {
	if p.local != nil {
		ctx, cancel := p.g.opContext(ctx)
		defer cancel()
		err := p.local.Recv(ctx, v)
		if errors.Is(err, mp.ErrClosed) && p.g.ctx.Err() == nil && ctx.Err() == nil {
			return io.EOF
		}
		return p.localErr(ctx, "pipe recv", err)
	}
	p.recvMu.Lock()
	defer p.recvMu.Unlock()
	stop := context.AfterFunc(ctx, p.end)
	defer stop()
	f, err := p.r.next()
	if err != nil {
		if errors.Is(err, io.EOF) && p.g.ctx.Err() == nil && ctx.Err() == nil {
			return io.EOF
		}
		return p.err(ctx, "pipe recv", err)
	}
	if err := p.r.value(f, v); err != nil {
		return p.err(ctx, "pipe recv", err)
	}
	return nil
}

func (p *Pipe) err(ctx context.Context, op string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("dist: %s: the pipe to rank %d is broken: %w", op, p.peer, ctx.Err())
	}
	return p.g.opErr(ctx, p.peer, op, err)
}

// localErr is the error of a same-host pipe's call.
func (p *Pipe) localErr(ctx context.Context, op string, err error) error {
	if err == nil {
		return nil
	}
	if cause := context.Cause(p.g.ctx); cause != nil {
		return cause
	}
	if ctx.Err() != nil {
		return fmt.Errorf("dist: %s with rank %d: %w", op, p.peer, context.Cause(ctx))
	}
	return fmt.Errorf("dist: %s with rank %d: %w", op, p.peer, err)
}

// Close ends the pipe. It is idempotent.
func (p *Pipe) Close() error {
	p.once.Do(func() {
		if p.local != nil {
			_ = p.local.Close()
			return
		}
		_ = p.closeSend()
		p.end()
	})
	return nil
}

// pipeChan returns the channel on which pipes from rank r arrive.
func (n *node) pipeChan(r int) chan *pipeConn {
	n.mu.Lock()
	defer n.mu.Unlock()
	ch, ok := n.pipes[r]
	if !ok {
		ch = make(chan *pipeConn)
		n.pipes[r] = ch
	}
	return ch
}

// servePipe hands a pipe stream from rank r to this rank's Pipe call and
// keeps it open until the pipe closes.
func (n *node) servePipe(r int, s flight.FlightService_DoExchangeServer) error {
	pc := &pipeConn{s: s, done: make(chan struct{})}
	select {
	case n.pipeChan(r) <- pc:
	case <-s.Context().Done():
		return nil
	}
	select {
	case <-pc.done:
	case <-s.Context().Done():
	}
	return nil
}

// mustSchema returns the stream's schema message, for stock readers.
func mustSchema() []byte {
	h, err := schemaHeader()
	if err != nil {
		panic(err) // a fixed one-column schema always serialises
	}
	return h
}

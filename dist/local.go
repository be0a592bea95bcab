package dist

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

// The same-host shortcut. Every rank also listens on a named endpoint of
// package mp (an abstract Unix socket name, so nothing is left behind),
// registered with its address. A Pipe between two ranks of one host is
// an mp.Pipe over it, and so is each Put and Get of a queue whose owner
// is another rank of the same host: tensors travel as shared memory, on
// mp's descriptor path, not through the network stack. The dialling rank
// says who it is and what it wants (a hello); the listener checks that
// against the kernel's credentials of the connection (the registered
// process ID) before serving it.

// localHello is the first message on a same-host connection.
type localHello struct {
	Rank  int    // the dialler
	Op    string // "pipe", "put" or "get"
	Queue string // for put and get
	Cap   int    // for put and get: the queue's capacity if it is new
}

// listenLocal starts this rank's endpoint; a host where it cannot be
// made simply has no shortcut.
func (g *Group) listenLocal() {
	if g.o.noLocal {
		return
	}
	var id [12]byte
	_, _ = rand.Read(id[:])
	name := "@tensormp-dist-" + hex.EncodeToString(id[:])
	l, err := mp.Listen(name)
	if err != nil {
		return
	}
	g.local = l
	g.wg.Add(1)
	go g.acceptLocal()
}

// acceptLocal hands pipes dialled by same-host ranks to their Pipe
// calls until the listener closes.
func (g *Group) acceptLocal() {
	defer g.wg.Done()
	for {
		p, cred, err := g.local.Accept(g.ctx)
		if errors.Is(err, mp.ErrClosed) || g.ctx.Err() != nil {
			return
		}
		if err != nil {
			continue // a refused peer
		}
		g.wg.Add(1) // while this loop runs, so the group's count is not zero
		go g.admitLocal(p, cred)
	}
}

// admitLocal reads who dialled p and what for, and serves it if the
// kernel agrees that it is that rank's process. It owns p until it hands
// it to a Pipe call.
func (g *Group) admitLocal(p *mp.Pipe, cred mp.Cred) {
	defer g.wg.Done()
	ctx, cancel := context.WithTimeout(g.ctx, g.o.timeout)
	defer cancel()
	var h localHello
	if err := p.Recv(ctx, &h); err != nil || h.Rank < 0 || h.Rank == g.rank {
		_ = p.Close()
		return
	}
	g.peersMu.Lock()
	ok := h.Rank < len(g.peers) && g.peers[h.Rank].PID == cred.PID && g.peers[h.Rank].Host == g.host
	g.peersMu.Unlock()
	if !ok {
		_ = p.Close()
		return
	}
	switch h.Op {
	case "pipe":
		if h.Rank > g.rank {
			break // the lower rank dials
		}
		select {
		case g.node.localChan(h.Rank) <- p:
			return
		case <-ctx.Done():
		}
	case "put", "get":
		q, err := g.node.queue(h.Queue, h.Cap)
		if err != nil {
			_ = p.Send(ctx, sharedValue{Err: err.Error()})
			break
		}
		if h.Op == "put" {
			q.serveSharedPut(g.ctx, p, g.o.timeout)
		} else {
			q.serveSharedGet(g.ctx, p)
		}
	}
	_ = p.Close()
}

// sameHost reports whether rank r registered on this host with an
// endpoint, and returns the endpoint.
func (g *Group) sameHost(r int) (string, bool) {
	g.peersMu.Lock()
	defer g.peersMu.Unlock()
	if g.local == nil || r < 0 || r >= len(g.peers) || g.peers[r].Host != g.host || g.peers[r].Local == "" {
		return "", false
	}
	return g.peers[r].Local, true
}

// dialLocal opens a same-host connection to rank r at addr and says
// hello. The caller owns the pipe.
func (g *Group) dialLocal(ctx context.Context, r int, addr string, h localHello) (*mp.Pipe, error) {
	ctx, cancel := context.WithTimeout(ctx, g.o.timeout)
	defer cancel()
	g.peersMu.Lock()
	want := g.peers[r].PID
	g.peersMu.Unlock()
	p, err := mp.Dial(ctx, addr, mp.WithPeerCheck(func(c mp.Cred) error {
		if c.PID != want || c.UID != os.Geteuid() {
			return fmt.Errorf("rank %d registered as pid %d; the endpoint is pid %d, uid %d", r, want, c.PID, c.UID)
		}
		return nil
	}))
	if err != nil {
		return nil, err
	}
	h.Rank = g.rank
	if err := p.Send(ctx, h); err != nil {
		_ = p.Close()
		return nil, fmt.Errorf("dist: a same-host pipe to rank %d (pid %d): %w", r, want, err)
	}
	return p, nil
}

// localChan returns the channel on which same-host pipes from rank r
// arrive.
func (n *node) localChan(r int) chan *mp.Pipe {
	n.mu.Lock()
	defer n.mu.Unlock()
	ch, ok := n.local[r]
	if !ok {
		ch = make(chan *mp.Pipe)
		n.local[r] = ch
	}
	return ch
}

// sharedValue is a queued value on a same-host connection: its encoding
// and bodies (shared memory, on mp's descriptor path), or, for a value
// put by reference, its putter's rank and ticket. Err is the owner's
// refusal instead of a value.
type sharedValue struct {
	Data   []byte
	Bodies []*tensor.Storage
	Rank   int
	Ticket []byte
	Err    string
}

// sharedAnswer ends a same-host put or get: empty when the value was
// queued or taken, else why not.
type sharedAnswer struct {
	Err string
}

// errNoShortcut says that a same-host connection could not be made: the
// caller goes through Flight instead.
var errNoShortcut = errors.New("dist: no same-host connection")

// dialQueue opens a same-host connection to the queue's owner for op, or
// returns errNoShortcut.
func (q *Queue) dialQueue(ctx context.Context, op string) (*mp.Pipe, error) {
	addr, ok := q.g.sameHost(q.owner)
	if !ok {
		return nil, errNoShortcut
	}
	p, err := q.g.dialLocal(ctx, q.owner, addr, localHello{Op: op, Queue: q.name, Cap: q.cap})
	if err != nil {
		return nil, errNoShortcut
	}
	return p, nil
}

// putShared puts v through a same-host connection p, which it closes:
// the owner maps v's tensors, as an mp.Queue's getter would.
func (q *Queue) putShared(ctx context.Context, p *mp.Pipe, v any) error {
	defer p.Close()
	data, bodies, err := reduction.NewBodyEncoder().Encode(v)
	if err != nil {
		return err
	}
	if err := p.Send(ctx, sharedValue{Data: data, Bodies: bodies}); err != nil {
		return q.sharedErr(ctx, "put", err)
	}
	var a sharedAnswer
	if err := p.Recv(ctx, &a); err != nil {
		return q.sharedErr(ctx, "put", err)
	}
	if a.Err != "" {
		return fmt.Errorf("dist: put on queue %q: %s", q.name, a.Err)
	}
	// The owner has room: it takes the value once told this Put still
	// waits (see serveSharedPut), and says when the value is in, so that
	// the putter's next value comes after it. From the acknowledgement on
	// the Put is committed: it waits for that word whatever ctx says.
	if err := p.Send(ctx, sharedValue{}); err != nil {
		return q.sharedErr(ctx, "put", err)
	}
	if err := p.Recv(q.g.ctx, &a); err != nil {
		return q.sharedErr(q.g.ctx, "put", err)
	}
	return nil
}

// getShared takes the head of the queue through a same-host connection
// p, which it closes.
func (q *Queue) getShared(ctx context.Context, p *mp.Pipe, v any) error {
	defer p.Close()
	var sv sharedValue
	if err := p.Recv(ctx, &sv); err != nil {
		return q.sharedErr(ctx, "get", err)
	}
	if sv.Err != "" {
		return fmt.Errorf("dist: get on queue %q: %s", q.name, sv.Err)
	}
	bodies := sv.Bodies
	var err error
	if sv.Ticket != nil {
		if bodies, err = q.g.pull(ctx, sv.Rank, sv.Ticket); err != nil && !errors.Is(err, ErrLeaseExpired) {
			return fmt.Errorf("dist: get on queue %q: %w", q.name, err) // the owner keeps the value
		}
	}
	var derr error
	switch {
	case err != nil:
		derr = fmt.Errorf("dist: get on queue %q: %w", q.name, err)
	default:
		if err := reduction.NewBodyDecoder().Decode(sv.Data, bodies, v); err != nil {
			derr = fmt.Errorf("dist: get on queue %q: dropped a malformed value: %w", q.name, err)
		}
	}
	// Taken, or gone for good (expired, malformed): either way the owner
	// drops it. A message sent is delivered even if this end closes.
	a := sharedAnswer{}
	if derr != nil {
		a.Err = derr.Error()
	}
	if err := p.Send(ctx, a); err != nil && derr == nil {
		derr = q.sharedErr(ctx, "get", err)
	}
	if sv.Ticket != nil && err == nil {
		q.g.letGo(ctx, sv.Rank, sv.Ticket)
	}
	return derr
}

// sharedErr is the error of a same-host put or get that failed with err.
func (q *Queue) sharedErr(ctx context.Context, op string, err error) error {
	if cause := context.Cause(q.g.ctx); cause != nil {
		return cause
	}
	if ctx.Err() != nil {
		return fmt.Errorf("dist: %s on queue %q: %w", op, q.name, context.Cause(ctx))
	}
	if errors.Is(err, mp.ErrClosed) {
		return &PeerError{Rank: q.owner, Addr: q.g.peerAddr(q.owner), Op: op, Err: fmt.Errorf("%w: the same-host connection closed", ErrPeerLost)}
	}
	return fmt.Errorf("dist: %s on queue %q: %w", op, q.name, err)
}

// awaitPeer receives p's next message into v in the background. The
// context it returns ends when that receive returns, whose error (nil
// for a message) then comes on done: a rank waiting for room or for a
// value learns so that its peer gave up.
func awaitPeer(parent context.Context, p *mp.Pipe, v any) (context.Context, <-chan error) {
	ctx, cancel := context.WithCancelCause(parent)
	done := make(chan error, 1)
	go func() {
		err := p.Recv(parent, v)
		cancel(errPeerAnswered)
		done <- err
	}()
	return ctx, done
}

var errPeerAnswered = errors.New("dist: the same-host peer answered or left")

// serveSharedPut receives one value from a same-host putter on p: its
// tensors stay in the putter's shared memory, mapped here.
func (q *queueState) serveSharedPut(ctx context.Context, p *mp.Pipe, timeout time.Duration) {
	rctx, cancel := context.WithTimeout(ctx, timeout)
	var sv sharedValue
	err := p.Recv(rctx, &sv)
	cancel()
	if err != nil || sv.Ticket != nil || sv.Err != "" {
		return
	}
	it := item{data: sv.Data, bodies: sv.Bodies, shared: true}
	var ack sharedValue
	wctx, done := awaitPeer(ctx, p, &ack)
	if err := q.reserve(wctx); err != nil {
		_ = p.Send(ctx, sharedAnswer{Err: err.Error()})
		_ = p.Close()
		<-done
		return
	}
	// Room. The value goes in only if the putter is still waiting: it
	// acknowledges the answer. One that gave up meanwhile closes instead,
	// and its Put, which failed, leaves nothing behind.
	err = p.Send(ctx, sharedAnswer{})
	if err != nil {
		_ = p.Close() // ends the pending receive
	}
	if rerr := <-done; err == nil && rerr == nil {
		q.push(it)
		// In: the putter's next Put comes after. The value is in, so the
		// word goes even if the group is closing meanwhile (a getter may
		// take the value and end the group before it is said): Close waits
		// for this call.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
		_ = p.Send(sctx, sharedAnswer{})
		cancel()
	} else {
		q.unreserve()
		it.release()
	}
	_ = p.Close()
}

// serveSharedGet sends the head of the queue to a same-host getter on p
// and removes it once the getter answers; a getter that fails first
// leaves it at the head.
func (q *queueState) serveSharedGet(ctx context.Context, p *mp.Pipe) {
	var a sharedAnswer
	wctx, done := awaitPeer(ctx, p, &a)
	popped := false
	err := q.handOut(wctx, func(it item) error {
		popped = true
		sv := sharedValue{Data: it.data, Bodies: it.bodies}
		if it.ref != nil {
			sv = sharedValue{Data: it.data, Rank: it.ref.rank, Ticket: it.ref.ticket}
		}
		err := p.Send(ctx, sv)
		if err != nil {
			_ = p.Close() // ends the pending receive
		}
		if rerr := <-done; err == nil {
			err = rerr
		}
		return err
	})
	if !popped {
		_ = p.Send(ctx, sharedValue{Err: err.Error()})
	}
	_ = p.Close()
	if !popped {
		<-done
	}
}

package dist

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"

	"github.com/tensormp/tensormp/mp"
)

// The same-host shortcut. Every rank also listens on a named endpoint of
// package mp (an abstract Unix socket name, so nothing is left behind),
// registered with its address. A Pipe between two ranks of one host is
// an mp.Pipe over it: tensors travel as shared memory, on mp's descriptor
// path, not through the network stack. The dialling rank says who it is;
// the listener checks that against the kernel's credentials of the
// connection (the registered process ID) before handing it out.

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
		go g.admitLocal(p, cred)
	}
}

// admitLocal reads which rank dialled p and hands p on if the kernel
// agrees that it is that rank's process.
func (g *Group) admitLocal(p *mp.Pipe, cred mp.Cred) {
	ctx, cancel := context.WithTimeout(g.ctx, g.o.timeout)
	defer cancel()
	var r int
	if err := p.Recv(ctx, &r); err != nil || r < 0 || r >= g.rank {
		_ = p.Close()
		return
	}
	g.peersMu.Lock()
	ok := r < len(g.peers) && g.peers[r].PID == cred.PID && g.peers[r].Host == g.host
	g.peersMu.Unlock()
	if !ok {
		_ = p.Close()
		return
	}
	select {
	case g.node.localChan(r) <- p:
	case <-ctx.Done():
		_ = p.Close()
	}
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

// dialLocal opens a same-host pipe to rank r at addr.
func (g *Group) dialLocal(ctx context.Context, r int, addr string) (*mp.Pipe, error) {
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
	if err := p.Send(ctx, g.rank); err != nil {
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

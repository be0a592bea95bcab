package mp

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/tensormp/tensormp/internal/sock"
)

// Named endpoints: processes that did not start one another reach each
// other through a Unix socket (torch's multiprocessing.connection
// Listener and Client). Each connection is a Pipe; a Queue, or anything
// else a Pipe carries, can be sent over it.

// Cred is the identity of the process at the other end of a connection,
// as the kernel recorded it when the connection was made (SO_PEERCRED).
type Cred struct {
	PID, UID, GID int
}

// ErrPeerRefused is returned by Accept and Dial when the peer's
// credentials fail the check (by default: another user).
var ErrPeerRefused = errors.New("mp: peer refused")

// EndpointOption configures Listen and Dial.
type EndpointOption func(*endpointOptions)

type endpointOptions struct {
	mode  os.FileMode
	check func(Cred) error
}

// WithMode sets the permission bits of the socket file Listen makes
// (default 0600: only this user may connect). It has no effect on an
// abstract name, which has no file.
func WithMode(mode os.FileMode) EndpointOption {
	return func(o *endpointOptions) { o.mode = mode.Perm() }
}

// WithPeerCheck replaces the check of the peer's credentials made before
// a connection is handed out: by default the peer must run as this
// process's user. A check's error refuses the peer; a nil check accepts
// any process that can connect.
func WithPeerCheck(check func(Cred) error) EndpointOption {
	return func(o *endpointOptions) { o.check = check }
}

func endpointConfig(opts []EndpointOption) endpointOptions {
	o := endpointOptions{mode: 0o600, check: sameUser}
	for _, f := range opts {
		f(&o)
	}
	return o
}

// checkPeer runs check, if there is one, on the credentials of a peer.
func checkPeer(cred Cred, check func(Cred) error) error {
	if check != nil {
		if err := check(cred); err != nil {
			return fmt.Errorf("%w: pid %d, uid %d: %v", ErrPeerRefused, cred.PID, cred.UID, err)
		}
	}
	return nil
}

// sameUser is the default peer check.
func sameUser(c Cred) error {
	if c.UID != os.Geteuid() {
		return fmt.Errorf("uid %d is not this process's %d", c.UID, os.Geteuid())
	}
	return nil
}

// Listener accepts connections on a named endpoint. It owns its socket
// and the socket file it made; Close releases both.
type Listener struct {
	l     *sock.Listener
	check func(Cred) error
}

// Listen listens on addr: a file system path, or "@name" for a name in
// Linux's abstract namespace (no file; reachable from the same network
// namespace). The socket file must not exist yet; its mode is WithMode's
// before any process can connect.
func Listen(addr string, opts ...EndpointOption) (*Listener, error) {
	checkInit("mp.Listen")
	o := endpointConfig(opts)
	l, err := sock.Listen(addr, o.mode)
	if err != nil {
		return nil, err
	}
	return &Listener{l: l, check: o.check}, nil
}

// Addr returns the address the listener listens on.
func (l *Listener) Addr() string { return l.l.Addr() }

// Accept waits, while ctx lasts, for a process to connect, and returns
// its end of the connection and its credentials. A peer the check
// refuses is disconnected and Accept returns an error wrapping
// ErrPeerRefused; the listener stays usable.
func (l *Listener) Accept(ctx context.Context) (*Pipe, Cred, error) {
	s, sc, err := l.l.Accept(ctx)
	cred := Cred(sc)
	if err != nil {
		return nil, cred, err
	}
	if err := checkPeer(cred, l.check); err != nil {
		_ = s.Close()
		return nil, cred, fmt.Errorf("mp: accept on %s: %w", l.l.Addr(), err)
	}
	c, err := sock.New(s, "endpoint")
	if err != nil {
		return nil, cred, err
	}
	p := newPipe(c, nil, nil)
	p.unwatch = watchPeer(cred.PID)
	return p, cred, nil
}

// Close stops listening and removes the socket file Listen made.
// Connections accepted before stay open. Close wakes a blocked Accept,
// which returns ErrClosed.
func (l *Listener) Close() error { return l.l.Close() }

// Dial connects to the endpoint at addr (see Listen), retrying while the
// listener's backlog is full and ctx lasts, and checks the listener's
// credentials as Accept checks a dialler's. It returns this process's end
// of the connection.
func Dial(ctx context.Context, addr string, opts ...EndpointOption) (*Pipe, error) {
	checkInit("mp.Dial")
	o := endpointConfig(opts)
	s, sc, err := sock.Dial(ctx, addr)
	if err != nil {
		return nil, err
	}
	cred := Cred(sc)
	if err := checkPeer(cred, o.check); err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("mp: dial %s: %w", addr, err)
	}
	c, err := sock.New(s, "endpoint")
	if err != nil {
		return nil, err
	}
	p := newPipe(c, nil, nil)
	p.unwatch = watchPeer(cred.PID)
	return p, nil
}

package mp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
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

// checkPeer reads the credentials of the peer of the connected socket s
// and runs check on them, if there is one.
func checkPeer(s int, check func(Cred) error) (Cred, error) {
	cred, err := peerCred(s)
	if err == nil && check != nil {
		if cerr := check(cred); cerr != nil {
			err = fmt.Errorf("%w: pid %d, uid %d: %v", ErrPeerRefused, cred.PID, cred.UID, cerr)
		}
	}
	return cred, err
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
	c     *conn
	addr  string
	file  string // the socket file Listen made, "" for an abstract name
	check func(Cred) error
	once  sync.Once
}

// Listen listens on addr: a file system path, or "@name" for a name in
// Linux's abstract namespace (no file; reachable from the same network
// namespace). The socket file must not exist yet; its mode is WithMode's
// before any process can connect.
func Listen(addr string, opts ...EndpointOption) (*Listener, error) {
	checkInit("mp.Listen")
	o := endpointConfig(opts)
	sa, file, err := sockaddr(addr)
	if err != nil {
		return nil, err
	}
	s, err := unix.Socket(unix.AF_UNIX, sockType, 0)
	if err != nil {
		return nil, fmt.Errorf("mp: listen on %s: %w%s", addr, err, fdHint(err))
	}
	sock := fd.New(s)
	if err := unix.Bind(s, sa); err != nil {
		_ = sock.Close()
		return nil, fmt.Errorf("mp: listen on %s: %w", addr, err)
	}
	// Bound: from here a failure also removes the socket file. Nobody
	// can connect before listen, so the mode is set first.
	c, err := func() (*conn, error) {
		if file != "" {
			if err := os.Chmod(file, o.mode); err != nil {
				return nil, err
			}
		}
		if err := unix.Listen(s, unix.SOMAXCONN); err != nil {
			return nil, err
		}
		return newConn(sock, "listener")
	}()
	if err != nil {
		_ = sock.Close()
		if file != "" {
			_ = os.Remove(file)
		}
		return nil, fmt.Errorf("mp: listen on %s: %w", addr, err)
	}
	return &Listener{c: c, addr: addr, file: file, check: o.check}, nil
}

// sockaddr parses an endpoint's address; file is the path of the socket
// file it names, "" for an abstract name.
func sockaddr(addr string) (sa *unix.SockaddrUnix, file string, err error) {
	switch {
	case addr == "" || addr == "@":
		return nil, "", errors.New("mp: an endpoint needs a path or an @name")
	case len(addr) > 107:
		return nil, "", fmt.Errorf("mp: endpoint %q is longer than a Unix socket address (107 bytes)", addr)
	case strings.HasPrefix(addr, "@"):
		return &unix.SockaddrUnix{Name: addr}, "", nil
	}
	return &unix.SockaddrUnix{Name: addr}, addr, nil
}

// Addr returns the address the listener listens on.
func (l *Listener) Addr() string { return l.addr }

// Accept waits, while ctx lasts, for a process to connect, and returns
// its end of the connection and its credentials. A peer the check
// refuses is disconnected and Accept returns an error wrapping
// ErrPeerRefused; the listener stays usable.
func (l *Listener) Accept(ctx context.Context) (*Pipe, Cred, error) {
	var s int
	err := l.c.io(ctx, unix.POLLIN, "accept on "+l.addr, true, func(ls int) error {
		var err error
		s, err = accept(ls)
		return err
	}, nil)
	if err != nil {
		if errors.Is(err, errConnClosed) {
			err = ErrClosed
		}
		return nil, Cred{}, err
	}
	sock := fd.New(s)
	cred, err := checkPeer(s, l.check)
	if err != nil {
		_ = sock.Close()
		return nil, cred, fmt.Errorf("mp: accept on %s: %w", l.addr, err)
	}
	c, err := newConn(sock, "endpoint")
	if err != nil {
		return nil, cred, err
	}
	return &Pipe{c: c, unwatch: watchPeer(cred.PID)}, cred, nil
}

// Close stops listening and removes the socket file Listen made.
// Connections accepted before stay open. Close wakes a blocked Accept,
// which returns ErrClosed.
func (l *Listener) Close() error {
	var err error
	l.once.Do(func() {
		err = l.c.close()
		if l.file != "" {
			if rerr := os.Remove(l.file); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
				err = errors.Join(err, rerr)
			}
		}
	})
	return err
}

// Dial connects to the endpoint at addr (see Listen), retrying while the
// listener's backlog is full and ctx lasts, and checks the listener's
// credentials as Accept checks a dialler's. It returns this process's end
// of the connection.
func Dial(ctx context.Context, addr string, opts ...EndpointOption) (*Pipe, error) {
	checkInit("mp.Dial")
	o := endpointConfig(opts)
	sa, _, err := sockaddr(addr)
	if err != nil {
		return nil, err
	}
	s, err := unix.Socket(unix.AF_UNIX, sockType, 0)
	if err != nil {
		return nil, fmt.Errorf("mp: dial %s: %w%s", addr, err, fdHint(err))
	}
	sock := fd.New(s)
	fail := func(err error) (*Pipe, error) {
		_ = sock.Close()
		return nil, fmt.Errorf("mp: dial %s: %w", addr, err)
	}
	if err := unix.SetNonblock(s, true); err != nil {
		return fail(err)
	}
	for wait := time.Millisecond; ; wait = min(2*wait, 100*time.Millisecond) {
		err := unix.Connect(s, sa)
		if err == nil {
			break
		}
		if err != unix.EAGAIN && err != unix.EINTR {
			return fail(err)
		}
		select {
		case <-ctx.Done():
			return fail(ctx.Err())
		case <-time.After(wait):
		}
	}
	cred, err := checkPeer(s, o.check)
	if err != nil {
		return fail(err)
	}
	c, err := newConn(sock, "endpoint")
	if err != nil {
		return nil, err
	}
	return &Pipe{c: c, unwatch: watchPeer(cred.PID)}, nil
}

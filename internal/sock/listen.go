package sock

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

// Cred is the identity of the process at the other end of a connection,
// as the kernel recorded it when the connection was made (SO_PEERCRED).
type Cred struct {
	PID, UID, GID int
}

// A Listener is a listening SOCK_SEQPACKET socket on a named endpoint. It
// owns its socket and the socket file Listen made; Close releases both.
type Listener struct {
	c    *Conn
	addr string
	file string // the socket file Listen made, "" for an abstract name
	once sync.Once
}

// Listen listens on addr: a file system path, or "@name" for a name in
// Linux's abstract namespace. The socket file must not exist yet; it has
// mode's permission bits before any process can connect.
func Listen(addr string, mode os.FileMode) (*Listener, error) {
	sa, file, err := sockaddr(addr)
	if err != nil {
		return nil, err
	}
	s, err := unix.Socket(unix.AF_UNIX, sockType, 0)
	if err != nil {
		return nil, fmt.Errorf("mp: listen on %s: %w%s", addr, err, FDHint(err))
	}
	sock := fd.New(s)
	if err := unix.Bind(s, sa); err != nil {
		_ = sock.Close()
		return nil, fmt.Errorf("mp: listen on %s: %w", addr, err)
	}
	// Bound: from here a failure also removes the socket file. Nobody
	// can connect before listen, so the mode is set first.
	c, err := func() (*Conn, error) {
		if file != "" {
			if err := os.Chmod(file, mode); err != nil {
				return nil, err
			}
		}
		if err := unix.Listen(s, unix.SOMAXCONN); err != nil {
			return nil, err
		}
		return New(sock, "listener")
	}()
	if err != nil {
		_ = sock.Close()
		if file != "" {
			_ = os.Remove(file)
		}
		return nil, fmt.Errorf("mp: listen on %s: %w", addr, err)
	}
	return &Listener{c: c, addr: addr, file: file}, nil
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
// the connected socket, owned by the caller, and the credentials of the
// process at its other end. Once l is closed it returns ErrClosed.
func (l *Listener) Accept(ctx context.Context) (*fd.FD, Cred, error) {
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
	cred, err := peerCred(s)
	if err != nil {
		_ = sock.Close()
		return nil, cred, fmt.Errorf("mp: accept on %s: %w", l.addr, err)
	}
	return sock, cred, nil
}

// Close stops listening and removes the socket file Listen made.
// Connections accepted before stay open. Close wakes a blocked Accept,
// which returns ErrClosed.
func (l *Listener) Close() error {
	var err error
	l.once.Do(func() {
		err = l.c.Close()
		if l.file != "" {
			if rerr := os.Remove(l.file); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
				err = errors.Join(err, rerr)
			}
		}
	})
	return err
}

// Dial connects to the endpoint at addr (see Listen), retrying while the
// listener's backlog is full and ctx lasts. It returns the connected
// socket, owned by the caller, and the credentials of the listening
// process.
func Dial(ctx context.Context, addr string) (*fd.FD, Cred, error) {
	sa, _, err := sockaddr(addr)
	if err != nil {
		return nil, Cred{}, err
	}
	s, err := unix.Socket(unix.AF_UNIX, sockType, 0)
	if err != nil {
		return nil, Cred{}, fmt.Errorf("mp: dial %s: %w%s", addr, err, FDHint(err))
	}
	sock := fd.New(s)
	fail := func(err error) (*fd.FD, Cred, error) {
		_ = sock.Close()
		return nil, Cred{}, fmt.Errorf("mp: dial %s: %w", addr, err)
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
	cred, err := peerCred(s)
	if err != nil {
		return fail(err)
	}
	return sock, cred, nil
}

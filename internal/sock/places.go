package sock

import (
	"context"
	"errors"
	"fmt"
	"io"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

// Places are the free places of a bounded queue, shared by every process
// that holds the queue: a pipe holding a byte for each. A sender takes
// one before it sends, a receiver gives one back as soon as it has taken
// a message. Places own their two ends of the pipe in this process until
// Close.
type Places struct {
	free, freed *Conn // the pipe's reading and writing ends
	n           int
}

// NewPlaces returns n free places: a new pipe holding n bytes.
func NewPlaces(n int) (*Places, error) {
	p, err := placesPipe(n)
	if err != nil {
		return nil, fmt.Errorf("mp: a queue capacity of %d: %w%s", n, err, FDHint(err))
	}
	if err := fillPlaces(p[1], n); err != nil {
		_, _ = unix.Close(p[0]), unix.Close(p[1])
		return nil, err
	}
	return AdoptPlaces(fd.New(p[0]), fd.New(p[1]), n)
}

// fillPlaces writes n bytes, one per free place, into a places pipe.
func fillPlaces(w, n int) error {
	ones := make([]byte, min(n, 64<<10))
	for i := range ones {
		ones[i] = 1
	}
	for left := n; left > 0; {
		k, err := unix.Write(w, ones[:min(left, len(ones))])
		if err != nil {
			return fmt.Errorf("mp: filling a queue's places: %w", err)
		}
		left -= k
	}
	return nil
}

// AdoptPlaces takes over r and w, the reading and writing ends of a
// places pipe of n places (see CheckPlaces); on error both are closed.
func AdoptPlaces(r, w *fd.FD, n int) (*Places, error) {
	free, err := New(r, "queue places")
	if err != nil {
		_ = w.Close()
		return nil, err
	}
	freed, err := New(w, "queue places")
	if err != nil {
		_ = free.Close()
		return nil, err
	}
	return &Places{free: free, freed: freed, n: n}, nil
}

// Cap returns the number of places.
func (p *Places) Cap() int { return p.n }

// Take takes a place, waiting for one until ctx ends or p is closed.
func (p *Places) Take(ctx context.Context) error { return p.take(ctx, true) }

// TryTake takes a place if one is free now, and returns ErrWouldBlock if
// not.
func (p *Places) TryTake(ctx context.Context) error { return p.take(ctx, false) }

// take takes a byte from the places pipe.
func (p *Places) take(ctx context.Context, block bool) error {
	c := p.free
	if err := c.lock(ctx, c.rmu, block); err != nil {
		return err
	}
	defer func() { <-c.rmu }()
	return c.io(ctx, unix.POLLIN, "taking a place in a queue", block, func(s int) error {
		var b [1]byte
		n, err := unix.Read(s, b[:])
		if err == nil && n == 0 {
			return io.EOF // every writing end closed: not while p holds one
		}
		return err
	}, nil)
}

// Give puts a place back. It never waits: the pipe has room for every
// place.
func (p *Places) Give() {
	_ = p.freed.io(context.Background(), unix.POLLOUT, "giving a place back to a queue", false, func(s int) error {
		_, err := unix.Write(s, []byte{1})
		return err
	}, nil)
}

// Waiting returns how many calls of this process wait for a place now.
func (p *Places) Waiting() int { return p.free.Waiting() }

// Dup returns duplicates of the pipe's reading and writing ends, for
// passing to another process, owned by the caller.
func (p *Places) Dup() (r, w *fd.FD, err error) {
	if r, err = p.free.Dup(); err != nil {
		return nil, nil, err
	}
	if w, err = p.freed.Dup(); err != nil {
		_ = r.Close()
		return nil, nil, err
	}
	return r, w, nil
}

// Close releases this process's ends of the pipe and wakes its blocked
// Take calls with ErrClosed.
func (p *Places) Close() error {
	return errors.Join(p.free.Close(), p.freed.Close())
}

// CheckSocket checks that f, received for a queue or a pipe, is what Pair
// makes: an AF_UNIX SOCK_SEQPACKET socket. A peer can put any descriptor
// it has in a queue's place; taken for one, it would fail only at first
// use.
func CheckSocket(f *fd.FD) error {
	raw, err := f.Lend()
	if err != nil {
		return err
	}
	defer f.Return()
	if domain, typ, err := socketKind(raw); err != nil || domain != unix.AF_UNIX || typ != unix.SOCK_SEQPACKET {
		return fmt.Errorf("mp: a received queue or pipe: %s is not a queue's or pipe's socket (AF_UNIX, SOCK_SEQPACKET)", describeFD(raw))
	}
	return nil
}

// CheckPlaces checks that r and w, received for a bounded queue's places,
// are the reading and the writing end of one pipe.
func CheckPlaces(r, w *fd.FD) error {
	rr, err := r.Lend()
	if err != nil {
		return err
	}
	defer r.Return()
	rw, err := w.Lend()
	if err != nil {
		return err
	}
	defer w.Return()
	var rs, ws unix.Stat_t
	if unix.Fstat(rr, &rs) != nil || unix.Fstat(rw, &ws) != nil ||
		rs.Mode&unix.S_IFMT != unix.S_IFIFO || rs.Dev != ws.Dev || rs.Ino != ws.Ino ||
		!accessMode(rr, unix.O_RDONLY) || !accessMode(rw, unix.O_WRONLY) {
		return fmt.Errorf("mp: a received bounded queue: %s and %s are not the two ends of its places pipe", describeFD(rr), describeFD(rw))
	}
	return nil
}

// accessMode reports whether fd is open with access mode mode.
func accessMode(fd, mode int) bool {
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	return err == nil && fl&unix.O_ACCMODE == mode
}

// Package fd gives a file descriptor one owner and one Close.
//
// An FD owns its descriptor from New until Close (or Disown). The owner
// may lend the number, with Lend, to code that uses it outside the owner's
// locks (a sendmsg that passes it to another process, say): a Close that
// comes meanwhile closes the descriptor only when the last loan is
// returned, so a lent number is never a closed one, nor one the kernel
// already gave to another file. An FD that becomes unreachable unclosed is
// closed by a runtime cleanup, as a safety net.
package fd

import (
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// ErrClosed is returned by Lend and Dup on a closed FD.
var ErrClosed = errors.New("fd: descriptor closed")

// FD is an owned file descriptor. Its methods may be called from several
// goroutines.
type FD struct {
	num     int // the number New took
	mu      sync.Mutex
	lent    int
	gone    bool // closed or disowned
	closing bool // Close was called while lent
	cleanup runtime.Cleanup
}

// New takes ownership of raw.
func New(raw int) *FD {
	f := &FD{num: raw}
	f.cleanup = runtime.AddCleanup(f, func(raw int) {
		untraced(raw)
		_ = unix.Close(raw)
	}, raw)
	traced(raw)
	return f
}

// Lend returns the descriptor's number, which stays open, and the same
// file, until the matching Return, whatever Close does meanwhile.
func (f *FD) Lend() (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gone || f.closing {
		return -1, ErrClosed
	}
	f.lent++
	return f.num, nil
}

// Num returns the descriptor's number, for the system calls of an owner
// that knows no Close runs meanwhile (it holds the lock its Close takes,
// say), as os.File.Fd does: the number of a closed FD may name another
// file already. Code that cannot rule out a Close uses Lend. Num of a nil
// FD is -1.
func (f *FD) Num() int {
	if f == nil {
		return -1
	}
	return f.num
}

// Return ends one Lend. The last Return after a Close closes the
// descriptor.
func (f *FD) Return() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lent--
	if f.lent == 0 && f.closing {
		return f.closeLocked()
	}
	return nil
}

// Close closes the descriptor, or, while it is lent, has the last Return
// close it. Closing twice returns nil.
func (f *FD) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gone || f.closing {
		return nil
	}
	if f.lent > 0 {
		f.closing = true
		return nil
	}
	return f.closeLocked()
}

func (f *FD) closeLocked() error {
	f.cleanup.Stop()
	f.gone, f.closing = true, false
	untraced(f.num)
	return unix.Close(f.num)
}

// Disown hands the descriptor over to the caller, who closes it; the FD
// is closed without closing it. It fails while the descriptor is lent.
func (f *FD) Disown() (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gone || f.closing {
		return -1, ErrClosed
	}
	if f.lent > 0 {
		return -1, errors.New("fd: disowning a descriptor that is lent")
	}
	f.cleanup.Stop()
	f.gone = true
	untraced(f.num)
	return f.num, nil
}

// CloseEach closes every FD of fds, skipping nil ones.
func CloseEach(fds []*FD) {
	for _, f := range fds {
		if f != nil {
			_ = f.Close()
		}
	}
}

// Dup returns a close-on-exec duplicate, owned by its own FD.
func (f *FD) Dup() (*FD, error) {
	raw, err := f.Lend()
	if err != nil {
		return nil, err
	}
	defer f.Return()
	d, err := Dup(raw)
	if err != nil {
		return nil, err
	}
	return New(d), nil
}

// Dup returns a close-on-exec duplicate of raw, which the caller owns.
func Dup(raw int) (int, error) {
	d, err := unix.FcntlInt(uintptr(raw), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("fd: dup %d: %w", raw, err)
	}
	return d, nil
}

func (f *FD) String() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gone {
		return "fd (closed)"
	}
	return "fd " + strconv.Itoa(f.num)
}

package main

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

// The futex and spin floors are a round trip with no message at all: the
// parent and the worker map one shared page (a memfd's) and each stores
// a word in it for the other to see. Under the futex floor the one who
// waits sleeps in FUTEX_WAIT and is woken with FUTEX_WAKE, the least a
// round trip that blocks can cost; under the spin floor it spins on the
// word, the least any round trip can cost, and only when the two run on
// different CPUs. The futexes are shared ones (no FUTEX_PRIVATE_FLAG):
// the kernel keys a private one by the process, and would never wake the
// other.

// The page's words, each on its own cache line.
const (
	floorPageSize   = 4096
	callOffset      = 0   // the parent's latest call
	answerOffset    = 64  // the worker's latest answer: the call it answers
	workerAsleepOff = 128 // 1 while the worker sleeps, or is about to, on the call
	parentAsleepOff = 192 // 1 while the parent sleeps, or is about to, on the answer
)

// A call is the parent's count of calls shifted left by 2, and in the low
// bits how the worker answers it and waits for the next.
const (
	callSleep = 0 // answer with a FUTEX_WAKE, then sleep in FUTEX_WAIT
	callSpin  = 1 // answer with the store alone, then spin
	callStop  = 2 // answer nothing and end
	callMode  = 3
)

const (
	spinCheck = 1 << 20                // spins between looks at the other end and the clock
	spinFor   = 100 * time.Millisecond // spinning without a change before sleeping instead
	// futexTimeout is how long a side sleeps before it looks at the
	// other end. Long: a thread that goes back to sleep holds its
	// process's scheduler slot until the runtime takes it back, and
	// under -cpus (GOMAXPROCS=1) the worker's idle server would take
	// that time from the cases measured meanwhile (see sock's
	// maxSleepSlice).
	futexTimeout = time.Second
)

const (
	futexWait = 0 // FUTEX_WAIT, shared
	futexWake = 1 // FUTEX_WAKE, shared
)

// floorPage is one side's view of a mapped floor page.
type floorPage struct {
	mem                        []byte
	call, answer               *atomic.Uint32
	workerAsleep, parentAsleep *atomic.Uint32
}

// mapFloorPage maps the floor page that memfd holds, shared; it does not
// close memfd. Unmap it with unmap.
func mapFloorPage(memfd int) (*floorPage, error) {
	mem, err := unix.Mmap(memfd, 0, floorPageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mapping the floor page: %w", err)
	}
	word := func(off int) *atomic.Uint32 { return (*atomic.Uint32)(unsafe.Pointer(&mem[off])) }
	return &floorPage{mem: mem, call: word(callOffset), answer: word(answerOffset),
		workerAsleep: word(workerAsleepOff), parentAsleep: word(parentAsleepOff)}, nil
}

func (p *floorPage) unmap() error {
	if err := unix.Munmap(p.mem); err != nil {
		return fmt.Errorf("unmapping the floor page: %w", err)
	}
	return nil
}

// newFloorPage makes a memfd of a floor page and maps it; the caller
// closes the memfd once the worker has it.
func newFloorPage() (*floorPage, int, error) {
	memfd, err := unix.MemfdCreate("tensormp-floor-page", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, -1, fmt.Errorf("floor page memfd: %w", err)
	}
	if err := unix.Ftruncate(memfd, floorPageSize); err != nil {
		_ = unix.Close(memfd)
		return nil, -1, fmt.Errorf("sizing the floor page: %w", err)
	}
	p, err := mapFloorPage(memfd)
	if err != nil {
		_ = unix.Close(memfd)
		return nil, -1, err
	}
	return p, memfd, nil
}

// futexRoundTrip is a call that the worker answers with a FUTEX_WAKE, and
// whose answer the parent sleeps for.
func (f *floor) futexRoundTrip() (time.Duration, error) { return f.call(callSleep) }

// spinRoundTrip is a call that the worker, spinning, answers with a store
// alone, and whose answer the parent spins for. After one the worker
// spins for the next call: end a run of them with a futexRoundTrip, or it
// takes a CPU for spinFor.
func (f *floor) spinRoundTrip() (time.Duration, error) { return f.call(callSpin) }

// call makes the next call of mode and waits for its answer.
func (f *floor) call(mode uint32) (time.Duration, error) {
	last := f.page.answer.Load()
	f.calls++
	c := f.calls<<2 | mode
	start := time.Now()
	f.page.call.Store(c)
	if mode != callSpin || f.page.workerAsleep.Load() != 0 {
		if err := wake(f.page.call); err != nil {
			return 0, err
		}
	}
	got, err := await(f.page.answer, last, f.page.parentAsleep, mode == callSpin, f.s)
	d := time.Since(start)
	if err != nil {
		return 0, err
	}
	if got != c {
		return 0, fmt.Errorf("floor: call %#x answered with %#x", c, got)
	}
	return d, nil
}

// stopPage tells the worker's serveFutex to end.
func (f *floor) stopPage() {
	f.calls++
	f.page.call.Store(f.calls<<2 | callStop)
	_ = wake(f.page.call)
}

// serveFutex answers the calls on the floor page in pageFD, which it
// closes, until the parent stops it or the other end of sock, which it
// borrows, is gone. It runs on its own thread, which it blocks in the
// kernel or spins, as the call asks. A failure shuts sock down, which the
// parent's next call, on either floor, reports.
func serveFutex(sock, pageFD *fd.FD) (err error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	s, err := sock.Lend()
	if err != nil {
		_ = pageFD.Close()
		if errors.Is(err, fd.ErrClosed) {
			return nil // the floor ended before it began
		}
		return err
	}
	defer func() { _ = sock.Return() }()
	defer func() {
		if err != nil {
			_ = unix.Shutdown(s, unix.SHUT_RDWR)
		}
	}()
	p, err := mapFloorPage(pageFD.Num())
	_ = pageFD.Close()
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, p.unmap()) }()
	var last uint32 // a new page's call
	for {
		c, err := await(p.call, last, p.workerAsleep, last&callMode == callSpin, s)
		if errors.Is(err, errFloorClosed) {
			return nil
		}
		if err != nil {
			return err
		}
		if c&callMode == callStop {
			return nil
		}
		p.answer.Store(c)
		if c&callMode != callSpin || p.parentAsleep.Load() != 0 {
			if err := wake(p.answer); err != nil {
				return err
			}
		}
		last = c
	}
}

// await returns w's value once it is not last. With spin it spins first,
// for up to spinFor; then it sleeps in FUTEX_WAIT with asleep set, which
// tells the other side to wake it. Every spinCheck spins, and once
// futexTimeout asleep has gone by, it looks whether the other end of sock is gone,
// and returns errFloorClosed if so.
func await(w *atomic.Uint32, last uint32, asleep *atomic.Uint32, spin bool, sock int) (uint32, error) {
	if spin {
		var since time.Time
		for i := 1; ; i++ {
			if v := w.Load(); v != last {
				return v, nil
			}
			if i%spinCheck != 0 {
				continue
			}
			if peerGone(sock) {
				return 0, errFloorClosed
			}
			if since.IsZero() {
				since = time.Now()
			} else if time.Since(since) >= spinFor {
				break
			}
		}
	}
	timeout := unix.NsecToTimespec(int64(futexTimeout))
	looked := time.Now()
	for {
		// Set before the kernel's look at w, so that a call stored after
		// that look finds it set, and wakes.
		asleep.Store(1)
		_, _, errno := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWait, uintptr(last), uintptr(unsafe.Pointer(&timeout)), 0, 0)
		asleep.Store(0)
		if v := w.Load(); v != last {
			return v, nil
		}
		switch errno {
		case 0, unix.EAGAIN, unix.EINTR, unix.ETIMEDOUT:
			// Woken for nothing, or the sleep's end. Signals may cut
			// every sleep short: the look at the other end goes by
			// the clock.
			if time.Since(looked) < futexTimeout {
				continue
			}
			if peerGone(sock) {
				return 0, errFloorClosed
			}
			looked = time.Now()
		default:
			return 0, fmt.Errorf("floor FUTEX_WAIT: %w", errno)
		}
	}
}

// wake wakes the one waiter on w, if any.
func wake(w *atomic.Uint32) error {
	// FUTEX_WAKE never blocks: no need to tell the scheduler.
	if _, _, errno := unix.RawSyscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWake, 1, 0, 0, 0); errno != 0 {
		return fmt.Errorf("floor FUTEX_WAKE: %w", errno)
	}
	return nil
}

// peerGone reports whether the other end of socket s is closed (or s
// itself is).
func peerGone(s int) bool {
	p := []unix.PollFd{{Fd: int32(s), Events: unix.POLLRDHUP}}
	n, err := unix.Poll(p, 0)
	return err == nil && n > 0 && p[0].Revents&(unix.POLLHUP|unix.POLLRDHUP|unix.POLLERR|unix.POLLNVAL) != 0
}

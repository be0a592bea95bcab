package sock

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

// sendFlags: never block, and a peer gone is EPIPE, not SIGPIPE.
const sendFlags = unix.MSG_DONTWAIT | unix.MSG_NOSIGNAL

// kernelWait is how long a caller may wait for its socket in the kernel
// before another caller that needs its wait slot takes it. A reply that
// comes within it wakes the caller's thread directly: the runtime's poller
// would instead wake a thread of its own and then schedule the caller,
// about a third of a round trip. A receive on a message socket first
// waits in the receive call itself, which kernelWait bounds as the
// socket's receive timeout (see blockingReceives). Then, and for other
// calls, the caller polls without a timeout (arming a timer for each poll
// costs as much as it saves); one that waited longer gives its slot up
// only when asked, and then parks.
const kernelWait = time.Millisecond

// kernelWaiters bounds the threads that wait in the kernel at once: a
// thousand goroutines blocked in Get are a thousand parked goroutines, not
// a thousand threads. Callers beyond it park.
const kernelWaiters = 4

// A waitSlot is one of the kernelWaiters ways to wait in the kernel: a
// receive call, or a poll of the socket and of an eventfd. Close and
// cancellation end either at once (the call by SIGURG to its thread, the
// poll through the eventfd), and a caller needing the slot ends a poll.
// The slots belong to the package for the life of the process; whoever
// takes one gives it back.
type waitSlot struct {
	efd int
	// since is when the slot's caller took it, in nanoseconds after
	// epoch; 0 while it is free.
	since atomic.Int64
	// call is the receive call blocked with the slot, which a signal
	// interrupts instead of the eventfd: its thread's id in the high 32
	// bits, a number of its own in the low ones, so that a signal meant
	// for it never reaches a later call of the same thread; 0 while none
	// is blocked.
	call atomic.Uint64
}

var (
	pid   = unix.Getpid() // this process's, for signalling its threads
	calls atomic.Uint32   // numbers the blocked calls
)

var (
	waitSlots     [kernelWaiters]waitSlot
	epoch         = time.Now()
	makeWaitSlots = sync.OnceFunc(func() {
		for i := range waitSlots {
			efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
			if err != nil {
				efd = -1 // one slot fewer: its callers park
			} else {
				fd.KeepForLife(efd)
			}
			waitSlots[i].efd = efd
		}
	})
)

// takeWaitSlot returns a free slot, or nil if there is none. Then it asks
// the caller that has waited longest, if longer than kernelWait, to give
// its slot up and park, so that the slots go to those that wait briefly.
func takeWaitSlot() *waitSlot {
	makeWaitSlots()
	now := int64(time.Since(epoch)) + 1
	var oldest *waitSlot
	oldestSince := now - int64(kernelWait)
	for i := range waitSlots {
		sl := &waitSlots[i]
		if sl.efd < 0 {
			continue
		}
		since := sl.since.Load()
		if since == 0 && sl.since.CompareAndSwap(0, now) {
			return sl
		}
		if since != 0 && since < oldestSince {
			oldest, oldestSince = sl, since
		}
	}
	if oldest != nil {
		oldest.poke() // a poll: blocked calls end within kernelWait
	}
	return nil
}

func putWaitSlot(sl *waitSlot) { sl.since.Store(0) }

// poke ends the slot's current poll, or its next one: a poke that comes
// late wakes the slot's next poll once, which then parks.
func (sl *waitSlot) poke() {
	one := [8]byte{1}
	_, _ = unix.Write(sl.efd, one[:])
}

// current returns the receive call blocked with the slot, 0 if none is.
func (sl *waitSlot) current() uint64 { return sl.call.Load() }

// interrupt ends the slot's wait at once, for close and cancellation: a
// poll (call 0) through the eventfd, a blocked receive call by SIGURG to
// its thread, which the runtime takes for a preemption request it did not
// make and ignores; the call fails with EINTR (a socket with a receive
// timeout is never restarted). The signal is repeated until the thread
// has left the call, since one that comes just before the call begins is
// lost; after kernelWait the call's own timeout has ended it anyway.
func (sl *waitSlot) interrupt(call uint64) {
	if call == 0 {
		sl.poke()
		return
	}
	for deadline := time.Now().Add(kernelWait); sl.call.Load() == call && time.Now().Before(deadline); {
		_ = unix.Tgkill(pid, int(call>>32), unix.SIGURG)
		time.Sleep(kernelWait / 20)
	}
}

// blockingReceives readies s, if it is a connected message socket, for
// receives that wait in the receive call itself, and reports whether it
// did: the socket's description is made blocking and its receive timeout
// kernelWait, which bounds every such wait, also one whose interrupting
// signal was lost. The description is shared with every process holding
// the socket, which all do the same; every other call on the socket says
// MSG_DONTWAIT.
func blockingReceives(s int) bool {
	if t, err := unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || t != unix.SOCK_SEQPACKET {
		return false
	}
	if l, err := unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || l != 0 {
		return false
	}
	tv := unix.NsecToTimeval(int64(kernelWait))
	if unix.SetsockoptTimeval(s, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv) != nil {
		return false
	}
	return unix.SetNonblock(s, false) == nil
}

// blockingCall makes recv, a receive that blocks, on c's socket: the
// message wakes this thread with itself, where a poll would wake it to
// make a second call. The socket's receive timeout bounds it (see
// blockingReceives); close and the end of ctx interrupt it. Without a
// free wait slot it returns EAGAIN at once, and the caller parks.
func (c *Conn) blockingCall(ctx context.Context, recv func(s int) error) error {
	sl := takeWaitSlot()
	if sl == nil {
		return unix.EAGAIN
	}
	defer putWaitSlot(sl)
	runtime.LockOSThread() // the thread the signal is for
	defer runtime.UnlockOSThread()
	sl.call.Store(uint64(unix.Gettid())<<32 | uint64(calls.Add(1)))
	defer sl.call.Store(0)
	if ctx.Done() != c.watching {
		c.watch(ctx)
	}
	// Publish the slot, then look, as waitKernel does.
	c.rwait.Store(sl)
	defer c.rwait.Store(nil)
	if c.closed.Load() || ctx.Err() != nil {
		return unix.EINTR
	}
	return recv(c.sock.Num())
}

// wait waits for s to be ready for ev, or for a signal, and reports
// whether s may be ready.
func (sl *waitSlot) wait(s int, ev int16) bool {
	fds := [2]unix.PollFd{{Fd: int32(s), Events: ev}, {Fd: int32(sl.efd), Events: unix.POLLIN}}
	n, err := unix.Ppoll(fds[:], nil, nil)
	if fds[1].Revents != 0 {
		var b [8]byte
		_, _ = unix.Read(sl.efd, b[:]) // consume the signal
	}
	return err == nil && n > 0 && fds[0].Revents != 0
}

// thePoller is the package's poller: one epoll instance and one goroutine
// waiting on it, for every parked caller of every Conn, and every watch
// of a socket's other end (watchGone). Sockets are registered one-shot,
// when a caller parks or a watch is armed, so a socket nobody waits on or
// watches wakes it at most once. It starts at its first use (startPoller),
// under startMu, and once started is never stopped: started is set last,
// and epfd and parks are read only after it.
var thePoller struct {
	startMu sync.Mutex
	started atomic.Bool
	epfd    int

	mu    sync.Mutex
	next  uint64
	parks map[uint64]*parking
}

// parking is a Conn's registration with the poller. It belongs to the
// Conn, which releases it before it closes its socket.
type parking struct {
	mu    sync.Mutex
	id    uint64 // 0 until the socket is registered
	want  int16  // POLLIN and POLLOUT that callers wait for, under mu
	armed bool   // registered for an event not yet told, under mu
	in    chan struct{}
	out   chan struct{}
	// gone is what the watchers of the other end's close run (see
	// watchGone), by key, under mu.
	gone map[any]func()
}

func newParking() parking {
	return parking{in: make(chan struct{}, 1), out: make(chan struct{}, 1)}
}

// arm registers s for ev, one-shot, and returns the channel that
// readiness is told on. A readiness told before is dropped first: the
// caller has just found s not ready.
func (p *parking) arm(s int, ev int16) (<-chan struct{}, error) {
	if err := startPoller(); err != nil {
		return nil, err
	}
	ch := p.in
	if ev != unix.POLLIN {
		ch = p.out
	}
	select {
	case <-ch:
	default:
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.want |= ev
	if err := p.registerLocked(s); err != nil {
		return nil, err
	}
	return ch, nil
}

// registerLocked registers s with the poller, one-shot, for the events
// that p's callers want and for its other end's close, which epoll
// reports at once if it is closed already. The caller holds p.mu.
func (p *parking) registerLocked(s int) error {
	op := unix.EPOLL_CTL_MOD
	if p.id == 0 {
		thePoller.mu.Lock()
		thePoller.next++
		p.id = thePoller.next
		thePoller.parks[p.id] = p
		thePoller.mu.Unlock()
		op = unix.EPOLL_CTL_ADD
	}
	e := unix.EpollEvent{Events: uint32(p.want) | unix.EPOLLONESHOT | unix.EPOLLRDHUP}
	putID(&e, p.id)
	if err := unix.EpollCtl(thePoller.epfd, op, s, &e); err != nil {
		return err
	}
	p.armed = true
	return nil
}

// watchGone makes the poller run f, keyed key, at the next event of s:
// the close of its other end in every process, or, as the registration
// is one-shot and shared with the callers parked on s, any other event,
// after which the watcher looks at what it was and calls watchGone again
// if it still waits. f runs under p.mu: it must not block, and once
// unwatchGone(key) has returned it is not running and never runs. A
// watchGone while the registration is armed makes no system call.
func (p *parking) watchGone(s int, key any, f func()) error {
	if err := startPoller(); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	_, watched := p.gone[key]
	if p.gone == nil {
		p.gone = make(map[any]func())
	}
	p.gone[key] = f
	if watched && p.armed {
		return nil
	}
	return p.registerLocked(s)
}

// unwatchGone ends the watch key, once an f of it under way has returned.
func (p *parking) unwatchGone(key any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.gone, key)
}

// release unregisters s. The Conn calls it once no call uses s, before
// closing s: the socket may live on in other processes, and epoll would
// keep reporting it.
func (p *parking) release(s int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.id == 0 {
		return
	}
	_ = unix.EpollCtl(thePoller.epfd, unix.EPOLL_CTL_DEL, s, nil)
	thePoller.mu.Lock()
	delete(thePoller.parks, p.id)
	thePoller.mu.Unlock()
	p.id, p.armed = 0, false
}

// notify tells every parked caller of p that its socket may be ready, and
// runs what its watchers of the other end's close run: a one-shot
// registration is spent by any event, so each tries again, or looks, and
// parks or watches again if it was not its turn.
func (p *parking) notify() {
	p.mu.Lock()
	want := p.want
	p.want, p.armed = 0, false
	if hook := beforeGone.Load(); hook != nil && len(p.gone) > 0 {
		(*hook)(p)
	}
	for _, f := range p.gone {
		f()
	}
	p.mu.Unlock()
	if want&unix.POLLIN != 0 {
		tell(p.in)
	}
	if want&unix.POLLOUT != 0 {
		tell(p.out)
	}
}

// beforeGone, if set, runs in the poller before it runs the watches of
// p's socket, under p.mu, for tests: a poller slow to run them.
var beforeGone atomic.Pointer[func(p *parking)]

func tell(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// startPoller starts the package's poller if it has not started. A start
// that fails (the process's descriptors exhausted, say) fails the call
// that needed it, and the next call tries again: a process that ran out
// of descriptors once can park its callers once it has some again.
func startPoller() error {
	if thePoller.started.Load() {
		return nil
	}
	thePoller.startMu.Lock()
	defer thePoller.startMu.Unlock()
	if thePoller.started.Load() {
		return nil
	}
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return fmt.Errorf("starting the poller: %w", err) // the caller says what waited
	}
	fd.KeepForLife(epfd)
	thePoller.epfd = epfd
	thePoller.parks = make(map[uint64]*parking)
	go pollLoop(epfd)
	thePoller.started.Store(true)
	return nil
}

// pollLoop waits on the poller for the life of the process, in a thread
// of its own while it waits.
func pollLoop(epfd int) {
	var events [64]unix.EpollEvent
	var ready []*parking
	for {
		n, err := unix.EpollWait(epfd, events[:], -1)
		if err != nil {
			continue // EINTR
		}
		thePoller.mu.Lock()
		ready = ready[:0]
		for i := range events[:n] {
			if p := thePoller.parks[getID(&events[i])]; p != nil {
				ready = append(ready, p)
			}
		}
		thePoller.mu.Unlock()
		for _, p := range ready {
			p.notify()
		}
		clear(ready) // no registration outlives its Conn here
	}
}

// putID and getID keep a registration's id in an event's data.
func putID(e *unix.EpollEvent, id uint64) {
	e.Fd = int32(id)
	e.Pad = int32(id >> 32)
}

func getID(e *unix.EpollEvent) uint64 {
	return uint64(uint32(e.Fd)) | uint64(uint32(e.Pad))<<32
}

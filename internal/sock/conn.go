package sock

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/reduction"
)

// ErrClosed is returned by calls on a closed Conn, and to callers blocked
// in one when it is closed; also by receives once the other end is closed
// in every process. It is mp.ErrClosed.
var ErrClosed = errors.New("mp: closed")

// ErrMalformed is wrapped by the errors for a message that tensormp did
// not frame: whatever it brought is closed, and the Conn goes on. It is
// reduction.ErrMalformed, which a message whose value cannot be decoded
// also wraps, and mp.ErrMalformed.
var ErrMalformed = reduction.ErrMalformed

// ErrWouldBlock is what the Try calls return instead of waiting.
var ErrWouldBlock = errors.New("mp: would block")

// A Conn is this process's hold on one descriptor that tensormp waits
// on: most often an end of a connected AF_UNIX SOCK_SEQPACKET socket,
// whose messages Send and Recv carry, each logical message one sendmsg
// whatever its size or number of descriptors (see frame.go), so that
// several processes writing and reading the same socket never see a
// message in parts. Inside this package a Conn also holds a listening
// socket (Listener) and an end of a pipe (Places), which only its waiting
// serves; Send and Recv are for the first kind alone.
//
// A Conn does its own waiting, not the runtime poller's (see io): a
// message that arrives while its reader waits wakes the reader's thread
// directly, without a round of the scheduler. It owns its descriptor
// until Close; any number of goroutines may call it, one receive and one
// send running at a time.
type Conn struct {
	sock *fd.FD // the socket; its number is valid while use is held

	// use is read-held by every call on s and write-held by close,
	// which thereby closes s only once no call uses it.
	use    sync.RWMutex
	closed atomic.Bool
	done   chan struct{} // closed by close, waking parked callers
	// rwait and wwait are the kernel waits (see waitKernel) of the
	// reader and the writer, for close and cancellation to interrupt.
	rwait, wwait atomic.Pointer[waitSlot]
	park         parking // registration with the package's poller
	// recvBlock: s is a message socket whose receives may block in the
	// kernel, for at most kernelWait (see blockingReceives).
	recvBlock bool
	// recvWaited: the last receive waited, so the next goes to the
	// blocking call at once, without trying first.
	recvWaited atomic.Bool
	// watching is the Done channel of the context whose end interrupts a
	// blocking receive, the last one a receive waited with: a loop of
	// receives on one context registers with it once. unwatch ends the
	// registration. Both are written under watchMu, by blocking receives
	// and by close.
	watchMu  sync.Mutex
	watching <-chan struct{}
	unwatch  func() bool

	rmu  chan struct{} // held by the one reader
	wmu  chan struct{} // held by the one writer
	once sync.Once
	// waiting counts the calls of this process that wait on the Conn:
	// for rmu or wmu, or for the socket to be ready.
	waiting atomic.Int32

	// The message being received, under rmu: the buffers and the calls
	// that receive into them, made on first use, and what the last call
	// got. Reused, so that a receive allocates no more than its result.
	buf, oob          []byte
	rfds              []int  // the message's descriptors, in a slice reused
	rset              fd.Set // owns them from the receive until Done
	tryRecv, waitRecv func(s int) error
	got               received
	spill             []byte // the mapping the message lies in, if spilled

	// The message being sent, its descriptors and its control message,
	// under wmu: reused, so that a send allocates nothing.
	wbuf    []byte
	wfds    []int
	wrights []byte
}

// New wraps s, a connected SOCK_SEQPACKET socket (or, inside this
// package, a listening socket or an end of a places pipe, which only io
// uses), taking it over: on error s is closed. name says what s is in
// errors.
func New(s *fd.FD, name string) (*Conn, error) {
	raw, err := s.Lend()
	if err != nil {
		return nil, fmt.Errorf("mp: %s: %w", name, err)
	}
	defer s.Return()
	recvBlock := blockingReceives(raw)
	if !recvBlock {
		if err := unix.SetNonblock(raw, true); err != nil {
			_ = s.Close()
			return nil, fmt.Errorf("mp: %s: %w", name, err)
		}
	}
	return &Conn{
		sock:      s,
		done:      make(chan struct{}),
		park:      newParking(),
		rmu:       make(chan struct{}, 1),
		wmu:       make(chan struct{}, 1),
		recvBlock: recvBlock,
	}, nil
}

// Pair returns the two connected ends of a new SOCK_SEQPACKET socket
// pair, close-on-exec, each owned by the caller.
func Pair() ([2]*fd.FD, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, sockType, 0)
	if err != nil {
		return [2]*fd.FD{}, fmt.Errorf("mp: socketpair: %w%s", err, FDHint(err))
	}
	return [2]*fd.FD{fd.New(fds[0]), fd.New(fds[1])}, nil
}

// FDHint is what to append to an error for err, the failure of a call
// that makes descriptors: the way out of the descriptor limit when err is
// that limit, else nothing.
func FDHint(err error) string {
	if fd.OutOfDescriptors(err) {
		return " (out of file descriptors: " + fd.LimitHint + ")"
	}
	return ""
}

// waitedMin is the least time a receive that waited took: a thread's
// sleep and wakeup. One that took less found its message there.
const waitedMin = 5 * time.Microsecond

// errConnClosed is what calls on a closed Conn return.
var errConnClosed = fmt.Errorf("%w (the connection)", ErrClosed)

// Dup returns a duplicate of the Conn's descriptor, for passing to
// another process, owned by the caller. A Close racing the send of it
// closes the Conn, never the duplicate.
func (c *Conn) Dup() (*fd.FD, error) {
	c.use.RLock()
	defer c.use.RUnlock()
	if c.closed.Load() {
		return nil, errConnClosed
	}
	dup, err := c.sock.Dup()
	if err != nil {
		return nil, fmt.Errorf("mp: duplicating a socket: %w%s", err, FDHint(err))
	}
	return dup, nil
}

// Close closes the descriptor once the calls using it have returned: it
// wakes those that wait first, and they return ErrClosed. Calls after the
// first do nothing and return nil.
func (c *Conn) Close() error {
	var err error
	c.once.Do(func() {
		c.closed.Store(true)
		close(c.done)
		interrupt(c.rwait.Load())
		interrupt(c.wwait.Load())
		c.use.Lock()
		defer c.use.Unlock()
		c.watch(context.Background()) // stops the last one's watch
		c.park.release(c.sock.Num())
		err = c.sock.Close()
	})
	return err
}

// watch makes the end of ctx interrupt c's blocking receives from now on,
// and stops the last context's doing so; a ctx that never ends only stops
// it. A context that ends once another is watched interrupts nothing: a
// caller that cancels its context after its receive has returned does not
// disturb the next receive. Contexts are told apart by their Done
// channels, which any context type has comparable.
func (c *Conn) watch(ctx context.Context) {
	done := ctx.Done()
	c.watchMu.Lock()
	defer c.watchMu.Unlock()
	if c.unwatch != nil {
		c.unwatch()
	}
	c.watching, c.unwatch = done, nil
	if done == nil {
		return
	}
	c.unwatch = context.AfterFunc(ctx, func() {
		// Which wait to end is read with the watch: a receive waiting
		// with another context has replaced it before it waits.
		c.watchMu.Lock()
		var sl *waitSlot
		var call uint64
		if c.watching == done {
			if sl = c.rwait.Load(); sl != nil {
				call = sl.current()
			}
		}
		c.watchMu.Unlock()
		if sl != nil {
			sl.interrupt(call)
		}
	})
}

// interrupt ends the wait of sl, if any, at once.
func interrupt(sl *waitSlot) {
	if sl != nil {
		sl.interrupt(sl.current())
	}
}

// lock takes sem, one of c's, giving up when ctx ends. A context that is
// done already gets nothing, even if sem is free: a Get on a cancelled
// context never takes a message.
func (c *Conn) lock(ctx context.Context, sem chan struct{}, block bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case sem <- struct{}{}: // free, the common case: no select over ctx
		return nil
	default:
		if !block {
			return ErrWouldBlock // another call of this process is waiting
		}
	}
	c.waiting.Add(1)
	defer c.waiting.Add(-1)
	select {
	case sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// io runs op, a call on the socket that does not block, until it does
// something other than EAGAIN, and returns its error, wrapped as what's.
// Between tries it waits for the socket to be ready for ev (POLLIN or
// POLLOUT): in the kernel if a wait slot is free, where readiness wakes
// this thread directly (a reply within microseconds costs no scheduling),
// else parked on the package's poller, costing no thread. Once the Conn
// is closed it returns ErrClosed, once ctx is done ctx's error, at once
// from either wait. Unless block, it returns ErrWouldBlock instead of
// waiting.
//
// wait, if not nil, is op's blocking form, a receive: on a socket whose
// receives may block, the first wait is that call itself, which the
// message wakes with the message (one system call where a poll costs two).
// When the last receive waited, as every one does in a conversation, the
// blocking call is also the first try.
func (c *Conn) io(ctx context.Context, ev int16, what string, block bool, op, wait func(s int) error) error {
	c.use.RLock()
	defer c.use.RUnlock()
	reset, waiting := false, false
	defer func() {
		if waiting {
			c.waiting.Add(-1)
		}
	}()
	canBlock := wait != nil && c.recvBlock && block // the first wait may be the blocking call
	blocking := canBlock && c.recvWaited.Load()     // this round makes it
	canBlock = canBlock && !blocking
	for {
		if c.closed.Load() {
			return errConnClosed
		}
		var err error
		if blocking {
			blocking = false
			if !waiting { // the call may wait, as waitKernel does
				waiting = true
				c.waiting.Add(1)
			}
			start := time.Now()
			err = c.blockingCall(ctx, wait)
			// A message that was there already comes within a system
			// call's time; one that was waited for, after a sleep.
			c.recvWaited.Store(err != nil || time.Since(start) > waitedMin)
		} else {
			err = op(c.sock.Num())
		}
		switch {
		case err == nil:
			if canBlock {
				c.recvWaited.Store(false) // found at the first try
			}
			return nil
		case err == unix.EINTR:
			continue
		case err == unix.ECONNRESET && ev == unix.POLLIN && !reset:
			// The peer closed with messages of ours unread. The kernel
			// says so once, before what the peer sent before closing,
			// which is still to be read.
			reset = true
			continue
		case err != unix.EAGAIN:
			if err = connErr(err); errors.Is(err, ErrClosed) {
				return err
			}
			return fmt.Errorf("mp: %s: %w%s", what, err, FDHint(err))
		case !block:
			return ErrWouldBlock
		case ctx.Err() != nil:
			return ctx.Err()
		case canBlock:
			canBlock, blocking = false, true // which records whether it waited
			continue
		}
		if !waiting {
			waiting = true
			c.waiting.Add(1)
		}
		if c.waitKernel(ctx, ev) {
			continue
		}
		if err := c.waitParked(ctx, ev); err != nil {
			return err
		}
	}
}

// waitKernel waits in the kernel for the socket to be ready for ev and
// reports whether it may be. It returns false at once when no wait slot is
// free, when the Conn is closed or ctx is done, and when its wait is
// interrupted (by close, by ctx, or to give its slot to another caller).
func (c *Conn) waitKernel(ctx context.Context, ev int16) bool {
	sl := takeWaitSlot()
	if sl == nil {
		return false
	}
	defer putWaitSlot(sl)
	slot := &c.rwait
	if ev != unix.POLLIN {
		slot = &c.wwait
	}
	// Publish the slot, then look: a close or a cancellation either
	// happened before (seen here) or finds the slot and signals it.
	slot.Store(sl)
	defer slot.Store(nil)
	if ctx.Done() != nil {
		stop := context.AfterFunc(ctx, sl.poke)
		defer stop()
	}
	if c.closed.Load() || ctx.Err() != nil {
		return false
	}
	return sl.wait(c.sock.Num(), ev)
}

// waitParked waits for the socket to be ready for ev on the package's
// poller, without a thread of its own.
func (c *Conn) waitParked(ctx context.Context, ev int16) error {
	ready, err := c.park.arm(c.sock.Num(), ev)
	if err != nil {
		return fmt.Errorf("mp: waiting for a socket: %w%s", err, FDHint(err))
	}
	select {
	case <-ready:
		return nil
	case <-c.done:
		return errConnClosed
	case <-ctx.Done():
		return ctx.Err()
	}
}

// connErr reports the end of the other side (reading past it, or writing
// to it) as ErrClosed.
func connErr(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, unix.EPIPE) || errors.Is(err, unix.ECONNRESET) {
		return fmt.Errorf("%w (%v)", ErrClosed, err)
	}
	return err
}

// Send sends one message, data and the descriptors fds, which stay the
// caller's, waiting while the socket is full until ctx ends or c is
// closed.
func (c *Conn) Send(ctx context.Context, data []byte, fds []int) error {
	return c.send(ctx, data, fds, -1, true)
}

// TrySend is Send that returns ErrWouldBlock instead of waiting, for a
// full socket or a send of this process already waiting on c.
func (c *Conn) TrySend(ctx context.Context, data []byte, fds []int) error {
	return c.send(ctx, data, fds, -1, false)
}

// send sends one message: data and the descriptors fds, which stay the
// caller's, tagged with tag unless it is -1 (see frame). Unless block, a
// full socket is ErrWouldBlock.
func (c *Conn) send(ctx context.Context, data []byte, fds []int, tag int64, block bool) error {
	if err := c.lock(ctx, c.wmu, block); err != nil {
		return err
	}
	defer func() { <-c.wmu }()

	h, payload, rights, made, err := frame(data, fds, c.wfds[:0])
	if err != nil {
		return err
	}
	defer fd.CloseAll(made)
	c.wfds = rights

	msg := append(c.wbuf[:0], make([]byte, headerLen)...)
	if tag >= 0 {
		h.flags |= flagTag
		msg = binary.LittleEndian.AppendUint32(msg, uint32(tag))
	}
	h.put(msg)
	msg = append(msg, payload...)
	c.wbuf = msg
	var oob []byte
	if len(rights) > 0 {
		oob = appendRights(c.wrights[:0], rights)
		c.wrights = oob
	}
	return c.io(ctx, unix.POLLOUT, "send", block, func(s int) error {
		n, err := unix.SendmsgN(s, msg, oob, nil, sendFlags)
		if err == nil && n != len(msg) {
			return fmt.Errorf("short write (%d of %d bytes)", n, len(msg))
		}
		return err
	}, nil)
}

// A Msg is a message Recv received. Its descriptors are FDs's, a Set the
// caller takes them from (a decode does) until Done, which closes what
// FDs still owns. Data and FDs stay valid, and the Conn reserved to the
// receiver, until Done: a message's bytes and descriptor numbers are in
// the Conn's buffers, or its bytes, if spilled, in a mapping of the
// sender's sealed copy.
type Msg struct {
	Data []byte
	FDs  *fd.Set
	c    *Conn // the socket it came by, nil for a lane's message
	w    *Way  // the Way it came by, if it did
	// tag is the message's tag (see frame), or -1.
	tag int64
}

// Way returns the Way m came by, by its lane or its socket, or nil for a
// message a Conn received itself.
func (m Msg) Way() *Way { return m.w }

// ByLane reports whether m came by a Way's lane, not by its socket: it
// carries no descriptor, and may name blocks by identity (see Way.Maps).
func (m Msg) ByLane() bool { return m.c == nil && m.w != nil }

// Done ends the receive of m: what FDs still owns is closed, and Data and
// FDs are the Conn's (or Way's) again for the next receive. It is called
// once.
func (m Msg) Done() {
	if m.c != nil {
		m.c.recvDone()
	}
	if m.w != nil {
		m.w.recvDone()
	}
}

// Recv receives one message, waiting for one until ctx ends or c is
// closed. Once the other end is closed in every process that held it,
// Recv returns an error wrapping ErrClosed.
func (c *Conn) Recv(ctx context.Context) (Msg, error) { return c.recv(ctx, true) }

// TryRecv is Recv that returns ErrWouldBlock instead of waiting, for an
// empty socket or a receive of this process already waiting on c.
func (c *Conn) TryRecv(ctx context.Context) (Msg, error) { return c.recv(ctx, false) }

// Waiting returns how many calls of this process wait on c now: for
// another call of this process to finish, or for the socket to be ready.
func (c *Conn) Waiting() int { return int(c.waiting.Load()) }

// recv receives one message, which the caller ends with its Done. Unless
// block, an empty socket is ErrWouldBlock. A wake frame is skipped.
func (c *Conn) recv(ctx context.Context, block bool) (Msg, error) {
	for {
		m, err := c.recvOrWake(ctx, block)
		if !errors.Is(err, errWoken) {
			return m, err
		}
	}
}

// recvOrWake is recv that returns errWoken for a wake frame (see
// flagWake), which it consumes: for a reader that waits on the socket
// for its lane's writer too (see Way.park).
func (c *Conn) recvOrWake(ctx context.Context, block bool) (Msg, error) {
	if err := c.lock(ctx, c.rmu, block); err != nil {
		return Msg{}, err
	}
	data, fds, spill, tag, err := c.recvLocked(ctx, block)
	if err != nil {
		<-c.rmu
		return Msg{}, err
	}
	c.spill = spill
	c.rset.Reset(fds)
	return Msg{Data: data, FDs: &c.rset, c: c, tag: tag}, nil
}

// wake sends a wake frame (see flagWake) if it can now: not while
// another send of this process is under way, nor into a full socket (a
// reader of this end has messages to wake it then), nor to a gone peer.
// It does not wait, and takes no context: a wake is owed once its
// writer has published, whatever becomes of the writer's call. Where a
// wake is not sent, or another receiver of the end takes it, the reader
// finds the entry at the end of its slice (see Way.park).
func (c *Conn) wake() error {
	ctx := context.Background()
	if err := c.lock(ctx, c.wmu, false); err != nil {
		return err
	}
	defer func() { <-c.wmu }()
	var msg [headerLen]byte
	header{flags: flagWake}.put(msg[:])
	return c.io(ctx, unix.POLLOUT, "wake", false, func(s int) error {
		_, err := unix.SendmsgN(s, msg[:], nil, nil, sendFlags)
		return err
	}, nil)
}

// recvDone ends the receive that recv began.
func (c *Conn) recvDone() {
	c.rset.Close()
	if c.spill != nil {
		_ = shm.Unmap(c.spill)
		c.spill = nil
	}
	<-c.rmu
}

// recvLocked is recv with the read lock held; spill is the mapping data
// lies in, if the message was spilled, and tag its tag (see unframe).
func (c *Conn) recvLocked(ctx context.Context, block bool) (data []byte, fds []int, spill []byte, tag int64, err error) {
	if c.buf == nil {
		c.buf = make([]byte, headerLen+tagLen+maxInline)
		c.oob = make([]byte, unix.CmsgSpace(maxFDs*4))
		c.tryRecv = func(s int) error { return c.recvmsg(s, unix.MSG_DONTWAIT) }
		c.waitRecv = func(s int) error { return c.recvmsg(s, 0) }
	}
	c.got = received{}
	err = c.io(ctx, unix.POLLIN, "receive", block, c.tryRecv, c.waitRecv)
	n, oobn, flags := c.got.n, c.got.oobn, c.got.flags
	if err == nil && n == 0 && oobn == 0 {
		if c.peerGone() {
			err = connErr(io.EOF)
		} else {
			// An empty message while the other end is open: not ours.
			err = fmt.Errorf("mp: receive: %w: an empty message", ErrMalformed)
		}
	}
	if oobn > 0 {
		got, perr := parseRights(c.rfds[:0], c.oob[:oobn])
		fds, c.rfds = got, got
		if perr != nil && err == nil {
			err = perr
		}
	}
	defer func() {
		if err != nil {
			fd.CloseAll(fds)
			fds = nil
		}
	}()
	switch {
	case err != nil:
		return nil, fds, nil, -1, err
	case flags&unix.MSG_CTRUNC != 0:
		_ = shm.DropIdle() // make room for the next message's
		return nil, fds, nil, -1, errors.New("mp: receive: descriptors were dropped by the kernel (MSG_CTRUNC): the process is probably out of file descriptors; " + fd.LimitHint)
	case flags&unix.MSG_TRUNC != 0:
		return nil, fds, nil, -1, fmt.Errorf("mp: receive: message larger than %d bytes was truncated (MSG_TRUNC)", len(c.buf))
	case n < headerLen:
		return nil, fds, nil, -1, fmt.Errorf("mp: receive: %w: %d bytes, shorter than a header", ErrMalformed, n)
	}
	return unframe(c.buf[:n], fds)
}

// received is what a receive call got: the message's length, its
// control data's, and the flags the kernel returned.
type received struct{ n, oobn, flags int }

// recvmsg receives a message into c.buf and c.oob, how says whether it
// may wait, and leaves what it got in c.got.
func (c *Conn) recvmsg(s, how int) error {
	n, oobn, flags, err := recvmsg(s, c.buf, c.oob, recvFlags|how)
	c.got = received{n, oobn, flags}
	return err
}

// peerGone reports whether the other end of the socket is closed in
// every process: a read of zero bytes is that, or an empty message.
func (c *Conn) peerGone() bool { return c.poll()&pollGone != 0 }

// pollGone are the events of poll that say the other end is closed in
// every process: a closed Conn's, and a failed look, count too.
const pollGone = pollPeerGone | unix.POLLHUP | unix.POLLERR | unix.POLLNVAL

// watchGone makes the close of c's other end in every process (its peer
// gone) run f at once, in the package's poller, keyed key: once, at the
// next event of the socket, whatever it is, after which the caller looks
// (peerGone) and watches again if it still waits. unwatchGone(key) ends
// it: once it has returned, f is not running and never runs. f must not
// block.
func (c *Conn) watchGone(key any, f func()) error {
	c.use.RLock()
	defer c.use.RUnlock()
	if c.closed.Load() {
		return nil // its callers see it closed
	}
	return c.park.watchGone(c.sock.Num(), key, f)
}

// unwatchGone ends the watch key (see watchGone).
func (c *Conn) unwatchGone(key any) { c.park.unwatchGone(key) }

// poll returns what the socket is ready for now: POLLIN, and the other
// end's close (pollPeerGone, POLLHUP). A closed Conn is POLLNVAL.
func (c *Conn) poll() int16 {
	c.use.RLock()
	defer c.use.RUnlock()
	if c.closed.Load() {
		return unix.POLLNVAL
	}
	p := []unix.PollFd{{Fd: int32(c.sock.Num()), Events: unix.POLLIN | pollPeerGone}}
	for {
		_, err := unix.Poll(p, 0)
		if err == unix.EINTR {
			continue // a signal came: that says nothing of the peer
		}
		if err != nil {
			return unix.POLLERR
		}
		return p[0].Revents
	}
}

// peekTag looks at the socket's next message without receiving it, if
// there is one now (ok), and returns its tag, or -1 if it has none or is
// not a frame (its receive says what is wrong with it). A socket whose
// other end is gone has none.
func (c *Conn) peekTag() (tag int64, ok bool) {
	c.use.RLock()
	defer c.use.RUnlock()
	if c.closed.Load() {
		return -1, false
	}
	var b [headerLen + tagLen]byte
	n, err := peek(c.sock.Num(), b[:])
	if err == unix.ECONNRESET {
		// The other end closed with messages of ours unread: the
		// first receive says so, once, before what it left.
		n, err = peek(c.sock.Num(), b[:])
	}
	switch {
	case err != nil:
		return -1, false
	case n < headerLen+tagLen || parseHeader(b[:n]).flags&flagTag == 0:
		// Not tagged, or not a frame, or the other end's close: the
		// receive says which.
		return -1, true
	}
	return int64(binary.LittleEndian.Uint32(b[headerLen:])), true
}

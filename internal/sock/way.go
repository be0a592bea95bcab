package sock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
)

// A Way is one direction of a pipe, as one process that holds an end of
// it sees it: the pipe's socket, and beside it a lane in shared memory
// (see Lane) that the direction's writer and reader take, each one
// process, so that a message whose value carries no descriptor goes by
// memory, with no system call while both sides are awake.
//
// Roles. The lane has one writing process and one reading process at a
// time. Each holds its role by an OFD lock on the lane's file (byte 0 the
// writer's, byte 1 the reader's), taken at its first Send or Recv through
// a description of the file that is its own (shm.HoldByte): the kernel
// drops it when the process closes the Way or dies, and another process
// that holds the same end takes the role over at its next call (a
// writer's Lane resumes after what the lane holds). A process without the
// role sends and receives on the socket, as it would without a lane, and
// a reader without it tries for it again each roleRetry, or at once when
// it receives a message of the role's writer. A reader lets go of its
// role when its end is sent to another process (LetGo; with a receive
// under way, as the receive ends), and when it has not received for
// idleRole (100 to 200 ms): a process that hands an end on and keeps its
// copy, or stops receiving, does not keep the lane's messages from one
// that receives.
//
// Order. The writer sends on the socket what the lane cannot carry
// (descriptors, or more bytes than an entry holds), each such message
// tagged with the lane position it follows (see frame), and then a marker
// in the lane. The reader takes the lane's entries in order. At a marker,
// and when it takes the role, it receives from the socket until the
// socket is empty or its next message (looked at without receiving it)
// follows an entry it has not taken. So the writer's messages arrive in
// the order it sent them, whichever way each went. A marker that finds
// the lane full is written before the writer's next message instead;
// until then, and for messages of processes without the role (which
// nudge the reader), the reader looks at the socket at the end of each
// sleep slice while it waits on the lane (see Bell.Wait). A message
// received ahead of its place (by a process that had no role yet) is kept
// until its place comes, or, if the reader lets go of its role meanwhile,
// until its next receive; a reader that closes its end drops it.
//
// Waits. A reader waits on the lane, a thread of its process asleep on
// the lane's bell, only while it holds one of its process's lane waits
// (laneWaiters), once a receive and for at most laneSleep; else it waits
// on the socket as a Conn waits (in one of a few kernel waits for a
// millisecond, then on the package's poller), and says so in the
// reader's words (readerWaits): a Pipe's writer that publishes an entry
// then wakes it with a wake frame (see park), and a fair Way's sends
// there (see waitFair). A Pipe's reader looks at the lane again at the
// end of each of its slices on the socket (see park). A writer that waits
// for room in a full lane sleeps on the lane only while it holds a lane
// wait too, and past laneSleep only while no other wait was refused one;
// else its goroutine sleeps on a timer between looks at the lane (see
// Lane.waitRoom).
//
// Ends. A reader whose writers are all gone (the socket's other end is
// closed in every process) gets what the lane and the socket still hold,
// then ErrClosed. A writer whose readers are all gone gets ErrClosed once
// the lane is full, or at its first Send a millisecond after they went
// (the socket says so at once): a message sent meanwhile is lost, as one
// sent on the socket just before the readers went is. So may be one a
// writer publishes while its end closes.
//
// A hostile peer. An entry the Way did not write is an error wrapping
// ErrMalformed for that receive; counts that no honest peer writes end the
// lane for this process, which uses the socket alone from then on.
//
// Ownership. A Way owns the lane's memory descriptor, its mapping and its
// role's description until Close; the socket stays its caller's. One Send
// and one Recv run at a time; a received Msg holds the Way's receive until
// its Done.
type Way struct {
	shared *Conn  // the pipe end's socket: the caller's
	mem    *fd.FD // the lane's memory, or nil for a pipe without one
	writes bool   // this process writes the lane (else it reads it)

	sem     callLock // held by the one call, and a received Msg until Done
	closed  atomic.Bool
	waiting atomic.Int32 // calls waiting for sem, or on the lane for a message

	// The role, under sem: lane is mapped and role holds its lock, or
	// both are nil and tried says when a try last failed. lane stays set
	// once mapped, for Close to nudge.
	lane  atomic.Pointer[Lane]
	role  *fd.FD
	held  bool
	tried time.Time
	// broken: the lane cannot be used here (it is not a lane, or its
	// counts are not an honest peer's): the socket serves alone.
	broken bool
	// turnedAway: the last taken, a fair Way's reader's without the
	// role, found no lane wait free and nothing in the lane (under sem).
	turnedAway bool

	alive     func() error // the Way's check of its peer, made once
	sockMoved func() error // a fair Way's reader's socketSentSince, made once
	onGone    func()       // nudgeLane, made once, for watchPeer

	// fair: the Way of a queue, which any number of processes may read
	// (see NewFairWay). A reader waits on the lane for sleep at most
	// (laneSleep), and a fair Way's writer takes a reader that spun
	// within live as alive (liveWindow; tests change both).
	fair  bool
	sleep time.Duration
	live  time.Duration
	// reading: a fair Way's reader's read lock on readersByte while it
	// reads without the role; others and othersAt: the writer's last
	// look at whether other readers are (otherReaders).
	reading  *fd.FD
	others   atomic.Bool
	othersAt atomic.Int64

	// A Pipe's reader's wait on its socket (see park): how long its
	// first slice of a receive lasts (parkSlice; tests change it), and
	// the next slice's, under sem (0: it has not parked in this
	// receive).
	parkFirst time.Duration
	parkNext  time.Duration

	// The reader's role's idle timer (see letGoIdle), and the count of
	// receives ended, now and when it last looked; under sem. Once the
	// reader has let go of the role with pins left, the timer looks at
	// them each pinLook (pinLookEvery; tests change it); idleEvery is
	// the timer's period, idleRole or pinLook, for a tick that finds a
	// receive under way. A receive that waits looks at the pins itself,
	// at most once a pinLook (lookWhileWaiting): lookedAt is its last.
	idle        *time.Timer
	recvs, seen uint64
	pinLook     time.Duration
	idleEvery   atomic.Int64
	lookedAt    int64
	// handOn: a LetGo found sem held, and left the hand-on to its holder,
	// which does it as it releases sem (unlock). Under handMu, which
	// LetGo holds as it tries for sem and unlock as it releases it, so
	// that one of the two sees the other.
	handMu sync.Mutex
	handOn bool

	// The writer's, under sem.
	owed    bool     // a marker is owed: a socket message went without one
	wait    patience // a fair Way's: how long to wait for a busy reader
	onSock  bool     // this process sent on the socket without the role
	checked int64    // the last look at whether the readers are gone (monoNow)
	wbuf    []byte
	hbuf    []byte // an entry's head (see appendReturns)

	// The writer's loans (see way_pins.go), under sem, the timer that
	// settles them while no Send does (made in NewWay), and its copy of
	// the reader's list, under viewMu, which Close takes before it unmaps
	// the lane.
	ledger   ledger
	settler  *time.Timer
	settling bool        // under sem: settler is armed, or about to be
	writing  atomic.Bool // this process holds the writer's role (held, for Maps)
	// byLane says whether the lane took the writer's last message (its
	// send may still have gone by the socket, if the lane then refused
	// it): Warm asks for the taken count's line, which a fair Way's
	// writer claims its reader on, only then. Written under sem, when it
	// changes; a stale value costs a prefetch, or misses one.
	byLane     atomic.Bool
	viewMu     sync.Mutex
	view       pinView
	viewClosed bool // under viewMu: the lane may be unmapped

	// The reader's, under sem.
	pins pins
	// Returns (see way_returns.go): the blocks the entry being taken
	// returns, under takeMu, which the scanner takes too, and the
	// scanner's room; the scanner's unregistering, once registered; the
	// segments listed as this process's, as of shm's version prodsAt.
	takeMu     sync.Mutex
	taking     []shm.ReturnRef
	sbuf       []byte
	unregister func()
	prods      []shm.ID
	prodsAt    uint64
	rbuf       []byte
	abuf       []byte // Ahead's copies
	none       fd.Set // a lane message's descriptors: none
	draining   bool   // at a marker: the socket first
	// sockSeen: the lane's sockSends when a fair Way's reader last found
	// the socket empty; sockReady: it has a message all the same (of a
	// writer that did not count it)
	sockSeen  uint32
	sockReady bool
	// sockRun: a fair Way's reader's receives in a row that came by the
	// socket; missSeen: the lane's laneMisses as it last waited on the
	// lane (see waitFair).
	sockRun  int
	missSeen uint32
	atMarker bool // and no message received from it since the marker
	stash    Msg  // a socket message that follows entries not yet taken
	stashed  bool
}

// Lane entries of a Way begin with their kind.
const (
	kindValue  = 0 // the message's bytes follow
	kindMarker = 1 // a message went by the socket
)

// A Way's lane: WayEntries entries of WayEntry bytes (516 KiB with its header).
const (
	WayEntries = 256
	WayEntry   = 2048
	// roleRetry is how often a process without the lane's role tries for
	// it again while it waits on the socket.
	roleRetry = 10 * time.Millisecond
	// peerCheck is how often a writer with room in the lane looks at
	// whether its readers are gone.
	peerCheck = time.Millisecond
)

var (
	marker = []byte{kindMarker}

	// errSocketReady and errWritersGone end a reader's wait on the lane
	// (see Way.readerAlive).
	errSocketReady = errors.New("mp: the socket has a message")
	errWritersGone = errors.New("mp: the writers are gone")
	errWayClosed   = fmt.Errorf("%w (the pipe)", ErrClosed)
)

// NewWay returns the Way of shared, a pipe end's socket, whose lane's
// memory is mem (made by CreateLane), which the Way takes over; writes
// says whether this end writes the lane or reads it. A nil mem makes a
// Way that only uses the socket.
func NewWay(shared *Conn, mem *fd.FD, writes bool) *Way {
	w := &Way{shared: shared, mem: mem, writes: writes, broken: mem == nil, sleep: laneSleep, parkFirst: parkSlice}
	w.sem.freed = make(chan struct{}, 1)
	w.onGone = w.nudgeLane
	if writes {
		w.alive = w.writerAlive
		w.settler = time.AfterFunc(time.Hour, w.settleIdle)
		w.settler.Stop() // until a loan is out
	} else {
		w.alive, w.sockMoved = w.readerAlive, w.socketSentSince
		w.pins.most, w.pins.mostBytes = maxPins, maxPinBytes
		w.pinLook = pinLookEvery
		w.idle = time.AfterFunc(time.Hour, w.letGoIdle)
		w.idle.Stop() // until the role is taken
	}
	return w
}

// NewFairWay returns the Way of a queue's socket, shared, as NewWay
// does, for a queue that any number of processes may read. Its writer
// hands a message to the lane only with the lane empty, while the role's
// reader waits on it, or is busy (between two receives) and no other
// process reads the end; to the socket otherwise, which every reader
// receives from. So a message waits in the lane behind a busy reader only
// while no other reader is there to take it: the lane saves the system
// calls of a hand-off, and keeps the socket's sharing out of messages
// among readers. A reader that starts reading while one waits behind the
// busy reader gets it once that reader is back, or has let go of its
// role (idleRole), and it has taken the role (within laneSleep).
//
// Order: a fair writer sends by the socket with no marker, and counts the
// message in the lane's reader's words (sockSends); the lane takes a message
// only from a writer that sees the count unchanged since the reader last
// found the socket empty, and the reader takes the lane's entries before
// the socket's. So a message does not overtake one that any writer
// finished sending before it, by the socket, but for a writer killed
// between its send and its count.
//
// Waits: a reader waits on the lane at most laneSleep, and at most
// laneWaiters readers of a process at once, each a thread; the others
// wait on the socket, parked, and say so (waitParked): the writer sends
// there. So does a reader whose last messages came by the socket, until
// the writer counts a message it sent there that the lane would have
// taken from a reader waiting on it (laneMisses, see socketRun). A
// writer claims the reader's state before it publishes an entry
// (waitClaimed, claimedBusy), and the reader, once claimed, waits for the
// entry on the lane, never on the socket, until it comes or the claiming
// writer is gone. Tensors by identity (of the writer's pool, or returned
// to the reader, which made them) go only to a reader that waits on the
// lane and holds the role now (see readerLive); a writer with one for a
// busy reader, the end's only one, waits briefly for it to come back to
// the lane if the writer's process is answering (awaitReader). A reader
// without the role counts as another from its first receive on, a try
// (TryRecv) included (see countReader).
func NewFairWay(shared *Conn, mem *fd.FD, writes bool) *Way {
	w := NewWay(shared, mem, writes)
	w.fair, w.sleep, w.live = true, laneSleep, liveWindow
	w.wait.spin = awaitSpin
	return w
}

// CreateWayLane makes the memory of a Way's lane, owned by the caller.
func CreateWayLane() (*fd.FD, error) { return CreateLane(WayEntries, WayEntry) }

// Dup returns a duplicate of the lane's memory descriptor, owned by the
// caller, or nil for a Way without a lane.
func (w *Way) Dup() (*fd.FD, error) {
	if w.mem == nil {
		return nil, nil
	}
	dup, err := w.mem.Dup()
	if err != nil {
		return nil, fmt.Errorf("mp: duplicating a lane: %w%s", err, FDHint(err))
	}
	return dup, nil
}

// Waiting returns how many calls of this process wait on the Way now:
// for another call of this process to finish, or for a message in the
// lane; and, on its socket, for the socket to be ready.
func (w *Way) Waiting() int { return int(w.waiting.Load()) + w.shared.Waiting() }

// lockCall takes the Way's one call, waiting until ctx ends if block,
// else returning ErrWouldBlock at once while another call holds it; a
// done ctx is its error.
func (w *Way) lockCall(ctx context.Context, block bool) error {
	if err := ctx.Err(); err != nil {
		return err // a done context takes and sends nothing
	}
	if !w.sem.tryLock() {
		if !block {
			return ErrWouldBlock
		}
		w.waiting.Add(1)
		defer w.waiting.Add(-1)
		if !w.sem.lockOr(ctx.Done()) {
			return ctx.Err()
		}
		if err := ctx.Err(); err != nil {
			// Handed the call as ctx ended (see callLock.giveUp):
			// released as a call ends, which hands on a LetGo that
			// found it taken.
			w.unlock()
			return err
		}
	}
	if w.closed.Load() {
		w.sem.unlock()
		return errWayClosed
	}
	return nil
}

// recvDone ends a receive, counting it for letGoIdle, and tells the
// writer what the reader has done with (see ack).
func (w *Way) recvDone() {
	w.recvs++
	now := monoNow() // as the receive ends: its caller may have held the message long
	lastRecv.Store(now)
	if len(w.taking) > 0 {
		w.takeMu.Lock()
		w.taking = w.taking[:0] // revived, or never to be
		w.takeMu.Unlock()
	}
	if w.held {
		l := w.lane.Load()
		ack(l)
		w.relistProduced(l)
		lookCPU(now)
		l.stampCPU(false) // for a writer that spins for this reader (awaitReader)
	}
	w.unlock()
}

// unlock releases sem, and hands on if a LetGo came while it was held
// (handOn).
func (w *Way) unlock() {
	w.handMu.Lock()
	w.sem.unlock()
	asked := w.handOn
	w.handOn = false
	w.handMu.Unlock()
	if asked {
		w.LetGo() // at once, or left to whoever took sem since
	}
}

// idleRole is how often a reader that holds its role looks at whether it
// has received since it last looked; if it has not, and is not receiving
// now, it lets go (see letGoIdle).
const idleRole = 100 * time.Millisecond

// pinLookEvery is how often a reader looks at whether the producers of
// the segments it pins have let go of them, once it has let go of its
// role with pins left (see letGoIdle), and at most, while a receive
// waits (see lookWhileWaiting; a fair Way's reader parked on its socket
// waits in slices of it): a lock's query a pin.
const pinLookEvery = time.Second

// letGoIdle lets go of the reader's role if no receive has ended or been
// under way since it last ran, idleRole ago, so that a process that holds
// the end and stopped receiving (it handed the end on, or is done with
// it) does not keep the lane's messages from one that receives. It takes
// the role again at its next receive, if it is free. A reader that lets
// go with pins left goes on looking at them each pinLook, unpinning those
// their producers let go of (prunePins), until none is left or it takes
// the role again: a dead producer's segment is not kept for an idle
// reader.
func (w *Way) letGoIdle() {
	if w.closed.Load() {
		return
	}
	if !w.sem.tryLock() {
		w.idle.Reset(time.Duration(w.idleEvery.Load())) // receiving
		return
	}
	defer w.unlock()
	switch {
	case w.closed.Load():
	case !w.held:
		w.lookAtPins()
	case w.recvs != w.seen:
		w.seen = w.recvs
		w.prunePins(w.lane.Load()) // segments their producers have let go of
		w.idle.Reset(idleRole)
	case w.fair && w.lane.Load().readerWord(readerWaits).Load() == waitClaimed:
		// An entry comes for this reader, whose receive ended first,
		// and may name blocks it pins, which another reader, taking the
		// role, would not map: it takes it at its next receive. (An
		// entry for a busy reader names none: see handsOver.)
		w.idle.Reset(idleRole)
	case w.returnWaits(w.lane.Load()):
		// An entry returns blocks this process made, which no other
		// reader could take back (see way_returns.go): a pipe's, or a
		// queue's claimed one, whose receive ended first.
		w.idle.Reset(idleRole)
	default:
		w.letGo(false)
		w.lookAtPins()
	}
}

// lookAtPins unpins, for a reader without the role, the segments whose
// producers have let go of them (prunePins), and looks again in pinLook
// if any are left. The caller holds sem.
func (w *Way) lookAtPins() {
	if len(w.pins.order) == 0 {
		return
	}
	w.prunePins(w.lane.Load())
	if len(w.pins.order) > 0 {
		w.idleEvery.Store(int64(w.pinLook))
		w.idle.Reset(w.pinLook)
	}
}

// lookWhileWaiting is lookAtPins for a receive that waits (on the
// socket, or between its slices): it prunes the reader's pins at most
// once a pinLook, so that a consumer that waits long in a receive keeps
// no segment its producer let go of either. The caller holds the
// receive.
func (w *Way) lookWhileWaiting() {
	if len(w.pins.order) == 0 {
		return
	}
	now := monoNow()
	if now-w.lookedAt < int64(w.pinLook) {
		return
	}
	w.lookedAt = now
	w.prunePins(w.lane.Load())
}

// taken returns the lane if this process holds its role, trying for it
// if it has not tried within roleRetry; a fair Way's reader does not try
// while no lane wait is free and the lane holds nothing (turnedAway).
// The caller holds sem.
func (w *Way) taken() *Lane {
	w.turnedAway = false
	if w.held {
		return w.lane.Load()
	}
	if w.broken || !w.tried.IsZero() && time.Since(w.tried) < roleRetry {
		return nil
	}
	l := w.lane.Load()
	if w.fair && !w.writes {
		if l != nil && laneSleepers.Load() >= laneWaiters && l.Sent() == l.Taken() {
			// No lane wait to be had now, nor an entry to take: the
			// socket (see waitFair), without the system calls of a role.
			w.turnedAway = true
			return nil
		}
		// One try for a role at a time in the process: a thousand
		// readers that wake together make their calls in turn, not a
		// thread each.
		if !roleTry.CompareAndSwap(false, true) {
			return nil
		}
		defer roleTry.Store(false)
	}
	if l == nil {
		var err error
		if l, err = OpenLane(w.mem); err != nil {
			// Not a lane (the socket serves for good), or no room to
			// map it now.
			w.broken = errors.Is(err, ErrMalformed) || errors.Is(err, errors.ErrUnsupported)
			w.tried = time.Now()
			return nil
		}
		w.lane.Store(l)
	}
	var b int64 // the writer's byte
	if !w.writes {
		b = 1
	}
	role, err := shm.HoldByte(w.mem, b)
	if err != nil || role == nil {
		w.tried = time.Now()
		return nil
	}
	w.role, w.held = role, true
	if w.writes {
		l.Resume()                   // after what earlier writers published
		w.owed = w.onSock && !w.fair // what it sent on the socket comes first
		if w.fair {
			// A claim of a writer killed before it published.
			// Unless it published: the reader takes that entry.
			if l.Sent() == l.Taken() {
				giveBack(l.readerWord(readerWaits))
			}
		}
		w.writing.Store(true)
	} else {
		// What earlier readers left on the socket first; a fair Way's
		// reader takes the lane's first (see handsOver), and the socket's
		// before it waits.
		w.draining = !w.fair
		if w.reading != nil {
			_ = w.reading.Close() // the role's reader is not another
			w.reading = nil
		}
		if w.fair {
			// This reader's, busy; an earlier reader's claims are this
			// reader's to take.
			moveWait(l.readerWord(readerWaits), waitBusy)
		}
		w.registerReturns() // before the list says which segments are its own
		w.listPins(l)
		w.idleEvery.Store(int64(idleRole))
		w.idle.Reset(idleRole)
	}
	return l
}

// letGo gives up the role, for good if the lane is broken (its counts
// are not an honest peer's): the socket serves alone. The caller holds
// sem.
func (w *Way) letGo(broken bool) {
	w.leaveWaits()
	if w.role != nil {
		_ = w.role.Close()
		w.role = nil
	}
	w.held, w.tried = false, time.Time{}
	w.writing.Store(false)
	if broken {
		w.broken = true
	}
}

// leaveWaits says, as a fair Way's reader that lets go of its role, that
// no reader holds it (waitNone): the writer claims no busy reader then.
// A claim stays, for the next reader. The caller holds sem.
func (w *Way) leaveWaits() {
	if l := w.lane.Load(); w.fair && !w.writes && w.held && l != nil {
		moveWait(l.readerWord(readerWaits), waitNone)
	}
}

// LetGo gives up this process's reader's role of the Way, and unlists its
// pins, so that another process that holds the end (the one it is sent
// to) may take the role, and the writer names nothing by identity for
// this process's pins any more, which that process may not map. A call
// of the Way under way (a receive) does so as it ends. This process
// takes the role again at its next receive if it is free.
func (w *Way) LetGo() {
	if w.writes {
		return
	}
	w.handMu.Lock()
	if !w.sem.tryLock() {
		w.handOn = true // the call under way hands on as it ends
		w.handMu.Unlock()
		return
	}
	w.handOn = false // done now
	w.handMu.Unlock()
	defer w.unlock()
	w.handOnNow()
}

// handOnNow does what LetGo asks for. A reader that let go of the role
// idle left its list in the lane's page, which it unlists too. The
// caller holds sem.
func (w *Way) handOnNow() {
	if w.closed.Load() {
		return
	}
	if l := w.lane.Load(); l != nil {
		w.unlistPins(l)
	}
	if w.held {
		w.letGo(false)
	}
}

// Send sends data and the descriptors fds, which stay the caller's: by
// the lane if this process holds the writer's role and the message fits
// an entry without descriptors (for a fair Way, if the lane's reader
// waits for it too), else by the socket (see Way). It waits while the
// lane is full, until ctx ends or the readers are gone.
func (w *Way) Send(ctx context.Context, data []byte, fds []int) error {
	return w.send(ctx, data, fds, nil, true)
}

// TrySend is Send that returns ErrWouldBlock instead of waiting: for a
// full socket, or a send of this process under way on the Way. A full
// lane sends by the socket.
func (w *Way) TrySend(ctx context.Context, data []byte, fds []int) error {
	return w.send(ctx, data, fds, nil, false)
}

// SendLent sends data, a message that names the blocks lent by their
// segments' identity alone (see Maps), by the lane, which takes the loans
// over: they are returned once the reader holds the blocks, or is gone.
// A message that cannot go by the lane now (this process does not hold
// the writer's role, a marker is owed, it does not fit an entry, or, for
// a fair Way, the reader does not wait for it) is carry.ErrNoLane, the
// loans still the caller's; so is any error. With nothing lent it is
// Send. It is a carry.SendFunc.
func (w *Way) SendLent(ctx context.Context, data []byte, fds []int, lent []*shm.Block) error {
	return w.send(ctx, data, fds, lent, true)
}

// TrySendLent is SendLent that returns ErrWouldBlock instead of waiting,
// as TrySend does.
func (w *Way) TrySendLent(ctx context.Context, data []byte, fds []int, lent []*shm.Block) error {
	return w.send(ctx, data, fds, lent, false)
}

func (w *Way) send(ctx context.Context, data []byte, fds []int, lent []*shm.Block, block bool) error {
	if len(lent) > 0 && len(fds) > 0 {
		return carry.ErrNoLane // never made so
	}
	if err := w.lockCall(ctx, block); err != nil {
		return err
	}
	defer w.sem.unlock()
	l := w.taken()
	if l == nil {
		if len(lent) > 0 {
			return carry.ErrNoLane
		}
		w.onSock = true
		if err := w.shared.send(ctx, data, fds, -1, block); err != nil {
			return err
		}
		if l := w.lane.Load(); l != nil {
			if w.fair {
				l.readerWord(sockSends).Add(1) // see handsOver
			}
			l.Nudge() // a reader asleep on the lane looks at the socket
		}
		return nil
	}
	now := monoNow() // one clock read, for the settling and the look at the readers
	w.ledger.settle(l, w.mem, false, now)
	lookCPU(now)
	l.stampCPU(true) // for a reader that spins on the lane, whatever way this goes
	if w.owed {
		w.owed = l.TrySend(marker) != nil
	}
	if len(lent) > 0 && w.fair && !w.readerLive(l, now) {
		// Names by identity for pins of a reader that is gone: the next
		// reader does not map them.
		return carry.ErrNoLane
	}
	hdr, ok := appendReturns(w.hbuf[:0], lent)
	w.hbuf = hdr
	fits := ok && len(fds) == 0 && len(hdr)+len(data) <= l.Room() && !w.owed
	handed := fits && w.lanes(ctx, l, len(lent) > 0, block)
	if w.byLane.Load() != handed {
		w.byLane.Store(handed)
	}
	if handed {
		pos := l.Tail()
		err := w.sendEntry(ctx, l, hdr, data, block, now)
		switch {
		case err != nil && w.fair:
			giveBack(l.readerWord(readerWaits)) // no entry comes
		case err == nil && !w.fair:
			w.wakeParked(l)
		}
		switch {
		case err == nil && len(lent) > 0:
			if hdr[0] == kindReturn {
				returnsSent.Add(1)
			}
			if w.ledger.lend(pos, lent) {
				if !w.settling {
					// Armed once, not at each Send: while loans are
					// out it comes back each settleEvery (settleIdle).
					w.settling = true
					w.settler.Reset(settleEvery)
				}
				lentSent.Add(1)
			}
			return nil
		case len(lent) > 0 && (errors.Is(err, errCounts) || errors.Is(err, ErrWouldBlock)):
			return carry.ErrNoLane // the socket serves now
		case errors.Is(err, errCounts):
			return w.shared.send(ctx, data, fds, -1, block) // the socket serves now
		case !errors.Is(err, ErrWouldBlock):
			return err
		}
		// A full lane, not waited for: the socket, after its entries.
	} else {
		if fits && w.fair {
			// The lane would have taken it from a reader waiting there.
			l.readerWord(laneMisses).Add(1) // see waitFair
		}
		if len(lent) > 0 {
			return carry.ErrNoLane
		}
	}
	if w.fair {
		// No marker: the reader takes the lane's entries first, and
		// the socket's before it waits on the lane again (see
		// handsOver).
		if err := w.shared.send(ctx, data, fds, -1, block); err != nil {
			return err
		}
		l.readerWord(sockSends).Add(1)
		l.Nudge()
		return nil
	}
	if err := w.shared.send(ctx, data, fds, int64(l.Tail()), block); err != nil {
		return err
	}
	// The message is sent: whatever becomes of its marker, it is the
	// readers'. One that finds no room is owed.
	w.owed = l.TrySend(marker) != nil
	return nil
}

// lanes reports whether the lane l takes the writer's next message,
// claiming a fair Way's reader for it (see handsOver). A message that
// names blocks goes only to a reader that waits on the lane; one sent
// with block waits first, briefly, for a busy reader to come back to the
// lane (awaitReader).
func (w *Way) lanes(ctx context.Context, l *Lane, named, block bool) bool {
	tail := l.Tail()
	if w.handsOver(l, tail, true, named) {
		return true
	}
	return w.fair && named && block && w.awaitReader(ctx, l, tail) && w.handsOver(l, tail, true, named)
}

// handsOver reports whether the lane l may take the writer's next
// message, at tail: always, but for a fair Way only with every entry
// before tail taken, no message sent by the socket since the reader last
// found it empty (which may have been sent before this one, as a pool's
// notice of a worker's exit follows the worker's last reply: this one
// follows it on the socket), and the reader waiting on the lane, or, for
// a message that names no block (not named), busy while no other process
// reads the end (it takes the entry at its next receive; a reader that
// lets go of its role meanwhile leaves it to the next, which could not
// rebuild blocks named for the first one's pins, nor take back blocks
// returned to the first one, which made them). With claim, the writer
// that may send claims the reader (see waitClaimed), which then waits
// for the entry on the lane, not on the socket; the writer publishes the
// entry, or gives the claim back.
func (w *Way) handsOver(l *Lane, tail uint32, claim, named bool) bool {
	if !w.fair {
		return true
	}
	waits := l.readerWord(readerWaits)
	if waits == nil || l.Taken() != tail || l.readerWord(sockSends).Load() != l.readerWord(waitsAt).Load() {
		return false
	}
	// A busy reader only for a message that names no block, and with no
	// other reader: looked at only then, past the waiting reader's claim.
	if !claim {
		v := waits.Load()
		return v == waitOnLane || v == waitBusy && !named && !w.otherReaders()
	}
	if !waits.CompareAndSwap(waitOnLane, waitClaimed) && (named || w.otherReaders() || !waits.CompareAndSwap(waitBusy, claimedBusy)) {
		return false
	}
	if l.readerWord(sockSends).Load() != l.readerWord(waitsAt).Load() {
		giveBack(waits) // sent by the socket meanwhile
		return false
	}
	return true
}

// A fair Way's writer with a message that names blocks, which only a
// reader waiting on the lane may be handed, and that finds the role's
// reader busy (between two receives) as the end's only reader, with
// every entry taken, spins for up to awaitSpin for it to come back to
// the lane (awaitReader): a reader between the two halves of a round
// trip, on another CPU, is back within microseconds, and the lane saves
// the hand-off its system calls and its descriptor. After
// patienceMisses waits in a row ended without it (a reader busy with
// work of its own, one that shares the writer's CPU and cannot run while
// it spins, or one that takes what the socket holds first), only one
// such message in patienceProbe waits, to see whether that changed.
const (
	awaitSpin      = 50 * time.Microsecond // about what a wake across CPUs costs
	patienceMisses = 4
	patienceProbe  = 64
)

// spinTurns is how many turns a spin for another process (awaitReader,
// a Bell's) makes between two looks at its clock, and at spinYield.
const spinTurns = 64

// patience is a fair Way's writer's record of its waits for a busy
// reader: written by awaitReader, under sem, and read by Maps too.
type patience struct {
	misses atomic.Int32 // waits in a row that ended without it
	tries  atomic.Uint32
	waits  atomic.Uint64 // waits begun, for tests
	spin   time.Duration // how long a wait spins: awaitSpin (tests change it)
}

// willWait reports whether the writer may wait for a busy reader now: if
// it came back lately, or once in patienceProbe tries.
func (p *patience) willWait() bool {
	return p.misses.Load() < patienceMisses || p.tries.Add(1)%patienceProbe == 0
}

// miss records a wait that ended without the reader.
func (p *patience) miss() {
	if p.misses.Load() < patienceMisses {
		p.misses.Add(1)
	}
}

// mayAwait reports whether a message that names blocks may wait for the
// fair Way's reader, busy as the end's only reader with every entry taken
// (see awaitReader), as Maps asks before it names any.
func (w *Way) mayAwait(l *Lane) bool {
	return w.fair && w.busyAlone(l, l.Tail()) && w.wait.willWait()
}

// busyAlone reports whether the role's reader of a fair Way is busy as
// the end's only reader, with every entry up to tail taken, and this
// process answering: the reader awaitReader waits for.
func (w *Way) busyAlone(l *Lane, tail uint32) bool {
	waits := l.readerWord(readerWaits)
	return waits != nil && waits.Load() == waitBusy && l.Taken() == tail && answering() && !w.otherReaders()
}

// answerWindow is how lately a process must have received a message on a
// Way for its writers to wait for busy readers (see answering).
const answerWindow = 200 * time.Microsecond

// lastRecv is when this process last ended a receive on a Way (see
// monoNow).
var lastRecv atomic.Int64

// monoNow returns this process's monotonic clock, in nanoseconds, at
// least an hour from zero: one read of the clock, where time.Now reads
// two, for the stamps a Send or a receive takes on every message. Other
// processes read them only as stamp makes them, Unix nanoseconds. A zero
// stamp is so an hour old or more.
func monoNow() int64 { return int64(time.Since(monoBase)) }

// monoBase is monoNow's zero, an hour before the process started, and,
// with its wall clock reading, stamp's (see stampBase).
var monoBase = time.Now().Add(-time.Hour)

// answering reports whether this process received a message on a Way
// within answerWindow: it is likely answering it, and the reader it sends
// to, busy, likely sending the message it answered or about to wait for
// the answer; a round trip's hand-off. A writer that receives nothing (a
// stream's) does not wait for a busy reader: the socket lets it run
// ahead of the reader, where a wait for each would hand its messages over
// one at a time.
func answering() bool { return monoNow()-lastRecv.Load() < int64(answerWindow) }

// awaitReader spins, for at most the writer's patience (awaitSpin),
// until the role's reader of a fair Way, busy as the end's only reader
// with every entry up to tail taken, waits on the lane again, and
// reports whether it does. It never sleeps: a writer asleep until the
// reader woke it would add a wake to the round trip, which on a VM of
// two CPUs doubled a queue's, unpinned and on one CPU, and cost its
// first share as much again. A writer pinned to the one CPU its reader
// is pinned to yields it as it spins (sharesCPU), for the reader to come
// back. A reader that parks on the socket instead, lets go of its role,
// or does not come back in time ends the wait; so does ctx. The caller
// holds sem and the writer's role.
func (w *Way) awaitReader(ctx context.Context, l *Lane, tail uint32) bool {
	if !w.busyAlone(l, tail) {
		return false
	}
	p, waits := &w.wait, l.readerWord(readerWaits)
	p.waits.Add(1)
	start := monoNow()
	yield := sharesCPU(l.readerCPU(), start)
	for i := 1; ; i++ {
		switch waits.Load() {
		case waitOnLane:
			p.misses.Store(0)
			return true
		case waitBusy:
		default:
			return false // parked on the socket, gone, or claimed by another writer
		}
		if i%spinTurns == 0 {
			if ctx.Err() != nil {
				return false
			}
			if yield {
				spinYield()
			}
			if monoNow()-start >= int64(p.spin) {
				p.miss()
				return false
			}
		}
	}
}

// giveBack returns a writer's claim of the reader (waits) to the state it
// claimed: no entry comes for it.
func giveBack(waits *atomic.Uint32) {
	if !waits.CompareAndSwap(waitClaimed, waitOnLane) {
		waits.CompareAndSwap(claimedBusy, waitBusy)
	}
}

// readerHeld reports whether a process holds the reader's role, whose
// pins a message may name: a reader killed waiting on the lane leaves its
// state and its list behind.
func (w *Way) readerHeld() bool {
	held, err := shm.ByteHeld(w.mem, 1)
	return err == nil && held
}

// liveWindow is how recent a fair Way's reader's stamp must be (its wait
// on the lane's, which is its process's last receive, or its spin's) for
// its writer to take it as alive without asking the kernel (see
// readerLive): about what a writer on the reader's CPU takes, once the
// reader yields it, to come to its Send.
const liveWindow = 20 * time.Microsecond

// heldLooks counts readerLive's looks at the reader's role, for tests.
var heldLooks atomic.Uint64

// readerLive reports whether the role's reader of a fair Way is alive, as
// readerHeld does, but without readerHeld's system call for a reader
// whose process was alive within the Way's live (liveWindow) of now, as
// a reader waiting for a round trip's next message is. Its wait on the
// lane l is stamped as it begins (readerAt, on the line of the reader's
// words, which the writer reads already), with its process's last
// receive (lastRecv), a time before the truth that costs no clock read;
// a spin that goes on is stamped each stampEvery (Bell.spunWithin). A
// reader that works longer than the window between a receive and its
// next wait so costs its writer a system call, about a microsecond, on
// each Send that lends it blocks before that wait has spun stampEvery:
// for the whole wait, if it spins less than that, or sleeps first. A
// reader killed within the window is taken as alive, as one killed just
// after readerHeld's look is: the message named for its pins is in
// flight to it, lost with it, and its blocks come back to the writer
// with the loan. now is a reading of monoNow.
func (w *Way) readerLive(l *Lane, now int64) bool {
	if s := l.readerStamp(readerAt); s != nil && stampedWithin(s.Load(), now, w.live) || l.readerSpunWithin(now, w.live) {
		return true
	}
	heldLooks.Add(1)
	return w.readerHeld()
}

// otherReaders reports whether a process other than the role's reader
// reads the Way's end, as of at most peerCheck ago: it holds a read lock
// on readersByte (see recvShared). The writer's own process counts, if it
// reads the end too.
func (w *Way) otherReaders() bool {
	now := monoNow()
	if now-w.othersAt.Load() < int64(peerCheck) {
		return w.others.Load()
	}
	held, err := shm.ByteHeld(w.mem, readersByte)
	w.others.Store(held || err != nil)
	w.othersAt.Store(now)
	return held || err != nil
}

// sendEntry publishes data in the lane l as the next value entry, after
// hdr, its kind and what it returns (see appendReturns), unless
// the readers are gone, waiting for room if block (else ErrWouldBlock). If a peer wrote the lane's
// counts (errCounts), this process gives up the lane for good: the
// socket serves it from then on. The caller holds sem and the writer's
// role.
func (w *Way) sendEntry(ctx context.Context, l *Lane, hdr, data []byte, block bool, now int64) error {
	if err := w.readersGone(now); err != nil {
		return err
	}
	w.wbuf = append(append(w.wbuf[:0], hdr...), data...)
	var err error
	if block {
		err = l.send(ctx, w.wbuf, w.alive, true, w.sleep)
	} else {
		err = l.TrySend(w.wbuf)
	}
	if errors.Is(err, errCounts) {
		w.letGo(true)
		w.onSock = true
	}
	return err
}

// settleIdle settles the writer's loans each settleEvery until none is
// left, between Sends (which settle too): a reader killed with messages
// untaken gives their blocks back though the writer never sends again.
// The Send that lends while none is out arms it.
func (w *Way) settleIdle() {
	if !w.sem.tryLock() {
		w.settler.Reset(settleEvery) // sending: it settles
		return
	}
	defer w.sem.unlock()
	l := w.lane.Load()
	if w.closed.Load() || l == nil {
		w.settling = false
		return // Close settles
	}
	w.ledger.settle(l, w.mem, false, monoNow())
	if len(w.ledger.out()) > 0 {
		w.settler.Reset(settleEvery)
	} else {
		w.settling = false
	}
}

// readersGone returns ErrClosed if the readers are gone, looking at most
// once each peerCheck; now is monoNow.
func (w *Way) readersGone(now int64) error {
	if now-w.checked < int64(peerCheck) {
		return nil
	}
	w.checked = now
	if w.shared.peerGone() {
		return fmt.Errorf("%w (the readers are gone)", ErrClosed)
	}
	return nil
}

// writerAlive is a writer's alive while it waits for room, which
// settles the writer's loans meanwhile.
func (w *Way) writerAlive() error {
	if w.closed.Load() {
		return errWayClosed
	}
	if l := w.lane.Load(); l != nil {
		w.ledger.settle(l, w.mem, false, monoNow())
	}
	if w.shared.peerGone() {
		return fmt.Errorf("%w (the readers are gone)", ErrClosed)
	}
	w.watchPeer()
	return nil
}

// readerAlive is a reader's alive while it waits on the lane: it ends
// the wait for a message on the socket, or for the writers' end.
func (w *Way) readerAlive() error {
	if w.closed.Load() {
		return errWayClosed
	}
	switch ev := w.shared.poll(); {
	case ev&pollGone != 0:
		return errWritersGone // what they left is received before ErrClosed
	case ev&unix.POLLIN != 0:
		return errSocketReady
	}
	w.watchPeer()
	return nil
}

// watchPeer makes the close of the socket's other end in every process
// that holds it (the peer's exit or death, SIGKILL included) wake this
// process's calls asleep on the lane at once (nudgeLane), which ask
// alive and find it: without it they would find it at the end of their
// sleep slice, up to maxSleepSlice later. A Pipe's Way's only: a queue's
// ends are not gone while this process holds the queue. alive asks it,
// and a wait asks alive only once its first slice has ended: a hot wait
// arms nothing. A watch that fails to arm leaves it to the slices.
func (w *Way) watchPeer() {
	if !w.fair {
		_ = w.shared.watchGone(w, w.onGone)
	}
}

// nudgeLane wakes this process's calls asleep on the lane, if it is
// mapped (see watchPeer). The poller runs it; Close ends that before it
// unmaps the lane.
func (w *Way) nudgeLane() {
	if l := w.lane.Load(); l != nil {
		l.Nudge()
	}
}

// Recv receives the next message, waiting for one until ctx ends, the
// Way is closed, or the writers are gone and nothing they sent is left
// (ErrClosed). The caller ends it with its Done.
func (w *Way) Recv(ctx context.Context) (Msg, error) { return w.receive(ctx, true) }

// TryRecv is Recv that returns ErrWouldBlock instead of waiting: for no
// message now, or a receive of this process under way on the Way.
func (w *Way) TryRecv(ctx context.Context) (Msg, error) { return w.receive(ctx, false) }

func (w *Way) receive(ctx context.Context, block bool) (Msg, error) {
	if err := w.lockCall(ctx, block); err != nil {
		return Msg{}, err
	}
	w.parkNext = 0
	m, err := w.recv(ctx, block)
	if err == nil && m.c == nil {
		w.sockRun = 0
	} else if err == nil {
		w.sockRun++
	}
	if err != nil {
		w.recvDone()
		return Msg{}, err
	}
	m.w = w
	return m, nil
}

func (w *Way) recv(ctx context.Context, block bool) (Msg, error) {
	for pass := 1; ; pass++ {
		if err := checkEvery(ctx, pass); err != nil {
			return Msg{}, err // a peer that keeps writing markers
		}
		l := w.taken()
		if l == nil && w.stashed {
			// The lane is broken since: the kept message is next.
			w.stashed = false
			return w.stash, nil
		}
		if l == nil {
			if w.turnedAway && block && w.shared.poll()&unix.POLLIN == 0 {
				// It waits on the socket for want of a lane wait.
				laneWaitsRefused.Add(1)
			}
			m, err := w.recvShared(ctx, block)
			if errors.Is(err, errRetry) {
				w.lookWhileWaiting()
				continue
			}
			if err != nil || m.tag < 0 {
				return m, err
			}
			// The role's writer sent it: if the role's reader is gone,
			// this process takes the role now, so that the message
			// keeps its place after the lane's entries; else it is
			// this process's, out of the order of those the role's
			// reader takes.
			w.tried = time.Time{}
			if l = w.taken(); l == nil {
				return m, nil
			}
			if m, ok, err := w.place(m, l); err != nil || ok {
				return m, err
			}
			continue
		}
		if w.stashed {
			if int32(uint32(w.stash.tag)-l.Taken()) <= 0 {
				w.stashed = false
				return w.stash, nil
			}
			// Entries before it first; their markers' messages came
			// before it, so they are received already.
			m, ok, err := w.fromLane(l)
			if err != nil || ok {
				return m, err
			}
			if l.Sent() == l.Taken() {
				// Nothing is left before it (a peer that moved the
				// counts took it): it is next.
				w.stashed = false
				return w.stash, nil
			}
			continue
		}
		if w.draining {
			m, ok, err := w.fromSocket(ctx, l)
			if err != nil || ok {
				return m, err
			}
			w.draining = false
			continue
		}
		m, ok, err := w.fromLane(l)
		if err != nil || ok {
			return m, err
		}
		if w.draining {
			continue
		}
		// The socket's count first: an entry published after it is
		// seen, and comes before what the socket got after it.
		c := l.readerWord(sockSends).Load()
		last := l.Sent()
		if last != l.Taken() {
			continue // sent since: take it
		}
		// Where a fair Way's reader waits, decided once: a reader that
		// skipped the look below for a wait on the socket, and then
		// waited on the lane, would sleep there past the socket's
		// message, whose nudge came before it slept.
		lane := w.fair && block && w.lanesNext(l)
		if w.fair && (c != w.sockSeen || w.sockReady) && (!block || lane) {
			// Before a wait on the lane, the messages sent by the
			// socket since the reader last found it empty: the lane's
			// entries, all taken, came before them (see handsOver). A
			// wait on the socket finds them there, and leaves waitsAt
			// as it was: the lane takes no entry for this reader until
			// it looks again.
			m, err := w.shared.TryRecv(ctx)
			switch {
			case err == nil:
				if m, ok, err := w.place(m, l); err != nil || ok {
					return m, err
				}
			case errors.Is(err, ErrWouldBlock) || errors.Is(err, ErrClosed) && !errors.Is(err, errConnClosed):
				w.sockSeen, w.sockReady = c, false
				l.readerWord(waitsAt).Store(c) // see handsOver
			default:
				return Msg{}, err
			}
			continue
		}
		if !block {
			// No wait: one look at the socket, for what the lane's
			// writer did not mark (other writers') or marked since.
			m, ok, err := w.fromSocket(ctx, l)
			if err != nil || ok {
				return m, err
			}
			return Msg{}, ErrWouldBlock
		}
		if w.fair {
			var m Msg
			var ok bool
			if h := beforeWaitFair.Load(); h != nil {
				(*h)()
			}
			m, ok, err = w.waitFair(ctx, l, last, lane)
			if ok {
				return m, nil
			}
			if err == nil {
				continue // the lane has an entry, or the writer sends one
			}
		} else {
			var m Msg
			var ok bool
			m, ok, err = w.waitPipe(ctx, l, last)
			if ok {
				return m, nil
			}
			if err == nil {
				continue // the lane has an entry, or the writer woke it
			}
		}
		switch {
		case errors.Is(err, errSocketReady) && w.fair:
			w.sockReady = true // once the lane's entries are taken
		case errors.Is(err, errSocketReady):
			w.draining = true // the socket until it is empty
		case errors.Is(err, errWritersGone):
			if l.Sent() != l.Taken() {
				continue
			}
			m, ok, err := w.fromSocket(ctx, l)
			if err != nil || ok {
				w.draining = err == nil
				return m, err
			}
			return Msg{}, fmt.Errorf("%w (the writers are gone)", ErrClosed)
		case err != nil:
			return Msg{}, err
		}
	}
}

// The states of a fair Way's reader, in the reader's words (readerWaits),
// which the reader moves between its own states and the writer claims:
// the writer hands an entry to the lane only with a claim, from
// waitOnLane, or from waitBusy while no other process reads the end
// (sockWaiters), and the reader, once claimed, waits for the entry on the
// lane, never on the socket, and takes it next. A Pipe's reader uses two:
// waitParked while it waits on the socket, and waitNone otherwise.
const (
	waitNone    = 0 // no reader holds the role
	waitOnLane  = 1 // waiting on the lane
	waitClaimed = 2 // a writer publishes an entry for the waiting reader
	waitParked  = 3 // waiting on the socket: a fair Way's writer sends
	// there; a Pipe's wakes it (see park)
	claimedBusy = 4 // a writer publishes an entry for the busy reader
	waitBusy    = 5 // the role's reader is not waiting (it takes an
	// entry at its next receive)
)

// claimed reports whether v is a claim: an entry comes for the reader.
func claimed(v uint32) bool { return v == waitClaimed || v == claimedBusy }

// A fair Way's reader whose last socketRun messages came by the socket
// (tensors that need descriptors, a writer without the role) waits for
// the next on the socket, where a wake costs the writer nothing more than
// its send, unless the role's writer has sent by the socket since its
// last wait on the lane a message that the lane would have taken from a
// reader waiting there (laneMisses, in the reader's page): it then waits
// on the lane, for the writer to hand it the next such message. A stream
// whose every message needs descriptors keeps its reader on the socket.
const socketRun = 2

// lanesNext reports whether the reader's next wait is on the lane l (see
// socketRun).
func (w *Way) lanesNext(l *Lane) bool {
	return w.sockRun < socketRun || l.readerWord(laneMisses).Load() != w.missSeen
}

// Lane waits of readers, and of writers waiting for room, hold a thread
// each (a sleep in FUTEX_WAIT): at most laneWaiters in a process at
// once, each for at most laneSleep (a writer's for longer while no other
// wait is refused one); a reader without one waits on its socket as a
// Conn waits (in one of a few kernel waits, else on the package's
// poller), where a fair Way's writer sends meanwhile (see waitFair) and
// a Pipe's wakes it (see park), and a writer on a timer (see
// Lane.waitRoom). So a thousand Recvs or Sends that wait hold a few
// threads, not a thousand.
const (
	laneWaiters = 8
	laneSleep   = 100 * time.Millisecond
)

// laneSleepers counts the lane waits taken now, by the Ways' readers
// waiting on a lane and writers waiting for room in one, and
// roleTry is held by the fair Way's reader that maps its lane or tries
// for its role.
var (
	laneSleepers atomic.Int32
	roleTry      atomic.Bool
)

// beforeWaitFair, if set, runs between a fair Way's reader's decision
// of where it waits and its wait: for tests.
var beforeWaitFair atomic.Pointer[func()]

// errWaitedEnough ends a Bell's WaitUntil at its time.
var errWaitedEnough = errors.New("mp: waited on a lane for as long as allowed")

// waitFair waits for a message as a fair Way's reader whose lane is
// empty (last its count of entries sent): on the lane while it can hold
// a thread for it (laneWaiters, laneSleep), as waitOnLane, so that the
// writer hands its next message to the lane, and then on the socket,
// parked, as waitParked, where the writer sends meanwhile. A claim (an
// entry comes) is waited for on the lane, whatever else ended the wait.
// The wait is on the lane only if lane (lanesNext, as the caller found
// it before its look at the socket). It returns a socket message for the
// caller (ok), or nothing, for the caller to look at the lane again, or
// an error as Way.recv's wait on the lane does.
func (w *Way) waitFair(ctx context.Context, l *Lane, last uint32, lane bool) (Msg, bool, error) {
	waits := l.readerWord(readerWaits)
	if lane && takeLaneWait() {
		w.missSeen = l.readerWord(laneMisses).Load()
		l.readerWord(waitsAt).Store(w.sockSeen)
		l.readerStamp(readerAt).Store(stampAt(lastRecv.Load())) // see readerLive
		if !moveWait(waits, waitOnLane) {
			laneSleepers.Add(-1)
			return Msg{}, false, w.waitClaimed(ctx, l, last)
		}
		w.waiting.Add(1)
		_, err := l.WaitSentUntil(ctx, last, w.alive, w.sleep, w.sockMoved)
		l.warmTake(last) // whatever ended the wait: an entry it does not take costs nothing
		w.waiting.Add(-1)
		laneSleepers.Add(-1)
		to := uint32(waitBusy)
		if errors.Is(err, errWaitedEnough) && l.Sent() == last {
			to = waitParked
		}
		if !waits.CompareAndSwap(waitOnLane, to) {
			// Claimed: the entry is next, whatever ended the wait. A
			// receive that ends first leaves the claim to the next.
			if e := w.waitClaimed(ctx, l, last); e != nil || !errors.Is(err, errSocketReady) {
				return Msg{}, false, e
			}
			return Msg{}, false, err // once the entry is taken
		}
		if to != waitParked {
			if errors.Is(err, errWaitedEnough) {
				err = nil
			}
			return Msg{}, false, err
		}
	} else {
		if !moveWait(waits, waitParked) {
			return Msg{}, false, w.waitClaimed(ctx, l, last)
		}
	}
	m, err := w.recvParked(ctx)
	waits.CompareAndSwap(waitParked, waitBusy)
	return w.fromParked(m, err, l)
}

// recvParked receives on the socket for a fair Way's reader parked
// there: while it pins segments, in slices of pinLook, looking at its
// pins at each slice's end (lookWhileWaiting).
func (w *Way) recvParked(ctx context.Context) (Msg, error) {
	for len(w.pins.order) > 0 {
		wait, cancel := context.WithTimeout(ctx, w.pinLook)
		m, err := w.shared.Recv(wait)
		cancel()
		if err != nil && ctx.Err() != nil {
			return Msg{}, ctx.Err() // the caller's end, not the slice's
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			return m, err
		}
		w.lookWhileWaiting()
	}
	return w.shared.Recv(ctx)
}

// fromParked returns what a receive on the socket gave a reader that
// waited there (m, or err), as waitFair and park return it: a message for
// the caller (ok) once placed (see place), or the error a wait on the
// lane would have given.
func (w *Way) fromParked(m Msg, err error, l *Lane) (Msg, bool, error) {
	switch {
	case errors.Is(err, errConnClosed):
		return Msg{}, false, errWayClosed
	case errors.Is(err, ErrClosed):
		return Msg{}, false, errWritersGone // what they left is received before ErrClosed
	case err != nil:
		return Msg{}, false, err
	}
	return w.place(m, l)
}

// waitPipe waits for a message as a Pipe's reader whose lane is empty
// (last its count of entries sent): on the lane while it can hold a
// thread for it (laneWaiters, for the Way's sleep, laneSleep), and then
// on the socket (park). A reader without a lane wait to be had, or that
// has parked already in this receive (it comes back to the lane at each
// slice's end), spins on the lane first, as long as the lane's bell has
// learnt to (see Bell.Spin), and parks then: an idle reader holds a lane
// wait once a receive, not once a slice. It returns a socket message for
// the caller (ok), or nothing, for the caller to look at the lane again,
// or an error as Way.recv's wait on the lane does.
func (w *Way) waitPipe(ctx context.Context, l *Lane, last uint32) (Msg, bool, error) {
	if w.parkNext != 0 || !takeLaneWait() {
		if l.SpinSent(last) {
			return Msg{}, false, nil
		}
		return w.park(ctx, l, last)
	}
	w.waiting.Add(1)
	_, err := l.WaitSentUntil(ctx, last, w.alive, w.sleep, nil)
	l.warmTake(last)
	w.waiting.Add(-1)
	laneSleepers.Add(-1)
	if !errors.Is(err, errWaitedEnough) {
		return Msg{}, false, err
	}
	return w.park(ctx, l, last)
}

// takeLaneWait takes one of the process's lane waits (laneSleepers) if
// one is free, and reports whether it did; the caller gives it back. A
// refusal is counted (laneWaitsRefused).
func takeLaneWait() bool {
	if laneSleepers.Add(1) <= laneWaiters {
		return true
	}
	laneSleepers.Add(-1)
	laneWaitsRefused.Add(1)
	return false
}

// laneWaitsRefused counts the lane waits refused: by takeLaneWait, and
// to a fair Way's reader without the role that waits on an empty socket
// because none was free (see Way.taken). A writer waiting for room keeps
// its lane wait past its patience while none is (see Lane.waitRoom).
var laneWaitsRefused atomic.Uint32

// A Pipe's reader's slices on its socket (see park): the first of a
// receive, and the longest, as a lane wait's sleep slices are (see
// Bell.WaitUntil).
const (
	parkSlice    = 10 * time.Millisecond
	maxParkSlice = time.Second
)

// The steps of a park at which parkStep runs: the reader's, before it
// says that it waits on the socket, between that and its last look at
// the lane, and between that look and its receive on the socket; and the
// writer's, between its look at the word and its wake (wakeLooked).
const (
	parkSaying = iota
	parkSaid
	parkLooked
	wakeLooked
)

// parkStep, if set, runs at each step of a park: for tests, to put one
// side's moves at any point of the other's Dekker's pattern.
var parkStep atomic.Pointer[func(step int)]

// park waits on the socket as a Pipe's reader whose lane is empty (last
// its count of entries sent) and that holds no lane wait: it says so in
// the reader's words (waitParked), and the writer that publishes an entry
// then wakes it with a wake frame (see wakeParked). Either the writer
// sees the word, or the reader sees the entry before it receives
// (Dekker's pattern, both sides sequentially consistent). A message that
// comes by the socket meanwhile, the peer's end, the Way's Close and
// ctx's end wake it too. The wait lasts a slice, parkSlice in a
// receive's first park, twice as long each time one runs out, up to
// maxParkSlice; then the reader spins on the lane and parks again: an
// entry whose wake was not sent (a writer killed between its publish
// and its wake, a send that failed) or that another process receiving on
// the same end took is seen so at the slice's end. A wake that finds the
// reader gone from the socket is skipped by a later receive. It returns
// what waitPipe does.
func (w *Way) park(ctx context.Context, l *Lane, last uint32) (Msg, bool, error) {
	step := func(s int) {
		if h := parkStep.Load(); h != nil {
			(*h)(s)
		}
	}
	step(parkSaying)
	waits := l.readerWord(readerWaits)
	waits.Store(waitParked)
	defer waits.CompareAndSwap(waitParked, waitNone)
	step(parkSaid)
	if l.Sent() != last {
		return Msg{}, false, nil
	}
	step(parkLooked)
	if w.parkNext == 0 {
		w.parkNext = w.parkFirst // parked in this receive: see waitPipe
	}
	slice := w.parkNext
	wait, cancel := context.WithTimeout(ctx, slice)
	m, err := w.shared.recvOrWake(wait, true)
	cancel()
	switch {
	case err != nil && ctx.Err() != nil:
		return Msg{}, false, ctx.Err()
	case errors.Is(err, context.DeadlineExceeded):
		w.parkNext = min(2*slice, max(maxParkSlice, slice))
		w.lookWhileWaiting()
		return Msg{}, false, nil // the lane again
	case errors.Is(err, errWoken):
		return Msg{}, false, nil
	}
	return w.fromParked(m, err, l)
}

// wakeParked wakes the reader of a Pipe's Way that waits on the socket
// (see park), once the writer has published an entry: the first writer
// that finds it parked says it is not (waitNone) and sends a wake frame,
// if it can now (see Conn.wake).
func (w *Way) wakeParked(l *Lane) {
	waits := l.readerWord(readerWaits)
	if waits == nil {
		return
	}
	v := waits.Load()
	if h := parkStep.Load(); h != nil {
		(*h)(wakeLooked)
	}
	if v == waitParked && waits.CompareAndSwap(waitParked, waitNone) {
		_ = w.shared.wake()
	}
}

// socketSentSince returns errSocketReady if a writer has counted a
// message sent by the socket since the fair Way's reader last found it
// empty, as its wait on the lane arms its sleep: the writer's Nudge,
// which follows its count, found no sleep to wake if it came before the
// arm, while the reader spun, and the reader would sleep past the message
// until alive's next look, a sleep slice later. The caller holds sem.
func (w *Way) socketSentSince() error {
	if l := w.lane.Load(); l != nil && l.readerWord(sockSends).Load() != w.sockSeen {
		return errSocketReady
	}
	return nil
}

// moveWait moves the reader's state to to, and reports whether it did:
// not if a writer claimed it, which it keeps.
func moveWait(waits *atomic.Uint32, to uint32) bool {
	for {
		v := waits.Load()
		if claimed(v) {
			return false
		}
		if waits.CompareAndSwap(v, to) {
			return true
		}
	}
}

// claimPatience is how long a claimed reader waits for its entry before
// it looks at the socket too (as often as its wait asks alive).
const claimPatience = 10 * time.Millisecond

// errClaimGone ends a wait for a claimed entry whose writer is gone.
var errClaimGone = errors.New("mp: the writer that claimed the wait is gone")

// waitClaimed waits for the entry that a writer claimed the reader for,
// which it publishes within its send: until the lane's count of entries
// sent is no longer last, ctx ends, the Way closes, or the claim is gone
// (a writer that took the role over gave it back, or no process holds
// the writer's role: the claiming writer died first, and the claim is
// dropped), or, once it has waited claimPatience, the socket has a
// message (errSocketReady; the claim stays). The reader takes the entry
// next, which ends the claim (see fromLane). A reader that waited on the
// socket meanwhile would leave the entry in the lane, unseen.
func (w *Way) waitClaimed(ctx context.Context, l *Lane, last uint32) error {
	waits := l.readerWord(readerWaits)
	if l.Sent() != last || !claimed(waits.Load()) {
		return nil
	}
	start := time.Now()
	_, err := l.WaitSent(ctx, last, func() error {
		if w.closed.Load() {
			return errWayClosed
		}
		if time.Since(start) >= claimPatience && w.shared.poll()&unix.POLLIN != 0 {
			// Not published within a slice (a writer stopped, or a
			// peer's word): the socket's message meanwhile; the claim
			// stays, for the next receive.
			return errSocketReady
		}
		v := waits.Load()
		if !claimed(v) {
			return errClaimGone // a new writer gave it back (see taken)
		}
		if held, err := shm.ByteHeld(w.mem, 0); err == nil && !held {
			waits.CompareAndSwap(v, waitBusy)
			return errClaimGone
		}
		return nil
	})
	if errors.Is(err, errClaimGone) {
		return nil // the loop looks at the lane and the socket again
	}
	return err
}

// fromLane takes the lane's next entry, if any: a message (ok), or a
// marker, which sets draining unless a socket message is kept already.
func (w *Way) fromLane(l *Lane) (Msg, bool, error) {
	w.takeMu.Lock() // the scanner sees a return in the lane or in taking
	buf, _, err := l.TryRecv(w.rbuf[:0])
	w.rbuf = buf
	if err == nil && len(buf) > 0 && buf[0] == kindReturn {
		var data []byte
		if data, err = parseReturns(buf, func(r shm.ReturnRef) { w.taking = append(w.taking, r) }); err == nil {
			buf = append(buf[:1], data...) // a value entry's shape
			returnsTaken.Add(1)
		}
	}
	w.takeMu.Unlock()
	switch {
	case errors.Is(err, ErrWouldBlock):
		return Msg{}, false, nil
	case errors.Is(err, errCounts):
		w.letGo(true) // a peer wrote the counts: the socket serves
		return Msg{}, false, err
	case err != nil:
		return Msg{}, false, err
	case len(buf) == 0:
		return Msg{}, false, fmt.Errorf("mp: receiving on a lane: %w: an empty entry", ErrMalformed)
	}
	switch buf[0] {
	case kindValue, kindReturn:
		if w.fair {
			// The entry a claim was for, if any: the claim ends.
			waits := l.readerWord(readerWaits)
			if v := waits.Load(); claimed(v) {
				waits.CompareAndSwap(v, waitBusy)
			}
		}
		w.none.Reset(nil)
		return Msg{Data: buf[1:], FDs: &w.none, tag: -1}, true, nil
	case kindMarker:
		w.draining = !w.stashed
		w.atMarker = w.draining
		return Msg{}, false, nil
	}
	return Msg{}, false, fmt.Errorf("mp: receiving on a lane: %w: an entry of kind %d", ErrMalformed, buf[0])
}

// fromSocket receives the socket's next message, if it has one now and
// it follows no lane entry not taken yet: a message for the caller (ok).
// One that does is left on the socket, and draining ends: the entries
// come first, and the message's marker after them. An empty socket, or
// one whose writers are gone, is no message.
func (w *Way) fromSocket(ctx context.Context, l *Lane) (Msg, bool, error) {
	// Right after a marker the socket's next message is the marker's
	// own, sent before it, unless another reader took that one: no look
	// first (a system call per message). What comes later is looked at.
	if !w.atMarker {
		tag, ok := w.shared.peekTag()
		if !ok {
			return Msg{}, false, nil
		}
		if tag >= 0 && int32(uint32(tag)-l.Taken()) > 0 && int32(uint32(tag)-l.Sent()) <= 0 {
			w.draining = false
			return Msg{}, false, nil
		}
	}
	w.atMarker = false
	m, err := w.shared.TryRecv(ctx)
	switch {
	case errors.Is(err, ErrWouldBlock) || errors.Is(err, ErrClosed) && !errors.Is(err, errConnClosed):
		return Msg{}, false, nil
	case err != nil:
		return Msg{}, false, err
	}
	return w.place(m, l)
}

// place returns m, a socket message, for the caller (ok) if it follows no
// lane entry the reader has not taken; else it keeps it in the stash
// (received by a process without the role, or after another reader took
// the one fromSocket looked at).
func (w *Way) place(m Msg, l *Lane) (Msg, bool, error) {
	if m.tag < 0 {
		return m, true, nil
	}
	tag := uint32(m.tag)
	if int32(tag-l.Sent()) > 0 {
		m.Done()
		return Msg{}, false, fmt.Errorf("mp: receive: %w: a message that follows lane position %d, where %d were sent", ErrMalformed, tag, l.Sent())
	}
	if int32(tag-l.Taken()) <= 0 {
		return m, true, nil
	}
	w.stash, w.stashed, w.draining = m, true, false
	return Msg{}, false, nil
}

// passEvery is how many passes a loop of a lane's or a Way's calls that
// does not wait makes between two looks at its context.
const passEvery = 1024

// checkEvery returns ctx's error every passEvery passes of a loop that
// goes round without waiting: while another side keeps moving the counts
// or writing markers, which only a peer that writes them at will does for
// long.
func checkEvery(ctx context.Context, pass int) error {
	if pass%passEvery != 0 {
		return nil
	}
	return ctx.Err()
}

// errRetry: a receive without the role waited roleRetry; the role may be
// free now.
var errRetry = errors.New("mp: try for the role again")

// recvShared receives on the socket, for a process without the reader's
// role, waiting until ctx ends or, while the lane may still be taken,
// roleRetry (errRetry); unless block, it does not wait.
func (w *Way) recvShared(ctx context.Context, block bool) (Msg, error) {
	w.countReader()
	if !block {
		return w.shared.TryRecv(ctx)
	}
	if w.broken {
		return w.shared.Recv(ctx)
	}
	retry := roleRetry
	if w.fair {
		retry = laneSleep // the writer sends by the socket while it waits there
	}
	wait, cancel := context.WithTimeout(ctx, retry)
	m, err := w.shared.Recv(wait)
	cancel()
	switch {
	case err != nil && ctx.Err() != nil:
		return Msg{}, ctx.Err()
	case errors.Is(err, context.DeadlineExceeded):
		return Msg{}, errRetry // wait's time (cancel ended wait too)
	}
	return m, err
}

// countReader says, for a fair Way's reader without the role, that
// another process reads the end, from its first receive (a try
// included) until it takes the role or closes: the lane then takes no
// message for the role's reader unless it waits (handsOver). One that
// has not said so yet (each says so in turn, as each tries for a role),
// or cannot (no descriptor for the lock), may miss a message in the lane
// that the busy role's reader takes later. The caller holds sem.
func (w *Way) countReader() {
	if w.fair && !w.broken && w.reading == nil && roleTry.CompareAndSwap(false, true) {
		w.reading, _ = shm.ShareByte(w.mem, readersByte)
		roleTry.Store(false)
	}
}

// Close releases the Way's lane, its role and its memory descriptor, once
// its call has returned (and a received Msg is Done): one that waits on
// the lane is woken, and returns ErrClosed. Close the socket first, which
// ends a receive that waits on it.
func (w *Way) Close() error {
	if w.closed.Swap(true) {
		return nil
	}
	// A call asleep on the lane wakes to a nudge, unless it armed its
	// sleep after the nudge looked: nudge until the call has returned.
	for taken := false; !taken; {
		if l := w.lane.Load(); l != nil {
			l.Nudge()
		}
		wait, cancel := context.WithTimeout(context.Background(), time.Millisecond)
		taken = w.sem.lockOr(wait.Done())
		cancel()
	}
	defer w.sem.unlock()
	w.shared.unwatchGone(w) // the poller nudges the lane no more
	if w.lane.Load() == nil && w.mem != nil && !w.broken && !w.fair {
		// A peer asleep on the lane, a reader or a writer waiting for
		// room, wakes to a nudge, and then sees this end gone if it was
		// the last (its socket is closed first): a lane this process
		// never mapped is mapped for the nudge, as that peer's sleep may
		// last up to maxSleepSlice. (A queue's ends are never gone while
		// the queue is held, and its waiters sleep laneSleep at most.)
		if l, err := OpenLane(w.mem); err == nil {
			l.Nudge()
			_ = l.Close()
		}
	}
	if w.idle != nil {
		w.idle.Stop()
	}
	if w.settler != nil {
		w.settler.Stop() // the loans left are keepSettling's
	}
	var errs []error
	if w.stashed {
		w.stash.Done() // its socket's receive; the Way's is Close's
		w.stashed = false
	}
	w.viewMu.Lock() // a Maps under way has returned; later ones see the Way closed
	w.viewClosed = true
	w.viewMu.Unlock()
	l := w.lane.Load()
	if l != nil && !w.writes {
		w.unlistPins(l)
	}
	errs = append(errs, w.pins.unpinAll())
	if w.unregister != nil {
		w.unregister() // before the lane is unmapped: no scan reads it after
	}
	w.leaveWaits()
	if w.role != nil {
		errs = append(errs, w.role.Close())
	}
	if w.reading != nil {
		errs = append(errs, w.reading.Close())
	}
	if l != nil {
		w.ledger.settle(l, w.mem, true, monoNow())
		if len(w.ledger.out()) > 0 {
			w.ledger.keepSettling(l, w.mem) // it closes both
			return errors.Join(errs...)
		}
		errs = append(errs, l.Close())
	}
	if w.mem != nil {
		errs = append(errs, w.mem.Close())
	}
	return errors.Join(errs...)
}

package shm

import (
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// The process's shared-memory state: every table, pool and queue this
// package keeps for the life of the process is declared here, and the
// operations on the whole of it (Trim, DropIdle, DropRefsForExit) are
// below. The files named beside each say how it is used.
//
// Lock order. A goroutine takes at most one lock of each line, and takes
// a lock only after those of the lines above it:
//
//  1. a Pool's mu, or attached.mu: never both, since a producer's
//     segments and a receiver's are apart
//  2. a segment's tickets.mu
//  3. returnScanners.mu (returns.go), whose scanners take no lock of
//     this package
//  4. the leaves, which call out to no lock of this package: the later
//     queues' mu, liveSegments, extentPools, refHolders, produced,
//     orphans.mu, extentClosing, and package fd's locks
//
// A segment's slotUsers.mu is taken with no other lock of this package
// held: its alive callback calls into the package above.
var (
	// session is this process's session id (see Session).
	session = sync.OnceValue(func() string {
		if s := os.Getenv(EnvSession); validSession(s) {
			return s
		}
		return randomHex(6)
	})
	sessionPrefix = sync.OnceValue(func() string { return NamePrefix + Session() + "_" })

	// defaultPool is the pool of file_descriptor segments (pool.go).
	defaultPool = sync.OnceValue(func() *Pool {
		limit := int64(1 << 30)
		if v, err := strconv.ParseInt(os.Getenv(envCache), 10, 64); err == nil && v >= 0 {
			limit = v
		}
		return newPool(limit)
	})
	// namedPool is the pool of file_system segments, used once
	// namedEnabled (pool.go).
	namedPool = sync.OnceValue(func() *Pool {
		p := newPool(defaultPool().limit)
		p.named = true
		return p
	})
	namedEnabled atomic.Bool
	// extentPools holds every extent pool of the process, for Trim
	// (extent.go).
	extentPools = newLockedSet[*Pool]()

	// attached is the table of segments this process received blocks
	// of (attach.go). Receivers map each segment once and share the
	// mapping among the blocks they attach.
	attached = &segmentTable{m: map[ID]*segment{}, names: map[string]ID{}}
	// produced indexes the segments this process's pools made, by
	// identity and, for named ones, by name (users.go).
	produced = newSegmentIndex()
	// liveSegments holds every pooled segment this process maps, as
	// producer or receiver, for DropRefsForExit.
	liveSegments = newLockedSet[*segment]()
	// refHolders holds the open RefCount allocations, so that a process
	// about to exit can give their references back (shm.go).
	refHolders = newLockedSet[*Allocation]()
	// orphans watches the named segments this process let go of while
	// they were held elsewhere (orphans.go).
	orphans = &orphanWatch{due: map[string]*orphan{}}
	// extentClosing counts the extents handed over to be closed and not
	// closed yet (extent.go).
	extentClosing = newCounter()

	// transfers settles a receiver's holds in its own description, a
	// batch at a time, transferDelay after they changed (attach.go).
	transfers = newLater(transferDelay, func(seg *segment) bool {
		if transfersHeld.Load() {
			return true // a test holds them off
		}
		attached.mu.Lock()
		defer attached.mu.Unlock()
		_ = seg.transferLocked()
		return seg.dirty // locks taken ahead, kept for now
	})
	// idleChecks drops received segments that nobody holds any more:
	// the producer is gone and no process holds a block of it. The last
	// process to let go of a named segment removes its name this way
	// (attach.go).
	idleChecks = newLater(idleCheckDelay, func(seg *segment) bool {
		if idleChecksHeld.Load() {
			return true // a test holds them off
		}
		attached.dropIfAbandoned(seg)
		return false
	})
	// rotations retires ticket descriptions rotateDelay after they were
	// opened, so that what a process released is free for its producer
	// within milliseconds even if the process goes quiet. One younger
	// than that waits for the next round (ticket.go).
	rotations = newLater(rotateDelay, func(seg *segment) (again bool) {
		switch seg.tickets.rotateIfOlder(rotateDelay) {
		case rotated:
			seg.afterTicketsRotated()
		case tooYoung:
			return true
		}
		return false
	})
)

// transfersHeld and idleChecksHeld, set by tests only, make the
// transfers and the idle checks wait.
var transfersHeld, idleChecksHeld atomic.Bool

// DropIdle unmaps the received segments no block of this process uses. A
// process out of descriptors calls it before trying again: each keeps
// one.
func DropIdle() error {
	attached.mu.Lock()
	err := attached.trimLocked(0, 0)
	attached.mu.Unlock()
	extentClosing.wait()
	return err
}

// Trim gives back to the system what this process keeps only for reuse:
// the pools' unused segments (extent pools' too, with their extents) and
// the mappings of received segments no storage uses.
func Trim() {
	DefaultPool().Trim(0)
	if p := NamedPool(); p != nil {
		p.Trim(0)
	}
	for _, p := range extentPools.list() {
		p.Trim(0)
	}
	_ = DropIdle()
	extentClosing.wait()
}

// DropRefsForExit lets go, for a process about to exit, of everything it
// holds in shared memory that another process would otherwise wait for:
// its received blocks' holds, its ticket descriptions, its reference to
// every RefCount segment (unlinking those it was the last holder of), and
// its pools' segments (a named one is removed now if nobody else holds a
// block of it, else by the last process to let go of it). The mappings
// stay for the exit to remove, so memory the process's goroutines still
// touch stays valid. Death by a signal drops all of this too, the names
// of abandoned named segments excepted, which the session's keeper
// removes.
func DropRefsForExit() {
	for _, seg := range liveSegments.list() {
		if seg.pool != nil {
			continue
		}
		attached.mu.Lock()
		seg.slots.forgetHolds()
		seg.dirty = true
		_ = seg.transferLocked()
		seg.users = 0
		seg.tickets.rotate()
		if seg.named {
			seg.abandoned()
		}
		attached.mu.Unlock()
	}
	DefaultPool().letGo()
	if p := NamedPool(); p != nil {
		p.letGo()
	}
	for _, a := range refHolders.list() {
		_ = a.dropRef()
	}
}

// later runs fn on segments a while after they were scheduled, each once
// however often it was scheduled meanwhile, on one timer; a segment for
// which fn reports again is scheduled anew.
type later struct {
	delay time.Duration
	fn    func(*segment) (again bool)
	mu    sync.Mutex
	due   map[*segment]struct{}
	timer *time.Timer
}

func newLater(delay time.Duration, fn func(*segment) (again bool)) *later {
	return &later{delay: delay, fn: fn, due: map[*segment]struct{}{}}
}

func (l *later) schedule(seg *segment) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.due[seg] = struct{}{}
	if l.timer == nil {
		l.timer = time.AfterFunc(l.delay, l.run)
	}
}

func (l *later) run() {
	l.mu.Lock()
	due := l.due
	l.due = map[*segment]struct{}{}
	l.timer = nil
	l.mu.Unlock()
	for seg := range due {
		if l.fn(seg) {
			l.schedule(seg)
		}
	}
}

// lockedSet is a set guarded by its own lock, for the process-wide walks
// (exit, for one) that must not take other locks in a fixed order.
type lockedSet[T comparable] struct {
	mu sync.Mutex
	m  map[T]struct{}
}

func newLockedSet[T comparable]() *lockedSet[T] {
	return &lockedSet[T]{m: map[T]struct{}{}}
}

func (s *lockedSet[T]) add(v T) {
	s.mu.Lock()
	s.m[v] = struct{}{}
	s.mu.Unlock()
}

func (s *lockedSet[T]) remove(v T) {
	s.mu.Lock()
	delete(s.m, v)
	s.mu.Unlock()
}

// list returns the members at the time of the call.
func (s *lockedSet[T]) list() []T {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]T, 0, len(s.m))
	for v := range s.m {
		out = append(out, v)
	}
	return out
}

// counter is a count that can be waited on to fall to zero.
type counter struct {
	mu   sync.Mutex
	zero *sync.Cond
	n    int
}

func newCounter() *counter {
	c := &counter{}
	c.zero = sync.NewCond(&c.mu)
	return c
}

func (c *counter) add() {
	c.mu.Lock()
	c.n++
	c.mu.Unlock()
}

func (c *counter) done() {
	c.mu.Lock()
	if c.n--; c.n == 0 {
		c.zero.Broadcast()
	}
	c.mu.Unlock()
}

// wait returns once the count is zero.
func (c *counter) wait() {
	c.mu.Lock()
	for c.n > 0 {
		c.zero.Wait()
	}
	c.mu.Unlock()
}

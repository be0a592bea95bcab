package sock

import "sync/atomic"

// A callLock is a Way's lock on its one call: a mutex whose waiter may
// give up when a channel closes (lockOr), as a send on a channel of one
// may. Taken and released by an atomic operation or two while nobody
// waits for it, where a channel's send and receive each take the
// channel's runtime lock: a hand-off takes and releases two Ways' locks
// on each side, on a path of a few microseconds.
//
// Fair to those who wait: a release that finds a waiter hands the lock
// to it, through freed, without letting it go, so that a caller in a
// tight loop cannot take it back first. The lock is then held by
// whichever waiter takes the token, or, if the one it was meant for gave
// up without it, by the next waiter or tryLock to take it. Its
// zero value is not ready: NewWay makes freed.
type callLock struct {
	held    atomic.Bool // taken, by a caller or by the token in freed
	waiters atomic.Int32
	// freed holds the lock's token while it is handed to a waiter; it
	// is empty whenever a caller holds the lock.
	freed chan struct{}
	// beforeWait and beforeRelease, if set, run in lockOr between its
	// first try and its count of the waiter, and in unlock between its
	// look at the waiters and its release, for tests: a release, or a
	// waiter, that comes there.
	beforeWait, beforeRelease func()
}

// tryLock takes the lock if it is free, and reports whether it did.
// A lock handed to waiters is theirs.
func (c *callLock) tryLock() bool {
	if c.held.CompareAndSwap(false, true) {
		return true
	}
	if c.waiters.Load() != 0 {
		return false
	}
	select {
	case <-c.freed: // handed to a waiter that gave up
		return true
	default:
		return false
	}
}

// lock takes the lock, waiting for as long as it is held.
func (c *callLock) lock() { c.lockOr(nil) }

// lockOr takes the lock, waiting for it until done closes, and reports
// whether it took it: also when done closed as the lock was handed to
// it (see giveUp).
func (c *callLock) lockOr(done <-chan struct{}) bool {
	if c.tryLock() {
		return true
	}
	if c.beforeWait != nil {
		c.beforeWait()
	}
	// Counted before the try that follows: a release either sees the
	// waiter and hands it the lock, or let it go first, and the try
	// finds it free (both sides' operations are sequentially
	// consistent).
	c.waiters.Add(1)
	if c.held.CompareAndSwap(false, true) {
		c.waiters.Add(-1)
		return true
	}
	select {
	case <-c.freed:
		c.waiters.Add(-1)
		return true
	case <-done:
		return c.giveUp()
	}
}

// giveUp ends a wait that its done ended, and reports whether the waiter
// took the lock all the same: a release that counted it may have handed
// the lock over meanwhile, and a tryLock fails while the waiter is
// counted, so the token is the waiter's to take, as a send on a channel
// of one goes through when its select finds both ready. One that comes
// after the waiter looked, with no other waiter left, is the next
// tryLock's.
func (c *callLock) giveUp() bool {
	c.waiters.Add(-1)
	select {
	case <-c.freed:
		return true
	default:
		return false
	}
}

// unlock releases the lock, which the caller holds: to a waiter if there
// is one.
func (c *callLock) unlock() {
	for {
		if c.waiters.Load() != 0 {
			c.freed <- struct{}{} // empty while a caller holds the lock
			return
		}
		if c.beforeRelease != nil {
			c.beforeRelease()
		}
		c.held.Store(false)
		// A waiter counted since, that found the lock still held, waits
		// for a hand-off: take the lock back to hand it over, unless
		// someone took it meanwhile.
		if c.waiters.Load() == 0 || !c.held.CompareAndSwap(false, true) {
			return
		}
	}
}

package sock

import "sync/atomic"

// A callLock is a Way's one call: a mutex whose waiters may give up. Taken
// and left free, it costs an atomic operation each way, where a channel
// of one token, which it replaces, costs its lock and unlock for each; a
// Send and a receive take it once each, on every message.
//
// A waiter that finds it taken marks it contended and sleeps on wake; the
// unlock that finds it contended leaves a token there. A waiter marks it
// contended again as it takes it after a sleep, as others may sleep
// still: an unlock then leaves a token that nobody may take, and the next
// waiter to sleep wakes to it for nothing, and sleeps again.
type callLock struct {
	state atomic.Int32
	wake  chan struct{} // a token for a sleeping waiter; one at most
}

// A callLock's states.
const (
	unlocked  = 0
	locked    = 1
	contended = 2 // locked, and waiters may sleep
)

func newCallLock() callLock { return callLock{wake: make(chan struct{}, 1)} }

// tryLock takes l if it is free, and reports whether it did.
func (l *callLock) tryLock() bool { return l.state.CompareAndSwap(unlocked, locked) }

// lock takes l, waiting for it until done is closed (never, if nil), and
// reports whether it took it.
func (l *callLock) lock(done <-chan struct{}) bool {
	if l.tryLock() {
		return true
	}
	for l.state.Swap(contended) != unlocked {
		select {
		case <-l.wake:
		case <-done:
			return false
		}
	}
	return true
}

// unlock lets go of l, which the caller holds, and wakes a waiter.
func (l *callLock) unlock() {
	if l.state.Swap(unlocked) == contended {
		select {
		case l.wake <- struct{}{}:
		default: // a token is there already, which a waiter wakes to
		}
	}
}

package sock

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func newTestCallLock() *callLock { return &callLock{freed: make(chan struct{}, 1)} }

// gotWithin returns what ch gives, failing the test with why if nothing
// comes within ten seconds: a waiter never woken, a call that never
// returns.
func gotWithin[T any](t *testing.T, ch <-chan T, why string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatal(why)
		var zero T
		return zero
	}
}

// waitingLocker starts a lock of c, which it returns once the lock is
// counted as waiting; what the lock reports comes on the channel.
func waitingLocker(c *callLock) <-chan bool {
	got := make(chan bool, 1)
	go func() { got <- c.lockOr(nil) }()
	for c.waiters.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	return got
}

// heldTillReleased checks that c is held, by a waiter that took it, and
// free once that waiter releases it (the test releases it for it).
func heldTillReleased(t *testing.T, c *callLock) {
	t.Helper()
	assert.False(t, c.tryLock(), "the waiter holds it")
	c.unlock()
	assert.True(t, c.tryLock(), "free once the waiter let it go")
}

// lockedWithin returns what a lockOr reported on got.
func lockedWithin(t *testing.T, got <-chan bool) bool {
	t.Helper()
	return gotWithin(t, got, "a waiter was never woken")
}

// A callLock is held by one caller at a time: callers that wait for it
// each get it, none is left waiting when it is released for the last
// time, and what they guard is never touched by two at once (the race
// detector watches count).
func TestCallLockExcludes(t *testing.T) {
	c := newTestCallLock()
	var wg sync.WaitGroup
	count, inside := 0, 0
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 2000 {
				c.lock()
				inside++
				if inside != 1 {
					panic("two callers hold the lock")
				}
				count++
				inside--
				c.unlock()
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("a waiter was never woken")
	}
	assert.Equal(t, 8*2000, count)
	assert.True(t, c.tryLock(), "free once all are done")
}

// A waiter gives up when its channel closes, and one that waits is woken
// by the release; tryLock takes only a free lock.
func TestCallLockWaits(t *testing.T) {
	c := newTestCallLock()
	require.True(t, c.tryLock())
	assert.False(t, c.tryLock(), "held")

	done := make(chan struct{})
	gave := make(chan bool)
	go func() { gave <- c.lockOr(done) }()
	close(done)
	assert.False(t, lockedWithin(t, gave), "the waiter gave up")

	got := waitingLocker(c)
	select {
	case <-got:
		t.Fatal("took a held lock")
	case <-time.After(10 * time.Millisecond):
	}
	c.unlock()
	assert.True(t, lockedWithin(t, got), "woken by the release")
	heldTillReleased(t, c)
}

// A release hands the lock to the caller that waits for it, not to one
// that comes as it is released; a waiter that gives up once it was
// handed the lock leaves it to the next caller.
func TestCallLockHandsOver(t *testing.T) {
	c := newTestCallLock()
	require.True(t, c.tryLock())
	got := waitingLocker(c)
	c.unlock()
	assert.False(t, c.tryLock(), "taken back from the waiter")
	require.True(t, lockedWithin(t, got))
	c.unlock()

	// A waiter counted, handed the lock, gone before it took it.
	require.True(t, c.tryLock())
	c.waiters.Add(1)
	c.unlock()
	assert.False(t, c.tryLock(), "the waiter's")
	c.waiters.Add(-1)
	assert.True(t, c.tryLock(), "left to the next caller")
	c.unlock()
	assert.True(t, c.tryLock(), "free")
}

// A waiter that comes as the lock is released, and finds it still held,
// is handed it all the same: the release looks at the waiters again.
func TestCallLockSeesALateWaiter(t *testing.T) {
	c := newTestCallLock()
	require.True(t, c.tryLock())
	c.beforeRelease = func() {
		c.beforeRelease = nil
		c.waiters.Add(1) // what lockOr does, up to its wait for the token
		require.False(t, c.held.CompareAndSwap(false, true), "still held")
	}
	c.unlock()
	select {
	case <-c.freed:
	default:
		t.Fatal("the waiter was not handed the lock")
	}
	c.waiters.Add(-1)
	heldTillReleased(t, c)
}

// A release between a waiter's first try and its count leaves the lock
// free, and the waiter's next try takes it.
func TestCallLockSeesAReleaseBeforeTheCount(t *testing.T) {
	c := newTestCallLock()
	require.True(t, c.tryLock())
	c.beforeWait = func() {
		c.beforeWait = nil
		c.unlock()
	}
	got := make(chan bool)
	go func() { got <- c.lockOr(nil) }()
	assert.True(t, lockedWithin(t, got), "took the lock released before its count")
	assert.False(t, c.tryLock(), "the waiter holds it")
}

// A waiter that gives up as the lock is handed to it takes it all the
// same, so that nothing is left held by nobody: a tryLock fails while
// that waiter is counted.
func TestCallLockGivesUpWithTheToken(t *testing.T) {
	c := newTestCallLock()
	require.True(t, c.tryLock())
	c.waiters.Add(1) // a waiter, counted, whose done has closed
	c.unlock()
	assert.False(t, c.tryLock(), "handed to the waiter")
	assert.True(t, c.giveUp(), "the waiter took it as it gave up")
	assert.Zero(t, c.waiters.Load())
	assert.False(t, c.tryLock(), "the waiter holds it")
	c.unlock()

	// Nothing was handed over: it gives up without the lock.
	require.True(t, c.tryLock())
	c.waiters.Add(1)
	assert.False(t, c.giveUp())
	c.unlock()
	assert.True(t, c.tryLock(), "free")
}

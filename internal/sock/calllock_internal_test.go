package sock

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A callLock is taken by one call at a time; tryLock fails while it is
// held, and a waiter that gives up leaves it as it was.
func TestCallLockTakesAndGivesUp(t *testing.T) {
	l := newCallLock()
	require.True(t, l.tryLock())
	assert.False(t, l.tryLock(), "held")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	assert.False(t, l.lock(ctx.Done()), "a waiter whose context ended")
	l.unlock()
	require.True(t, l.tryLock(), "free once let go, with a waiter gone")
	l.unlock()
	assert.True(t, l.lock(nil))
	l.unlock()
}

// Many goroutines that take a callLock in turn, some giving up as they
// wait, each get it alone, and none sleeps past its release: every one
// that waits to the end takes it, within 30 s, though the give-ups
// leave it marked contended and tokens in its channel.
func TestCallLockWakesEveryWaiter(t *testing.T) {
	l := newCallLock()
	const workers, rounds = 8, 2000
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex // only to count, not to exclude
		inside  int
		most    int
		taken   int
		gaveUp  int
		stalled int
	)
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				done := ctx.Done()
				var stop context.CancelFunc
				if (i+r)%7 == 0 {
					// A waiter that gives up at once, if it has to wait.
					var c context.Context
					c, stop = context.WithCancel(ctx)
					stop()
					done = c.Done()
				}
				ok := l.lock(done)
				if stop != nil {
					stop()
				}
				if !ok {
					mu.Lock()
					if ctx.Err() != nil {
						stalled++
					} else {
						gaveUp++
					}
					mu.Unlock()
					if ctx.Err() != nil {
						return
					}
					continue
				}
				mu.Lock()
				inside++
				most = max(most, inside)
				taken++
				mu.Unlock()
				if r%3 == 0 {
					time.Sleep(time.Microsecond) // some hold it long enough for others to sleep
				}
				mu.Lock()
				inside--
				mu.Unlock()
				l.unlock()
			}
		}()
	}
	wg.Wait()
	assert.Zero(t, stalled, "waiters never woken")
	assert.Equal(t, 1, most, "more than one call inside at once")
	assert.Equal(t, workers*rounds, taken+gaveUp)
	assert.Less(t, gaveUp, workers*rounds/7+workers, "only the waiters told to give up do")
	assert.True(t, l.tryLock(), "free at the end")
}

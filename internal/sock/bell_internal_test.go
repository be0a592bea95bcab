//go:build linux

package sock

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A waiter whose spins keep missing stops spinning, but for a probe now
// and then, and spins again once a probe finds its ring.
func TestBellStopsSpinningWhenSpinsMiss(t *testing.T) {
	b := testBell(t)
	b.misses.Store(0)
	last := b.Load()
	for i := range maxMisses {
		_, found, _ := b.spin(last, monoNow())
		require.False(t, found)
		require.EqualValues(t, i+1, b.spun.Load(), "spin %d spun", i)
	}
	for range 2 * probeEvery {
		b.spin(last, monoNow())
	}
	probes := b.spun.Load() - maxMisses
	assert.InDelta(t, 2, probes, 1, "waits that spun after %d misses in a row, of %d", maxMisses, 2*probeEvery)

	// A probe that finds the ring: spinning again.
	b.Ring()
	for b.waits.Load()%probeEvery != probeEvery-1 {
		b.spin(last, monoNow())
	}
	_, found, _ := b.spin(last, monoNow())
	require.True(t, found, "the probe finds the ring")
	spun := b.spun.Load()
	b.spin(last, monoNow())
	assert.Equal(t, spun+1, b.spun.Load(), "a wait after a found ring spins")
}

func unsafeAddr(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

// testBell returns a Bell in process memory whose waiters go straight to
// sleep, without spinning.
func testBell(t *testing.T) *Bell {
	t.Helper()
	mem := make([]byte, 4096)
	off := (64 - int(uintptr(unsafeAddr(mem))%64)) % 64
	b, err := NewBell(mem[off : off+bellSize])
	require.NoError(t, err)
	b.misses.Store(maxMisses)
	return b
}

// onceBeforeSleep has the first waiter that is about to sleep run f, in
// the gap between its last look at the word and its sleep, until the
// test's end.
func onceBeforeSleep(t *testing.T, f func()) {
	var once sync.Once
	hook := func() { once.Do(f) }
	beforeSleep.Store(&hook)
	t.Cleanup(func() { beforeSleep.Store(nil) })
}

// armedWithin reports whether b's asleep flag is armed, or becomes armed
// within half a sleep slice: a waiter about to sleep has said so.
func armedWithin(b *Bell) bool {
	for end := time.Now().Add(sleepSlice / 2); time.Now().Before(end); time.Sleep(50 * time.Microsecond) {
		if atomic.LoadUint32(b.asleep)&1 == 1 {
			return true
		}
	}
	return false
}

// A ringer late to wake, whose ring the waiter has seen already, clears
// the flag the waiter armed for its next sleep, just before that sleep;
// the ring after it still wakes the waiter: no sleep ends by its time.
func TestBellLateWakeLosesNoRing(t *testing.T) {
	b := testBell(t)
	atomic.AddUint32(b.word, 1) // a ring whose wake comes late
	var armed atomic.Bool
	onceBeforeSleep(t, func() {
		b.wake() // the late wake, in the gap before the sleep
		go func() {
			armed.Store(armedWithin(b)) // the waiter is asleep, and says so
			b.Ring()
		}()
	})
	_, err := b.Wait(context.Background(), b.Load(), func() error { return nil })
	require.NoError(t, err)
	assert.True(t, armed.Load(), "the waiter slept unarmed: the ring woke nobody")
	assert.Zero(t, b.timeouts.Load(), "sleeps that slept through a ring")
}

// Two waiters on one word, as a lane's readers are: the ring that wakes
// the one asleep, which then arms the flag again on its way out, still
// reaches the other, which looked before the ring and is about to sleep.
func TestBellSecondWaiterLosesNoRing(t *testing.T) {
	b := testBell(t)
	last := b.Load()
	never := func() error { return nil }
	first := make(chan struct{})
	done := make(chan error, 1)
	var hooks atomic.Int32
	hook := func() {
		switch hooks.Add(1) {
		case 1: // the first waiter, about to sleep
			close(first)
		case 2: // the second, between its look and its sleep: the ring,
			// and the first waiter woken by it and gone, arming the
			// flag on its way out
			b.Ring()
			select {
			case err := <-done:
				done <- err
			case <-time.After(time.Second):
			}
		}
	}
	beforeSleep.Store(&hook)
	defer beforeSleep.Store(nil)
	go func() {
		_, err := b.Wait(context.Background(), last, never)
		done <- err
	}()
	<-first
	_, err := b.Wait(context.Background(), last, never)
	require.NoError(t, err)
	require.NoError(t, <-done)
	assert.Zero(t, b.timeouts.Load(), "sleeps that slept through a ring")
}

// A waiter that has seen a ring already, waiting for the next, arms the
// flag that the ring just cleared: a waiter that looked before that ring
// does not sleep through it on that arming.
func TestBellNewerWaiterLosesNoRing(t *testing.T) {
	b := testBell(t)
	last := b.Load()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	never := func() error { return nil }
	newer := make(chan struct{})
	onceBeforeSleep(t, func() {
		b.Ring()
		go func() {
			_, _ = b.Wait(ctx, last+1, never) // sleeps until cancel
			close(newer)
		}()
		armedWithin(b)
	})
	_, err := b.Wait(ctx, last, never)
	require.NoError(t, err)
	assert.Zero(t, b.timeouts.Load(), "sleeps that slept through a ring")
	cancel()
	<-newer
}

// Only a ring that finds a waiter asleep reads the clock, to stamp the
// ring for the waiter it wakes, which learns the gap from the stamp; a
// waiter that finds the ring awake learns it from its own clock.
func TestBellStampsOnlyForASleeper(t *testing.T) {
	b := testBell(t)
	atomic.StoreInt64(b.rang, 1)
	b.Ring()
	require.True(t, b.Advance(b.Load()))
	assert.EqualValues(t, 1, atomic.LoadInt64(b.rang), "rings with nobody asleep stamp nothing")

	for _, advance := range []bool{false, true} {
		var before, after int64
		for try := 0; ; try++ { // again if the waiter was too slow to arm
			require.Less(t, try, 20, "advance %v: the waiter never armed its flag in time", advance)
			b.gap.Store(0)
			atomic.AddUint32(b.asleep, atomic.LoadUint32(b.asleep)&1) // a waiter gone leaves its flag armed
			last := b.Load()
			var armed bool
			rung := make(chan struct{})
			go func() {
				defer close(rung)
				armed = armedWithin(b)
				before = time.Now().UnixNano()
				if advance {
					b.Advance(last)
				} else {
					b.Ring()
				}
				after = time.Now().UnixNano()
			}()
			_, err := b.Wait(context.Background(), last, func() error { return nil })
			require.NoError(t, err)
			<-rung
			if armed {
				break
			}
		}
		// The stamp is the wall clock as of the process's start,
		// advanced by the monotonic clock (see stamp): behind the
		// wall clock by the time between time.Now's two reads.
		stamp := atomic.LoadInt64(b.rang)
		assert.True(t, before-int64(time.Microsecond) <= stamp && stamp <= after, "advance %v: stamped %d, rung between %d and %d", advance, stamp, before, after)
		assert.Positive(t, b.gap.Load(), "advance %v: the waiter learns a gap", advance)
	}

	// A ringer whose stamp says it rang 40 µs after a stamp taken just
	// before the wait began, and that wakes the sleeper 5 ms after it
	// armed: the sleeper learns the stamp's gap (40 µs, less the time
	// between that stamp and the wait's start), not what its own clock
	// says (5 ms), nor a gap between stamps of two clocks. Tried again if
	// the waiter was not asleep when woken (descheduled between its
	// arming and its look at the word, it finds the ring awake).
	const rangAfter = 40 * time.Microsecond
	var last uint32
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for try := 0; ; try++ {
		require.Less(t, try, 20, "the waiter was never asleep when woken")
		b.gap.Store(int64(spinCap) / 2)
		atomic.AddUint32(b.asleep, atomic.LoadUint32(b.asleep)&1)
		last = b.Load()
		woken := make(chan uintptr, 1)
		before := stamp()
		go func() {
			if !armedWithin(b) {
				b.Ring() // too slow to arm: this try ends, and another begins
				woken <- 0
				return
			}
			time.Sleep(5 * time.Millisecond)
			atomic.StoreInt64(b.rang, before+int64(rangAfter))
			atomic.AddUint32(b.word, 1)
			atomic.AddUint32(b.asleep, 1) // cleared, as wake clears it, with no stamp of its own
			n, _, _ := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(b.asleep)), futexWake, 1<<30, 0, 0, 0)
			woken <- n
		}()
		_, err := b.Wait(ctx, last, func() error { return nil })
		require.NoError(t, err)
		if <-woken > 0 {
			break
		}
	}
	old := int64(spinCap) / 2
	most, least := old+(int64(rangAfter)-old)/4, old-old/4 // a quarter of the way to 40 µs, or to no gap
	assert.True(t, least <= b.gap.Load() && b.gap.Load() <= most, "learnt %v, want %v to %v", time.Duration(b.gap.Load()), time.Duration(least), time.Duration(most))

	// A spin that finds its ring 30 µs after its wait began, the stamp
	// being from long ago: the gap it learns is its own clock's.
	atomic.StoreInt64(b.rang, 1)
	b.gap.Store(0)
	b.misses.Store(0)
	last = b.Load()
	b.Ring()
	before := monoNow()
	_, found, _ := b.spin(last, before-int64(30*time.Microsecond))
	after := monoNow()
	require.True(t, found)
	assert.GreaterOrEqual(t, b.gap.Load(), int64(30*time.Microsecond)/4, "a quarter of the way from 0 to 30 µs or more")
	assert.LessOrEqual(t, b.gap.Load(), (after-before+int64(30*time.Microsecond))/4, "and no more than the spin's own clock says")
}

// A waiter stamps the wall clock each stampEvery as its spin goes on, and
// not as it begins (its caller stamps that it waits where the ringer
// reads it anyway: see Way.waitFair); a waiter that does not spin stamps
// nothing: spunWithin says a waiter's process was alive lately only when
// it spun lately.
func TestBellSpinStampsItsTime(t *testing.T) {
	b := testBell(t)
	assert.False(t, b.spunWithin(monoNow(), time.Hour), "nobody spun yet")
	last := b.Load()
	b.spin(last, monoNow()) // not spinning: the misses say so
	assert.False(t, b.spunWithin(monoNow(), time.Hour), "a wait that did not spin")

	b.misses.Store(0)
	b.Ring()
	_, found, _ := b.spin(last, monoNow())
	require.True(t, found)
	assert.False(t, b.spunWithin(monoNow(), time.Hour), "a spin that finds its ring at once stamps nothing")

	b.gap.Store(int64(5 * stampEvery)) // a spin of ten stampEvery
	last = b.Load()
	before := monoNow()
	_, found, _ = b.spin(last, before)
	require.False(t, found)
	spunAt := atomic.LoadInt64(b.spunAt)
	assert.GreaterOrEqual(t, spunAt, stampAt(before)+int64(stampEvery), "stamped as it spun on")
	assert.LessOrEqual(t, spunAt, stamp())
	assert.True(t, b.spunWithin(monoNow(), time.Hour))
	assert.False(t, b.spunWithin(monoNow(), 0), "no spin is younger than nothing")

	atomic.StoreInt64(b.spunAt, stamp()+int64(time.Millisecond))
	assert.True(t, b.spunWithin(monoNow(), time.Second), "a stamp since the caller read its clock, a little ahead")
	atomic.StoreInt64(b.spunAt, stamp()+int64(2*time.Hour))
	assert.False(t, b.spunWithin(monoNow(), time.Hour), "a stamp further ahead (another process's stamps disagree) says nothing")
}

// A waiter whose rings have lately come 60 µs after its waits began (a
// peer that slept, woken across this VM's two CPUs) still spins for the
// next: a waiter that stopped there would keep its peer's rings that
// slow, each side sleeping and waking the other for good.
func TestBellSpinsThroughAPeersWake(t *testing.T) {
	b := testBell(t)
	b.misses.Store(0)
	b.waits.Store(1) // not a probe
	b.gap.Store(int64(60 * time.Microsecond))
	spun := b.spun.Load()
	start := time.Now()
	_, found, _ := b.spin(b.Load(), monoNow())
	assert.False(t, found)
	assert.Equal(t, spun+1, b.spun.Load(), "a waiter whose rings take a wake's time did not spin")
	assert.GreaterOrEqual(t, time.Since(start), spinCap, "a spin shorter than a wake and what the peer does after it")
}

// A waiter's look (see WaitUntil) comes after it armed its flag, so that
// a Nudge before the arm, which wakes nobody, is seen by the look, and
// one after it wakes the sleep; and it ends the wait with its error.
func TestBellLooksOnceArmed(t *testing.T) {
	b := testBell(t)
	b.misses.Store(0) // a spin first, as a waiter with a peer on another CPU
	errLooked := errors.New("looked")
	for range 3 {
		atomic.AddUint32(b.asleep, atomic.LoadUint32(b.asleep)&1) // even: no waiter armed
		var armed bool
		looks := 0
		look := func() error {
			looks++
			armed = atomic.LoadUint32(b.asleep)&1 == 1
			return errLooked
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // a lost look fails, not hangs
		_, err := b.WaitUntil(ctx, b.Load(), func() error { return nil }, 0, look)
		cancel()
		require.ErrorIs(t, err, errLooked)
		assert.Equal(t, 1, looks)
		assert.True(t, armed, "the look came before the waiter armed its flag")
	}
}

// A wait whose context's callback runs slowly, after the context ended
// the wait, returns only once that callback is done with the Bell: its
// caller may unmap the Bell's memory as soon as it returns.
func TestBellWaitOutlivesItsCallback(t *testing.T) {
	b := testBell(t)
	var started, ended atomic.Int32
	hook := func() {
		started.Add(1)
		time.Sleep(20 * time.Millisecond) // scheduled slowly
		ended.Add(1)
	}
	afterNudge.Store(&hook)
	t.Cleanup(func() { afterNudge.Store(nil) })
	never := func() error { return nil }
	for try := 0; ; try++ {
		started.Store(0)
		ended.Store(0)
		// Past the first slice (10 ms), whose end arms the callback.
		ctx, cancel := context.WithTimeout(context.Background(), 12*time.Millisecond)
		_, err := b.Wait(ctx, b.Load(), never)
		endedAtReturn := ended.Load()
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
		time.Sleep(40 * time.Millisecond) // a callback still to come has run
		require.Equal(t, started.Load(), endedAtReturn, "a callback ran after the wait returned")
		if started.Load() == 1 {
			return // the callback ran, and the wait waited for it
		}
		require.Less(t, try, 19, "the callback never ran in 20 tries: its stop always came first")
	}
}

// A wait that its ring ends within the first slice makes no context
// callback, and allocates nothing.
func TestBellHotWaitAllocatesNothing(t *testing.T) {
	b := testBell(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := make(chan struct{})
	rang := make(chan struct{})
	go func() { // rings each wait once its waiter has armed its flag
		defer close(rang)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if atomic.LoadUint32(b.asleep)&1 == 1 {
				b.Ring()
			}
			runtime.Gosched()
		}
	}()
	defer func() { close(stop); <-rang }()
	never := func() error { return nil }
	allocs := testing.AllocsPerRun(200, func() {
		if _, err := b.Wait(ctx, b.Load(), never); err != nil {
			t.Error(err)
		}
	})
	assert.Zero(t, allocs, "allocations in a hot wait")
}

// A wait with no ring ends at its context's deadline, whether that
// carries the monotonic clock's reading or not, and one with a patience
// once it has waited that long, not at the end of its first sleep slice:
// each shortens the sleep. The quickest of a few tries counts, as a
// descheduled test only ends late.
func TestBellWaitEndsOnTime(t *testing.T) {
	b := testBell(t)
	never := func() error { return nil }
	const (
		after = 2 * time.Millisecond
		late  = sleepSlice * 3 / 5 // a wait that slept its slice ends later
	)
	quickest := func(wait func() error, want error) time.Duration {
		best := time.Hour
		for range 5 {
			start := time.Now()
			err := wait()
			took := time.Since(start)
			require.ErrorIs(t, err, want)
			assert.GreaterOrEqual(t, took, after, "ended before its time")
			best = min(best, took)
		}
		return best
	}
	took := quickest(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), after)
		defer cancel()
		_, err := b.Wait(ctx, b.Load(), never)
		return err
	}, context.DeadlineExceeded)
	assert.Less(t, took, late, "a wait past its deadline")
	took = quickest(func() error {
		// A deadline made from a wall time, without the monotonic
		// clock's reading.
		ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(after).Round(0))
		defer cancel()
		_, err := b.Wait(ctx, b.Load(), never)
		return err
	}, context.DeadlineExceeded)
	assert.Less(t, took, late, "a wait past its wall deadline")

	// A ring before a wall deadline ends the wait: the deadline only
	// bounds its sleeps.
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(5*time.Second).Round(0))
	defer cancel()
	last := b.Load()
	ring := time.AfterFunc(20*time.Millisecond, b.Ring)
	defer ring.Stop()
	_, err := b.Wait(ctx, last, never)
	require.NoError(t, err, "the ring, not the deadline, ends it")
	took = quickest(func() error {
		_, err := b.WaitUntil(context.Background(), b.Load(), never, after, nil)
		return err
	}, errWaitedEnough)
	assert.Less(t, took, late, "a wait past its patience")
}

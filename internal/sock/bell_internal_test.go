//go:build linux

package sock

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A waiter whose spins keep missing stops spinning, but for a probe now
// and then, and spins again once a probe finds its ring.
func TestBellStopsSpinningWhenSpinsMiss(t *testing.T) {
	mem := make([]byte, 4096)
	off := 64 - int(uintptr(unsafeAddr(mem))%64)
	b, err := NewBell(mem[off%64 : off%64+bellSize])
	require.NoError(t, err)
	last := b.Load()
	for i := range maxMisses {
		_, found := b.spin(last, time.Now())
		require.False(t, found)
		require.EqualValues(t, i+1, b.spun.Load(), "spin %d spun", i)
	}
	for range 2 * probeEvery {
		b.spin(last, time.Now())
	}
	probes := b.spun.Load() - maxMisses
	assert.InDelta(t, 2, probes, 1, "waits that spun after %d misses in a row, of %d", maxMisses, 2*probeEvery)

	// A probe that finds the ring: spinning again.
	b.Ring()
	for b.waits.Load()%probeEvery != probeEvery-1 {
		b.spin(last, time.Now())
	}
	_, found := b.spin(last, time.Now())
	require.True(t, found, "the probe finds the ring")
	spun := b.spun.Load()
	b.spin(last, time.Now())
	assert.Equal(t, spun+1, b.spun.Load(), "a wait after a found ring spins")
}

func unsafeAddr(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

// A ringer late to wake, whose ring the waiter has seen already, clears
// the flag the waiter set for its next sleep, just before that sleep; the
// ring after it still wakes the waiter, not a sleep slice later.
func TestBellLateWakeLosesNoRing(t *testing.T) {
	mem := make([]byte, 4096)
	off := (64 - int(uintptr(unsafeAddr(mem))%64)) % 64
	b, err := NewBell(mem[off : off+bellSize])
	require.NoError(t, err)
	b.misses.Store(maxMisses)   // no spinning: straight to sleep
	atomic.AddUint32(b.word, 1) // a ring whose wake comes late
	var once sync.Once
	var flagged atomic.Bool
	late := func() {
		once.Do(func() {
			b.wake() // the late wake, in the gap before the sleep
			time.AfterFunc(2*time.Millisecond, func() {
				// The waiter is asleep by now: its flag must say so,
				// or this ring wakes nobody.
				flagged.Store(atomic.LoadUint32(b.asleep) == 1)
				b.Ring()
			})
		})
	}
	beforeSleep.Store(&late)
	defer beforeSleep.Store(nil)
	_, err = b.Wait(context.Background(), b.Load(), func() error { return nil })
	require.NoError(t, err)
	assert.True(t, flagged.Load(), "the waiter slept unflagged: the ring woke nobody")
}

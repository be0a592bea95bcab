//go:build linux

package sock

import (
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

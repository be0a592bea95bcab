//go:build linux

package sock

import (
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/carry"
)

// pinThread runs the rest of the test on the calling goroutine's thread,
// pinned to the last CPU it may run on, with pinnedCPU's look taken
// again; it returns that CPU plus one, and unpin, which gives the thread
// back its CPUs and takes the look again (the test's end calls it too),
// and returns what pinnedCPU should say then.
func pinThread(t *testing.T) (cpu uint32, unpin func() uint32) {
	t.Helper()
	runtime.LockOSThread()
	var was, one unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &was))
	c := 0
	for i := range 1024 { // the last: CPU 0, a likely constant, only if it is the one
		if was.IsSet(i) {
			c = i
		}
	}
	one.Set(c)
	require.NoError(t, unix.SchedSetaffinity(0, &one))
	lookAgain()
	lookCPU(monoNow())
	done := false
	unpin = func() uint32 {
		if !done {
			done = true
			require.NoError(t, unix.SchedSetaffinity(0, &was))
			lookAgain()
			lookCPU(monoNow())
			runtime.UnlockOSThread()
		}
		if was.Count() == 1 {
			return uint32(c) + 1
		}
		return 0
	}
	t.Cleanup(func() { unpin() })
	return uint32(c) + 1, unpin
}

// lookAgain forgets pinnedCPU's answer, which the next lookCPU asks for.
func lookAgain() {
	cpusLooked.Store(0)
	cpusPinned.Store(0)
}

// pinnedCPU says which one CPU the thread may run on, and that it may run
// on more, as lookCPU found; lookCPU asks the kernel again only once
// cpusLookEvery has gone by.
func TestPinnedCPU(t *testing.T) {
	c, unpin := pinThread(t)
	lookAgain()
	assert.Zero(t, pinnedCPU(), "no look yet")
	lookCPU(monoNow())
	assert.Equal(t, c, pinnedCPU())
	cpusPinned.Store(c + 1)
	lookCPU(monoNow())
	assert.Equal(t, c+1, pinnedCPU(), "looked lately: not asked again")
	lookCPU(monoNow() + int64(cpusLookEvery))
	assert.Equal(t, c, pinnedCPU(), "asked again")
	assert.Equal(t, unpin(), pinnedCPU())
}

// A ring stamps the CPU the ringer is pinned to in the bell, for its
// waiter: by Ring and by Advance, and 0 once it may run on more than one.
func TestBellRingStampsItsCPU(t *testing.T) {
	b := testBell(t)
	c, unpin := pinThread(t)
	b.Ring()
	assert.Equal(t, c, b.RingerCPU(), "Ring")
	atomic.StoreUint32(b.cpu, 0)
	require.True(t, b.Advance(b.Load()))
	assert.Equal(t, c, b.RingerCPU(), "Advance")
	cpusPinned.Store(0) // as if its last look found it may run anywhere
	b.Ring()
	assert.Equal(t, cpuNow(), b.RingerCPU(), "the CPU it runs on, as the processor says")
	if cpuWay() != readNone {
		assert.Equal(t, c, b.RingerCPU())
	}
	unpin()
}

// A spin yields its CPU only to a peer pinned to the one CPU it is pinned
// to.
func TestSpinYieldsOnlyToAPeerOnItsCPU(t *testing.T) {
	c, unpin := pinThread(t)
	now := monoNow()
	lookAgain()
	assert.False(t, sharesCPU(0, now), "an unpinned peer, or one that has not looked")
	assert.Equal(t, c, pinnedCPU(), "the spin looked all the same: its rings stamp it")
	assert.True(t, sharesCPU(c, now), "a peer on its CPU")
	assert.False(t, sharesCPU(c+1, now), "a peer elsewhere")
	assert.False(t, sharesCPU(0, now), "an unpinned peer")
	cpusPinned.Store(0) // as if its last look found it may run anywhere
	assert.Equal(t, cpuWay() != readNone, sharesCPU(c, now), "a peer on the CPU it runs on, as the processor says")
	assert.False(t, sharesCPU(c+1, now), "a peer elsewhere")
	assert.False(t, sharesCPU(0, now), "a peer on a CPU unknown")
	assert.False(t, sameCPU(0, 0), "both unknown")
	unpin()
}

// A waiter pinned to its ringer's CPU yields it as it spins; one whose
// ringer is elsewhere does not.
func TestBellSpinYieldsToItsRingersCPU(t *testing.T) {
	b := testBell(t)
	b.misses.Store(0)
	b.gap.Store(int64(spinCap / 2)) // it spins for spinCap: many looks at the clock
	c, _ := pinThread(t)
	lookAgain() // the spin looks
	last := b.Load()
	atomic.StoreUint32(b.cpu, c)
	n := spinYields.Load()
	_, found, _ := b.spin(last, monoNow())
	require.False(t, found)
	assert.Greater(t, spinYields.Load(), n, "the ringer shares its CPU")
	atomic.StoreUint32(b.cpu, c+1)
	b.misses.Store(0)
	n = spinYields.Load()
	b.spin(last, monoNow())
	assert.Equal(t, n, spinYields.Load(), "the ringer runs elsewhere")
}

// A waiter pinned to its ringer's CPU yields it before it reads the
// clock: a ring that the yield let come ends the spin with no reading,
// nothing learnt and no stamp; a yield that brings none leaves a spin
// that reads the clock and stamps its own time as it goes on.
func TestBellYieldsFirstToItsRingersCPU(t *testing.T) {
	b := testBell(t)
	b.misses.Store(maxMisses - 1) // it spins all the same
	b.waits.Store(1)              // not a probe
	gap := int64(spinCap / 4)
	b.gap.Store(gap)
	c, _ := pinThread(t)
	atomic.StoreUint32(b.cpu, c)
	ring := func() { b.Ring() }
	afterYield.Store(&ring)
	t.Cleanup(func() { afterYield.Store(nil) })

	last := b.Load()
	n := spinYields.Load()
	w, found, start := b.spin(last, 0)
	require.True(t, found)
	assert.Equal(t, last+1, w)
	assert.Zero(t, start, "the clock was read")
	assert.Equal(t, n+1, spinYields.Load(), "one yield")
	assert.Zero(t, b.misses.Load(), "a spin that found its ring")
	assert.Equal(t, gap, b.gap.Load(), "a gap learnt from a ring within a yield")
	assert.Zero(t, atomic.LoadInt64(b.spunAt), "no stamp: its caller stamped the wait (see Way.waitFair)")

	afterYield.Store(nil)
	last = b.Load()
	before := monoNow()
	_, found, start = b.spin(last, 0)
	require.False(t, found)
	assert.GreaterOrEqual(t, start, before, "the spin's own beginning")
	assert.Greater(t, spinYields.Load(), n+2, "yielding as it spun on")
	assert.Greater(t, atomic.LoadInt64(b.spunAt), stampAt(start), "stamped as it spun on")
}

// A spin whose ring comes while it yields its CPU to the ringer (here,
// after its third yield, a millisecond into it) learns the gap as of a
// look at the clock after the yield, not before it: the look before is
// not the spin's once the ringer has run.
func TestBellSpinLooksAtTheClockAfterAYield(t *testing.T) {
	b := testBell(t)
	b.misses.Store(0)
	b.waits.Store(1)                  // not a probe
	b.gap.Store(int64(spinCap)/2 - 1) // spins spinCap
	c, _ := pinThread(t)
	atomic.StoreUint32(b.cpu, c)
	yields := 0
	ring := func() {
		if yields++; yields == 3 {
			time.Sleep(time.Millisecond) // the ringer runs meanwhile
			b.Ring()
		}
	}
	afterYield.Store(&ring)
	t.Cleanup(func() { afterYield.Store(nil) })
	last := b.Load()
	_, found, _ := b.spin(last, 0)
	require.True(t, found)
	assert.Equal(t, int64(spinCap)/2-1+(2*int64(spinCap)-(int64(spinCap)/2-1))/4, b.gap.Load(), "a quarter of the way to the longest gap learnt: the yield's millisecond and more")
}

// A writer pinned to the CPU its busy reader last took an entry on yields
// it as it spins for the reader.
func TestFairWayWriterYieldsToItsReadersCPU(t *testing.T) {
	w, r, _, _, lend := busyReader(t, 200*time.Microsecond)
	r.idle.Stop() // the reader stays busy: the spin runs its course
	c, _ := pinThread(t)
	atomic.StoreUint32(r.lane.Load().taken.cpu, c)
	n, waits := spinYields.Load(), w.wait.waits.Load()
	require.ErrorIs(t, lend(), carry.ErrNoLane)
	require.Equal(t, waits+1, w.wait.waits.Load(), "the writer spun for its reader")
	assert.Greater(t, spinYields.Load(), n, "and yielded the CPU they share")

	// A reader elsewhere: no yield (the writer's own stamp, c, is on the
	// other bell).
	w.wait.misses.Store(0)
	atomic.StoreUint32(r.lane.Load().taken.cpu, c+1)
	n, waits = spinYields.Load(), w.wait.waits.Load()
	require.ErrorIs(t, lend(), carry.ErrNoLane)
	require.Equal(t, waits+1, w.wait.waits.Load(), "the writer spun for its reader")
	assert.Equal(t, c, w.lane.Load().sent.RingerCPU())
	assert.Equal(t, n, spinYields.Load(), "its reader runs elsewhere")
}

// A fair Way's writer and reader stamp their CPU at each message, by the
// socket too, which rings nothing: the other side's spins see it all the
// same.
func TestFairWayStampsItsCPUByTheSocketToo(t *testing.T) {
	w, r, _, ctx := fairRoles(t)
	null := devNull(t)
	c, _ := pinThread(t)
	l := w.lane.Load()
	atomic.StoreUint32(l.sent.cpu, 0)
	atomic.StoreUint32(l.taken.cpu, 0)
	lookAgain()                                                // the Send looks
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), []int{null})) // a descriptor: by the socket
	assert.Equal(t, c, l.sent.RingerCPU(), "the writer's")
	lookAgain() // the receive looks
	_, byLane := recvWay(t, ctx, r)
	require.False(t, byLane)
	assert.Equal(t, c, l.taken.RingerCPU(), "the reader's")
}

// A waiter pinned to one CPU whose ringer is pinned to another spins for
// spinApart at least, however soon its rings came lately; one whose
// ringer shares its CPU or may run anywhere, or that may run anywhere
// itself, spins for twice its gap, within spinMin.
func TestBellSpinsLongerForARingerApart(t *testing.T) {
	b := testBell(t)
	c, unpin := pinThread(t)
	require.Equal(t, c, pinnedCPU())
	assert.Equal(t, int64(spinApart), spinBudget(0, c+1), "a ringer on another CPU")
	assert.Equal(t, int64(spinCap), spinBudget(int64(spinCap), c+1), "within spinCap all the same")
	assert.Equal(t, int64(spinMin), spinBudget(0, c), "a ringer on its CPU")
	assert.Equal(t, int64(spinMin), spinBudget(0, 0), "a ringer that may run anywhere")
	assert.Equal(t, int64(3*spinMin), spinBudget(int64(3*spinMin)/2, 0), "twice the gap")

	b.misses.Store(0)
	b.waits.Store(1) // not a probe
	b.gap.Store(0)
	atomic.StoreUint32(b.cpu, c+1)
	start := time.Now()
	_, found, _ := b.spin(b.Load(), monoNow())
	require.False(t, found)
	assert.GreaterOrEqual(t, time.Since(start), spinApart, "the spin's budget")

	cpusPinned.Store(0) // as if its last look found it may run anywhere
	want := int64(spinMin)
	if cpuWay() != readNone {
		want = int64(spinApart) // the processor says where it runs
	}
	assert.Equal(t, want, spinBudget(0, c+1), "a waiter that may run anywhere, whose ringer ran elsewhere")
	assert.False(t, apartCPUs(0, c+1), "a waiter whose CPU is unknown")
	assert.False(t, apartCPUs(c, 0), "a ringer whose CPU is unknown")
	unpin()
}

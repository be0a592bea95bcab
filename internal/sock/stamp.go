package sock

import (
	"math"
	"time"
)

// stamp returns the time of a ring, a spin or a wait for the waiters and
// ringers of every process to read, in Unix nanoseconds: the wall clock as this
// process read it as it started (monoBase), advanced since by the
// monotonic clock, which the system's time adjustments slew alike. One
// read of the clock (monoNow), where time.Now makes two. Processes agree
// on it as on the wall clock, except where the wall clock moved against
// the monotonic one between their starts (a step set by hand or by a
// time daemon, a leap second, a suspend): they disagree by as much for as
// long as both run. That costs a waiter gaps learnt wrong, within learn's
// bounds (spins too long or too short), and a writer a look at whether
// its reader lives on each Send that lends blocks (see stampedWithin,
// and Way.readerLive); never a ring.
func stamp() int64 { return stampAt(monoNow()) }

// stampAt is stamp at now, a reading of monoNow.
func stampAt(now int64) int64 { return stampBase + now }

// stampBase is stamp at monoNow's zero: the wall clock less the
// monotonic clock, each as time.Now reads them, the wall clock first.
// The time between the two reads makes the difference too small by as
// much, so the largest of a few is the closest.
var stampBase = func() int64 {
	base := int64(math.MinInt64)
	for range 8 {
		t := time.Now()
		base = max(base, t.UnixNano()-int64(t.Sub(monoBase)))
	}
	return base
}()

// stampedWithin reports whether at, a stamp (see stamp), is within d of
// now, a reading of monoNow: behind it by less than d, or ahead of it by
// less than d (taken since the caller read its clock). One ahead by d or
// more is of a process whose stamps disagree with this one's.
func stampedWithin(at, now int64, d time.Duration) bool {
	age := stampAt(now) - at
	return age > -int64(d) && age < int64(d)
}

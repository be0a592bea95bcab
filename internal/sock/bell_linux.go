package sock

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A Bell wakes a process that waits for a word in memory that both map:
// the doorbell of a shared-memory lane. The ringer bumps the word; the
// waiter spins on it for as long as messages have lately taken to come
// (not while its spins keep missing), then sleeps (FUTEX_WAIT on a flag
// beside it), and is woken only if it sleeps: a ringer whose waiter is
// awake makes no system call, nor do the rings that follow one that woke
// it.
//
// The Bell's memory is bellSize bytes of a MAP_SHARED mapping, aligned to
// 64 bytes, which the caller owns and keeps mapped while the Bell is used;
// every process maps the same bytes. Its layout:
//
//	0   uint32  the word, bumped by each Ring
//	8   int64   when the last Ring (or Nudge) that found a waiter asleep
//	            was, Unix nanoseconds (see stamp)
//	16  int64   when a waiter last spun, Unix nanoseconds (see stamp):
//	            stamped each stampEvery as its spin goes on, not as it
//	            begins (see spunWithin)
//	24  the rest of the word's line, to 64, is the caller's (bellOwn):
//	    words that change when the word does share their move between
//	    CPUs with it
//	64  uint32  odd once a waiter is about to sleep, made even by the ringer
//	            that wakes it: the futex the waiters sleep on
//	72  uint32  the CPU the last ringer ran on as it rang, plus one (0:
//	            unknown; see runningCPU): a waiter on the same CPU yields
//	            it as it spins (see sharesCPU), one on another spins longer
//	            (apartCPU). Off the word's line, which the ringer would
//	            otherwise read before it writes it: a second transfer of
//	            the line between the CPUs at each ring
//
// A peer that writes the memory at will can wake the waiter for nothing,
// make it spin up to spinCap in vain, yield its CPU as it spins, or make
// a ringer take a waiter gone for one that spun lately (spunWithin); it
// cannot make it miss a Ring or sleep past its context and its peer's
// end, and a Ring whose wake it suppresses is seen at most a sleep slice
// late (sleepSlice early in a wait, up to maxSleepSlice in a long one). So
// is one whose wake is lost to a ringer killed between clearing the flag
// and waking.
type Bell struct {
	word   *uint32
	rang   *int64
	spunAt *int64
	asleep *uint32
	cpu    *uint32

	// The waiter's spin budget, process-local: how long rings have lately
	// taken to come after a wait began (an average), and how many spins
	// in a row have ended without one.
	gap    atomic.Int64 // ns
	misses atomic.Int32
	waits  atomic.Uint32
	spun   atomic.Uint64 // waits that spun, for tests and benchmarks
	// timeouts counts sleeps that ended by their time with the word
	// moved: rings slept through, for tests.
	timeouts atomic.Uint64
}

// beforeSleep, if set, runs in a waiter between its last look at the word
// and its sleep: for tests, to put another side's move in that gap.
var beforeSleep atomic.Pointer[func()]

// afterNudge, if set, runs in a wait's context callback between its Nudge
// and its saying it is done, for tests: a callback that the scheduler
// runs slowly.
var afterNudge atomic.Pointer[func()]

// bellOwn is the bytes of its first cache line that a Bell uses.
const bellOwn = 24

// bellSize is the bytes a Bell takes.
const bellSize = 128

// The futex operations, shared between processes (not FUTEX_PRIVATE_FLAG,
// which keys a futex by the address space).
const (
	futexWait = 0
	futexWake = 1
)

const (
	// spinCap is the longest a waiter spins: about twice what a futex
	// wake across two CPUs costs (25–60 µs on a 2-CPU VM, from one hour
	// to the next). A waiter whose peer sleeps sees the peer's wake-up in
	// its gap: with a cap below the wake and what the peer does after it,
	// each side of a round trip learns gaps too long to spin for, and
	// both sleep for good, each waking the other (at 50 µs, spawn bench
	// -cpus 2 went so in four runs of ten in an hour of costly wakes:
	// 31–115 µs a round trip, against 7–11 µs).
	spinCap = 100 * time.Microsecond
	// sleepSlice is the longest a waiter sleeps at first before it asks
	// whether its peer is alive again: how late a dead peer may be seen
	// by a wait that began lately. Each slice that ends with no ring
	// doubles the next, up to maxSleepSlice: a waiter whose peer is
	// silent for long wakes ever more rarely (see WaitUntil), and a
	// dead peer is seen within about as long as the wait had lasted
	// when it died, and within maxSleepSlice, unless the caller's alive
	// has something nudge the waiter at the peer's end (as a Pipe's
	// Way does: see Way.watchPeer).
	sleepSlice = 10 * time.Millisecond
	// maxSleepSlice is the longest a waiter sleeps before it asks
	// whether its peer is alive. A thread that goes back into FUTEX_WAIT
	// holds its process's scheduler slot (its P) in the system call
	// until the runtime's monitor takes it back, up to 10 ms later when
	// the process has been busy: with GOMAXPROCS=1 (a process on one
	// CPU, by pinning or by its cgroup's quota), a goroutine that went
	// back to sleep every 10 ms halved the stream of another goroutine of
	// its process (a Pipe stream of 4 KiB tensors, each process on a CPU
	// of its own: 110–160k/s against 200–300k/s alone); one that did so
	// each second cost nothing that showed.
	maxSleepSlice = time.Second
	// stampEvery is how often a spin stamps that it goes on (spunAt):
	// well within the window in which a writer takes a stamp as a sign
	// of life (liveWindow).
	stampEvery = 4 * time.Microsecond
	// spinMin is the shortest spin: what a ring from a ringer already
	// running on another CPU takes to be seen, with room to spare.
	spinMin = 2 * time.Microsecond
	// spinApart is the shortest spin of a waiter whose ringer runs on
	// another CPU (see apartCPU): it spins on a CPU
	// nothing else of the two needs, and a ring that comes a little
	// later than its gap says (the peer's decode took longer, an
	// interrupt) then costs no wake across the CPUs (25–60 µs) where it
	// is seen within spinApart.
	spinApart = 20 * time.Microsecond
	// maxClears is how many times a ringer tries to clear the asleep
	// flag before it wakes the waiters all the same: only a peer that
	// keeps writing the flag makes it fail more than once or twice.
	maxClears = 64
	// maxMisses is how many spins in a row may end without a ring before
	// the waiter stops spinning: a ringer that cannot run while its
	// waiter spins (the two share one CPU) never rings in time. After
	// that, one wait in probeEvery spins, to see whether that changed.
	maxMisses  = 4
	probeEvery = 64
)

// NewBell returns the Bell whose memory is mem, which must be bellSize
// bytes, 64-byte aligned, in a shared mapping the caller keeps.
func NewBell(mem []byte) (*Bell, error) {
	if len(mem) < bellSize || uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%64 != 0 {
		return nil, fmt.Errorf("mp: a bell needs %d bytes aligned to 64, got %d at %p", bellSize, len(mem), unsafe.SliceData(mem))
	}
	p := unsafe.Pointer(unsafe.SliceData(mem))
	b := &Bell{
		word:   (*uint32)(p),
		rang:   (*int64)(unsafe.Add(p, 8)),
		spunAt: (*int64)(unsafe.Add(p, 16)),
		asleep: (*uint32)(unsafe.Add(p, 64)),
		cpu:    (*uint32)(unsafe.Add(p, 72)),
	}
	return b, nil
}

// Load returns the word.
func (b *Bell) Load() uint32 { return atomic.LoadUint32(b.word) }

// Ring bumps the word, waking the waiters that sleep on it.
func (b *Bell) Ring() {
	b.stampCPU()
	atomic.AddUint32(b.word, 1)
	b.wake()
}

// Advance moves the word from old to old+1, waking the waiters that sleep
// on it, and reports whether it did: false if the word was not old.
func (b *Bell) Advance(old uint32) bool {
	b.stampCPU()
	if !atomic.CompareAndSwapUint32(b.word, old, old+1) {
		return false
	}
	b.wake()
	return true
}

// stampCPU says which CPU the ringer runs on (see runningCPU), for its
// waiter's spin: written only when it changed, as the line is the
// waiter's to read.
func (b *Bell) stampCPU() {
	if c := runningCPU(); atomic.LoadUint32(b.cpu) != c {
		atomic.StoreUint32(b.cpu, c)
	}
}

// spunWithin reports whether a waiter stamped a spin on the word within d
// of now, a reading of monoNow the caller took: the waiter's process was
// alive then. A spin stamps only once it has gone on for stampEvery, so a
// shorter one says nothing. A waiter whose stamp is d or more older has
// not, nor one asleep, nor one that stopped spinning; nor one whose stamp
// is d or more ahead (its process's stamps disagree with this one's: see
// stamp). One that stamped since the caller read its clock, ahead of now
// by less than d, spun within d too.
func (b *Bell) spunWithin(now int64, d time.Duration) bool {
	return stampedWithin(atomic.LoadInt64(b.spunAt), now, d)
}

// RingerCPU returns what the last ringer stamped (see stampCPU).
func (b *Bell) RingerCPU() uint32 { return atomic.LoadUint32(b.cpu) }

// Nudge wakes the waiters asleep on the word, if any, without moving it:
// each asks its alive at once, and sleeps again unless that ends its wait.
// A waiter that arms its flag after the Nudge looked at it is not woken,
// and asks alive at its slice's end: a caller that must reach the waiter
// nudges until it has, or writes first what the waiter's look, asked
// once it has armed, finds (see WaitUntil).
func (b *Bell) Nudge() { b.wake() }

// wake wakes the waiters asleep on the word, if any, once it has moved.
// The asleep flag is a count, odd while a waiter is about to sleep or
// asleep: the ringer that finds it odd makes it even and wakes every
// waiter. A count, not a 0 or 1, so that each clearing changes it: a
// waiter sleeps only while the flag still holds the value it armed, and
// another waiter arming it again does not bring that value back. A waiter
// woken but not yet run costs the rings after that one nothing; one that
// wakes to nothing arms the flag again before it sleeps again. The
// ringer that finds the flag odd stamps the ring first, for the waiter it
// wakes to learn when the ring came (see learn); one that finds it even
// reads no clock. A Nudge stamps too: a waiter it woke that finds a ring
// before it arms the flag again learns the Nudge's time, a gap too short,
// which costs it only a shorter spin.
//
// FUTEX_WAKE fails only for an address that is not mapped or not aligned,
// which a Bell's never are; a wake that failed all the same would be seen
// by its waiter a sleep slice late, so it is not an error of the ring.
func (b *Bell) wake() {
	// Dekker's pattern with the waiter, both sides sequentially
	// consistent: either the waiter's arming is seen here, or the waiter
	// sees the new word before it sleeps.
	for i := 0; ; i++ {
		v := atomic.LoadUint32(b.asleep)
		if v&1 == 0 {
			if i == 0 {
				return
			}
			// Another ringer cleared it first: wake all the same, as
			// that ringer may have died before its own wake.
			break
		}
		if i == 0 {
			atomic.StoreInt64(b.rang, stamp())
		}
		if atomic.CompareAndSwapUint32(b.asleep, v, v+1) || i == maxClears {
			break // cleared, or a peer keeps writing it: wake anyway
		}
	}
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(b.asleep)), futexWake, 1<<30, 0, 0, 0)
}

// Wait waits until the word is no longer last and returns it. It ends
// early with ctx's error, or with alive's: alive is asked whether the peer
// that rings is still there each time a sleep slice has gone by without a
// ring, whatever woke the waiter meanwhile (a signal, a ring for nothing),
// and after a wake that did not move the word (Nudge), and its error is
// returned as it is. The first slice is sleepSlice, and each that ends
// with no ring doubles the next, up to maxSleepSlice; once the first has
// ended, the end of ctx wakes the sleep at once. A Nudge it made is done
// with the Bell's memory before Wait returns.
//
// A waiter that leaves its wait (its ring came, or its context ended)
// while its flag is set, or is killed asleep, costs the next Ring one
// FUTEX_WAKE for nobody.
func (b *Bell) Wait(ctx context.Context, last uint32, alive func() error) (uint32, error) {
	return b.WaitUntil(ctx, last, alive, 0, nil)
}

// WaitUntil is Wait that ends with errWaitedEnough once it has waited
// patience, unless that is zero or less. If look is not nil, it is asked once,
// after the waiter first arms its flag and before it first sleeps, and
// its error ends the wait: a look at what a Nudge would have made alive
// say, for a waiter that must not miss a Nudge, which finds no waiter to
// wake before the flag is armed (while the waiter spins, say). A Nudge
// after the arm wakes it.
//
// The wait reads the clock (monoNow) once as it begins, each spinTurns
// turns of its spin and after each of its yields, once before each sleep
// (twice for a deadline made from a wall time), and once as it finds its
// ring after its flag is armed, before any sleep (for learn); not as a
// spin sees its ring (see spin): a read costs 50 ns or more on a VM, and
// a stream or a round trip waits once a message. A waiter whose ringer
// shares its CPU yields it first, and reads none if that brings the ring.
func (b *Bell) WaitUntil(ctx context.Context, last uint32, alive func() error, patience time.Duration, look func() error) (uint32, error) {
	if w := atomic.LoadUint32(b.word); w != last {
		return w, nil
	}
	w, ok, start := b.spin(last, 0)
	if ok {
		return w, nil
	}
	// The times the wait ends at, on monoNow's clock: its patience's
	// end, and its context's deadline if that carries the monotonic
	// clock's reading, as a deadline made by context.WithTimeout does.
	// One made from a wall time (without: see time.Time.Round) is asked
	// of the wall clock before each sleep, as the context's timer was
	// set by it.
	deadline, hasDeadline := ctx.Deadline()
	var until, ends int64
	if patience > 0 {
		until = start + int64(patience)
	}
	wallDeadline := hasDeadline && deadline == deadline.Round(0)
	if hasDeadline && !wallDeadline {
		ends = int64(deadline.Sub(monoBase))
	}
	slice := sleepSlice
	sliceEnd := start + int64(slice) // the spin's time is in the first slice
	nudged, slept := false, false
	// Once the first slice has ended, the end of ctx wakes the sleep at
	// once, which the slices, long in a long wait, would see late; a
	// wait that ends within the first, a hot one's, arms nothing.
	var disarm func()
	defer func() {
		if disarm != nil {
			disarm()
		}
	}()
	for {
		// Arm the flag before the look: a ring after the look sees it.
		// The sleep is on the flag's armed value, not on the word: any
		// clearing since (even by a ringer late to wake, whose ring
		// this waiter has seen already) ends the sleep at once, and the
		// loop arms it again.
		armed := atomic.LoadUint32(b.asleep)
		if armed&1 == 0 && atomic.CompareAndSwapUint32(b.asleep, armed, armed+1) {
			armed++ // else it moved meanwhile: the sleep fails at once
		}
		if w := atomic.LoadUint32(b.word); w != last {
			if slept {
				b.learn(atomic.LoadInt64(b.rang) - stampAt(start))
			} else {
				b.learn(monoNow() - start)
			}
			return w, nil
		}
		if err := ctx.Err(); err != nil {
			return last, err
		}
		if look != nil {
			// After the arm: a Nudge before it is seen here, one after
			// it wakes the sleep.
			if err := look(); err != nil {
				return last, err
			}
			look = nil
		}
		now := monoNow()
		if nudged || now >= sliceEnd {
			if err := alive(); err != nil {
				return last, err
			}
			if !nudged {
				slice = min(2*slice, maxSleepSlice)
				if disarm == nil && ctx.Done() != nil {
					disarm = b.nudgeAtEnd(ctx)
				}
			}
			sliceEnd = now + int64(slice)
			nudged = false
		}
		sleep := sliceEnd - now
		if hasDeadline {
			left := ends - now
			if wallDeadline {
				left = int64(time.Until(deadline))
			}
			if left <= 0 {
				// Past it, before the context's own timer says so: that
				// timer sets the context's error and its cause, at once.
				<-ctx.Done()
				return last, ctx.Err()
			}
			sleep = min(sleep, left)
		}
		if until != 0 {
			if now >= until {
				return last, errWaitedEnough
			}
			sleep = min(sleep, until-now)
		}
		ts := unix.NsecToTimespec(sleep)
		if hook := beforeSleep.Load(); hook != nil {
			(*hook)()
		}
		_, _, errno := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(b.asleep)), futexWait, uintptr(armed), uintptr(unsafe.Pointer(&ts)), 0, 0)
		slept = true
		switch errno {
		case unix.ETIMEDOUT:
			if atomic.LoadUint32(b.word) != last {
				b.timeouts.Add(1) // it slept through a ring
			}
		case 0, unix.EAGAIN:
			// Woken, or the flag cleared before the sleep: by a ring,
			// which the loop sees, or by a Nudge (or a ringer late to
			// wake), for which alive is asked.
			nudged = true
		case unix.EINTR:
			// A signal: the loop looks.
		default:
			return last, fmt.Errorf("mp: waiting for a lane: %w", errno)
		}
	}
}

// Spin spins on the word as a wait does before it sleeps (see
// WaitUntil), and returns it and true if it moved from last meanwhile:
// for a waiter that then waits elsewhere, with nothing armed here.
func (b *Bell) Spin(last uint32) (uint32, bool) {
	if w := atomic.LoadUint32(b.word); w != last {
		return w, true
	}
	w, ok, _ := b.spin(last, 0)
	return w, ok
}

// nudgeAtEnd makes the end of ctx Nudge b, and returns what undoes it:
// disarm returns once a Nudge already started is done with b's memory,
// which the waiter's caller may unmap as soon as its wait has returned.
func (b *Bell) nudgeAtEnd(ctx context.Context) (disarm func()) {
	done := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		b.Nudge()
		if hook := afterNudge.Load(); hook != nil {
			(*hook)()
		}
		close(done)
	})
	return func() {
		if !stop() {
			<-done
		}
	}
}

// spin spins on the word for about twice as long as rings have lately
// taken to come (spinBudget), and reports what it found, and when the
// wait began: start, a reading of monoNow, or one it takes if start is 0
// (monoNow never is).
// A spin is worth it only when the ringer runs on another CPU meanwhile,
// or, for a ringer on the waiter's CPU, when the waiter yields it as it
// spins (sharesCPU); the stamps say which, where the processor or the
// pinning tell (runningCPU), until the kernel moves a side; and the
// waiter learns from its spins: after maxMisses in a row end without a
// ring, it spins only to probe, one wait in probeEvery.
//
// A ringer on the waiter's CPU cannot ring while the waiter runs: a
// waiter that has not read the clock yields at once, and reads it only
// if that did not bring the ring (the wait's beginning it returns is
// then 0, and it learns nothing: the ring came within a yield).
//
// A spin reads the clock as it begins, each spinTurns turns, and after
// each yield (whose ringer may have run all the while), not as the ring
// comes: the gap it learns is as of its last read, short by one look's
// turns at most. A reader of a round trip so goes to its message one
// read sooner.
//
// A spin stamps that it goes on (spunAt) each stampEvery, not as it
// begins: a spin of a round trip's few microseconds writes nothing to the
// word's line, which the ringer then takes from the waiter's cache once,
// to ring. A caller that must say that its process waits says so as the
// wait begins, where the ringer reads it anyway (Way.waitFair).
func (b *Bell) spin(last uint32, start int64) (uint32, bool, int64) {
	waits := b.waits.Add(1)
	probe := waits%probeEvery == 0
	if !probe && (b.misses.Load() >= maxMisses || b.gap.Load() >= int64(spinCap)) {
		// Rings come slower than a sleep and a wake-up, or not while
		// the waiter spins.
		if start == 0 {
			start = monoNow()
		}
		return last, false, start
	}
	b.spun.Add(1)
	peer := atomic.LoadUint32(b.cpu)
	if start == 0 && sameCPU(runningCPU(), peer) {
		spinYield()
		if w := atomic.LoadUint32(b.word); w != last {
			b.misses.Store(0)
			return w, true, 0
		}
	}
	now := monoNow()
	if start == 0 {
		start = now
	}
	spun := now - start // how long it had waited at its last look at the clock
	yield := sharesCPU(peer, start)
	budget := spinBudget(b.gap.Load(), peer)
	wall := stampAt(start)
	var stamped int64 // how far into the spin its last stamp was
	for i := 1; ; i++ {
		if w := atomic.LoadUint32(b.word); w != last {
			// As of the last look at the clock, a read less on the
			// way to the message: a gap learnt short by a look's
			// turns at most.
			b.misses.Store(0)
			b.learn(spun)
			return w, true, start
		}
		if i%spinTurns == 0 {
			spun = monoNow() - start
			if spun-stamped >= int64(stampEvery) {
				atomic.StoreInt64(b.spunAt, wall+spun)
				stamped = spun
			}
			if spun > budget {
				if b.misses.Load() < maxMisses {
					b.misses.Add(1)
				}
				return last, false, start
			}
			if yield {
				spinYield()
				// The ringer may have run all the while: a yield
				// costs more than a read, and the look before it is
				// no longer the spin's.
				spun = monoNow() - start
			}
		}
	}
}

// spinBudget returns how long a waiter spins whose rings have lately
// come gap after its waits began, and whose ringer ran on peer (see
// stampCPU): twice the gap, within [spinMin, spinCap], or within
// [spinApart, spinCap] for a ringer on another CPU than the waiter's
// (apartCPU).
func spinBudget(gap int64, peer uint32) int64 {
	least := int64(spinMin)
	if apartCPU(peer) {
		least = int64(spinApart)
	}
	return min(max(2*gap, least), int64(spinCap))
}

// learn folds gap, how long a ring took to come after a wait began, into
// the spin budget. A waiter awake when the ring came learns it from its
// own clock; one that slept, from the stamp of the ringer that woke it,
// so that it learns the gap, not the gap plus its own wake-up. A ringer
// that lies about it, or whose stamps disagree with the waiter's (see
// stamp), moves the gap within [0, 2 spinCap] only.
func (b *Bell) learn(gap int64) {
	gap = max(0, min(gap, 2*int64(spinCap)))
	old := b.gap.Load()
	b.gap.Store(old + (gap-old)/4)
}

package shm

import (
	"fmt"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// SetRefsForTest overwrites a RefCount segment's shared reference count.
func SetRefsForTest(a *Allocation, n int32) { a.hdr().refs.Store(n) }

// LookAtOrphansNow looks at every watched name at once.
func LookAtOrphansNow() {
	orphans.mu.Lock()
	for _, o := range orphans.due {
		o.next = time.Time{}
	}
	orphans.mu.Unlock()
	orphans.run()
}

// WatchingOrphan reports whether the segment name in Dir is watched.
func WatchingOrphan(name string) bool {
	orphans.mu.Lock()
	defer orphans.mu.Unlock()
	_, ok := orphans.due[filepath.Join(Dir(), name)]
	return ok
}

// OrphanLooked reports whether the watch of the segment name in Dir has
// looked at it, and goes on watching it.
func OrphanLooked(name string) bool {
	orphans.mu.Lock()
	defer orphans.mu.Unlock()
	o, ok := orphans.due[filepath.Join(Dir(), name)]
	return ok && o.wait > orphanFirst
}

// IdleCheckDelay is how long a received segment no block uses waits for
// its idle check.
const IdleCheckDelay = idleCheckDelay

// IdleSegments returns how many received segments this process keeps
// mapped with no block of theirs in use.
func IdleSegments() int {
	attached.mu.Lock()
	defer attached.mu.Unlock()
	return len(attached.idle)
}

// WatchSegmentsOf is what package mp has run for each worker it reaps.
var WatchSegmentsOf = watchSegmentsOf

// AdoptMax is how many adopted descriptors a receiver that uses no block
// of their segment keeps.
const AdoptMax = adoptMax

// TransferDelay and AheadKeep are the receiver's transfer period and how
// long a lock LockAhead took outlives the transfers.
const (
	TransferDelay = transferDelay
	AheadKeep     = aheadKeep
)

// LetGoMax is how many slots of a segment a receiver lets go of before
// it unlocks them without waiting for the transfer.
const LetGoMax = letGoMax

// GenOffset returns where slot's generation lies in its segment's slot
// table.
func GenOffset(slot int) int { return slabHdrSize + 8*slot }

// SlotOf returns the slot b lives in.
func SlotOf(b *Block) int { return b.slot }

// HoldSlots locks slots of b's segment through a description of its own,
// as a receiver that moved its holds would, until the returned function
// closes that description.
func HoldSlots(b *Block, slots ...int) (func() error, error) {
	fd, err := reopen(b.seg.alloc.FD())
	if err != nil {
		return nil, err
	}
	for _, s := range slots {
		if ok, err := lockRead(fd, slotByte(s), 1); !ok || err != nil {
			_ = unix.Close(fd)
			return nil, fmt.Errorf("holding slot %d: %v, %w", s, ok, err)
		}
	}
	return func() error { return unix.Close(fd) }, nil
}

// AttachMapped is Attach for a segment this process maps already, found
// by its identity or its name: ErrNotMapped for another.
func AttachMapped(ref BlockRef) (*Block, error) {
	attached.mu.Lock()
	defer attached.mu.Unlock()
	id := ref.Seg.ID
	if ref.Seg.Name != "" {
		var ok bool
		if id, ok = attached.names[ref.Seg.Name]; !ok {
			return nil, errNotMapped
		}
	}
	return attached.attachLocked(id, ref.covers(id), ref, nil)
}

// The flags callers never pass, the names mmapalloc exports, and
// newPool, for tests.
const (
	SharedMem  = sharedMem
	Exclusive  = exclusive
	NoCreate   = noCreate
	FromFD     = fromFD
	Memfd      = memfd
	EnvDir     = envDir
	EnvCache   = envCache
	DefaultDir = defaultDir
)

var NewPool = newPool

// RaceBump makes f run in each reclaim between its first question about
// the slots and their generations' bump, until the test ends.
func RaceBump(t interface{ Cleanup(func()) }, f func()) {
	beforeBump.Store(&f)
	t.Cleanup(func() { beforeBump.Store(nil) })
}

// AttachAsAnother is Attach as another process's would be: it has none
// of this process's pools to look at first. Tests that stand for another
// process's receiver by this one call it where this process's pool's
// lock is held.
func AttachAsAnother(ref BlockRef) (*Block, error) { return attachRef(ref, false) }

// RaceAttach makes f run in each attach between its first look at this
// process's pools and its hold, until the test ends.
func RaceAttach(t interface{ Cleanup(func()) }, f func()) {
	afterLook.Store(&f)
	t.Cleanup(func() { afterLook.Store(nil) })
}

// HoldTransfers holds off the timed transfers of received holds (see
// transferDelay) until resume is called or the test ends: locks that no
// block took up stay.
func HoldTransfers(t interface{ Cleanup(func()) }) (resume func()) {
	transfersHeld.Store(true)
	resume = func() { transfersHeld.Store(false) }
	t.Cleanup(resume)
	return resume
}

// HoldIdleChecks holds off the idle checks of received segments (see
// idleCheckDelay), which close the descriptors adopted from a segment
// nobody uses, until resume is called or the test ends.
func HoldIdleChecks(t interface{ Cleanup(func()) }) (resume func()) {
	idleChecksHeld.Store(true)
	resume = func() { idleChecksHeld.Store(false) }
	t.Cleanup(resume)
	return resume
}

// UnlockCalls returns how many calls this process has made to unlock
// runs of received segments' slots.
func UnlockCalls() uint64 { return unlockCalls.Load() }

// FirstSlabSlots is how many blocks of size bytes a pool's first
// segment for them holds.
func FirstSlabSlots(size int64) int { return int(slabSlots(classCap(size), 0)) }

// ReclaimBatch is how many blocks a class takes released before it
// reclaims them with free blocks left.
const ReclaimBatch = reclaimBatch

// Reclaims returns how many reclaims p's class of blocks of size bytes
// has run.
func Reclaims(p *Pool, size int64) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c := p.classes[classCap(size)]; c != nil {
		return c.reclaims
	}
	return 0
}

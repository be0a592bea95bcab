package shm

import (
	"errors"
	"fmt"
	"sync"
)

// Returns.
//
// A block of this process's pool that another process sends back to it
// may travel by a lane of package sock, named by its segment's identity,
// slot and generation, with no descriptor to hold it in flight (see
// sock's Way). While such a message waits in the lane, the sender's own
// lock on the slot is the only hold a description has, and the sender may
// let go of it, or die, before this process takes the message. What keeps
// the slot then is this process itself: a lane's reader registers a
// scanner (RegisterReturns) that names the blocks its untaken messages
// return, and a pool's reclaim keeps a pending slot that a scanner names,
// as it keeps one another description holds. Taking the message, the
// reader takes the block back with Revive.
//
// A scanner's names are only what peers wrote in a lane: a wrong one
// keeps a released slot from reuse until the message that names it is
// taken, and Revive hands back only a block this process released with
// that generation, never one in use or reused since.

// ReturnRef names a block of this process's pools that a message returns.
type ReturnRef struct {
	ID     ID
	Offset int64 // of the block's data in its segment
	Gen    uint64
}

// returnScanners are the registered scanners, under their lock: the
// fourth line of state.go's lock order, taken under a Pool's mu.
var returnScanners struct {
	mu   sync.Mutex
	regs map[*returnScanner]struct{}
}

type returnScanner struct{ scan func(yield func(ReturnRef)) }

// RegisterReturns registers scan, which calls yield with each block that
// a message waiting for this process names (see Returns), until the
// returned unregister is called; a pool's reclaim calls it, with the
// pool's lock held, so it must take no lock of this package. Once
// unregister returns, scan is not running and is not called again.
func RegisterReturns(scan func(yield func(ReturnRef))) (unregister func()) {
	r := &returnScanner{scan: scan}
	returnScanners.mu.Lock()
	defer returnScanners.mu.Unlock()
	if returnScanners.regs == nil {
		returnScanners.regs = map[*returnScanner]struct{}{}
	}
	returnScanners.regs[r] = struct{}{}
	return func() {
		returnScanners.mu.Lock()
		defer returnScanners.mu.Unlock()
		delete(returnScanners.regs, r)
	}
}

// ReturnScanners returns how many scanners are registered: for tests, to
// see that a lane's reader unregisters its scanner when it closes.
func ReturnScanners() int {
	returnScanners.mu.Lock()
	defer returnScanners.mu.Unlock()
	return len(returnScanners.regs)
}

// returnsNamed fills named, which it clears first, with the blocks the
// registered scanners name now, and reports whether any is registered.
// The caller holds a Pool's mu.
func returnsNamed(named map[ReturnRef]struct{}) bool {
	clear(named)
	returnScanners.mu.Lock()
	defer returnScanners.mu.Unlock()
	if len(returnScanners.regs) == 0 {
		return false
	}
	for r := range returnScanners.regs {
		r.scan(func(ref ReturnRef) { named[ref] = struct{}{} })
	}
	return true
}

// ErrNotReturnable is returned by Revive for a block that names no slot
// of this process's pools that could be returned to it.
var ErrNotReturnable = errors.New("not a block of this process's pools")

// ErrInUse is returned by Revive for a block still in use here: a storage
// of this process holds it, or is releasing it now. It wraps
// ErrStaleBlock.
var ErrInUse = fmt.Errorf("%w (in use here)", ErrStaleBlock)

// Revive takes back the block ref names, of one of this process's pools,
// for a message that returned it by identity (see Returns): the block
// must have been released since it was handed out with ref's generation,
// and wait in its pool still (pending, or parked while lent). It is in
// use again, as Alloc's would be, for size bytes, the size it was handed
// out for. A block in use is ErrInUse (a storage that releases it on
// another goroutine lets go of its block last, and a block's Release
// puts it in its pool just after it marks it released); one reused
// since, or free, is ErrStaleBlock; a ref that names no slot of a
// segment this process's pools made (or one whose data lies in an
// extent) is ErrNotReturnable.
func Revive(ref ReturnRef, size int64) (*Block, error) {
	seg := produced.byID(ref.ID)
	if seg == nil || seg.external || seg.pool == nil {
		return nil, &Error{Op: "revive", Path: fmt.Sprintf("segment %v", ref.ID), Err: ErrNotReturnable}
	}
	slot, ok := seg.slotAt(ref.Offset)
	if !ok {
		return nil, &Error{Op: "revive", Path: seg.alloc.where(), Err: fmt.Errorf("%w: no slot at offset %d", ErrNotReturnable, ref.Offset)}
	}
	p := seg.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	var b *Block
	if slot < len(seg.blocks) {
		b = seg.blocks[slot]
	}
	if b == nil { // a segment of the pool's growing (see newSegment), not yet handed out
		return nil, &Error{Op: "revive", Path: seg.alloc.where(), Err: ErrStaleBlock}
	}
	if b.gen != ref.Gen || b.size != size {
		return nil, &Error{Op: "revive", Path: b.String(), Err: ErrStaleBlock}
	}
	if b.free {
		// Handed out next, with this generation: a slot never handed
		// out yet, or a peer that guessed the generation a reclaim gave.
		return nil, &Error{Op: "revive", Path: b.String(), Err: ErrStaleBlock}
	}
	if !b.released.Load() {
		return nil, &Error{Op: "revive", Path: b.String(), Err: ErrInUse}
	}
	switch {
	case b.parked:
		b.parked = false // its loans' last Return leaves it in use
	case p.unpendLocked(b):
	default:
		// Released with this generation, and neither pending nor free:
		// its Release, which marks it released before it takes the
		// pool's lock, puts it on the pending list next. (Or a trim
		// closed its segment since it was looked up: the next try
		// finds no segment.)
		return nil, &Error{Op: "revive", Path: b.String(), Err: ErrInUse}
	}
	b.released.Store(false)
	return b, nil
}

// unpendLocked takes b off its class's pending list, and reports whether
// it was there. The caller holds p.mu.
func (p *Pool) unpendLocked(b *Block) bool {
	c := b.seg.class
	for i := len(c.pending) - 1; i >= 0; i-- { // the latest released last
		if c.pending[i] == b {
			copy(c.pending[i:], c.pending[i+1:])
			c.pending[len(c.pending)-1] = nil
			c.pending = c.pending[:len(c.pending)-1]
			if i < c.kept { // one the last reclaim found held: those lead the list
				c.kept--
			}
			return true
		}
	}
	return false
}

// Produced appends to dst the identities of at most max segments of this
// process's pools whose blocks a message may return by identity (sealed
// ones, whose data they hold), and returns it with ProducedVersion as it
// was when they were read.
func Produced(dst []ID, max int) ([]ID, uint64) {
	m := produced.snap.Load()
	for id, seg := range m.ids {
		if len(dst) >= max {
			break
		}
		if seg.returnable() {
			dst = append(dst, id)
		}
	}
	return dst, m.version
}

// returnable reports whether a message may return seg's blocks by
// identity: seg is a segment of one of this process's pools, sealed, whose
// blocks hold their data.
func (seg *segment) returnable() bool { return !seg.named && !seg.external && seg.pool != nil }

// Returnable reports whether segment id is one of this process's pools'
// that Produced lists: a message that names a block of it by identity
// can only return the block, whatever else this process maps of the
// segment, and Revive's answer for it is final: a block of it reached
// another way (a second mapping of the segment, where a block of it came
// back by descriptor) would be held by a lock, which the lane's writer
// would have to keep the slot for.
func Returnable(id ID) bool {
	seg := produced.byID(id)
	return seg != nil && seg.returnable()
}

// ProducedVersion returns a count that changes whenever this process's
// pools make or close a segment.
func ProducedVersion() uint64 { return produced.snap.Load().version }

package shm

import "io"

// Extents: pooled slots whose data lies elsewhere.
//
// A pool made with NewExtentPool keeps its slabs' data out of shared
// memory: each slab's data is an extent, device memory, say, that the
// pool's maker makes, and the slab's segment holds its slot table alone.
// An extent is the data of one slab, or a receiver's attachment to it,
// and is only ever closed: it is an io.Closer.
// Who holds each slot is counted as for any pooled block, by the kernel,
// as locks on the segment's file, and a block's Offset is where its data
// starts in its slab's extent. The segment's identity names the slab: a
// receiver that maps a segment attaches its extent once (SetExtent) and
// finds it again with every block of that segment it receives.
//
// Ownership: the pool owns the extents of its slabs and closes each with
// its segment. A receiver's extent belongs to its mapping of the segment,
// which closes it when the mapping goes: once no block of the process
// uses the segment and it has left the idle list.

// NewExtentPool returns a pool whose slabs keep their data in extents
// that make makes, keeping at most limit bytes of unused slabs for reuse.
// Its segments are file_descriptor segments, whatever the strategy.
func NewExtentPool(limit int64, make func(n int64) (io.Closer, error)) *Pool {
	p := newPool(limit)
	p.extent = make
	extentPools.add(p)
	return p
}

// InExtent reports whether the block's data lies in an extent (see
// NewExtentPool) rather than in its segment.
func (b *Block) InExtent() bool { return b.seg.external }

// Extent returns the extent the block's data lies in: its pool's, or the
// one this process attached to the segment it received the block from;
// nil if there is none yet.
func (b *Block) Extent() io.Closer {
	if b.seg.pool != nil {
		return b.seg.ext
	}
	attached.mu.Lock()
	defer attached.mu.Unlock()
	return b.seg.ext
}

// SetExtent attaches x, this process's view of the extent of the segment
// that the received block b lives in, unless one is attached already,
// and returns the one attached: x, which the segment's mapping then owns,
// or the earlier one, and then x stays the caller's. It is ErrNoExtent for
// a block whose data lies in its segment.
func (b *Block) SetExtent(x io.Closer) (io.Closer, error) {
	if !b.seg.external || b.seg.pool != nil {
		return nil, ErrNoExtent
	}
	attached.mu.Lock()
	defer attached.mu.Unlock()
	if b.seg.ext == nil {
		b.seg.ext = x
	}
	return b.seg.ext, nil
}

// bytes is what a segment holds for this process: its mapping, or, for a
// slab whose data lies in an extent, that extent's bytes.
func (s *segment) bytes() int64 {
	if s.external {
		return int64(s.nslots) * s.cap
	}
	return s.alloc.Size()
}

// closeExtent hands the segment's extent, if it has one, to a goroutine
// of its own that closes it. Segments are let go of under the pool's or
// the received segments' lock, and a device slab's Close waits for the
// device's work and unmaps (milliseconds, more behind a long kernel):
// every allocation and every receive of the process would wait behind
// it. Trim waits for the closes handed over before it returns, and so
// does a pool that is out of room before it tries again.
//
// An extent's Close must take no lock of this package: Trim, DropIdle and
// a pool out of room wait for it.
func (s *segment) closeExtent() {
	if s.ext != nil {
		closeLater(s.ext)
		s.ext = nil
	}
}

// closeLater closes x on a goroutine of its own (see closeExtent).
func closeLater(x io.Closer) {
	extentClosing.add()
	go func() {
		defer extentClosing.done()
		_ = x.Close() // nobody to tell: the segment is gone
	}()
}

// WaitExtentsClosed returns once every extent let go of so far is closed:
// for a process that gives its devices back (cuda's Runtime.Close).
func WaitExtentsClosed() { extentClosing.wait() }

// ExtentSize returns the bytes of the extent the block's slab keeps its
// data in: its slots' capacity times their number.
func (b *Block) ExtentSize() int64 { return int64(b.seg.nslots) * b.seg.cap }

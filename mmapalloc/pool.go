package mmapalloc

import (
	"errors"
	"fmt"
	"math/bits"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Pooled file_descriptor segments.
//
// Making a segment costs a file, a fallocate, an mmap and a page fault per
// page, and a receiver pays an mmap for each one it is sent. So the
// producer keeps segments and recycles their pieces, blocks: small
// storages are packed many to a slab segment, large ones get a segment
// each, and a released block is reused once no process holds it any more.
//
// Every block starts with a 64-byte header whose reference count is shared
// by all processes: the producer's storage holds one reference, every
// message in flight one (taken by the sender, adopted by the receiver),
// every receiver's storage one. Whoever drops the last reference needs to
// tell nobody: the producer finds the count at zero the next time it looks
// for a free block. A receiver that dies holding a block keeps it counted
// until the producer exits; the memory goes back to the system when the
// last process mapping the segment is gone.

const (
	blockHeader = 64
	blockMagic  = 0x424d5054 // "TPMB" little-endian

	// smallMax is the largest block packed into slabs.
	smallMax = 64 << 10
	// smallMin is the smallest block size class.
	smallMin = 256
	// slabSize is the size of a slab segment.
	slabSize = 2 << 20
)

// blockHdr is the layout of a block header in shared memory.
type blockHdr struct {
	magic uint32
	_     uint32
	refs  atomic.Int32
	_     int32
	size  int64         // the block's capacity in bytes
	gen   atomic.Uint64 // bumped at every allocation of the block
	_     [blockHeader - 32]byte
}

var _ [blockHeader - unsafe.Sizeof(blockHdr{})]byte

// ErrStaleBlock is returned for a block whose generation differs from the
// message's: it was recycled, which a correct sender never lets happen
// while a message refers to it.
var ErrStaleBlock = errors.New("block recycled since the message was sent")

// segment is one mapping of a pooled segment in this process, shared by
// the blocks that live in it.
type segment struct {
	alloc *Allocation
	users int // live blocks of this process in it; guarded by the owner's lock
	// producer side
	class *sizeClass
	inUse int // slots allocated or awaiting release by other processes
}

// Block is one storage's piece of a pooled segment. A Block holds one
// reference to its piece; Release gives it back, once: a producer's Block
// is handed out again when its piece is reused, so it must not be touched
// after Release.
type Block struct {
	seg      *segment
	off      int64 // offset of the header in the segment
	size     int64 // bytes the storage asked for
	gen      uint64
	pool     *Pool // the producer's pool; nil in a receiver
	released atomic.Bool
}

func (b *Block) hdr() *blockHdr {
	return (*blockHdr)(unsafe.Pointer(&b.seg.alloc.mapping[b.off]))
}

// Bytes returns the block's data. It aliases memory shared with other
// processes and is invalid after Release.
func (b *Block) Bytes() []byte {
	start := b.off + blockHeader
	return b.seg.alloc.mapping[start : start+b.size : start+b.size]
}

// Size returns the number of data bytes.
func (b *Block) Size() int64 { return b.size }

// Segment returns the segment the block lives in; the block keeps
// ownership. Its FD is what travels to other processes.
func (b *Block) Segment() *Allocation { return b.seg.alloc }

// Offset returns the offset of the block's header in its segment.
func (b *Block) Offset() int64 { return b.off }

// Gen returns the block's generation: it changes each time the block is
// handed out.
func (b *Block) Gen() uint64 { return b.gen }

// Refs returns how many holders, in all processes and in flight, the
// block has.
func (b *Block) Refs() int32 { return b.hdr().refs.Load() }

// Retain takes a reference on behalf of a message that carries the block
// to another process; the receiver adopts it. It fails once the block's
// last holder has let it go.
func (b *Block) Retain() error {
	h := b.hdr()
	for {
		n := h.refs.Load()
		if n <= 0 || b.released.Load() {
			return ErrReleased
		}
		if h.refs.CompareAndSwap(n, n+1) {
			return nil
		}
	}
}

// Drop gives back a reference taken by Retain, for a message whose
// receiver already held the block.
func (b *Block) Drop() { b.hdr().refs.Add(-1) }

// Release gives back the block's reference. In the producer the piece
// returns to its pool as soon as no process holds it; in a receiver the
// segment is unmapped once no block of this process uses it. Releasing
// twice returns nil.
func (b *Block) Release() error {
	if !b.released.CompareAndSwap(false, true) {
		return nil
	}
	left := b.hdr().refs.Add(-1)
	if b.pool != nil {
		b.pool.put(b, left)
		return nil
	}
	return attached.detach(b.seg, b)
}

func (b *Block) String() string {
	return fmt.Sprintf("block %d+%d of %v", b.off, b.size, b.seg.alloc)
}

// sizeClass holds the free and pending blocks of one capacity. A
// producer's Block objects are made once per slot and handed out again at
// every reuse, so that taking a recycled block allocates nothing.
type sizeClass struct {
	cap     int64
	free    []*Block
	pending []*Block // released by the producer, still held elsewhere
}

// Pool hands out blocks of file_descriptor segments and recycles them. It
// owns every segment it made and closes them in Trim once unused.
type Pool struct {
	named   bool // file_system: segments keep their names, receivers open them by name
	mu      sync.Mutex
	classes map[int64]*sizeClass
	segs    map[*segment]struct{}
	cached  int64 // bytes of segments the pool holds
	limit   int64 // bytes of unused segments kept for reuse
}

// EnvCache names the environment variable that bounds, in bytes, the free
// shared memory a process keeps for reuse. The default is 1 GiB.
const EnvCache = "TENSORMP_SHM_CACHE"

var defaultPool = sync.OnceValue(func() *Pool {
	limit := int64(1 << 30)
	if v, err := strconv.ParseInt(os.Getenv(EnvCache), 10, 64); err == nil && v >= 0 {
		limit = v
	}
	return NewPool(limit)
})

// DefaultPool returns the process's pool of file_descriptor segments, the
// one shared tensors use under that strategy.
func DefaultPool() *Pool { return defaultPool() }

var (
	namedPool = sync.OnceValue(func() *Pool {
		p := NewPool(defaultPool().limit)
		p.named = true
		return p
	})
	namedEnabled atomic.Bool
)

// EnableNamedPool lets file_system storages come from a pool too. Named
// segments that a pool keeps for reuse would outlive a process that dies,
// so only a process whose session has a keeper to remove them at its end
// enables it; package mp does so for the program and every worker.
func EnableNamedPool() { namedEnabled.Store(true) }

// NamedPool returns the process's pool of file_system segments, or nil
// unless EnableNamedPool was called.
func NamedPool() *Pool {
	if !namedEnabled.Load() {
		return nil
	}
	return namedPool()
}

// NewPool returns a pool that keeps at most limit bytes of unused
// segments for reuse.
func NewPool(limit int64) *Pool {
	return &Pool{classes: map[int64]*sizeClass{}, segs: map[*segment]struct{}{}, limit: limit}
}

// classCap returns the capacity of the class serving size: powers of two
// for small blocks, quarter steps between powers of two for large ones,
// so that no block wastes more than a quarter of itself (plus a page).
func classCap(size int64) int64 {
	if size <= smallMin {
		return smallMin
	}
	if size <= smallMax {
		return 1 << bits.Len64(uint64(size-1))
	}
	top := int64(1) << (bits.Len64(uint64(size-1)) - 1) // the power of two below
	step := top / 4
	c := (size + step - 1) / step * step
	return (c + 4095) &^ 4095
}

// Alloc returns a block of at least size bytes, zeroed only if new: a
// recycled block holds its last user's bytes, which callers overwrite.
func (p *Pool) Alloc(size int64) (*Block, error) {
	if size <= 0 {
		return nil, fmt.Errorf("mmapalloc: block of %d bytes: must be positive", size)
	}
	capacity := classCap(size)
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.classes[capacity]
	if c == nil {
		c = &sizeClass{cap: capacity}
		p.classes[capacity] = c
	}
	if len(c.free) == 0 {
		p.reclaimLocked(c)
	}
	if len(c.free) == 0 {
		if err := p.growLocked(c); err != nil {
			return nil, err
		}
	}
	b := c.free[len(c.free)-1]
	c.free[len(c.free)-1] = nil
	c.free = c.free[:len(c.free)-1]
	h := b.hdr()
	h.refs.Store(1)
	b.size, b.gen = size, h.gen.Add(1)
	b.released.Store(false)
	return b, nil
}

// reclaimLocked moves the class's pending slots that nobody holds any
// more to its free list.
func (p *Pool) reclaimLocked(c *sizeClass) {
	kept := c.pending[:0]
	for _, b := range c.pending {
		if b.hdr().refs.Load() <= 0 {
			c.free = append(c.free, b)
			b.seg.inUse--
		} else {
			kept = append(kept, b)
		}
	}
	clear(c.pending[len(kept):])
	c.pending = kept
}

// growLocked adds a segment to class c: a slab of small blocks, or one
// large block. When the system is out of room, it trims the pool and
// tries once more.
func (p *Pool) growLocked(c *sizeClass) error {
	stride := blockHeader + c.cap
	segSize := stride
	if c.cap <= smallMax {
		segSize = slabSize / stride * stride
	}
	flags := KeepFD | Unlink
	if p.named {
		flags = 0
	}
	a, err := Create(segSize, flags)
	if err != nil {
		p.trimLocked(0)
		a, err = Create(segSize, flags)
	}
	if err != nil {
		return err
	}
	seg := &segment{alloc: a, class: c}
	p.segs[seg] = struct{}{}
	p.cached += segSize
	for off := int64(0); off+stride <= segSize; off += stride {
		b := &Block{seg: seg, off: off, pool: p}
		h := b.hdr()
		h.magic = blockMagic
		h.size = c.cap
		c.free = append(c.free, b)
	}
	return nil
}

// put takes back a block the producer released; left is its reference
// count after the release.
func (p *Pool) put(b *Block, left int32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := b.seg.class
	if left <= 0 {
		c.free = append(c.free, b)
	} else {
		c.pending = append(c.pending, b)
		b.seg.inUse++
	}
	if p.cached > p.limit {
		p.trimLocked(p.limit)
	}
}

// Trim closes the pool's segments that no block uses, keeping at most
// keep bytes of them. It is how memory goes back to the system on demand.
func (p *Pool) Trim(keep int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.classes {
		p.reclaimLocked(c)
	}
	p.trimLocked(keep)
}

// trimLocked closes unused segments until at most keep bytes are cached.
// A segment is unused when all its slots are free.
func (p *Pool) trimLocked(keep int64) {
	if p.cached <= keep {
		return
	}
	freeBySeg := map[*segment]int{}
	for _, c := range p.classes {
		for _, b := range c.free {
			freeBySeg[b.seg]++
		}
	}
	for seg := range p.segs {
		if p.cached <= keep {
			return
		}
		stride := blockHeader + seg.class.cap
		if int64(freeBySeg[seg]) != seg.alloc.Size()/stride || seg.inUse != 0 {
			continue
		}
		c := seg.class
		kept := c.free[:0]
		for _, b := range c.free {
			if b.seg != seg {
				kept = append(kept, b)
			}
		}
		clear(c.free[len(kept):])
		c.free = kept
		delete(p.segs, seg)
		p.cached -= seg.alloc.Size()
		_ = seg.alloc.Remove()
		_ = seg.alloc.Close()
	}
}

// Stats reports the pool's segments: how many, their bytes, and how many
// blocks are free for reuse.
func (p *Pool) Stats() (segments int, bytes int64, freeBlocks int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.classes {
		freeBlocks += len(c.free)
	}
	return len(p.segs), p.cached, freeBlocks
}

// Receivers map each segment once and share the mapping among the blocks
// they attach.
var attached = &segmentTable{m: map[ID]*segment{}, byName: map[string]*segment{}, blocks: map[*Block]struct{}{}}

// A receiver keeps up to idleMax segments that no block of its uses any
// more mapped, idleBytes at most, because the producer keeps recycling
// their blocks: the next block from one costs no mmap and no page faults.
const (
	idleMax   = 64
	idleBytes = 256 << 20
)

type segmentTable struct {
	mu        sync.Mutex
	m         map[ID]*segment
	byName    map[string]*segment // the named ones among m, by name
	blocks    map[*Block]struct{} // attached blocks not yet released
	idle      []*segment          // mapped, unused, oldest first
	idleBytes int64
}

// dropAttachedForExit gives back the references of every attached block
// not yet released, leaving the mappings for the exit to remove.
func (t *segmentTable) dropAttachedForExit() {
	t.mu.Lock()
	blocks := make([]*Block, 0, len(t.blocks))
	for b := range t.blocks {
		blocks = append(blocks, b)
	}
	clear(t.blocks)
	t.mu.Unlock()
	for _, b := range blocks {
		if b.released.CompareAndSwap(false, true) {
			b.hdr().refs.Add(-1)
		}
	}
}

// AttachBlock returns the block at header offset off, with size data
// bytes and generation gen, of the segment behind fd, which holds segSize
// bytes. The segment is mapped once per process, whatever the number of
// blocks attached from it. The block adopts the reference its sender took
// with Retain. fd stays the caller's.
func AttachBlock(fd int, segSize, off, size int64, gen uint64) (*Block, error) {
	if err := checkBlockBounds(segSize, off, size); err != nil {
		return nil, err
	}
	id, fsize, err := Stat(fd)
	if err != nil {
		return nil, err
	}
	if fsize < segSize {
		return nil, fmt.Errorf("mmapalloc: segment holds %d bytes, fewer than the %d claimed", fsize, segSize)
	}
	seg, err := attached.attach(fd, id, segSize)
	if err != nil {
		return nil, err
	}
	return attachAt(seg, off, size, gen)
}

// AttachNamedBlock is AttachBlock for a block of a named (file_system)
// segment in Dir. The name must be one tensormp made.
func AttachNamedBlock(name string, segSize, off, size int64, gen uint64) (*Block, error) {
	if err := checkBlockBounds(segSize, off, size); err != nil {
		return nil, err
	}
	if !ValidName(name) {
		return nil, &Error{Op: "open", Path: fmt.Sprintf("%q", name), Err: ErrBadName}
	}
	seg, err := attached.attachName(name, segSize)
	if err != nil {
		return nil, err
	}
	return attachAt(seg, off, size, gen)
}

func checkBlockBounds(segSize, off, size int64) error {
	if off < 0 || size <= 0 || off > segSize-blockHeader || size > segSize-blockHeader-off {
		return fmt.Errorf("mmapalloc: block %d+%d outside a segment of %d bytes", off, size, segSize)
	}
	return nil
}

// attachAt checks the block header at off of an attached segment and
// returns the block, or detaches again.
func attachAt(seg *segment, off, size int64, gen uint64) (*Block, error) {
	var err error
	b := &Block{seg: seg, off: off, size: size, gen: gen}
	h := b.hdr()
	switch {
	case h.magic != blockMagic:
		err = fmt.Errorf("mmapalloc: no block header at offset %d", off)
	case h.size < size:
		err = fmt.Errorf("mmapalloc: block at offset %d holds %d bytes, fewer than the %d claimed", off, h.size, size)
	case h.gen.Load() != gen:
		err = fmt.Errorf("mmapalloc: block at offset %d: %w", off, ErrStaleBlock)
	case h.refs.Load() <= 0:
		err = fmt.Errorf("mmapalloc: block at offset %d: %w", off, ErrReleased)
	}
	if err != nil {
		b.released.Store(true)
		_ = attached.detach(seg, nil)
		return nil, err
	}
	attached.mu.Lock()
	attached.blocks[b] = struct{}{}
	attached.mu.Unlock()
	return b, nil
}

func (t *segmentTable) attach(fd int, id ID, size int64) (*segment, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if seg, ok := t.m[id]; ok && seg.alloc.Size() >= size {
		if seg.users == 0 {
			t.unidleLocked(seg)
		}
		seg.users++
		return seg, nil
	}
	dup, err := Dup(fd)
	if err != nil {
		return nil, err
	}
	a, err := OpenFD(dup, size, KeepFD)
	if err != nil {
		return nil, err
	}
	seg := &segment{alloc: a, users: 1}
	if _, ok := t.m[id]; !ok {
		t.m[id] = seg
	}
	return seg, nil
}

func (t *segmentTable) attachName(name string, size int64) (*segment, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if seg, ok := t.byName[name]; ok && seg.alloc.Size() >= size {
		if seg.users == 0 {
			t.unidleLocked(seg)
		}
		seg.users++
		return seg, nil
	}
	a, err := OpenName(name, size, 0)
	if err != nil {
		return nil, err
	}
	seg := &segment{alloc: a, users: 1}
	if _, ok := t.m[a.ID()]; !ok {
		t.m[a.ID()] = seg
		t.byName[name] = seg
	}
	return seg, nil
}

func (t *segmentTable) detach(seg *segment, b *Block) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.blocks, b)
	seg.users--
	if seg.users > 0 {
		return nil
	}
	if t.m[seg.alloc.ID()] != seg {
		return seg.alloc.Close() // superseded: nobody finds it any more
	}
	t.idle = append(t.idle, seg)
	t.idleBytes += seg.alloc.Size()
	return t.trimLocked(idleMax, idleBytes)
}

func (t *segmentTable) unidleLocked(seg *segment) {
	for i, s := range t.idle {
		if s == seg {
			t.idle = append(t.idle[:i], t.idle[i+1:]...)
			t.idleBytes -= seg.alloc.Size()
			return
		}
	}
}

// trimLocked unmaps the oldest idle segments until at most n of them,
// and bytes in all, are left.
func (t *segmentTable) trimLocked(n int, bytes int64) error {
	var errs []error
	for len(t.idle) > 0 && (len(t.idle) > n || t.idleBytes > bytes) {
		seg := t.idle[0]
		t.idle = t.idle[1:]
		t.idleBytes -= seg.alloc.Size()
		delete(t.m, seg.alloc.ID())
		if n := seg.alloc.Name(); n != "" && t.byName[n] == seg {
			delete(t.byName, n)
		}
		if err := seg.alloc.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Trim gives back to the system what this process keeps only for reuse:
// the pools' unused segments and the mappings of received segments no
// storage uses.
func Trim() {
	DefaultPool().Trim(0)
	if p := NamedPool(); p != nil {
		p.Trim(0)
	}
	attached.mu.Lock()
	defer attached.mu.Unlock()
	_ = attached.trimLocked(0, 0)
}

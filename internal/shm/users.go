package shm

import (
	"maps"
	"sync"
	"sync/atomic"
)

// A process finds what it has already of a block a message names through
// its slots' users: the package above registers what it keeps on each
// Block it uses (a reference to package tensor's Storage that does not
// keep it alive) in its Users, and a receiver sent the same block again,
// or a producer sent its own block back, gets that user instead of making
// a second one. A registration costs a store in the segment's table; it
// ends when its Block is released.

// slotUser is a slot's registered user, with the Block that registered it
// and the block's generation.
type slotUser struct {
	b   *Block
	gen uint64
	u   any
}

// slotUsers is a segment's table of users, one entry per slot, in pages
// of slotPage entries made at their first registration: a slab of a
// quarter of a million slots costs what is registered of it.
type slotUsers struct {
	mu    sync.Mutex
	pages []*[slotPage]slotUser
}

// at returns the entry of slot, making its page (and the table) if
// create is set, else nil where there is none. The caller holds mu.
func (t *slotUsers) at(seg *segment, slot int, create bool) *slotUser {
	if t.pages == nil {
		if !create {
			return nil
		}
		t.pages = newPages[[slotPage]slotUser](seg.nslots)
	}
	p := t.pages[slot/slotPage]
	if p == nil {
		if !create {
			return nil
		}
		p = new([slotPage]slotUser)
		t.pages[slot/slotPage] = p
	}
	return &p[slot%slotPage]
}

// Users is the registry of the users of T that a package keeps on the
// blocks it uses, one per block in this process. Users of another T are
// not seen through it; a process has one registry, the package above's.
type Users[T any] struct{}

// Set registers u as the user of b's slot in this process, unless the
// user registered already, through b or another Block of the slot's
// generation, is one that alive accepts: then it returns that one and
// registers nothing. Otherwise it returns u. alive is called with no lock
// of this package's held but the table's, and must not call back into it.
// The registration ends when b is released.
func (Users[T]) Set(b *Block, u *T, alive func(*T) bool) *T {
	t := &b.seg.slotUsers
	t.mu.Lock()
	defer t.mu.Unlock()
	cur := t.at(b.seg, b.slot, true)
	if cur.b != nil && cur.gen == b.gen {
		if u, ok := cur.u.(*T); ok && alive(u) {
			return u
		}
	}
	*cur = slotUser{b: b, gen: b.gen, u: u}
	return u
}

// Find returns the user registered (see Set) for the block ref names,
// of a segment this process holds as its producer or as a receiver, or
// nil. Only the segment's identity or name, the offset and the
// generation of ref are asked.
func (Users[T]) Find(ref BlockRef) *T {
	u, _ := findUser(ref).(*T)
	return u
}

// forgetUser ends b's registration, if it has one, before its slot goes.
func (b *Block) forgetUser() {
	t := &b.seg.slotUsers
	t.mu.Lock()
	defer t.mu.Unlock()
	if cur := t.at(b.seg, b.slot, false); cur != nil && cur.b == b {
		*cur = slotUser{}
	}
}

// user returns the user registered for the block at data offset off with
// generation gen, or nil.
func (seg *segment) user(off int64, gen uint64) any {
	rel := off - seg.dataOff
	if rel < 0 || rel%seg.cap != 0 || rel/seg.cap >= int64(seg.nslots) {
		return nil
	}
	t := &seg.slotUsers
	t.mu.Lock()
	defer t.mu.Unlock()
	if cur := t.at(seg, int(rel/seg.cap), false); cur != nil && cur.b != nil && cur.gen == gen {
		return cur.u
	}
	return nil
}

// findUser returns the user registered for the block ref names, or nil.
func findUser(ref BlockRef) any {
	name, id := ref.Seg.Name, ref.Seg.ID
	attached.mu.Lock()
	if name != "" {
		id = attached.names[name]
	}
	seg := attached.m[id]
	attached.mu.Unlock()
	own := func() *segment {
		if name != "" {
			return produced.byName(name)
		}
		return produced.byID(id)
	}
	return userIn(seg, own, ref.Offset, ref.Gen)
}

// userIn returns the user registered in received, this process's mapping
// of a segment it received, if any, else in the segment own returns, its
// pool's.
func userIn(received *segment, own func() *segment, off int64, gen uint64) any {
	if received != nil {
		if u := received.user(off, gen); u != nil {
			return u
		}
	}
	if seg := own(); seg != nil {
		return seg.user(off, gen)
	}
	return nil
}

// A segmentIndex indexes segments by identity and, for named ones, by
// name. Lookups, several for each block a lane names, read a snapshot
// with no lock; add and remove, once a segment's life, copy it.
type segmentIndex struct {
	mu   sync.Mutex // serialises add and remove
	snap atomic.Pointer[segmentMaps]
}

// segmentMaps is a segmentIndex's contents at one version, never changed
// once stored.
type segmentMaps struct {
	ids     map[ID]*segment
	names   map[string]*segment
	version uint64 // bumped at each change
}

func newSegmentIndex() *segmentIndex {
	x := new(segmentIndex)
	x.snap.Store(&segmentMaps{ids: map[ID]*segment{}, names: map[string]*segment{}})
	return x
}

// change stores a copy of the index that edit changed.
func (x *segmentIndex) change(edit func(*segmentMaps)) {
	x.mu.Lock()
	defer x.mu.Unlock()
	old := x.snap.Load()
	next := &segmentMaps{ids: maps.Clone(old.ids), names: maps.Clone(old.names), version: old.version + 1}
	edit(next)
	x.snap.Store(next)
}

func (x *segmentIndex) add(seg *segment) {
	x.change(func(m *segmentMaps) {
		m.ids[seg.alloc.ID()] = seg
		if seg.named {
			m.names[seg.alloc.Name()] = seg
		}
	})
}

func (x *segmentIndex) remove(seg *segment) {
	x.change(func(m *segmentMaps) {
		if m.ids[seg.alloc.ID()] == seg {
			delete(m.ids, seg.alloc.ID())
		}
		if seg.named && m.names[seg.alloc.Name()] == seg {
			delete(m.names, seg.alloc.Name())
		}
	})
}

func (x *segmentIndex) byID(id ID) *segment { return x.snap.Load().ids[id] }

func (x *segmentIndex) byName(name string) *segment { return x.snap.Load().names[name] }

package reduction

import (
	"sync"

	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// sweepMin is the least number of entries at which the cache looks for
// dead ones to drop.
const sweepMin = 1 << 10

// cacheKey names a storage's memory: a whole file_descriptor segment by
// device and inode, a file_system segment by name, a GPU allocation by
// its handle and offset. (A pooled block's storage is found through its
// slot instead: see registerBlock.)
type cacheKey struct {
	id   shm.ID
	name string
	off  int64 // a GPU storage's offset in its allocation, else -1
}

func idKey(id shm.ID) cacheKey     { return cacheKey{id: id, off: -1} }
func nameKey(name string) cacheKey { return cacheKey{name: name, off: -1} }

// storageCache maps segments to the Storage this process has for them, so
// that one segment received twice is mapped once. It holds its storages
// by their references (tensor.StorageRef), which do not keep them: a
// Storage nobody uses is collected (and unmapped) as if the cache did not
// exist. It never drops a live Storage, however many there are:
// a released storage's entry goes at its Release; one collected
// unreleased goes when looked up, or in a sweep each time the cache has
// doubled since the last one, which costs a constant time per entry.
type storageCache struct {
	mu      sync.Mutex
	m       map[cacheKey]*tensor.StorageRef
	sweepAt int // the size at which the next put sweeps
}

// storages is the process's cache, guarded by its mutex.
var storages = &storageCache{m: make(map[cacheKey]*tensor.StorageRef), sweepAt: sweepMin}

// get returns the live Storage cached under k if it has size bytes.
func (c *storageCache) get(k cacheKey, size int64) *tensor.Storage {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.m[k]
	if !ok {
		return nil
	}
	s := r.Value()
	if s == nil || s.Released() {
		delete(c.m, k)
		return nil
	}
	if s.Size() != size {
		return nil
	}
	return s
}

// put caches s under k unless a live Storage is cached there already, and
// returns the one that is cached afterwards.
func (c *storageCache) put(k cacheKey, s *tensor.Storage) *tensor.Storage {
	r := s.Ref() // not under c.mu: s.mu is taken before it, by Release
	c.mu.Lock()
	if cur, ok := c.m[k]; ok {
		if old := cur.Value(); old != nil && !old.Released() {
			c.mu.Unlock()
			return old // s itself, when a sender registers again
		}
	}
	if len(c.m) >= c.sweepAt {
		c.sweepLocked()
	}
	c.m[k] = r
	c.mu.Unlock()
	// Not under c.mu: a storage released meanwhile runs forget at once.
	s.OnRelease(func() { c.forget(k, r) })
	return s
}

// forget drops the entry of a storage that was released, unless another
// storage took its key since.
func (c *storageCache) forget(k cacheKey, r *tensor.StorageRef) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m[k] == r {
		delete(c.m, k)
	}
}

// sweepLocked drops the entries of storages that were released or
// collected, and sets the size of the next sweep.
func (c *storageCache) sweepLocked() {
	for k, r := range c.m {
		if s := r.Value(); s == nil || s.Released() {
			delete(c.m, k)
		}
	}
	c.sweepAt = max(sweepMin, 2*len(c.m))
}

// len returns the number of entries, dead ones included.
func (c *storageCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}

// Pooled blocks are not in the cache: each Storage on a block is
// registered as the user of the block's slot (see shm.Users) by its
// reference, where finding it again costs no hashing.
var blockUsers shm.Users[tensor.StorageRef]

// registerBlock registers s as the storage of its block in this process,
// unless a live storage is registered already: then it returns that one.
func registerBlock(s *tensor.Storage, b *shm.Block) *tensor.Storage {
	r := s.Ref()
	alive := func(u *tensor.StorageRef) bool { return liveUser(u, s.Size()) != nil }
	for {
		u := blockUsers.Set(b, r, alive)
		if u == r {
			return s
		}
		if won := liveUser(u, s.Size()); won != nil {
			return won
		}
		// The registered storage was released since: take its place.
	}
}

// userOf returns the registered user of the block m names in seg, or
// nil.
func userOf(seg shm.SegmentRef, m *Meta) *tensor.StorageRef {
	return blockUsers.Find(shm.BlockRef{Seg: seg, Offset: m.BlockOffset, Gen: m.Gen})
}

// liveUser returns the storage u, a block's registered user, stands for,
// if it is live and of size bytes; else nil. A registered storage stays
// on its block until it is released.
func liveUser(r *tensor.StorageRef, size int64) *tensor.Storage {
	if r == nil {
		return nil
	}
	if s := r.Value(); s != nil && !s.Released() && s.Size() == size {
		return s
	}
	return nil
}

// remember caches s, a storage just described for a message as h, so
// that receiving it back here gives s again: as the registered user of
// its block, else by the segment's name or identity.
func remember(s *tensor.Storage, h shm.Handle) {
	switch {
	case h.Block != nil:
		registerBlock(s, h.Block)
	case h.Name != "":
		storages.put(nameKey(h.Name), s)
	default:
		storages.put(idKey(h.ID), s)
	}
}

package mmapalloc

import (
	"path/filepath"
	"time"
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

// WatchSegmentsOf is what package mp has run for each worker it reaps.
var WatchSegmentsOf = watchSegmentsOf

// AdoptMax is how many adopted descriptors a receiver that uses no block
// of their segment keeps.
const AdoptMax = adoptMax

// CloseAll is closeAll.
var CloseAll = closeAll

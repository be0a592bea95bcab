package shm

import (
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/tensormp/tensormp/internal/leftover"
)

// A named segment whose producer is gone loses its name with the last
// process to let go of it (segment.abandoned). The last holder is not
// always a process that will look again, though: a message in flight that
// is dropped unread holds its blocks until its socket closes, and the
// description of a producer that was killed can outlive the producer's
// reaping by a few milliseconds. A process that lets go of a received
// named segment while someone else still holds something of it therefore
// looks again, by name, for a while (orphans.watch), and removes the name
// once nobody holds anything. The process that reaps a producer watches
// the producer's segments the same way (watchSegmentsOf): a producer killed
// with messages nobody will read leaves segments no process maps. What is
// still held when its watch ends goes with the last process to let go of
// it, or when the session's keeper removes the session's entries.
//
// Each look opens the name afresh and asks the kernel for a write lock on
// every lock byte (one open, fstat, fcntl and close); a segment whose
// producer lives (the common case) is never found free, and costs that
// much a few times over orphanSpan.

const (
	orphanFirst = 20 * time.Millisecond // the first look; each wait after is twice the last
	orphanSpan  = time.Minute           // how long a name is watched
	orphanMax   = 4096                  // names watched at once, at most
)

type orphanWatch struct {
	mu    sync.Mutex
	due   map[string]*orphan // by path
	timer *time.Timer        // fires at the earliest next look; nil when none is due
}

type orphan struct {
	id    ID // the file the path named when the watch began
	next  time.Time
	wait  time.Duration
	until time.Time
}

func init() { leftover.Register(watchSegmentsOf) }

// watchSegmentsOf watches this session's named segments that process pid
// made; package mp has it run (through package leftover) for each worker
// it reaps. Each loses its name once nobody holds anything of it, within
// the watch's minute. A producer killed with messages that nobody will
// read leaves segments that no process maps; this is what removes them
// before the session ends.
func watchSegmentsOf(pid int) {
	entries, err := os.ReadDir(Dir())
	if err != nil {
		return
	}
	for _, e := range entries {
		n, ok := ParseName(e.Name())
		if !ok || n.Lock || n.Pid != pid || n.Session != session() || !e.Type().IsRegular() {
			continue
		}
		path := filepath.Join(Dir(), e.Name())
		if id, ok := statName(path); ok {
			orphans.watch(path, id)
		}
	}
}

// watch starts watching the segment at path, whose identity is id. A path
// watched already keeps its schedule.
func (w *orphanWatch) watch(path string, id ID) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.due[path]; ok || len(w.due) >= orphanMax {
		return
	}
	now := time.Now()
	w.due[path] = &orphan{id: id, next: now.Add(orphanFirst), wait: orphanFirst, until: now.Add(orphanSpan)}
	w.armLocked(now)
}

// armLocked sets the timer for the earliest look due.
func (w *orphanWatch) armLocked(now time.Time) {
	if w.timer != nil {
		w.timer.Stop()
		w.timer = nil
	}
	var first time.Time
	for _, o := range w.due {
		if first.IsZero() || o.next.Before(first) {
			first = o.next
		}
	}
	if !first.IsZero() {
		w.timer = time.AfterFunc(max(first.Sub(now), 0), w.run)
	}
}

// run looks at the segments due, removes the names nobody holds, and
// keeps watching the others until their watch ends.
func (w *orphanWatch) run() {
	now := time.Now()
	w.mu.Lock()
	due := map[string]ID{}
	for path, o := range w.due {
		if !o.next.After(now) {
			due[path] = o.id
		}
	}
	w.mu.Unlock()

	settled := map[string]bool{}
	for path, id := range due {
		settled[path] = removeIfAbandoned(path, id)
	}

	w.mu.Lock()
	defer w.mu.Unlock()
	now = time.Now()
	for path, done := range settled {
		o := w.due[path]
		if o == nil {
			continue
		}
		o.wait *= 2
		o.next = now.Add(o.wait)
		if done || o.next.After(o.until) {
			delete(w.due, path)
		}
	}
	w.armLocked(now)
}

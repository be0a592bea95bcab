// Package leftover removes what a dead process left behind under its
// own process id, where only that process could have removed it: the
// CUDA driver's /dev/shm files of a process that was killed or exited
// without giving its context back, say, or the named segments of one
// whose messages nobody read (mmapalloc watches those until nobody
// holds them).
//
// A package that leaves such files registers a remover. Package mp calls
// Remove for every process whose death it learns of: the parent for each
// worker it reaps, the session's keeper for each member of the session,
// an endpoint for the peer it knows by SO_PEERCRED.
//
// A process id names another process once its process is reaped, and
// only the parent of a worker can hold it unreaped. So a remover must
// itself make sure that it removes no live process's files: list the
// files named after pid first, then check that no live process has pid
// (Dead), and remove only what it listed. A file listed before the check
// was made by a process that had pid then; if no live process has pid at
// the check, that process is dead, whichever it was.
package leftover

import "sync"

var (
	mu       sync.Mutex
	removers []func(pid int)
)

// Register adds f to the removers Remove runs. f must touch only what
// pid's process made, only once it is dead (see the package comment),
// and must not block.
func Register(f func(pid int)) {
	mu.Lock()
	defer mu.Unlock()
	removers = append(removers, f)
}

// Any reports whether a remover is registered.
func Any() bool {
	mu.Lock()
	defer mu.Unlock()
	return len(removers) > 0
}

// Remove runs every registered remover for pid, a process the caller
// learnt is dead.
func Remove(pid int) {
	mu.Lock()
	fs := removers
	mu.Unlock()
	for _, f := range fs {
		f(pid)
	}
}

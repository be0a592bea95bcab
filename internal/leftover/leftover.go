// Package leftover removes what a dead process left behind under its
// own process id, where only that process could have removed it: the
// CUDA driver's /dev/shm files of a worker that was killed, say, or the
// named segments of one whose messages nobody read (mmapalloc watches
// those until nobody holds them).
//
// A package that leaves such files registers a remover; package mp calls
// Remove for each worker it started once the worker is dead and before
// it reaps it, so that the process id cannot yet name another process.
package leftover

import "sync"

var (
	mu       sync.Mutex
	removers []func(pid int)
)

// Register adds f to the removers Remove runs. f must touch only what
// pid's process made, and must not block.
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

// Remove runs every registered remover for pid. The caller must hold pid
// unreaped: a dead child not yet waited for.
func Remove(pid int) {
	mu.Lock()
	fs := removers
	mu.Unlock()
	for _, f := range fs {
		f(pid)
	}
}

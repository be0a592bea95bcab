package fd

import "sync"

// Descriptors a package keeps for the life of the process, made on first
// use and never closed: package mp's poller and its kernel wait slots,
// say. They are recorded so that leak checks can tell them from leaks by
// their number, where a check by kind would excuse any descriptor of
// that kind.
var lifelong struct {
	mu  sync.Mutex
	fds map[int]bool
}

// KeepForLife records raw as a descriptor its package keeps until the
// process exits.
func KeepForLife(raw int) {
	lifelong.mu.Lock()
	defer lifelong.mu.Unlock()
	if lifelong.fds == nil {
		lifelong.fds = make(map[int]bool)
	}
	lifelong.fds[raw] = true
}

// Lifelong reports whether raw was recorded with KeepForLife.
func Lifelong(raw int) bool {
	lifelong.mu.Lock()
	defer lifelong.mu.Unlock()
	return lifelong.fds[raw]
}

//go:build !linux

package cuda

// gettid has no portable equivalent; without it no call is taken for the
// executor's own, which only costs re-entrant calls their inline path.
func gettid() int { return -1 }

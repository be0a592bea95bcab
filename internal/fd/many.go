package fd

import (
	"errors"
	"slices"

	"golang.org/x/sys/unix"
)

// CloseAll closes raws, descriptors the caller owns (a received message's,
// say), skipping negative ones; raws is the caller's no longer, which
// CloseAll reorders. Each run of neighbouring numbers, as a stream of
// messages leaves them, goes in one close_range call where the system has
// it.
func CloseAll(raws []int) {
	raws = slices.DeleteFunc(raws, func(raw int) bool { return raw < 0 })
	slices.Sort(raws)
	for i := 0; i < len(raws); {
		j := i + 1
		for j < len(raws) && raws[j] == raws[j-1]+1 {
			j++
		}
		if j-i == 1 || closeRange(raws[i], raws[j-1]) != nil {
			for _, raw := range raws[i:j] {
				_ = unix.Close(raw)
			}
		}
		i = j
	}
}

// OutOfDescriptors reports whether err says that the process (EMFILE) or
// the system (ENFILE) is out of file descriptors.
func OutOfDescriptors(err error) bool {
	return errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE)
}

// LimitHint tells a user out of file descriptors what to do.
const LimitHint = "raise the limit with `ulimit -n` or RLIMIT_NOFILE"

package fd

import "golang.org/x/sys/unix"

// closeRange closes every descriptor from first to last.
func closeRange(first, last int) error { return unix.CloseRange(uint(first), uint(last), 0) }

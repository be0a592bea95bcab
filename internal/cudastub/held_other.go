//go:build !linux

package cudastub

// Held returns -1: the stand-in runs only on Linux.
func Held(pids ...int) int64 { return -1 }

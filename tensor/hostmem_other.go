//go:build !linux

package tensor

// hostMemory returns a bound on an allocation of host memory: where the
// machine's memory is not asked, the largest the Go runtime makes.
func hostMemory() int64 { return 1 << 47 }

package testmain

import (
	"syscall"
	"time"
)

// ProcessCPU returns the CPU time the process has used, in user and
// kernel mode, all its threads together: the collector's workers' as
// well as a benchmark's own, or 0 if the kernel does not say. Benchmarks
// report its change per operation as cpu-ns/op, beside the wall time of
// ns/op.
func ProcessCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

package tensor

import (
	"sync"

	"golang.org/x/sys/unix"
)

// hostMemory returns how many bytes of memory and swap the machine has: no
// allocation of host memory larger than that can succeed, and the Go
// runtime ends the process, unrecoverably, when one fails. It is asked of
// the kernel once: every allocation of a CPU tensor checks it.
var hostMemory = sync.OnceValue(func() int64 {
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) != nil {
		return 1 << 62
	}
	unit := int64(si.Unit)
	if unit == 0 {
		unit = 1
	}
	return (int64(si.Totalram) + int64(si.Totalswap)) * unit
})

//go:build linux && !amd64

package sock

// cpuNow returns 0 here: no instruction reads the CPU without a system
// call (see cpu_linux_amd64.go), so a thread's CPU is known only where it
// is pinned (pinnedCPU).
func cpuNow() uint32 { return 0 }

// How cpuNow reads the CPU: never, here.
const (
	readNone = iota
	readRDPID
	readRDTSCP
)

// cpuWay returns cpuNow's way: none.
func cpuWay() int { return readNone }

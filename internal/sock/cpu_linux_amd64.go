package sock

import (
	"runtime"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/cpuid"
)

// cpuNow returns one more than the CPU the calling thread runs on now, as
// the processor says: RDPID, or RDTSCP where it has no RDPID, reads the
// CPU's TSC_AUX register, in whose low 12 bits Linux keeps the CPU's
// number. It costs no system call. It returns 0 where the processor has
// neither instruction, or where what they read did not match the kernel's
// answer at its first call (cpuWay). The answer holds until the kernel
// moves the thread.
func cpuNow() uint32 {
	switch cpuWay() {
	case readRDPID:
		return rdpid()&0xfff + 1
	case readRDTSCP:
		return rdtscpAux()&0xfff + 1
	}
	return 0
}

// How cpuNow reads the CPU.
const (
	readNone = iota
	readRDPID
	readRDTSCP
)

// cpuReader is cpuNow's way, chosen at its first call: not as the package
// loads, so that a program that uses no lane makes no getcpu call, which
// a strict seccomp filter may forbid.
var cpuReader struct {
	once sync.Once
	way  int
}

// cpuWay returns cpuNow's way, choosing it at the first call.
func cpuWay() int {
	cpuReader.once.Do(func() { cpuReader.way = pickCPUReader() })
	return cpuReader.way
}

// pickCPUReader returns the instruction cpuNow uses: RDPID if the
// processor has it (CPUID leaf 7, ECX bit 22), else RDTSCP (leaf
// 0x80000001, EDX bit 27), else none; and none if the one it would use
// does not say what the getcpu system call says, on the same thread, in
// any of a few tries (the thread may move between the two).
func pickCPUReader() int {
	var read func() uint32
	way := readNone
	switch {
	case hasRDPID():
		read, way = rdpid, readRDPID
	case hasRDTSCP():
		read, way = rdtscpAux, readRDTSCP
	default:
		return readNone
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for range 8 {
		var cpu uint32
		if _, _, errno := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), 0, 0); errno != 0 {
			return readNone
		}
		if read()&0xfff == cpu {
			return way
		}
	}
	return readNone
}

// hasRDPID and hasRDTSCP report whether the processor has the
// instruction, as CPUID says (leaf 7 ECX bit 22; leaf 0x80000001 EDX bit
// 27).
func hasRDPID() bool { return cpuid.Has(7, 0, cpuid.ECX, 22) }

func hasRDTSCP() bool { return cpuid.Has(0x80000001, 0, cpuid.EDX, 27) }

// Implemented in cpu_linux_amd64.s.
func rdpid() uint32
func rdtscpAux() uint32

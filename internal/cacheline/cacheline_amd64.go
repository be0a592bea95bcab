package cacheline

import "unsafe"

// Implemented in cacheline_amd64.s: PREFETCHW and PREFETCHT0, which ask
// for the line at p, for writing or for reading, and PREFETCHW (else
// PREFETCHT0) on n lines from the one p is in. PREFETCHW only where the
// processor has it (prefetchW).
//
//go:noescape
func prefetchw(p unsafe.Pointer)

//go:noescape
func prefetcht0(p unsafe.Pointer)

//go:noescape
func prefetchwLines(p unsafe.Pointer, n uintptr)

//go:noescape
func prefetcht0Lines(p unsafe.Pointer, n uintptr)

// cpuid is the CPUID instruction, in cacheline_amd64.s.
func cpuid(leaf, sub uint32) (a, b, c, d uint32)

// hasPREFETCHW reports whether the processor has PREFETCHW, as CPUID
// says (leaf 0x80000001, ECX bit 8: the flag /proc/cpuinfo calls
// 3dnowprefetch).
func hasPREFETCHW() bool {
	leaves, _, _, _ := cpuid(0x80000000, 0)
	if leaves < 0x80000001 {
		return false
	}
	_, _, c, _ := cpuid(0x80000001, 0)
	return c&(1<<8) != 0
}

// prefetchW is hasPREFETCHW's answer, asked once: CPUID costs more than
// a prefetch saves.
var prefetchW = hasPREFETCHW()

func forWrite(p unsafe.Pointer) {
	if prefetchW {
		prefetchw(p)
	} else {
		prefetcht0(p)
	}
}

func forRead(p unsafe.Pointer) { prefetcht0(p) }

func writeAhead(p unsafe.Pointer, lines uintptr) {
	if prefetchW {
		prefetchwLines(p, lines)
	} else {
		prefetcht0Lines(p, lines)
	}
}

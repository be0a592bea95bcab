package cacheline

import (
	"unsafe"

	"github.com/tensormp/tensormp/internal/cpuid"
)

// Implemented in cacheline_amd64.s: PREFETCHW and PREFETCHT0, which ask
// for the line at p, for writing or for reading, and PREFETCHW on n lines
// from the one p is in. PREFETCHW only where the processor has it
// (prefetchW).
//
//go:noescape
func prefetchw(p unsafe.Pointer)

//go:noescape
func prefetcht0(p unsafe.Pointer)

//go:noescape
func prefetchwLines(p unsafe.Pointer, n uintptr)

// hasPREFETCHW reports whether the processor has PREFETCHW, as CPUID
// says (leaf 0x80000001, ECX bit 8: the flag /proc/cpuinfo calls
// 3dnowprefetch).
func hasPREFETCHW() bool { return cpuid.Has(0x80000001, 0, cpuid.ECX, 8) }

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

// writeAhead asks for nothing where the processor has no PREFETCHW: a
// line read in ahead would still wait to be made this CPU's own at the
// first store.
func writeAhead(p unsafe.Pointer, lines uintptr) {
	if prefetchW {
		prefetchwLines(p, lines)
	}
}

package cacheline

import (
	"slices"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"

	"github.com/tensormp/tensormp/internal/cpuid/cpuidtest"
)

// ForWrite asks for a line to write with PREFETCHW where CPUID says the
// processor has it, as /proc/cpuinfo does (3dnowprefetch), else reads
// it in; neither faults on memory the caller maps. Linux also says so
// of an AMD processor with long mode whose CPUID does not (a
// hypervisor's that hides the bit): PREFETCHW is asked of CPUID alone.
func TestPrefetchWMatchesTheKernel(t *testing.T) {
	fields := cpuidtest.KernelFlags(t)
	has := slices.Contains(fields, "3dnowprefetch")
	if has && !hasPREFETCHW() && slices.Contains(fields, "AuthenticAMD") {
		t.Logf("the kernel says an AMD processor has PREFETCHW, which its CPUID does not")
		has = false
	}
	assert.Equal(t, has, hasPREFETCHW(), "CPUID's answer for PREFETCHW")
	assert.Equal(t, has, prefetchW)
	line := make([]byte, 2*Size)
	ForWrite(unsafe.Pointer(&line[Size]))
	ForRead(unsafe.Pointer(&line[0]))
	prefetcht0(unsafe.Pointer(&line[0]))
	if has {
		prefetchw(unsafe.Pointer(&line[0]))
		prefetchwLines(unsafe.Pointer(&line[0]), 2)
	}
}

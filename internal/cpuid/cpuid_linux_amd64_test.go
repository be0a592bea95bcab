package cpuid

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/tensormp/tensormp/internal/cpuid/cpuidtest"
)

// Has answers as the kernel's reading of CPUID does, in /proc/cpuinfo's
// flags, for bits of basic and extended leaves in three of the
// registers. Leaves past the top are TestHasAsksNoLeafPastTheTop's.
func TestHasMatchesTheKernel(t *testing.T) {
	flags := cpuidtest.KernelFlags(t)
	for _, c := range []struct {
		flag      string
		leaf, sub uint32
		reg       Reg
		bit       int
	}{
		{"fpu", 1, 0, EDX, 0},
		{"sse2", 1, 0, EDX, 26},
		{"pni", 1, 0, ECX, 0}, // SSE3
		{"bmi1", 7, 0, EBX, 3},
		{"rdpid", 7, 0, ECX, 22},
		{"lm", 0x80000001, 0, EDX, 29},
		{"rdtscp", 0x80000001, 0, EDX, 27},
		{"lahf_lm", 0x80000001, 0, ECX, 0},
	} {
		assert.Equal(t, slices.Contains(flags, c.flag), Has(c.leaf, c.sub, c.reg, c.bit), c.flag)
	}
}

// Package cpuidtest gives tests the kernel's own reading of the
// processor, to check this module's readings of CPUID against.
package cpuidtest

import (
	"os"
	"strings"
	"testing"
)

// KernelFlags returns the words of /proc/cpuinfo, among them each CPU's
// vendor and the flags the kernel read from CPUID, failing t if it cannot
// read them.
func KernelFlags(t testing.TB) []string {
	t.Helper()
	info, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		t.Fatalf("reading the kernel's flags: %v", err)
	}
	return strings.Fields(string(info))
}

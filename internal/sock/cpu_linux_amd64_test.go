package sock

import (
	"runtime"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/cpuid/cpuidtest"
)

// cpuNow reads the CPU the thread runs on as the kernel places it, on
// each CPU the process may run on, with the instruction /proc/cpuinfo
// says the processor has (rdpid first, then rdtscp).
func TestCPUNowMatchesTheKernel(t *testing.T) {
	flags := cpuidtest.KernelFlags(t)
	want := readNone
	switch {
	case slices.Contains(flags, "rdpid"):
		want = readRDPID
	case slices.Contains(flags, "rdtscp"):
		want = readRDTSCP
	}
	require.Equal(t, want, cpuWay(), "the instruction cpuNow reads the CPU with")
	assert.Equal(t, slices.Contains(flags, "rdpid"), hasRDPID(), "CPUID's answer for RDPID")
	assert.Equal(t, slices.Contains(flags, "rdtscp"), hasRDTSCP(), "CPUID's answer for RDTSCP")
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var was unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &was))
	defer unix.SchedSetaffinity(0, &was)
	for c := 0; c < 1024; c++ {
		if !was.IsSet(c) {
			continue
		}
		var one unix.CPUSet
		one.Set(c)
		require.NoError(t, unix.SchedSetaffinity(0, &one))
		if want == readNone {
			assert.Zero(t, cpuNow())
		} else {
			assert.Equal(t, uint32(c)+1, cpuNow(), "on CPU %d", c)
		}
		// Each instruction the processor has, whichever cpuNow uses.
		if slices.Contains(flags, "rdpid") {
			assert.Equal(t, uint32(c), rdpid()&0xfff, "RDPID on CPU %d", c)
		}
		if slices.Contains(flags, "rdtscp") {
			assert.Equal(t, uint32(c), rdtscpAux()&0xfff, "RDTSCP on CPU %d", c)
		}
	}
}

package main

import (
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// threadCPUs returns the Cpus_allowed_list of each thread of process pid
// ("self" for this one), by thread id, leaving out those that exit while
// it reads.
func threadCPUs(pid string) map[string]string {
	paths, _ := filepath.Glob("/proc/" + pid + "/task/*/status")
	lists := map[string]string{}
	for _, p := range paths {
		status, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(status), "\n") {
			if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
				lists[filepath.Base(filepath.Dir(p))] = strings.TrimSpace(v)
			}
		}
	}
	return lists
}

// allCPUs returns the list every thread of lists has, or "" if they differ
// or there are none.
func allCPUs(lists map[string]string) string {
	all := ""
	for _, l := range lists {
		if all != "" && l != all {
			return ""
		}
		all = l
	}
	return all
}

// TestPinProcess: every thread runs on the CPU pinned to, those started
// after the pinning too, and restore gives them all back what they had.
func TestPinProcess(t *testing.T) {
	allowed, err := allowedCPUs()
	require.NoError(t, err)
	require.NotEmpty(t, allowed)
	before := threadCPUs("self")
	all := allCPUs(before)
	require.NotEmpty(t, all, "one list for every thread: %v", before)
	procs := runtime.GOMAXPROCS(0)
	cpu := allowed[len(allowed)-1]

	restore, err := pinProcess([]int{cpu})
	require.NoError(t, err)
	// Threads started now: more goroutines locked to their threads
	// than there were threads.
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range len(before) + 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			<-stop
		}()
	}
	time.Sleep(50 * time.Millisecond)
	pinned := threadCPUs("self")
	close(stop)
	wg.Wait()
	assert.Equal(t, 1, runtime.GOMAXPROCS(0), "GOMAXPROCS while pinned to one CPU")
	require.NoError(t, restore())

	started := 0
	for tid := range pinned {
		if _, ok := before[tid]; !ok {
			started++
		}
	}
	require.Positive(t, started, "threads started while pinned")
	for tid, list := range pinned {
		assert.Equal(t, strconv.Itoa(cpu), list, "thread %s while pinned", tid)
	}
	for tid, list := range threadCPUs("self") {
		assert.Equal(t, all, list, "thread %s after restore", tid)
	}
	got, err := allowedCPUs()
	require.NoError(t, err)
	assert.Equal(t, allowed, got)
	assert.Equal(t, procs, runtime.GOMAXPROCS(0), "GOMAXPROCS after restore")
}

// A GOMAXPROCS a program set itself, not the runtime's default, comes back
// as it was set.
func TestPinProcessKeepsASetGOMAXPROCS(t *testing.T) {
	allowed, err := allowedCPUs()
	require.NoError(t, err)
	was := runtime.GOMAXPROCS(len(allowed) + 3)
	defer runtime.GOMAXPROCS(was)
	restore, err := pinProcess(allowed[:1])
	require.NoError(t, err)
	require.NoError(t, restore())
	assert.Equal(t, len(allowed)+3, runtime.GOMAXPROCS(0))
}

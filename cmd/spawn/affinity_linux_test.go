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

// threadCPUs returns each thread's Cpus_allowed_list, by thread id.
func threadCPUs(t *testing.T) map[string]string {
	t.Helper()
	paths, err := filepath.Glob("/proc/self/task/*/status")
	require.NoError(t, err)
	lists := map[string]string{}
	for _, p := range paths {
		status, err := os.ReadFile(p)
		if os.IsNotExist(err) {
			continue // the thread exited
		}
		require.NoError(t, err)
		for _, line := range strings.Split(string(status), "\n") {
			if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
				lists[filepath.Base(filepath.Dir(p))] = strings.TrimSpace(v)
			}
		}
	}
	require.NotEmpty(t, lists)
	return lists
}

// TestPinProcess: every thread runs on the CPU pinned to, those started
// after the pinning too, and restore gives them all back what they had.
func TestPinProcess(t *testing.T) {
	allowed, err := allowedCPUs()
	require.NoError(t, err)
	require.NotEmpty(t, allowed)
	before := threadCPUs(t)
	all := before[strconv.Itoa(os.Getpid())]
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
	pinned := threadCPUs(t)
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
	for tid, list := range threadCPUs(t) {
		assert.Equal(t, all, list, "thread %s after restore", tid)
	}
	got, err := allowedCPUs()
	require.NoError(t, err)
	assert.Equal(t, allowed, got)
	assert.Equal(t, procs, runtime.GOMAXPROCS(0), "GOMAXPROCS after restore")
}

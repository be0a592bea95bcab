package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
)

// TestBenchCPUs: spawn bench measures the futex floor whatever -cpus, and
// the spin floor where the two processes may run on different CPUs,
// pinned as -cpus says while it runs and the parent as before once it is
// over; -cpus asks for no more CPUs than there are.
func TestBenchCPUs(t *testing.T) {
	allowed, err := allowedCPUs()
	require.NoError(t, err)
	for _, c := range []struct {
		cpus           int
		parent, worker string // the CPUs each runs on while pinned
		spin           bool
	}{
		{cpus: 0, spin: len(allowed) > 1},
		{cpus: 1, parent: strconv.Itoa(allowed[0]), worker: strconv.Itoa(allowed[0])},
		{cpus: 2, parent: strconv.Itoa(allowed[0]), worker: strconv.Itoa(allowed[min(1, len(allowed)-1)]), spin: true},
	} {
		t.Run(fmt.Sprintf("cpus=%d", c.cpus), func(t *testing.T) {
			leakcheck.Check(t)
			args := []string{"-json", "-strategy", "file_descriptor", "-max", "4096", "-trips", "50", "-stream", "160", "-hold", "10"}
			if c.cpus > 0 {
				args = append(args, "-cpus", strconv.Itoa(c.cpus))
			}
			if c.cpus > len(allowed) {
				code, _, errOut := runBench(t, args...)
				assert.Equal(t, 2, code)
				assert.Contains(t, errOut, fmt.Sprintf("-cpus %d: this process may run on %d CPU", c.cpus, len(allowed)))
				return
			}
			before := allCPUs(threadCPUs("self"))
			require.NotEmpty(t, before, "one list for every thread of this process")
			var pinned atomic.Bool // the parent's threads and the worker's seen pinned
			stopWatch := make(chan struct{})
			watched := make(chan struct{})
			go func() {
				defer close(watched)
				for c.cpus > 0 && !pinned.Load() {
					select {
					case <-stopWatch:
						return
					case <-time.After(time.Millisecond):
					}
					worker := childRunning("mp.worker.bench")
					pinned.Store(worker > 0 && allCPUs(threadCPUs(strconv.Itoa(worker))) == c.worker &&
						allCPUs(threadCPUs("self")) == c.parent)
				}
			}()
			code, out, errOut := runBench(t, args...)
			close(stopWatch)
			<-watched
			require.Equal(t, 0, code, errOut)
			rows := map[string]int{}
			for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
				var r benchResult
				require.NoError(t, json.Unmarshal([]byte(line), &r), line)
				rows[r.Case]++
				assert.Equal(t, c.cpus, r.CPUs, line)
				if strings.HasSuffix(r.Case, "roundtrip") {
					assert.Positive(t, r.P50us, line)
					// Not woken, a waiter sees the word at its FUTEX_WAIT
					// timeout.
					assert.Less(t, r.P50us, float64(futexTimeout/2/time.Microsecond), line)
				}
			}
			assert.Equal(t, 1, rows["floor_futex_roundtrip"])
			if c.spin {
				assert.Equal(t, 1, rows["floor_spin_roundtrip"])
			} else {
				assert.Zero(t, rows["floor_spin_roundtrip"])
			}
			if c.cpus > 0 {
				assert.True(t, pinned.Load(), "the parent seen on CPU %s and the worker on CPU %s", c.parent, c.worker)
			}
			assert.Equal(t, before, allCPUs(threadCPUs("self")), "this process's threads after the bench")
		})
	}
	var out, errOut bytes.Buffer
	assert.Equal(t, 2, run([]string{"bench", "-cpus", "3"}, &out, &errOut))
	assert.Contains(t, errOut.String(), "-cpus 3: want 0 (no pinning), 1 (one CPU for both processes) or 2 (one each)")
	for _, other := range []string{"-loader", "-python", "-device=gpu:0"} {
		errOut.Reset()
		assert.Equal(t, 2, run([]string{"bench", "-cpus", "1", other}, &out, &errOut), other)
		assert.Contains(t, errOut.String(), "-cpus pins the CPU cases' two processes", other)
	}
	assert.Empty(t, out.String())
}

package leakcheck

import (
	"bytes"
	"runtime"
	"slices"
	"strconv"
	"strings"
)

// lifelong names the functions of goroutines that live as long as the
// process by design, once something has started them: a goroutine with
// one of these in its stack is not a leak. Each is a package-qualified
// function name, as a stack names it.
var lifelong = []string{
	"os/signal.signal_recv",                               // signal.Notify's loop
	"github.com/tensormp/tensormp/internal/sock.pollLoop", // the process's epoll waiter
	"github.com/tensormp/tensormp/mp.spawner",             // the thread workers are started from
}

// goroutines returns the stacks of the process's goroutines by their
// ids, leaving out the caller's own.
func goroutines() map[uint64]string {
	buf := make([]byte, 1<<16)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	out := map[uint64]string{}
	for i, block := range bytes.Split(buf, []byte("\n\n")) {
		if i == 0 {
			continue // the caller's: runtime.Stack lists it first
		}
		header, _, _ := bytes.Cut(block, []byte("\n"))
		f := strings.Fields(string(header)) // goroutine 18 [chan receive]:
		if len(f) < 2 || f[0] != "goroutine" {
			continue
		}
		id, err := strconv.ParseUint(f[1], 10, 64)
		if err != nil {
			continue
		}
		out[id] = string(block)
	}
	return out
}

// newGoroutines returns the stacks in after of goroutines not in before
// and not lifelong.
func newGoroutines(before, after map[uint64]string) []string {
	var out []string
	for id, stack := range after {
		if _, ok := before[id]; ok {
			continue
		}
		if slices.ContainsFunc(lifelong, func(fn string) bool {
			return strings.Contains(stack, "\n"+fn+"(")
		}) {
			continue
		}
		out = append(out, stack)
	}
	slices.Sort(out)
	return out
}

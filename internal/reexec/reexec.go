// Package reexec runs named functions of the current binary in child
// processes. Go cannot fork, so a child is the same executable started
// again with an environment variable naming the function to run; Main,
// called first in main or TestMain, runs it and exits.
//
// It is the low-level half of mp.Init and of the cross-process tests; the
// caller of Command owns the returned *exec.Cmd and must Wait for it.
package reexec

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
)

// EnvVar names the function a re-executed child runs.
const EnvVar = "TENSORMP_REEXEC"

var (
	mu    sync.RWMutex
	funcs = map[string]func() int{}
	// tests holds the names registered from test files, and whether a
	// Command of this process has started each.
	tests = map[string]bool{}
)

// Register makes fn runnable in a child under name. fn returns the
// child's exit code. Registering a name twice panics: it is a programming
// error found at start-up.
func Register(name string, fn func() int) {
	mu.Lock()
	defer mu.Unlock()
	if _, dup := funcs[name]; dup {
		panic(fmt.Sprintf("reexec: %q registered twice", name))
	}
	funcs[name] = fn
	if calledFromTest() {
		tests[name] = false
	}
}

// calledFromTest reports whether a test file (_test.go) is among the
// callers.
func calledFromTest() bool {
	pcs := make([]uintptr, 32)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs)])
	for {
		f, more := frames.Next()
		if strings.HasSuffix(f.File, "_test.go") {
			return true
		}
		if !more {
			return false
		}
	}
}

// Unused returns, sorted, the names that test files registered and that
// no Command of this process, or of the processes it started when it
// tracks starts (TrackStarts), started: helpers that no test uses, once
// every test has run.
func Unused() []string {
	var tree []string
	if path := os.Getenv(envStarts); path != "" {
		if data, err := os.ReadFile(path); err == nil {
			tree = strings.Fields(string(data))
		}
	}
	mu.RLock()
	defer mu.RUnlock()
	var out []string
	for name, used := range tests {
		if !used && !slices.Contains(tree, name) {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// Main runs the registered function named by TENSORMP_REEXEC and exits
// with its code. In a process started normally it returns at once. A name
// that is not registered exits with code 2 and a message on stderr.
func Main() {
	name, ok := os.LookupEnv(EnvVar)
	if !ok {
		return
	}
	mu.RLock()
	fn := funcs[name]
	mu.RUnlock()
	if fn == nil {
		fmt.Fprintf(os.Stderr, "reexec: no function %q registered in %s\n", name, os.Args[0])
		os.Exit(2)
	}
	os.Exit(fn())
}

// Registered reports whether a function is registered under name.
func Registered(name string) bool {
	mu.RLock()
	defer mu.RUnlock()
	_, ok := funcs[name]
	return ok
}

// Child reports whether this process was started by Command.
func Child() bool {
	_, ok := os.LookupEnv(EnvVar)
	return ok
}

// Command returns a command that runs the registered function name in a
// new process of the current executable, with the current environment.
// Extra arguments are passed on; a child reads them after its own
// program-specific flags, from os.Args.
func Command(ctx context.Context, name string, args ...string) (*exec.Cmd, error) {
	started(name)
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("reexec: finding the running executable: %w", err)
	}
	cmd := exec.CommandContext(ctx, self, args...)
	cmd.Env = append(os.Environ(), EnvVar+"="+name)
	cmd.Stderr = os.Stderr
	return cmd, nil
}

// Env returns the environment entry that makes this executable, started
// with it, run the function registered as name: for a command that
// starts the executable through another program (a namespace's wrapper,
// say) instead of Command.
func Env(name string) string {
	started(name)
	return EnvVar + "=" + name
}

// started records that this process has started name, and, in a process
// tree that tracks its starts (TrackStarts), tells the tree's file.
func started(name string) {
	mu.Lock()
	if _, ok := tests[name]; ok {
		tests[name] = true
	}
	mu.Unlock()
	if path := os.Getenv(envStarts); path != "" {
		if f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0); err == nil {
			_, _ = f.WriteString(name + "\n") // one write: appends do not interleave
			_ = f.Close()
		}
	}
}

// envStarts names the file in which the processes of a tree that tracks
// its starts record the names they start.
const envStarts = "TENSORMP_REEXEC_STARTS"

// TrackStarts has this process and every process it starts record the
// names they start in a file of dir, so that Unused counts a helper that
// only a helper starts as used.
func TrackStarts(dir string) error {
	f, err := os.CreateTemp(dir, "reexec-starts-")
	if err != nil {
		return fmt.Errorf("reexec: tracking starts: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("reexec: tracking starts: %w", err)
	}
	return os.Setenv(envStarts, f.Name())
}

// SkipRaceExitSleep has the processes this one starts skip the second
// that a program built with the race detector sleeps before it exits
// (GORACE's atexit_sleep_ms), unless GORACE is set already. Test binaries
// call it first in TestMain: their helper processes are many and short,
// and that second would otherwise be most of their time, and a worker's
// graceful exit would take longer than a killed one's.
func SkipRaceExitSleep() {
	if _, ok := os.LookupEnv("GORACE"); !ok {
		_ = os.Setenv("GORACE", "atexit_sleep_ms=0")
	}
}

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
	"sync"
)

// EnvVar names the function a re-executed child runs.
const EnvVar = "TENSORMP_REEXEC"

var (
	mu    sync.RWMutex
	funcs = map[string]func() int{}
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
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("reexec: finding the running executable: %w", err)
	}
	cmd := exec.CommandContext(ctx, self, args...)
	cmd.Env = append(os.Environ(), EnvVar+"="+name)
	cmd.Stderr = os.Stderr
	return cmd, nil
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

// Package testmain is the TestMain of tensormp's test binaries. Their
// cross-process tests start helper processes that are the test binary
// itself, re-executed (mp workers, session keepers, reexec helpers), so
// every test binary begins and ends the same way; Run is that way, once.
// ProcessCPU is what their benchmarks read to report CPU time.
package testmain

import (
	"flag"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// An Option configures Run.
type Option func(*options)

type options struct {
	session bool
	after   []func()
	gpu     *cudastub.Config
}

// EnvRealGPU names the environment variable that, set, makes a test
// binary run on the machine's own CUDA driver instead of the stand-in
// (tests/gpu.sh sets it, on a machine with a GPU).
const EnvRealGPU = "TENSORMP_REQUIRE_GPU"

// WithStandInGPU runs the test binary, and every process it starts, on
// the stand-in CUDA driver (package cudastub) playing the machine cfg
// describes, unless EnvRealGPU is set: the binary re-executes itself
// with the stand-in first on its library path, so that package cuda
// opens it through its real binding.
func WithStandInGPU(cfg cudastub.Config) Option { return func(o *options) { o.gpu = &cfg } }

// WithSession starts the test process's session (mp.StartSession) before
// the tests, as a program that shares tensors under file_system does
// before it spawns: its keepers clean up after the tests whatever they
// leave.
func WithSession() Option { return func(o *options) { o.session = true } }

// After runs f once the tests have run, before the process exits.
func After(f func()) Option { return func(o *options) { o.after = append(o.after, f) } }

// Run is a test binary's TestMain; it never returns. Workers and helpers
// must be registered (mp.Register, reexec.Register) before it is called.
//
// In a helper process it runs the helper and exits (mp.Init). Otherwise
// it runs the tests, then the After functions, then gives the GPU
// contexts back (tensor.CloseBackends), so that a CUDA driver, the
// stand-in included, removes the files it made in /dev/shm, and exits with the
// tests' code. The processes it starts skip the race detector's exit
// sleep (reexec.SkipRaceExitSleep).
//
// It is the safety net under every test: it fails a binary whose tests
// passed but left, once they are all over, a descriptor open (named with
// where it was opened, fd.Trace), a segment mapped or in the
// shared-memory directory, or a goroutine running, that was not there
// before them (leakcheck.Snapshot); and, when every test ran (no -run,
// -skip or -short), one whose test files registered a helper that no
// test started (reexec.Unused).
func Run(m *testing.M, opts ...Option) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if o.gpu != nil && os.Getenv(EnvRealGPU) == "" {
		cudastub.Enter(*o.gpu)
	}
	reexec.SkipRaceExitSleep()
	mp.Init()
	flag.Parse()
	if f := flag.Lookup("test.bench"); f == nil || f.Value.String() == "" {
		fd.Trace() // not under benchmarks: a stack walk per descriptor
	}
	if o.session {
		if err := mp.StartSession(); err != nil {
			fmt.Fprintln(os.Stderr, "testmain: starting the session:", err)
			os.Exit(2)
		}
	}
	starts, err := os.MkdirTemp("", "tensormp-testmain-")
	if err == nil {
		err = reexec.TrackStarts(starts)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "testmain:", err)
		os.Exit(2)
	}
	before, err := leakcheck.Take()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testmain:", err)
		os.Exit(2)
	}
	code := m.Run()
	for _, f := range o.after {
		f()
	}
	_ = tensor.CloseBackends()
	if code == 0 {
		code = check(before)
	}
	_ = os.RemoveAll(starts)
	os.Exit(code)
}

// check returns 1, after saying why on stderr, if the tests left
// something behind that was not there before them, or a helper unused.
func check(before leakcheck.Snapshot) int {
	code := 0
	for _, leak := range before.Leaks(settle) {
		fmt.Fprintln(os.Stderr, "testmain: after the tests:", leak)
		code = 1
	}
	if everyTestRan() {
		for _, name := range reexec.Unused() {
			fmt.Fprintf(os.Stderr, "testmain: helper %q is registered but no test starts it\n", name)
			code = 1
		}
	}
	return code
}

// settle is how long the check after the tests waits for what they
// started to end (helpers exiting, safety nets running).
const settle = 5 * time.Second

// everyTestRan reports whether the tests ran unfiltered (-list runs
// none).
func everyTestRan() bool {
	for _, name := range []string{"test.run", "test.skip", "test.list"} {
		if f := flag.Lookup(name); f != nil && f.Value.String() != "" {
			return false
		}
	}
	return !testing.Short()
}

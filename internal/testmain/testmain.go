// Package testmain is the TestMain of tensormp's test binaries. Their
// cross-process tests start helper processes that are the test binary
// itself, re-executed (mp workers, session keepers, reexec helpers), so
// every test binary begins and ends the same way; Run is that way, once.
package testmain

import (
	"fmt"
	"os"
	"testing"

	"github.com/tensormp/tensormp/internal/cudastub"
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
	if o.session {
		if _, err := mp.StartSession(); err != nil {
			fmt.Fprintln(os.Stderr, "testmain: starting the session:", err)
			os.Exit(2)
		}
	}
	code := m.Run()
	for _, f := range o.after {
		f()
	}
	_ = tensor.CloseBackends()
	os.Exit(code)
}

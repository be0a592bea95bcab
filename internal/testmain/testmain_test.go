package testmain_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/mmapalloc"
)

// leakVar, set, makes this binary a fixture: its tests leave behind what
// the variable names, for TestSafetyNet to see the binary fail.
const leakVar = "TESTMAIN_LEAK"

func TestMain(m *testing.M) {
	if os.Getenv(leakVar) == "helper" {
		reexec.Register("testmain.unused", func() int { return 0 })
	}
	testmain.Run(m)
}

// kept holds what the fixture leaks, so that no safety net of the
// collector gives it back.
var kept []any

// TestLeaves is the fixture: it leaves behind what leakVar names.
func TestLeaves(t *testing.T) {
	switch os.Getenv(leakVar) {
	case "":
		t.Skip("a fixture: TestSafetyNet runs this binary with " + leakVar + " set")
	case "descriptor":
		raw, err := unix.Open(os.DevNull, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		require.NoError(t, err)
		kept = append(kept, fd.New(raw))
	case "goroutine":
		go func() { select {} }()
	case "segment":
		a, err := mmapalloc.Create(4096, mmapalloc.SharedMem|mmapalloc.RefCount)
		require.NoError(t, err)
		kept = append(kept, a)
	}
}

// Every test binary that uses Run fails, once its tests have passed, if
// they left a descriptor, a segment or a goroutine behind, or registered
// a helper that none of them started; it passes if they left nothing.
func TestSafetyNet(t *testing.T) {
	if os.Getenv(leakVar) != "" {
		return // in the fixture
	}
	for _, c := range []struct {
		leak string
		want string // in the binary's stderr
	}{
		{"nothing", ""},
		// Named with where it was opened.
		{"descriptor", "-> /dev/null, opened at\n\tgithub.com/tensormp/tensormp/internal/testmain_test.TestLeaves"},
		{"goroutine", "1 goroutines still running"},
		{"segment", "more segment mappings than before"},
		{"helper", `helper "testmain.unused" is registered but no test starts it`},
	} {
		t.Run(c.leak, func(t *testing.T) {
			cmd := exec.CommandContext(context.Background(), os.Args[0])
			// What the fixture leaves in its shared-memory directory
			// goes with the test's.
			cmd.Env = append(os.Environ(), leakVar+"="+c.leak, mmapalloc.EnvDir+"="+t.TempDir())
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			err := cmd.Run()
			if c.want == "" {
				require.NoError(t, err, "%s", stderr.String())
				return
			}
			var xe *exec.ExitError
			require.True(t, errors.As(err, &xe), "the binary passed: %v\n%s", err, stderr.String())
			assert.Equal(t, 1, xe.ExitCode())
			assert.Contains(t, stderr.String(), c.want)
		})
	}
}

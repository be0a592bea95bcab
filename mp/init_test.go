package mp_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/shm"
)

// TestMissingInit builds testdata/noinit, a program that gets mp.Init
// wrong three ways, and runs each: it fails at once with the reason, not
// with a tree of processes each running main again, and leaves nothing in
// the shared-memory directory.
func TestMissingInit(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a program")
	}
	gobin := filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	if _, err := os.Stat(gobin); err != nil {
		gobin = "go"
	}
	bin := filepath.Join(t.TempDir(), "noinit")
	build := exec.Command(gobin, "build", "-o", bin, "./testdata/noinit")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "building testdata/noinit: %s", out)

	for _, c := range []struct{ mode, want string }{
		{"spawn", "the session keeper reached mp.Spawn before mp.Init ran: call mp.Init first in main"},
		{"exit", "the session keeper exited before it started: call mp.Init first in main"},
		{"late", `no worker registered as "work" when mp.Init ran: call mp.Register in an init function or before mp.Init in main`},
	} {
		t.Run(c.mode, func(t *testing.T) {
			// The program runs in a session of its own, named here, so
			// that what other tests' processes make meanwhile is not
			// taken for its leftovers.
			session := fmt.Sprintf("noinit%dx%s", os.Getpid(), c.mode)
			_, ok := shm.ParseName(shm.LockName(session))
			require.True(t, ok, "a session name the program takes")
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin)
			cmd.Env = append(os.Environ(), "NOINIT_MODE="+c.mode, shm.EnvSession+"="+session)
			out, err := cmd.Output()
			var xe *exec.ExitError
			require.ErrorAs(t, err, &xe, "output: %s", out)
			assert.Equal(t, 1, xe.ExitCode(), "Run failed and said why (99: a grandchild ran main)\n%s", out)
			assert.Contains(t, string(out), c.want)
			// The keeper of a session that ran removes its lock once the
			// program is gone.
			deadline := time.Now().Add(5 * time.Second)
			for {
				left := sessionEntries(t, session)
				if len(left) == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("left in %s: %v", shm.Dir(), left)
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

// sessionEntries lists the shared-memory directory's entries of session.
func sessionEntries(t *testing.T, session string) []string {
	t.Helper()
	entries, err := os.ReadDir(shm.Dir())
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), shm.NamePrefix+session+"_") {
			names = append(names, e.Name())
		}
	}
	return names
}

package mp_test

import (
	"context"
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
			before := shmEntries(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin)
			cmd.Env = append(os.Environ(), "NOINIT_MODE="+c.mode)
			out, err := cmd.Output()
			var xe *exec.ExitError
			require.ErrorAs(t, err, &xe, "output: %s", out)
			assert.Equal(t, 1, xe.ExitCode(), "Run failed and said why (99: a grandchild ran main)\n%s", out)
			assert.Contains(t, string(out), c.want)
			// The keeper of a session that ran removes its lock once the
			// program is gone.
			deadline := time.Now().Add(5 * time.Second)
			for {
				left := newEntries(before, shmEntries(t))
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

func shmEntries(t *testing.T) map[string]bool {
	t.Helper()
	entries, err := os.ReadDir(shm.Dir())
	require.NoError(t, err)
	names := map[string]bool{}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), shm.NamePrefix) {
			names[e.Name()] = true
		}
	}
	return names
}

// newEntries lists what is in after and not in before, of sessions other
// than this test process's own (whose segments come and go with the other
// tests).
func newEntries(before, after map[string]bool) []string {
	var out []string
	for n := range after {
		if !before[n] && !strings.HasPrefix(n, shm.SessionPrefix()) {
			out = append(out, n)
		}
	}
	return out
}

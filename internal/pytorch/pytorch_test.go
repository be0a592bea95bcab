package pytorch

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakePython writes an executable named python3 that fails as a Python
// without torch does, and returns it.
func fakePython(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "python3")
	script := "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n"
	require.NoError(t, os.WriteFile(p, []byte(script), 0o700))
	return p
}

// A python3 without torch first in the list is passed over for one that
// has it; without any, the error names each and the hint.
func TestFind(t *testing.T) {
	fake := fakePython(t)
	missing := filepath.Join(t.TempDir(), "no-such-python")

	_, err := Find(fake, missing)
	require.Error(t, err)
	assert.Contains(t, err.Error(), fake+": ModuleNotFoundError: No module named 'torch'")
	assert.Contains(t, err.Error(), missing+": ")
	assert.Contains(t, err.Error(), Hint)

	real, err := Find(Candidates(os.Getenv(EnvVar))...)
	if err != nil {
		if os.Getenv("TENSORMP_REQUIRE_PYTHON") != "" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	got, err := Find(fake, real)
	require.NoError(t, err)
	assert.Equal(t, real, got)
}

func TestCandidates(t *testing.T) {
	assert.Equal(t, []string{"/usr/bin/python3", "python3"}, Candidates(""))
	assert.Equal(t, []string{"/opt/py", "/usr/bin/python3", "python3"}, Candidates("/opt/py"))
}

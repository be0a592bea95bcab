package leftover

import (
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDead(t *testing.T) {
	assert.False(t, Dead(os.Getpid()), "this process")
	assert.False(t, Dead(0))
	assert.False(t, Dead(-1))

	cmd := exec.Command("sleep", "60")
	require.NoError(t, cmd.Start())
	pid := cmd.Process.Pid
	assert.False(t, Dead(pid), "a running child")
	require.NoError(t, cmd.Process.Kill())
	// Dead but not reaped: a zombie counts as dead.
	require.Eventually(t, func() bool { return Dead(pid) }, 5e9, 1e6, "a killed child is dead before it is reaped")
	_ = cmd.Wait()
	assert.True(t, Dead(pid), "a reaped child")
}

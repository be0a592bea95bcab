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

// A child reaped while Dead reads its state is dead: the read that finds
// its process gone between opening /proc/<pid>/stat and reading it says
// so (ESRCH), and it must not count as live. A remover that takes such a
// process for a live one leaves its files for good: it runs once.
func TestDeadWhileReaped(t *testing.T) {
	for range 100 {
		cmd := exec.Command("true")
		require.NoError(t, cmd.Start())
		pid := cmd.Process.Pid
		require.Eventually(t, func() bool { return Dead(pid) }, 5e9, 1e5, "the child exited")
		reaped := make(chan struct{})
		go func() {
			_ = cmd.Wait()
			close(reaped)
		}()
		for done := false; !done; {
			select {
			case <-reaped:
				done = true
			default:
			}
			require.True(t, Dead(pid), "child %d, exited, while it is reaped", pid)
		}
	}
}

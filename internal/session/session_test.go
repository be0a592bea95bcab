package session

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/shm"
)

// A lock is used only if it is a regular file of this user's, mode 0600.
func TestOpenLockRefusesForeignLocks(t *testing.T) {
	dir := t.TempDir()
	own := filepath.Join(dir, shm.LockName("own"))
	f, err := openLock(own, true)
	require.NoError(t, err, "a new lock")
	require.NoError(t, f.Close())
	f, err = openLock(own, false)
	require.NoError(t, err, "this user's own lock")
	require.NoError(t, f.Close())

	open := filepath.Join(dir, shm.LockName("open"))
	require.NoError(t, os.WriteFile(open, nil, 0o600))
	require.NoError(t, os.Chmod(open, 0o666))
	_, err = openLock(open, false)
	assert.ErrorIs(t, err, ErrForeignLock, "a lock others may write")
	_, err = openLock(open, true)
	assert.ErrorIs(t, err, ErrForeignLock, "a lock others may write, in the way of a new one")

	link := filepath.Join(dir, shm.LockName("link"))
	require.NoError(t, os.Symlink(own, link))
	_, err = openLock(link, false)
	assert.Error(t, err, "a symbolic link")
}

// The roll gives each member once, in the order they joined, and skips
// what is not a pid.
func TestReadRoll(t *testing.T) {
	path := filepath.Join(t.TempDir(), "roll")
	require.NoError(t, os.WriteFile(path, []byte("12\n12\nx\n-3\n0\n40\n7"), 0o600))
	assert.Equal(t, []int{12, 40, 7}, readRoll(path))
	assert.Empty(t, readRoll(filepath.Join(t.TempDir(), "none")))
}

// Clean removes the entries of a session whose lock nobody holds, and
// leaves a live session's, and whatever is not a file tensormp names.
func TestClean(t *testing.T) {
	dir := t.TempDir()
	const seg = "_2147483646_0123456789abcdef" // a pid beyond pid_max
	write := func(name string) string {
		path := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(path, nil, 0o600))
		return name
	}
	dead := []string{write(shm.LockName("dead")), write("tensormp_dead" + seg)}
	lockless := write("tensormp_lockless" + seg)
	kept := []string{write("tensormp_dead_x"), write("other"), write(shm.LockName("live")), write("tensormp_live" + seg)}
	require.NoError(t, os.Mkdir(filepath.Join(dir, "tensormp_dead_1_0123456789abcdef"), 0o700))
	live, err := openLock(filepath.Join(dir, shm.LockName("live")), false)
	require.NoError(t, err)
	defer live.Close()
	require.NoError(t, unix.Flock(int(live.Fd()), unix.LOCK_SH))

	removed, err := Clean(dir, true)
	require.NoError(t, err)
	assert.ElementsMatch(t, append(dead, lockless), removed, "a dry run lists")
	for _, n := range removed {
		assert.FileExists(t, filepath.Join(dir, n), "a dry run removes nothing")
	}

	removed, err = Clean(dir, false)
	require.NoError(t, err)
	assert.ElementsMatch(t, append(dead, lockless), removed)
	for _, n := range removed {
		assert.NoFileExists(t, filepath.Join(dir, n))
	}
	for _, n := range kept {
		assert.FileExists(t, filepath.Join(dir, n))
	}
	assert.DirExists(t, filepath.Join(dir, "tensormp_dead_1_0123456789abcdef"))
}

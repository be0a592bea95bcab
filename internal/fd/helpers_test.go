package fd_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// open opens /dev/null, a descriptor the test owns.
func open(t *testing.T) int {
	t.Helper()
	raw, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	return raw
}

// isOpen reports whether raw is an open descriptor.
func isOpen(raw int) bool {
	_, err := unix.FcntlInt(uintptr(raw), unix.F_GETFD, 0)
	return err == nil
}

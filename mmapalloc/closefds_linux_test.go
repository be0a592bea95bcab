package mmapalloc

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// closeFDs closes exactly the descriptors it is given, neighbours in runs
// and strays alone, and none between them.
func TestCloseFDsClosesOnlyItsOwn(t *testing.T) {
	m, err := unix.MemfdCreate("tensormp-test", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(m)
	var all []int
	for range 12 {
		d, err := unix.FcntlInt(uintptr(m), unix.F_DUPFD_CLOEXEC, 0)
		require.NoError(t, err)
		all = append(all, d)
	}
	open := func(fd int) bool {
		_, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		return err == nil
	}
	// Two runs and a stray, given out of order; the others stay open.
	mine := []int{all[5], all[0], all[1], all[2], all[9], all[6], all[7]}
	kept := []int{all[3], all[4], all[8], all[10], all[11]}
	closeFDs(mine)
	for _, fd := range mine {
		assert.False(t, open(fd), "descriptor %d was to be closed", fd)
	}
	for _, fd := range kept {
		assert.True(t, open(fd), "descriptor %d was not the caller's to close", fd)
		_ = unix.Close(fd)
	}
}

//go:build linux

package mmapalloc_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

func TestMain(m *testing.M) { testmain.Run(m) }

func TestNamedSegmentIsSharedByName(t *testing.T) {
	leakcheck.Check(t)
	a, err := mmapalloc.Create(4096, mmapalloc.RefCount)
	require.NoError(t, err)
	require.True(t, mmapalloc.ValidName(a.Name()), "%q", a.Name())
	assert.Contains(t, a.Name(), mmapalloc.SessionPrefix())
	assert.False(t, a.Sealed(), "a named segment can be resized by whoever opens it")

	b, err := mmapalloc.OpenName(a.Name(), 4096, mmapalloc.RefCount)
	require.NoError(t, err)
	a.Bytes()[7] = 42
	assert.Equal(t, byte(42), b.Bytes()[7], "one memory")
	assert.Equal(t, int32(2), b.Refs())

	require.NoError(t, a.Release())
	require.NoError(t, a.Release(), "releasing twice is harmless")
	assert.Nil(t, a.Bytes())
	_, err = os.Stat(filepath.Join(mmapalloc.Dir(), b.Name()))
	require.NoError(t, err, "a holder is left")
	require.NoError(t, b.Release())
	_, err = os.Stat(filepath.Join(mmapalloc.Dir(), b.Name()))
	assert.ErrorIs(t, err, os.ErrNotExist, "the last holder removes it")

	_, err = mmapalloc.OpenName(b.Name(), 4096, mmapalloc.RefCount)
	assert.Error(t, err, "nothing to open once removed")
	_, err = mmapalloc.OpenName("../../etc/passwd", 1, 0)
	assert.ErrorIs(t, err, mmapalloc.ErrBadName)
}

func TestMemfdIsSharedByDescriptor(t *testing.T) {
	leakcheck.Check(t)
	a, err := mmapalloc.Create(4096, mmapalloc.KeepFD|mmapalloc.Unlink)
	require.NoError(t, err)
	defer a.Release()
	assert.True(t, a.Sealed())
	assert.NotZero(t, a.Flags()&mmapalloc.Memfd)

	n, err := a.LendFD()
	require.NoError(t, err)
	dup, err := unix.FcntlInt(uintptr(n), unix.F_DUPFD_CLOEXEC, 0)
	a.ReturnFD()
	require.NoError(t, err)
	b, err := mmapalloc.OpenFD(dup, 4096, 0)
	require.NoError(t, err, "OpenFD takes the duplicate over")
	defer b.Release()
	b.Bytes()[0] = 7
	assert.Equal(t, byte(7), a.Bytes()[0])

	raw, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(raw, 4096))
	_, err = mmapalloc.OpenFD(raw, 4096, 0)
	assert.ErrorIs(t, err, mmapalloc.ErrUnsealed, "a file any holder could cut short")
}

// A storage on an Allocation of the caller's is private memory: sending
// it first copies it into memory whose holders tensormp tracks, and gives
// the Allocation back.
func TestStorageOnAnAllocationIsPrivate(t *testing.T) {
	leakcheck.Check(t)
	a, err := mmapalloc.Create(16, mmapalloc.KeepFD|mmapalloc.Unlink)
	require.NoError(t, err)
	a.Bytes()[3] = 9
	s, err := tensor.NewStorage(device.CPU(), a)
	require.NoError(t, err)
	assert.False(t, s.IsShared())
	require.NoError(t, s.ShareMemory(strategy.FileDescriptor))
	assert.True(t, s.IsShared())
	assert.Equal(t, byte(9), s.Bytes()[3], "copied")
	assert.Nil(t, a.Bytes(), "the Allocation was released")
	require.NoError(t, s.Release())
}

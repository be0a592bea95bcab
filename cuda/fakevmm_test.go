//go:build linux

package cuda_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/internal/cudafake"
	"github.com/tensormp/tensormp/internal/leakcheck"
)

// The fake's virtual memory calls behave as the real driver's in what
// tensormp relies on: an exported descriptor imports as the same memory,
// which lives while a handle or a mapping of it does; a descriptor of
// anything else, a mapping larger than the allocation, and access before
// MemSetAccess are errors.
func TestFakeVirtualMemory(t *testing.T) {
	leakcheck.Check(t)
	d := cudafake.New(1)
	ok, err := d.FDExportSupported(0)
	require.NoError(t, err)
	assert.True(t, ok)
	g, err := d.MemGranularity(0)
	require.NoError(t, err)
	_, err = d.MemCreate(0, g+1)
	assert.Error(t, err, "a size that is not a multiple of the granularity")

	h, err := d.MemCreate(0, g)
	require.NoError(t, err)
	fd, err := d.MemExportFD(h)
	require.NoError(t, err)
	require.NoError(t, d.MemRelease(h)) // the descriptor keeps the memory
	imported, err := d.MemImportFD(fd)
	require.NoError(t, err)
	require.NoError(t, unix.Close(fd))
	dev, err := d.MemDevice(imported)
	require.NoError(t, err)
	assert.Equal(t, 0, dev)

	p, err := d.MemAddressReserve(2*g, g)
	require.NoError(t, err)
	assert.Error(t, d.MemMap(p, 2*g, imported), "more than the allocation holds")
	require.NoError(t, d.MemMap(p, g, imported))
	require.NoError(t, d.MemRelease(imported)) // the mapping keeps the memory
	ctx, err := d.RetainPrimaryContext(0)
	require.NoError(t, err)
	defer d.ReleasePrimaryContext(0)
	require.NoError(t, d.SetCurrent(ctx))
	defer d.SetCurrent(0)
	assert.Error(t, d.MemcpyHtoD(p, []byte{1}), "no access before MemSetAccess")
	require.NoError(t, d.MemSetAccess(p, g, []int{0}))
	require.NoError(t, d.MemcpyHtoD(p+5, []byte{1, 2, 3}))
	got := make([]byte, 4)
	require.NoError(t, d.MemcpyDtoH(got, p+4))
	assert.Equal(t, []byte{0xab, 1, 2, 3}, got, "fresh memory holds garbage")
	require.NoError(t, d.MemUnmap(p, g))
	require.NoError(t, d.MemAddressFree(p, 2*g))
	assert.Zero(t, d.MemHandles())
	assert.Zero(t, d.Mapped())

	for name, other := range map[string]func() int{
		"memfd": func() int {
			fd, err := unix.MemfdCreate("other", unix.MFD_CLOEXEC)
			require.NoError(t, err)
			require.NoError(t, unix.Ftruncate(fd, g))
			return fd
		},
		"pipe": func() int {
			var p [2]int
			require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
			require.NoError(t, unix.Close(p[1]))
			return p[0]
		},
	} {
		fd := other()
		_, err := d.MemImportFD(fd)
		var ce *cuda.Error
		assert.ErrorAs(t, err, &ce, "a %s is no allocation", name)
		require.NoError(t, unix.Close(fd))
	}
}

package tensor_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// A peer truncates a file_system segment under its mappings (any process
// of the same user can): tensormp's own reads and writes of it are errors,
// never a SIGBUS.
func TestTruncatedSharedMemoryIsAnError(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.Arange(tensor.Float32, 1<<16)
	require.NoError(t, err)
	require.NoError(t, x.Storage().ShareMemory(strategy.FileSystem))
	a, ok := x.Storage().Backing().(*shm.Allocation)
	require.True(t, ok, "a file_system segment of its own, in a process with no session keeper")
	require.NoError(t, os.Truncate(filepath.Join(shm.Dir(), a.Name()), 0))

	private, err := tensor.Zeros(tensor.Float32, 1<<16)
	require.NoError(t, err)
	view, err := x.Narrow(0, 100, 50)
	require.NoError(t, err)
	strided, err := x.Reshape(256, 256)
	require.NoError(t, err)
	strided, err = strided.Transpose(0, 1)
	require.NoError(t, err)
	for name, op := range map[string]func() error{
		"At":         func() error { _, err := tensor.At[float32](x, 7); return err },
		"Set":        func() error { return tensor.Set[float32](x, 1, 7) },
		"Fill":       func() error { return tensor.Fill(view, func(int) float32 { return 1 }) },
		"Values":     func() error { _, err := tensor.Values[float32](strided); return err },
		"Clone":      func() error { _, err := x.Clone(); return err },
		"Contiguous": func() error { _, err := strided.Contiguous(); return err },
		"Copy into":  func() error { return tensor.Copy(x, private) },
		"Copy from":  func() error { return tensor.Copy(private, x) },
	} {
		assert.ErrorIs(t, op(), shm.ErrFault, name)
	}
	assert.False(t, tensor.Equal(x, private), "a tensor that cannot be read equals nothing")
	assert.ErrorIs(t, x.Release(), shm.ErrFault, "its header cannot be read either")
}

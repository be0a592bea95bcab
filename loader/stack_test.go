package loader

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/tensor"
)

func TestSamplesMadeWithZerosStackWithoutCopying(t *testing.T) {
	leakcheck.Check(t)
	var a arena
	a.reset(3)
	ctx := context.WithValue(context.Background(), arenaKey{}, &a)
	var xs, ms []*tensor.Tensor
	for k := range 3 {
		a.next(k)
		x, err := Zeros(ctx, tensor.Float32, 2, 2)
		require.NoError(t, err)
		require.NoError(t, tensor.Fill(x, func(i int) float32 { return float32(10*k + i) }))
		m, err := Zeros(ctx, tensor.Uint8, 5) // a sample's second tensor: its own part
		require.NoError(t, err)
		xs, ms = append(xs, x), append(ms, m)
	}
	stacked, err := Stack(xs)
	require.NoError(t, err)
	assert.Same(t, xs[0].Storage(), stacked.Storage(), "a view of the batch's part, not a copy")
	assert.Equal(t, []int{3, 2, 2}, stacked.Shape())
	vals, err := tensor.Values[float32](stacked)
	require.NoError(t, err)
	assert.Equal(t, []float32{0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23}, vals)
	masks, err := Stack(ms)
	require.NoError(t, err)
	assert.Same(t, ms[0].Storage(), masks.Storage())
	assert.NotSame(t, stacked.Storage(), masks.Storage())

	// Tensors made apart are copied into a new batch.
	y, err := Zeros(context.Background(), tensor.Float32, 2, 2)
	require.NoError(t, err)
	mixed, err := Stack([]*tensor.Tensor{xs[1], y})
	require.NoError(t, err)
	assert.NotSame(t, y.Storage(), mixed.Storage())
	vals, err = tensor.Values[float32](mixed)
	require.NoError(t, err)
	assert.Equal(t, []float32{10, 11, 12, 13, 0, 0, 0, 0}, vals)

	_, err = Stack([]*tensor.Tensor{xs[0], ms[0]})
	assert.ErrorContains(t, err, "tensor 1 is")
	for _, x := range []*tensor.Tensor{mixed, y} {
		require.NoError(t, x.Release())
	}
	a.release()
}

//go:build linux

package reduction_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

// receive copies each body into a fresh shared storage, as a transport
// between hosts does.
func receive(t *testing.T, bodies []*tensor.Storage) []*tensor.Storage {
	t.Helper()
	out := make([]*tensor.Storage, len(bodies))
	for i, b := range bodies {
		s, err := tensor.AllocSharedStorage(b.Size())
		require.NoError(t, err)
		copy(s.Bytes(), b.Bytes())
		out[i] = s
	}
	return out
}

func TestBodyCodecRoundTrip(t *testing.T) {
	a, err := tensor.FromSlice([]float32{1, 2, 3, 4, 5, 6}, 2, 3)
	require.NoError(t, err)
	defer a.Release()
	aT, err := a.Transpose(0, 1)
	require.NoError(t, err)
	row, err := a.Narrow(0, 1, 1)
	require.NoError(t, err)
	b, err := tensor.Arange(tensor.Int64, 4)
	require.NoError(t, err)
	defer b.Release()
	empty, err := tensor.Zeros(tensor.Float64, 0, 3)
	require.NoError(t, err)

	in := nested{
		Name:   "batch",
		Inputs: []*tensor.Tensor{a, row, empty},
		Layers: map[string]inner{"fc": {W: aT, Scale: 0.5}},
		Any:    b,
		Steps:  []int{7},
	}
	enc := reduction.NewBodyEncoder()
	data, bodies, err := enc.Encode(&in)
	require.NoError(t, err)
	require.Len(t, bodies, 2, "a, its views and b: two storages, two bodies; the empty tensor none")
	assert.False(t, a.IsShared(), "encoding by value moves nothing into shared memory")

	var out nested
	require.NoError(t, reduction.NewBodyDecoder().Decode(data, receive(t, bodies), &out))
	assert.Equal(t, "batch", out.Name)
	assert.Equal(t, []int{7}, out.Steps)
	require.Len(t, out.Inputs, 3)
	for i, want := range in.Inputs {
		assert.True(t, tensor.Equal(want, out.Inputs[i]), "input %d", i)
	}
	assert.True(t, tensor.Equal(aT, out.Layers["fc"].W))
	assert.Equal(t, aT.Strides(), out.Layers["fc"].W.Strides(), "a view keeps its strides")
	assert.Same(t, out.Inputs[0].Storage(), out.Layers["fc"].W.Storage(), "views of one storage arrive on one storage")
	assert.True(t, out.Inputs[0].IsShared(), "received bodies live in shared memory")
	assert.True(t, tensor.Equal(b, out.Any.(*tensor.Tensor)))
	assert.NotSame(t, a.Storage(), out.Inputs[0].Storage(), "by value: a copy")
	require.NoError(t, out.Inputs[0].Release())
	require.NoError(t, out.Any.(*tensor.Tensor).Release())
}

func TestBodyDecodeChecksBodies(t *testing.T) {
	a, err := tensor.FromSlice([]int32{1, 2, 3, 4}, 4)
	require.NoError(t, err)
	data, bodies, err := reduction.NewBodyEncoder().Encode(a)
	require.NoError(t, err)

	cases := []struct {
		name   string
		bodies func() []*tensor.Storage
		want   string
	}{
		{"missing body", func() []*tensor.Storage { return nil }, "body index 0 out of range"},
		{"short body", func() []*tensor.Storage {
			s, err := tensor.AllocSharedStorage(8)
			require.NoError(t, err)
			return []*tensor.Storage{s}
		}, "holds 8 bytes, the metadata says 16"},
		{"extra body", func() []*tensor.Storage { return append(receive(t, bodies), receive(t, bodies)...) }, "2 bodies, 1 of them not used"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			given := c.bodies()
			var out *tensor.Tensor
			err := reduction.NewBodyDecoder().Decode(data, given, &out)
			require.ErrorContains(t, err, c.want)
			for _, s := range given {
				assert.True(t, s.Released(), "a failed decode releases every body")
			}
		})
	}

	// Metadata made for descriptors does not decode against bodies.
	fdData, fds, err := reduction.Marshal(a)
	require.NoError(t, err)
	fd.CloseAll(fds)
	var out *tensor.Tensor
	require.ErrorContains(t, reduction.NewBodyDecoder().Decode(fdData, nil, &out), "descriptor metadata in a message that carries bodies")
	require.NoError(t, a.Release())
}

package reduction_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

type hidden struct {
	Step int
	t    *tensor.Tensor
}

// Hidden is used, so that the linter sees the field as meant.
func (h hidden) Hidden() *tensor.Tensor { return h.t }

type outer struct {
	Name  string
	Inner struct {
		Batch []hidden
	}
}

type withFile struct {
	Log *os.File
}

type fine struct {
	Step  int
	T     *tensor.Tensor
	note  string // unexported, holds nothing carried: skipped, as ever
	Inner *fine
}

// Encode refuses what msgpack would drop or mangle, naming the type and
// the field path, instead of a message that arrives with nil inside.
func TestEncodeRefusesWhatItCannotCarry(t *testing.T) {
	for _, c := range []struct {
		v    any
		want string
	}{
		{hidden{Step: 1}, "reduction_test.hidden.t is unexported and holds *tensor.Tensor"},
		{&outer{}, "reduction_test.outer.Inner.Batch.t is unexported and holds *tensor.Tensor"},
		{withFile{}, "reduction_test.withFile.Log is an os.File"},
		{[]any{os.Stdout}, "cannot carry an *os.File"},
	} {
		_, _, err := reduction.Marshal(c.v)
		if assert.Error(t, err, "%T", c.v) {
			assert.Contains(t, err.Error(), c.want)
		}
	}
	_, fds, err := reduction.Marshal(fine{Step: 3, note: "x"})
	assert.NoError(t, err, "an unexported field that holds nothing carried")
	assert.Empty(t, fds)
}

// A bare storage travels like a tensor's: the receiver gets the same
// memory.
func TestBareStorage(t *testing.T) {
	x, err := tensor.Zeros(tensor.Uint8, 100)
	require.NoError(t, err)
	defer x.Release()
	s := x.Storage()
	data, fds, err := reduction.Marshal(struct{ S *tensor.Storage }{s})
	require.NoError(t, err)
	require.Len(t, fds, 1, "the storage's descriptor")
	var got struct{ S *tensor.Storage }
	require.NoError(t, reduction.Unmarshal(data, fds, &got))
	require.NotNil(t, got.S)
	assert.Equal(t, s.Size(), got.S.Size())
	assert.True(t, got.S.IsShared())
}

type sentBatch struct {
	Index any
	Items []struct{ N any }
	Tags  map[string]any
}

type Batch struct {
	Index int64
	Items []struct{ N int }
	Tags  map[string]float32
}

// A message that does not fit its target type says which field, and
// which types, in Go's terms.
func TestDecodeErrorsNameTheField(t *testing.T) {
	for _, c := range []struct {
		sent sentBatch
		want string
	}{
		{sentBatch{Index: "x"}, "reduction: Batch.Index: cannot decode a string into int64"},
		{sentBatch{Items: []struct{ N any }{{1}, {"two"}}}, "reduction: Batch.Items[1].N: cannot decode a string into int"},
		{sentBatch{Tags: map[string]any{"lr": []int{1}}}, "reduction: Batch.Tags[lr]: cannot decode an array into float32"},
	} {
		data, fds, err := reduction.Marshal(c.sent)
		require.NoError(t, err)
		var got Batch
		err = reduction.Unmarshal(data, fds, &got)
		var de *reduction.DecodeError
		if assert.ErrorAs(t, err, &de) {
			assert.Equal(t, c.want, err.Error())
			assert.NotContains(t, err.Error(), "code=")
		}
	}
}

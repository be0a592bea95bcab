//go:build linux

package reduction_test

import (
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

// A receiver maps the producer's slab from the message's descriptor, sees
// the producer's bytes and writes back in place; what it received stays
// its own to release, and the producer's block is held until it does.
func TestGPUSlabTensorAcrossProcesses(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.On(reduction.SlabGPU).Arange(tensor.Int32, 1024)
	require.NoError(t, err)
	defer x.Release()
	data, fds, err := reduction.Marshal(x)
	require.NoError(t, err)
	require.Len(t, fds, 2)
	runHelperAs(t, "rebuild-gpu", data, fds)
	host, err := x.To(device.CPU())
	require.NoError(t, err)
	vals, err := tensor.Values[int32](host)
	require.NoError(t, err)
	assert.Equal(t, int32(-1), vals[0], "the receiver's write")
	assert.Equal(t, int32(1023), vals[1023])
}

// helperRebuildGPU receives a GPU tensor of 0..n-1 on device
// 0 in a process of its own, checks it and sets its first element to -1.
func helperRebuildGPU() int {
	if err := rebuildGPU(); err != nil {
		fmt.Fprintln(os.Stderr, "rebuild-gpu:", err)
		return 1
	}
	return 0
}

func rebuildGPU() error {
	data, fds, err := helperInput()
	if err != nil {
		return err
	}
	var x *tensor.Tensor
	if err := reduction.Unmarshal(data, fds, &x); err != nil {
		return err
	}
	defer x.Release()
	if x.Place() != device.GPU(0) || !x.IsShared() {
		return fmt.Errorf("received %v", x)
	}
	want, err := tensor.Arange(tensor.Int32, x.Numel())
	if err != nil {
		return err
	}
	host, err := x.To(device.CPU())
	if err != nil {
		return err
	}
	if !tensor.Equal(host, want) {
		return errors.New("the received GPU tensor differs")
	}
	return x.Storage().Backing().(tensor.Buffer).Write([]byte{0xff, 0xff, 0xff, 0xff}, 0)
}

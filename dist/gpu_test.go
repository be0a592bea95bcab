//go:build linux

package dist_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/dist"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/tensor"
)

// GPU tests run on the machine's driver where tests/gpu.sh asks for it
// (TENSORMP_REQUIRE_GPU), else on the stand-in (see TestMain): across
// hosts a GPU tensor is staged through host memory and arrives on the CPU.

func requireGPU(t *testing.T) {
	t.Helper()
	_, err := cuda.Default()
	require.NoError(t, err, "no CUDA driver")
	require.True(t, cuda.Available(), "the CUDA driver reports no device")
	warmDriver.Do(func() {
		var x *tensor.Tensor
		if x, warmDriver.err = tensor.On(device.GPU(0)).Zeros(tensor.Uint8, 16); warmDriver.err == nil {
			_, warmDriver.err = x.To(device.CPU())
			_ = x.Release()
		}
	})
	require.NoError(t, warmDriver.err, "warming the driver up")
}

// warmDriver makes the driver open, once per process, the descriptors it
// keeps for the process's life, so that the leak checks see only what
// tensormp opens.
var warmDriver struct {
	sync.Once
	err error
}

// gpuView is the GPU value both sides build: rows 1 and 2 of a 3×4
// arange, a view that does not start at its storage's beginning.
func gpuView() (base, view *tensor.Tensor, err error) {
	base, err = tensor.On(device.GPU(0)).Arange(tensor.Float32, 12)
	if err != nil {
		return nil, nil, err
	}
	m, err := base.Reshape(3, 4)
	if err == nil {
		view, err = m.Narrow(0, 1, 2)
	}
	if err != nil {
		_ = base.Release()
		return nil, nil, err
	}
	return base, view, nil
}

func init() {
	// put-gpu puts a GPU value into rank 0's queue "gpu", then echoes
	// on a pipe as pipe-echo does.
	scenarios["put-gpu"] = func(ctx context.Context, g *dist.Group) error {
		q, err := g.Queue(ctx, "gpu")
		if err != nil {
			return err
		}
		base, view, err := gpuView()
		if err != nil {
			return err
		}
		defer base.Release()
		if !view.Place().IsGPU() {
			return fmt.Errorf("the value is on %v", view.Place())
		}
		if err := q.Put(ctx, map[string]*tensor.Tensor{"view": view, "whole": base}); err != nil {
			return err
		}
		return scenarios["pipe-echo"](ctx, g)
	}
}

func TestGPUTensorsAreStagedAcrossHosts(t *testing.T) {
	requireGPU(t)
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store := freeStore(t)
	peer := startRank(t, "put-gpu", 1, 2, store)
	g := join(t, ctx, 0, 2, store)

	// From a GPU on the other host, through a queue this rank owns.
	q, err := g.Queue(ctx, "gpu")
	require.NoError(t, err)
	var got map[string]*tensor.Tensor
	require.NoError(t, q.Get(ctx, &got))
	base, want, err := gpuView()
	require.NoError(t, err)
	defer base.Release()
	for _, k := range []string{"view", "whole"} {
		x := got[k]
		require.NotNil(t, x, k)
		assert.Equal(t, device.CPU(), x.Place(), "%s arrives on the host", k)
		assert.True(t, x.IsShared(), "%s arrives in shared memory", k)
	}
	assert.Equal(t, []int{2, 4}, got["view"].Shape())
	assert.True(t, tensor.Equal(want, got["view"]), "got %v", got["view"])
	whole, err := tensor.Arange(tensor.Float32, 12)
	require.NoError(t, err)
	assert.True(t, tensor.Equal(whole, got["whole"]))
	for _, x := range got {
		require.NoError(t, x.Release())
	}

	// To the other host from this rank's GPU, and back.
	p, err := g.Pipe(ctx, 1)
	require.NoError(t, err)
	require.NoError(t, p.Send(ctx, want))
	var back *tensor.Tensor
	require.NoError(t, p.Recv(ctx, &back))
	plusOne, err := tensor.FromSlice([]float32{5, 6, 7, 8, 9, 10, 11, 12}, 2, 4)
	require.NoError(t, err)
	assert.True(t, tensor.Equal(plusOne, back), "got %v", back)
	require.NoError(t, back.Release())
	require.NoError(t, p.Close())

	assert.Equal(t, 0, peer.wait(t))
	require.NoError(t, g.Close())
	assertEmptyDir(t, peer.shm)
}

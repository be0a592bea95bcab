package reduction

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// The GPU tests of this package run on the stand-in driver's three
// devices (see TestMain): devices 0 and 2 share their memory in slabs
// (cuda_fd), device 1 by legacy CUDA IPC (cuda_ipc), as an older
// driver's does.
var (
	slabGPU   = device.GPU(0)
	legacyGPU = device.GPU(1)
	otherGPU  = device.GPU(2)
)

// gpuConfig is the machine TestMain plays: three GPUs, the second
// sharing by legacy IPC.
var gpuConfig = cudastub.Config{Devices: 3, Env: []string{cuda.EnvLegacy + "=gpu:1"}}

func TestGPUTensorThroughTheCodec(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.On(legacyGPU).Arange(tensor.Float32, 12)
	require.NoError(t, err)
	m, err := x.Reshape(3, 4)
	require.NoError(t, err)
	view, err := m.Narrow(0, 1, 2)
	require.NoError(t, err)

	data, fds, err := Marshal(map[string]*tensor.Tensor{"v": view})
	require.NoError(t, err)
	require.Len(t, fds, 1, "the token's segment travels as a descriptor")
	var got map[string]*tensor.Tensor
	require.NoError(t, Unmarshal(data, fds, &got))
	assert.Same(t, x.Storage(), got["v"].Storage(), "the producer's own process uses its memory directly")
	assert.Equal(t, int64(16), got["v"].Offset())
	assert.True(t, tensor.Equal(view, got["v"]))
	require.NoError(t, x.Release())
}

func TestGPUTensorOpenedByAReceiver(t *testing.T) {
	leakcheck.Check(t)
	live := cudastub.Allocs()
	x, err := tensor.On(legacyGPU).Full(tensor.Int32, 7, 8)
	require.NoError(t, err)
	var r reduced
	require.NoError(t, reduce(&r, x, nil, nil, nil))
	meta, fd, tok := r.Meta, r.ticket, r.lease
	require.NotNil(t, tok)
	assert.Equal(t, -1, r.memFD)
	assert.Equal(t, StrategyCUDAIPC, meta.Strategy)
	assert.Equal(t, tok.(*shm.Ticket).FD(), fd, "the message carries the token's ticket")

	// As a receiver that never held this memory: forget the producer's
	// entry in the cache.
	storages.mu.Lock()
	delete(storages.m, gpuKey([64]byte(meta.IPC), meta.DevOffset))
	storages.mu.Unlock()
	meta.FDIndex = 0
	y, err := Rebuild(meta, []int{fd})
	require.NoError(t, err)
	tok.Done() // delivered: the receiver holds the token itself
	assert.NotSame(t, x.Storage(), y.Storage())
	assert.Equal(t, legacyGPU, y.Place())
	assert.True(t, tensor.Equal(x, y))
	require.NoError(t, y.Storage().Backing().(tensor.Buffer).Write([]byte{1, 0, 0, 0}, 0))
	v, err := x.To(device.CPU())
	require.NoError(t, err)
	first, err := tensor.At[int32](v, 0)
	require.NoError(t, err)
	assert.Equal(t, int32(1), first, "the producer sees the receiver's write")

	require.NoError(t, x.Release())
	assert.Equal(t, live+1, cudastub.Allocs(), "the receiver still holds the producer's memory")
	require.NoError(t, y.Release())
	rt, err := cuda.Default()
	require.NoError(t, err)
	rt.CollectLimbo()
	assert.Equal(t, live, cudastub.Allocs(), "released everywhere: freed")
	assert.Equal(t, 0, cudastub.IPCOpened(), "its own export is never opened")
}

// A GPU tensor in a device slab travels as its block's ticket and the
// slab's descriptor; in the process that made it, it comes back as the
// same storage.
func TestGPUSlabTensorThroughTheCodec(t *testing.T) {
	leakcheck.Check(t)
	x, err := tensor.On(slabGPU).Arange(tensor.Float32, 12)
	require.NoError(t, err)
	defer x.Release()
	m, err := x.Reshape(3, 4)
	require.NoError(t, err)
	view, err := m.Narrow(0, 1, 2)
	require.NoError(t, err)
	data, fds, err := Marshal(map[string]*tensor.Tensor{"v": view, "again": x})
	require.NoError(t, err)
	require.Len(t, fds, 2, "one ticket and the slab's descriptor, for two tensors of one slab")
	var got map[string]*tensor.Tensor
	require.NoError(t, Unmarshal(data, fds, &got))
	assert.Same(t, x.Storage(), got["v"].Storage(), "the producer's own process uses its memory directly")
	assert.Same(t, x.Storage(), got["again"].Storage())
	assert.Equal(t, int64(16), got["v"].Offset())
	assert.True(t, tensor.Equal(view, got["v"]))
}

// An empty tensor crosses as metadata alone, on any place: it arrives
// with its shape, its LoD and its place, contiguous, and viewable.
func TestEmptyTensorArrives(t *testing.T) {
	leakcheck.Check(t)
	for _, p := range []device.Place{device.CPU(), slabGPU, legacyGPU} {
		t.Run(p.String(), func(t *testing.T) {
			x, err := tensor.On(p).Zeros(tensor.Float32, 0, 4)
			require.NoError(t, err)
			x, err = x.WithLoD([][]int{{0}})
			require.NoError(t, err)
			data, fds, err := Marshal(x)
			require.NoError(t, err)
			assert.Empty(t, fds, "no memory travels")
			var y *tensor.Tensor
			require.NoError(t, Unmarshal(data, fds, &y))
			assert.Equal(t, []int{0, 4}, y.Shape())
			assert.Equal(t, p, y.Place())
			assert.Equal(t, [][]int{{0}}, y.LoD())
			assert.True(t, y.IsContiguous())
			v, err := y.Reshape(4, 0)
			require.NoError(t, err)
			assert.Equal(t, []int{4, 0}, v.Shape())
			require.NoError(t, y.Release())
			require.NoError(t, x.Release())
		})
	}
}

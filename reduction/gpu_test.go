package reduction

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/cudafake"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/tensor"
)

// gpuFake is the driver the GPU tests of this package run on; the fake
// lets one process play producer and consumer.
var gpuFake = cudafake.New(1)

func useFakeGPU(t *testing.T) {
	t.Helper()
	cuda.UseDriver(gpuFake)
}

func TestGPUTensorThroughTheCodec(t *testing.T) {
	useFakeGPU(t)
	leakcheck.Check(t)
	x, err := tensor.On(device.GPU(0)).Arange(tensor.Float32, 12)
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
	useFakeGPU(t)
	leakcheck.Check(t)
	live := gpuFake.Live()
	x, err := tensor.On(device.GPU(0)).Full(tensor.Int32, 7, 8)
	require.NoError(t, err)
	meta, fd, tok, err := reduce(x, nil, nil)
	require.NoError(t, err)
	require.NotNil(t, tok)
	assert.Equal(t, StrategyCUDAIPC, meta.Strategy)
	assert.Equal(t, tok.(*mmapalloc.Ticket).FD(), fd, "the message carries the token's ticket")

	// As a receiver that never held this memory: forget the producer's
	// entry in the cache.
	storages.mu.Lock()
	delete(storages.m, gpuKey(cuda.IPCMemHandle(meta.IPC), meta.DevOffset))
	storages.mu.Unlock()
	meta.FD = 0
	y, err := Rebuild(meta, []int{fd})
	require.NoError(t, err)
	tok.Done() // delivered: the receiver holds the token itself
	assert.NotSame(t, x.Storage(), y.Storage())
	assert.Equal(t, device.GPU(0), y.Place())
	assert.True(t, tensor.Equal(x, y))
	require.NoError(t, y.Storage().Buffer().Write([]byte{1, 0, 0, 0}, 0))
	v, err := x.To(device.CPU())
	require.NoError(t, err)
	first, err := tensor.At[int32](v, 0)
	require.NoError(t, err)
	assert.Equal(t, int32(1), first, "the producer sees the receiver's write")

	require.NoError(t, x.Release())
	assert.Equal(t, live+1, gpuFake.Live(), "the receiver still holds the producer's memory")
	require.NoError(t, y.Release())
	rt, err := cuda.Default()
	require.NoError(t, err)
	rt.CollectLimbo()
	assert.Equal(t, live, gpuFake.Live(), "released everywhere: freed")
	assert.Equal(t, 0, gpuFake.Opened())
}

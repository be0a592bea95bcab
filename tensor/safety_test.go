package tensor_test

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/tensor"
)

// The safety net holds every storage in shared memory or on a device
// until it is released or collected, and gives back the memory of those
// collected unreleased.
func TestSafetyNet(t *testing.T) {
	leakcheck.Check(t) // fails if a collected storage's block was not released
	dev, be := hostDevice(t, "net_dev", 0)

	base := tensor.Armed()
	const n = 64
	xs := make([]*tensor.Tensor, 0, n+1)
	for range n {
		x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
		require.NoError(t, err)
		xs = append(xs, x)
	}
	heap, err := tensor.Zeros(tensor.Uint8, 4<<10)
	require.NoError(t, err)
	assert.Equal(t, base+n, tensor.Armed(), "heap memory needs no net")
	require.NoError(t, heap.ShareMemory())
	assert.Equal(t, base+n+1, tensor.Armed(), "shared in place: netted")
	xs = append(xs, heap)
	d, err := tensor.On(dev).Zeros(tensor.Float32, 4)
	require.NoError(t, err)
	assert.Equal(t, dev, d.Place())
	assert.Equal(t, base+n+2, tensor.Armed(), "device memory is netted")

	s := xs[0].Storage()
	assert.Equal(t, s.Weak(), s.Weak(), "one weak pointer per storage")
	assert.Same(t, s, s.Weak().Value())

	for _, x := range xs[:n/2] {
		require.NoError(t, x.Release())
	}
	require.NoError(t, xs[0].Release(), "releasing twice is harmless")
	assert.Equal(t, base+n/2+2, tensor.Armed(), "Release takes its storage out of the net")

	// Drop the rest unreleased: the net gives their memory back.
	xs, d = nil, nil
	require.Eventually(t, func() bool {
		runtime.GC()
		be.mu.Lock()
		defer be.mu.Unlock()
		return tensor.Armed() == base && be.live == 0
	}, 5*time.Second, 10*time.Millisecond, "collected storages leave the net, their memory freed")
}

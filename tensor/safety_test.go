package tensor_test

import (
	"runtime"
	"sync"
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
	assert.Same(t, s.Ref(), s.Ref(), "one reference per storage")
	assert.Same(t, s, s.Ref().Value())

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

// A storage's reference holds it until the first collection it lives
// through, then weakly: a live storage is always found through it, a
// released one at once no more, a dropped one after collections.
func TestStorageRefAges(t *testing.T) {
	leakcheck.Check(t)
	base := tensor.Armed()

	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
	require.NoError(t, err)
	r := x.Storage().Ref()
	assert.True(t, tensor.Young(r), "a storage in shared memory starts young")
	require.Eventually(t, func() bool {
		runtime.GC()
		return !tensor.Young(r)
	}, 5*time.Second, 10*time.Millisecond, "the sweep after a collection makes the reference weak")
	assert.Same(t, x.Storage(), r.Value(), "a live storage is found after it aged")
	assert.Same(t, r, x.Storage().Ref())

	y, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
	require.NoError(t, err)
	ry := y.Storage().Ref()
	require.NoError(t, y.Release())
	assert.Nil(t, ry.Value(), "a storage released young is let go at once")

	h, err := tensor.Zeros(tensor.Uint8, 16)
	require.NoError(t, err)
	rh := h.Storage().Ref()
	assert.False(t, tensor.Young(rh), "a storage the net does not hold is referred to weakly from the start")
	assert.Same(t, h.Storage(), rh.Value())

	assert.Equal(t, base+1, tensor.Armed())
	x, h = nil, nil
	require.Eventually(t, func() bool {
		runtime.GC()
		return r.Value() == nil && rh.Value() == nil && tensor.Armed() == base
	}, 5*time.Second, 10*time.Millisecond, "dropped storages are collected through their references, their memory given back")
}

// References are made, read, aged and let go from many goroutines at
// once, with collections running: under the race detector this checks
// that the net, Release and Value agree on who holds what.
func TestStorageRefConcurrent(t *testing.T) {
	leakcheck.Check(t)
	base := tensor.Armed()
	stop := make(chan struct{})
	gcDone := make(chan struct{})
	go func() {
		defer close(gcDone)
		for {
			select {
			case <-stop:
				return
			default:
				runtime.GC()
			}
		}
	}()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 500 {
				x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
				if !assert.NoError(t, err) {
					return
				}
				r := x.Storage().Ref()
				if !assert.Same(t, x.Storage(), r.Value(), "a live storage is found through its reference") {
					return
				}
				if (g+i)%2 == 0 {
					assert.NoError(t, x.Release())
					if s := r.Value(); s != nil {
						assert.True(t, s.Released(), "a released storage is found released, or not at all")
					}
				}
				// Odd ones are dropped unreleased, for the net.
			}
		})
	}
	wg.Wait()
	close(stop)
	<-gcDone
	require.Eventually(t, func() bool {
		runtime.GC()
		return tensor.Armed() == base
	}, 5*time.Second, 10*time.Millisecond, "every storage left the net")
}

// A heap storage, which the net does not hold, gets its reference at the
// first Ref, from whichever of many goroutines asks first, and the
// others find that one: under the race detector this checks that a
// storage others can see sets its reference atomically.
func TestStorageRefFirstAskedFromManyGoroutines(t *testing.T) {
	refsAskedAtOnce(t, nil)
}

// refsAskedAtOnce has four goroutines at once ask a new heap storage for
// its reference, with alongside, if not nil, run on the storage's tensor
// on a fifth, fifty times, and checks that they all got one reference,
// the storage's.
func refsAskedAtOnce(t *testing.T, alongside func(x *tensor.Tensor)) {
	t.Helper()
	for range 50 {
		x, err := tensor.Zeros(tensor.Uint8, 64)
		require.NoError(t, err)
		s := x.Storage()
		refs := make([]*tensor.StorageRef, 4)
		var wg sync.WaitGroup
		if alongside != nil {
			wg.Go(func() { alongside(x) })
		}
		for g := range refs {
			wg.Go(func() { refs[g] = s.Ref() })
		}
		wg.Wait()
		for _, r := range refs {
			require.Same(t, refs[0], r)
		}
		require.Same(t, s, refs[0].Value())
		require.NoError(t, x.Release())
	}
}

// A reference made between two sweeps stays young through the first sweep
// that follows, whose collection may have begun before the storage was
// made, and turns weak at the second: most storages are released before
// then and never cost the runtime a weak handle.
func TestStorageRefAgesAtTheSecondSweep(t *testing.T) {
	leakcheck.Check(t)
	tensor.Sweep()
	tensor.Sweep() // the net's count of sweeps is past 2, as in any long-running process
	for attempt := 0; ; attempt++ {
		require.Less(t, attempt, 100, "collections kept sweeping between the test's own sweeps")
		before := tensor.Sweeps()
		x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
		require.NoError(t, err)
		r := x.Storage().Ref()
		tensor.Sweep()
		young := tensor.Young(r)
		if tensor.Sweeps() != before+1 {
			require.NoError(t, x.Release()) // a collection swept too: try again
			continue
		}
		assert.True(t, young, "young through the first sweep after it was made")
		tensor.Sweep()
		assert.False(t, tensor.Young(r), "weak from the second sweep on")
		assert.Same(t, x.Storage(), r.Value())
		require.NoError(t, x.Release())
		return
	}
}

// A live storage is found through its reference while a sweep ages it:
// the weak pointer is set before the reference lets the storage go.
func TestStorageRefFoundWhileItAges(t *testing.T) {
	leakcheck.Check(t)
	const n = 256
	xs := make([]*tensor.Tensor, n)
	refs := make([]*tensor.StorageRef, n)
	for round := range 200 {
		for i := range xs {
			x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 64)
			require.NoError(t, err)
			xs[i], refs[i] = x, x.Storage().Ref()
		}
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			for {
				for i, r := range refs {
					if r.Value() == nil {
						t.Errorf("round %d: live storage %d not found through its reference", round, i)
						return
					}
				}
				select {
				case <-stop:
					return
				default:
				}
			}
		})
		tensor.Sweep()
		tensor.Sweep()
		tensor.Sweep()
		close(stop)
		wg.Wait()
		for _, x := range xs {
			require.NoError(t, x.Release())
		}
		if t.Failed() {
			return
		}
	}
}

package tensor_test

import (
	"errors"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// userMemory is host memory of the caller's own, such as a mapping of a
// file, with a count of its releases.
type userMemory struct {
	b        []byte
	releases atomic.Int32
}

func (u *userMemory) Bytes() []byte  { return u.b }
func (u *userMemory) Size() int64    { return int64(len(u.b)) }
func (u *userMemory) Release() error { u.releases.Add(1); return nil }

func TestNewStorageOwnsItsBacking(t *testing.T) {
	u := &userMemory{b: []byte{1, 2, 3, 4}}
	s, err := tensor.NewStorage(device.CPU(), u)
	require.NoError(t, err)
	assert.Same(t, u, s.Backing())
	assert.Equal(t, int64(4), s.Size())
	assert.False(t, s.IsShared(), "memory package tensor does not know is private")
	x, err := tensor.FromStorage(s, tensor.Uint8, 0, []int{4}, []int{1})
	require.NoError(t, err)
	require.NoError(t, tensor.Set[uint8](x, 9, 0))
	assert.Equal(t, byte(9), u.b[0], "the tensor writes into the backing")

	require.NoError(t, s.Release())
	require.NoError(t, s.Release())
	assert.Equal(t, int32(1), u.releases.Load(), "released once")
	assert.Nil(t, s.Backing(), "a released storage has no backing")
}

func TestShareMemoryGivesBackAPrivateBacking(t *testing.T) {
	for _, st := range strategy.All() {
		t.Run(st.String(), func(t *testing.T) {
			leakcheck.Check(t)
			u := &userMemory{b: []byte{1, 2, 3, 4}}
			s, err := tensor.NewStorage(device.CPU(), u)
			require.NoError(t, err)
			require.NoError(t, s.ShareMemory(st))
			assert.True(t, s.IsShared())
			assert.Equal(t, int32(1), u.releases.Load(), "the copied-out memory is given back")
			assert.Equal(t, []byte{1, 2, 3, 4}, s.Bytes())
			switch s.Backing().(type) {
			case *shm.Block, *shm.Allocation:
			default:
				t.Errorf("shared memory of %T", s.Backing())
			}
			require.NoError(t, s.Release())
			assert.Equal(t, int32(1), u.releases.Load(), "not released again")
		})
	}
}

func TestNewStorageRefusesMemoryOnTheWrongPlace(t *testing.T) {
	gpu, _ := hostDevice(t, "backing_dev", 0)
	dev, err := tensor.On(gpu).Zeros(tensor.Float32, 2)
	require.NoError(t, err)
	defer dev.Release()
	buf, ok := dev.Storage().Backing().(tensor.Buffer)
	require.True(t, ok, "device memory is a Buffer")
	assert.True(t, dev.IsShared(), "device memory crosses processes by its backend's handles")

	for _, c := range []struct {
		name string
		p    device.Place
		b    tensor.Backing
	}{
		{"device memory on the CPU", device.CPU(), buf},
		{"host memory on a device", gpu, &userMemory{b: make([]byte, 8)}},
		{"host memory whose bytes are short of its size", device.CPU(), shortMemory{}},
		{"an invalid place", device.GPU(-1), buf},
		{"no memory", device.CPU(), nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := tensor.NewStorage(c.p, c.b)
			assert.Error(t, err)
		})
	}
}

// shortMemory says it has more bytes than it gives.
type shortMemory struct{}

func (shortMemory) Bytes() []byte  { return make([]byte, 2) }
func (shortMemory) Size() int64    { return 8 }
func (shortMemory) Release() error { return errors.New("not made, not released") }

func TestBackingOfHeapMemory(t *testing.T) {
	x, err := tensor.FromSlice([]float32{1, 2})
	require.NoError(t, err)
	b := x.Storage().Backing()
	require.NotNil(t, b)
	assert.Equal(t, int64(8), b.Size())
	assert.Equal(t, x.Storage().Bytes(), b.Bytes())
	require.NoError(t, x.Release())
	assert.Nil(t, x.Storage().Backing())
}

// ShareMemory of a storage on a private backing of the caller's takes that
// backing out of the safety net as it gives it back, for an empty storage
// too: the net holds only the shared memory, Release takes that out, and
// neither is given back twice.
func TestShareMemoryTakesAPrivateBackingOutOfTheNet(t *testing.T) {
	for _, size := range []int{4, 0} {
		t.Run(fmt.Sprint(size, " bytes"), func(t *testing.T) {
			leakcheck.Check(t)
			base := tensor.Armed()
			u := &userMemory{b: make([]byte, size)}
			s, err := tensor.NewStorage(device.CPU(), u)
			require.NoError(t, err)
			assert.Equal(t, base+1, tensor.Armed(), "a backing of the caller's is netted")
			r := s.Ref()
			require.NoError(t, s.ShareMemory(strategy.Get()))
			assert.Equal(t, int32(1), u.releases.Load(), "the private backing is given back")
			want := base + 1
			if size == 0 {
				want = base // an empty storage needs no shared memory
			}
			assert.Equal(t, want, tensor.Armed(), "the private backing left the net")
			assert.Same(t, r, s.Ref(), "sharing keeps the storage's reference")
			require.NoError(t, s.Release())
			assert.Equal(t, base, tensor.Armed(), "Release takes the storage out of the net, once")
			assert.Equal(t, int32(1), u.releases.Load(), "not released again")
		})
	}
}

// A heap storage whose reference is asked for while it moves into shared
// memory has one reference, set atomically: under the race detector this
// checks the store of a reference that ShareMemory makes.
func TestRefWhileSharing(t *testing.T) {
	leakcheck.Check(t)
	refsAskedAtOnce(t, func(x *tensor.Tensor) { assert.NoError(t, x.ShareMemory()) })
}

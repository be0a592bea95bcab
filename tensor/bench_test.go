package tensor_test

import (
	"testing"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/tensor"
)

// BenchmarkShared4K makes 4 KiB tensors in shared memory and keeps the
// last window of them alive, as the producer of spawn bench's stream
// does: each new tensor takes a recycled block that has left the caches.
// Zeros clears it; Empty does not.
func BenchmarkShared4K(b *testing.B) {
	const window = 4096
	shared := tensor.On(device.CPU()).Shared()
	for _, c := range []struct {
		name string
		make func(tensor.DType, ...int) (*tensor.Tensor, error)
	}{{"Zeros", shared.Zeros}, {"Empty", shared.Empty}} {
		b.Run(c.name, func(b *testing.B) {
			live := make([]*tensor.Tensor, window)
			defer func() {
				for _, x := range live {
					if x != nil {
						_ = x.Release()
					}
				}
			}()
			i := 0
			for b.Loop() {
				x, err := c.make(tensor.Uint8, 4<<10)
				if err != nil {
					b.Fatal(err)
				}
				if old := live[i]; old != nil {
					_ = old.Release()
				}
				live[i] = x
				i = (i + 1) % window
			}
		})
	}
}

// BenchmarkNewStorage wraps memory in a Storage and a tensor on it, as a
// receiver does for each tensor a message names, and releases the one
// made a window before: the cost package tensor adds to each tensor
// received, without the memory's own.
func BenchmarkNewStorage(b *testing.B) {
	const window = 4096
	mem := &heldBytes{make([]byte, 4<<10)}
	live := make([]*tensor.Tensor, window)
	defer func() {
		for _, x := range live {
			if x != nil {
				_ = x.Release()
			}
		}
	}()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		s, err := tensor.NewStorage(device.CPU(), mem)
		if err != nil {
			b.Fatal(err)
		}
		x, err := tensor.FromStorage(s, tensor.Int64, 0, []int{512}, []int{1})
		if err != nil {
			b.Fatal(err)
		}
		if old := live[i]; old != nil {
			_ = old.Release()
		}
		live[i] = x
		i = (i + 1) % window
	}
}

// heldBytes is host memory that something else owns: Release gives
// nothing back.
type heldBytes struct{ b []byte }

func (h *heldBytes) Bytes() []byte  { return h.b }
func (h *heldBytes) Size() int64    { return int64(len(h.b)) }
func (h *heldBytes) Release() error { return nil }

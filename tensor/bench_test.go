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

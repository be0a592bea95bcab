package tensor_test

import (
	"testing"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/tensor"
)

// BenchmarkShared4K makes 4 KiB tensors in shared memory and keeps the
// last window of them alive, as the producer of spawn bench's stream
// does: each new tensor takes a recycled block that has left the caches.
// Zeros clears it; Empty does not.
func BenchmarkShared4K(b *testing.B) {
	shared := tensor.On(device.CPU()).Shared()
	for _, c := range []struct {
		name string
		make func(tensor.DType, ...int) (*tensor.Tensor, error)
	}{{"Zeros", shared.Zeros}, {"Empty", shared.Empty}} {
		b.Run(c.name, func(b *testing.B) {
			benchWindow(b, func() (*tensor.Tensor, error) { return c.make(tensor.Uint8, 4<<10) })
		})
	}
}

// BenchmarkNewStorage wraps memory in a Storage and a tensor on it, as a
// receiver does for each tensor a message names, and releases the one
// made a window before: the cost package tensor adds to each tensor
// received, without the memory's own.
func BenchmarkNewStorage(b *testing.B) {
	mem := &heldBytes{make([]byte, 4<<10)}
	benchWindow(b, func() (*tensor.Tensor, error) {
		s, err := tensor.NewStorage(device.CPU(), mem)
		if err != nil {
			return nil, err
		}
		return tensor.FromStorage(s, tensor.Int64, 0, []int{512}, []int{1})
	})
}

// BenchmarkTensorObjects allocates the heap objects a tensor is, for
// each iteration, and keeps the last window of them alive as benchWindow
// does, doing nothing else with them: what the allocator and the
// collector cost each tensor a process makes or receives, beneath this
// package's own work. Tensor: the Tensor alone, the least a tensor handed
// to a caller is; Storage: what NewStorage allocates, a Storage with its
// spare Tensor, and its memory's record with the Storage's reference.
func BenchmarkTensorObjects(b *testing.B) {
	b.Run("Tensor", func(b *testing.B) { benchObjects(b, func() *tensor.Tensor { return new(tensor.Tensor) }) })
	b.Run("Storage", func(b *testing.B) { benchObjects(b, func() *tensor.Storage { return tensor.BareStorage(4 << 10) }) })
}

// benchObjects keeps what next returns for each of b's iterations alive
// for the last benchWindowSize of them, and drops it then.
func benchObjects[T any](b *testing.B, next func() *T) {
	live := make([]*T, benchWindowSize)
	b.ReportAllocs()
	cpu := testmain.ProcessCPU()
	i := 0
	for b.Loop() {
		live[i] = next()
		i = (i + 1) % benchWindowSize
	}
	b.ReportMetric(float64(testmain.ProcessCPU()-cpu)/float64(b.N), "cpu-ns/op")
}

// benchWindowSize is how many of the tensors, or objects, a benchmark
// made last it keeps alive: as many as a stream's writer has in flight.
const benchWindowSize = 4096

// benchWindow makes a tensor with next for each of b's iterations and
// keeps the last window of them alive, releasing each as it leaves the
// window, and the rest once b is done.
func benchWindow(b *testing.B, next func() (*tensor.Tensor, error)) {
	live := make([]*tensor.Tensor, benchWindowSize)
	defer func() {
		for _, x := range live {
			if x != nil {
				_ = x.Release()
			}
		}
	}()
	b.ReportAllocs()
	cpu := testmain.ProcessCPU()
	i := 0
	for b.Loop() {
		x, err := next()
		if err != nil {
			b.Fatal(err)
		}
		if old := live[i]; old != nil {
			_ = old.Release()
		}
		live[i] = x
		i = (i + 1) % benchWindowSize
	}
	b.ReportMetric(float64(testmain.ProcessCPU()-cpu)/float64(b.N), "cpu-ns/op")
}

// heldBytes is host memory that something else owns: Release gives
// nothing back.
type heldBytes struct{ b []byte }

func (h *heldBytes) Bytes() []byte  { return h.b }
func (h *heldBytes) Size() int64    { return int64(len(h.b)) }
func (h *heldBytes) Release() error { return nil }

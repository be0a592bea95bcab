package mp_test

import (
	"context"
	"testing"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// BenchmarkQueueNewTensor4K is the stream's per-tensor cost in one
// process: make a 4 KiB tensor, share and send it, receive it, release
// both ends.
func BenchmarkQueueNewTensor4K(b *testing.B) {
	q, err := mp.NewQueue()
	if err != nil {
		b.Fatal(err)
	}
	defer q.Close()
	ctx := context.Background()
	cpu := tensor.On(device.CPU())
	b.ReportAllocs()
	for b.Loop() {
		x, err := cpu.Zeros(tensor.Uint8, 4<<10)
		if err != nil {
			b.Fatal(err)
		}
		if err := q.Put(ctx, x); err != nil {
			b.Fatal(err)
		}
		var y *tensor.Tensor
		if err := q.Get(ctx, &y); err != nil {
			b.Fatal(err)
		}
		_ = x.Release()
	}
}

// BenchmarkQueueSharedTensor is one hop of an already-shared tensor.
func BenchmarkQueueSharedTensor(b *testing.B) {
	q, err := mp.NewQueue()
	if err != nil {
		b.Fatal(err)
	}
	defer q.Close()
	ctx := context.Background()
	x, err := tensor.On(device.CPU()).Zeros(tensor.Uint8, 1<<20)
	if err != nil {
		b.Fatal(err)
	}
	defer x.Release()
	b.ReportAllocs()
	for b.Loop() {
		if err := q.Put(ctx, x); err != nil {
			b.Fatal(err)
		}
		var y *tensor.Tensor
		if err := q.Get(ctx, &y); err != nil {
			b.Fatal(err)
		}
	}
}

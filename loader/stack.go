package loader

import (
	"context"
	"fmt"
	"slices"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/tensor"
)

// Stack stacks tensors of one dtype and shape into one tensor in shared
// memory with a new first dimension (torch.stack). Tensors that lie side
// by side in one storage, in order, as Zeros makes a batch's samples, are
// returned as a view of it: nothing is copied.
func Stack(ts []*tensor.Tensor) (*tensor.Tensor, error) {
	if len(ts) == 0 {
		return nil, fmt.Errorf("loader: stack: no tensors")
	}
	first := ts[0]
	dt, shape := first.DType(), first.Shape()
	for i, t := range ts {
		if t == nil {
			return nil, fmt.Errorf("loader: stack: tensor %d is nil", i)
		}
		if t.DType() != dt || !slices.Equal(t.Shape(), shape) {
			return nil, fmt.Errorf("loader: stack: tensor %d is %v %v, tensor 0 %v %v", i, t.DType(), t.Shape(), dt, shape)
		}
	}
	full := append([]int{len(ts)}, shape...)
	if adjacent(ts) {
		return viewAt(first.Storage(), dt, first.Offset(), full)
	}
	out, err := tensor.On(device.CPU()).Shared().Empty(dt, full...)
	if err != nil {
		return nil, err
	}
	for i, t := range ts {
		row, err := out.Narrow(0, i, 1)
		if err == nil {
			row, err = row.Reshape(shape...)
		}
		if err == nil {
			err = tensor.Copy(row, t)
		}
		if err != nil {
			_ = out.Release()
			return nil, fmt.Errorf("loader: stack: tensor %d: %w", i, err)
		}
	}
	return out, nil
}

// adjacent reports whether ts are contiguous views that follow each other
// in one shared storage.
func adjacent(ts []*tensor.Tensor) bool {
	s, size := ts[0].Storage(), ts[0].Nbytes()
	if !s.IsShared() {
		return false
	}
	for i, t := range ts {
		if t.Storage() != s || !t.IsContiguous() || t.Offset() != ts[0].Offset()+int64(i)*size {
			return false
		}
	}
	return true
}

// viewAt returns the contiguous tensor of shape at byte offset off of s.
func viewAt(s *tensor.Storage, dt tensor.DType, off int64, shape []int) (*tensor.Tensor, error) {
	flat, err := tensor.FromStorage(s, dt, off, []int{tensor.Numel(shape...)}, []int{1})
	if err != nil {
		return nil, err
	}
	return flat.Reshape(shape...)
}

// arena is where the samples of the batch being fetched are made: the
// k-th tensor a sample makes with Zeros is row slot of the batch's k-th
// part, so that stacking the samples copies nothing.
type arena struct {
	n     int // samples in the batch
	slot  int // the sample being fetched
	calls int // Zeros calls the sample has made
	parts []*tensor.Tensor
}

type arenaKey struct{}

// reset readies a for a batch of n samples; the parts of the last batch
// are the caller's to release.
func (a *arena) reset(n int) {
	a.n, a.slot, a.calls, a.parts = n, 0, 0, nil
}

// next readies a for the batch's sample slot.
func (a *arena) next(slot int) { a.slot, a.calls = slot, 0 }

// release releases the parts made for the last batch.
func (a *arena) release() {
	for _, p := range a.parts {
		_ = p.Release()
	}
	a.parts = nil
}

// Zeros returns a tensor of zeros in shared memory for the sample a
// dataset's Get (or an Iterable's All) is making: in a loader it is a row
// of a batch-sized tensor, next to the same tensor of the batch's other
// samples, so that the default collate stacks them without copying (the
// counterpart of a torch dataset writing into pinned memory). Elsewhere
// it is tensor.On(device.CPU()).Shared().Zeros. A sample's tensors must
// be made in the same order, of the same dtypes and shapes, sample after
// sample, to lie in their batch; others are made on their own.
func Zeros(ctx context.Context, dt tensor.DType, shape ...int) (*tensor.Tensor, error) {
	a, _ := ctx.Value(arenaKey{}).(*arena)
	if a == nil || a.n < 1 || a.slot >= a.n {
		return tensor.On(device.CPU()).Shared().Zeros(dt, shape...)
	}
	k := a.calls
	a.calls++
	if k == len(a.parts) {
		if a.slot != 0 {
			return tensor.On(device.CPU()).Shared().Zeros(dt, shape...)
		}
		p, err := tensor.On(device.CPU()).Shared().Zeros(dt, append([]int{a.n}, shape...)...)
		if err != nil {
			return nil, err
		}
		a.parts = append(a.parts, p)
	}
	p := a.parts[k]
	if p.DType() != dt || !slices.Equal(p.Shape()[1:], shape) {
		return tensor.On(device.CPU()).Shared().Zeros(dt, shape...)
	}
	size := p.Nbytes() / int64(a.n)
	return viewAt(p.Storage(), dt, p.Offset()+int64(a.slot)*size, shape)
}

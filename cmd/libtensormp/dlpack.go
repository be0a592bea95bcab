package main

/*
#include <stdlib.h>
#include "dlpack.h"

extern void tensormp_dlpack_deleter(DLManagedTensor *m); // in abi.go

static void tensormp_call_deleter(DLManagedTensor *m) {
	if (m != NULL && m->deleter != NULL) {
		m->deleter(m);
	}
}

static void tensormp_set_deleter(DLManagedTensor *m) {
	m->deleter = tensormp_dlpack_deleter;
}

// A device address is no Go pointer: it goes into data from an integer.
static void tensormp_set_device_data(DLTensor *t, uint64_t addr) {
	t->data = (void *)(uintptr_t)addr;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/tensor"
)

// dlTypes maps tensormp's dtypes to DLPack's (code, bits); lanes are 1.
var dlTypes = map[tensor.DType][2]uint8{
	tensor.Bool:       {C.kDLBool, 8},
	tensor.Uint8:      {C.kDLUInt, 8},
	tensor.Int8:       {C.kDLInt, 8},
	tensor.Int16:      {C.kDLInt, 16},
	tensor.Int32:      {C.kDLInt, 32},
	tensor.Int64:      {C.kDLInt, 64},
	tensor.Float16:    {C.kDLFloat, 16},
	tensor.BFloat16:   {C.kDLBfloat, 16},
	tensor.Float32:    {C.kDLFloat, 32},
	tensor.Float64:    {C.kDLFloat, 64},
	tensor.Complex64:  {C.kDLComplex, 64},
	tensor.Complex128: {C.kDLComplex, 128},
}

func dtypeOf(t C.DLDataType) (tensor.DType, error) {
	if t.lanes == 1 {
		for d, dl := range dlTypes {
			if uint8(t.code) == dl[0] && uint8(t.bits) == dl[1] {
				return d, nil
			}
		}
	}
	return tensor.Invalid, fmt.Errorf("DLPack dtype (code %d, bits %d, lanes %d) has no tensormp dtype", t.code, t.bits, t.lanes)
}

// exportTable holds, for each DLManagedTensor made and not yet deleted,
// the storage it keeps held.
type exportTable struct {
	mu sync.Mutex
	m  map[*C.DLManagedTensor]*tensor.Storage
}

var exports = &exportTable{m: make(map[*C.DLManagedTensor]*tensor.Storage)}

// toDLPack makes a DLManagedTensor viewing t's memory, holding its
// storage until the consumer calls the deleter. as, if valid, is the
// dtype DLPack is told, of the same size as t's. The struct, shape and
// strides are one C allocation, freed by the deleter.
//
// A GPU tensor's memory is ready on every stream: it was received (and
// its producer's work waited for) or made here, and what this library
// queues on it is waited for before the caller gets it back.
func toDLPack(t *tensor.Tensor, as tensor.DType) (*C.DLManagedTensor, error) {
	dt := t.DType()
	if as != tensor.Invalid {
		if as.Size() != dt.Size() {
			return nil, fmt.Errorf("dtype %v cannot stand for %v", as, dt)
		}
		dt = as
	}
	s := t.Storage()
	if s.Released() {
		return nil, tensor.ErrReleased
	}
	var host []byte
	var gpu cudaMemory
	switch p := s.Place(); {
	case p.IsCPU():
		if !s.IsShared() {
			return nil, errors.New("tensor is not in shared memory")
		}
		host = s.Bytes()
	case p.IsGPU():
		var ok bool
		if gpu, ok = s.Backing().(cudaMemory); !ok {
			return nil, fmt.Errorf("tensor on %s has no CUDA memory", p)
		}
	default:
		return nil, fmt.Errorf("tensor on %s: only CPU and CUDA tensors are exported through DLPack", p)
	}
	shape, strides := t.Shape(), t.Strides()
	nd := len(shape)
	size := C.size_t(unsafe.Sizeof(C.DLManagedTensor{})) + C.size_t(2*nd)*8
	m := (*C.DLManagedTensor)(C.calloc(1, size))
	if m == nil {
		return nil, errors.New("out of memory for a DLManagedTensor")
	}
	dims := unsafe.Slice((*C.int64_t)(unsafe.Add(unsafe.Pointer(m), unsafe.Sizeof(*m))), 2*nd)
	for i := range nd {
		dims[i] = C.int64_t(shape[i])
		dims[nd+i] = C.int64_t(strides[i])
	}
	dl := &m.dl_tensor
	// A tensor with no bytes still gets a pointer that is not NULL: some
	// consumers refuse NULL. Nothing is read through it.
	dl.data = unsafe.Pointer(m)
	dl.device = C.DLDevice{device_type: C.kDLCPU}
	switch {
	case gpu != nil:
		dl.device = C.DLDevice{device_type: C.kDLCUDA, device_id: C.int32_t(gpu.Device())}
		if s.Size() > 0 {
			C.tensormp_set_device_data(dl, C.uint64_t(uint64(gpu.Ptr())+uint64(t.Offset())))
		}
	case len(host) > 0:
		dl.data = unsafe.Add(unsafe.Pointer(unsafe.SliceData(host)), t.Offset())
	}
	dl.ndim = C.int32_t(nd)
	code := dlTypes[dt]
	dl.dtype = C.DLDataType{code: C.uint8_t(code[0]), bits: C.uint8_t(code[1]), lanes: 1}
	if nd > 0 {
		dl.shape = &dims[0]
		dl.strides = &dims[nd]
	}
	C.tensormp_set_deleter(m)
	holds.hold(s)
	exports.mu.Lock()
	exports.m[m] = s
	exports.mu.Unlock()
	return m, nil
}

// fromDLPack returns a tensor for a DLPack tensor: on the same storage
// when its memory lies in a storage this process holds (a tensor it
// received, or made with tensormp_empty), else a copy in new memory:
// shared memory for a CPU tensor, laid out compact; memory of the same
// GPU for a CUDA tensor, laid out as the original (the bytes its elements
// span are copied whole, on the device). as, if valid, overrides the
// element type of the same size (a bool tensor sent as uint8). It
// consumes m: its deleter is called before fromDLPack returns, and a copy
// from a GPU is done by then. The tensor returned holds its storage once;
// the caller drops it.
func fromDLPack(m *C.DLManagedTensor, as tensor.DType) (*tensor.Tensor, error) {
	if m == nil {
		return nil, errors.New("DLManagedTensor is NULL")
	}
	defer consume(m)
	dl := &m.dl_tensor
	place := device.CPU()
	switch dl.device.device_type {
	case C.kDLCPU, C.kDLCUDAHost:
	case C.kDLCUDA:
		if dl.device.device_id < 0 {
			return nil, fmt.Errorf("DLPack CUDA device %d", dl.device.device_id)
		}
		place = device.GPU(int(dl.device.device_id))
	default:
		return nil, fmt.Errorf("DLPack device type %d: only CPU and CUDA memory is taken", dl.device.device_type)
	}
	dt, err := dtypeOf(dl.dtype)
	if err != nil {
		return nil, err
	}
	if as != tensor.Invalid {
		if as.Size() != dt.Size() {
			return nil, fmt.Errorf("dtype %v cannot stand for DLPack's %v", as, dt)
		}
		dt = as
	}
	nd := int(dl.ndim)
	if nd < 0 || nd > tensor.MaxDims {
		return nil, fmt.Errorf("DLPack tensor of %d dimensions (at most %d)", nd, tensor.MaxDims)
	}
	if nd > 0 && dl.shape == nil {
		return nil, errors.New("DLPack tensor without a shape")
	}
	shape := make([]int, nd)
	strides := make([]int, nd)
	compact := dl.strides == nil
	if nd > 0 {
		for i, n := range unsafe.Slice(dl.shape, nd) {
			if n < 0 {
				return nil, fmt.Errorf("DLPack shape has negative size %d in dimension %d", n, i)
			}
			shape[i] = int(n)
		}
		if !compact {
			for i, st := range unsafe.Slice(dl.strides, nd) {
				strides[i] = int(st)
			}
		}
	}
	if err := tensor.CheckView(dt, 0, shape, make([]int, nd), int64(dt.Size())); err != nil {
		return nil, err // the shape, before any arithmetic on it
	}
	if compact {
		strides = contiguous(shape)
	}
	lo, hi, empty, err := extent(dt, shape, strides)
	if err != nil {
		return nil, err
	}
	if empty {
		return newTensor(place, dt, shape)
	}
	// A CUDA tensor's address is no host memory: it is kept as an
	// integer, never as a pointer the collector would look at.
	p := uintptr(dl.data) + uintptr(dl.byte_offset)
	if lo == 0 {
		if s := holds.holdAt(place, p, uintptr(hi)); s != nil {
			base, _, _ := rangeOf(s)
			t, err := tensor.FromStorage(s, dt, int64(p-base), shape, strides)
			if err == nil {
				return t, nil
			}
			holds.drop(s) // not a view tensormp can express: copy it
		}
	}
	if place.IsGPU() {
		return copyCUDA(place, p, dt, shape, strides, lo, hi)
	}
	return copyForeign(unsafe.Add(dl.data, dl.byte_offset), dt, shape, strides)
}

// copyCUDA copies the bytes [p+lo, p+hi) of GPU memory this process does
// not hold into a new allocation on the same device and returns a tensor
// of the original layout on it. The copy is done when it returns.
func copyCUDA(place device.Place, p uintptr, dt tensor.DType, shape, strides []int, lo, hi int64) (*tensor.Tensor, error) {
	rt, err := cuda.Default()
	if err != nil {
		return nil, err
	}
	n := hi - lo
	b, err := rt.Alloc(place.Index(), n)
	if err != nil {
		return nil, err
	}
	if err := b.CopyIn(cuda.DevicePtr(int64(p)+lo), n); err != nil {
		return nil, errors.Join(err, b.Release())
	}
	s, err := tensor.NewStorage(place, b)
	if err != nil {
		return nil, errors.Join(err, b.Release())
	}
	return heldView(s, dt, -lo, shape, strides)
}

// consume calls m's deleter: the consumer is done with it.
func consume(m *C.DLManagedTensor) { C.tensormp_call_deleter(m) }

// extent returns the byte range [lo, hi) that a view's elements span
// relative to its first element's address (lo < 0 with negative strides),
// or empty when it has no elements. The shape is checked already.
func extent(dt tensor.DType, shape, strides []int) (lo, hi int64, empty bool, err error) {
	item := int64(dt.Size())
	for _, n := range shape {
		if n == 0 {
			return 0, 0, true, nil
		}
	}
	const limit = 1 << 62
	for i, n := range shape {
		st := int64(strides[i])
		if st > limit/item || st < -limit/item {
			return 0, 0, false, fmt.Errorf("DLPack stride %d overflows", st)
		}
		reach := int64(n-1) * st * item
		if int64(n-1) != 0 && reach/int64(n-1) != st*item {
			return 0, 0, false, fmt.Errorf("DLPack shape %v with strides %v overflows", shape, strides)
		}
		if reach < 0 {
			lo += reach
		} else {
			hi += reach
		}
		if lo < -limit || hi > limit {
			return 0, 0, false, fmt.Errorf("DLPack shape %v with strides %v overflows", shape, strides)
		}
	}
	return lo, hi + item, false, nil
}

// copyForeign copies the elements of a view of memory this process does
// not hold into new shared memory, compact.
func copyForeign(src unsafe.Pointer, dt tensor.DType, shape, strides []int) (*tensor.Tensor, error) {
	t, err := newTensor(device.CPU(), dt, shape)
	if err != nil {
		return nil, err
	}
	gather(t.Storage().Bytes(), src, dt.Size(), shape, strides)
	return t, nil
}

// newTensor returns a compact tensor of dt and shape in new memory on
// place, holding its storage once: the caller drops it. CPU memory is
// shared and not cleared (tensor.Factory.Empty); GPU memory is zeroed, and
// the zeroing is done when newTensor returns.
func newTensor(place device.Place, dt tensor.DType, shape []int) (*tensor.Tensor, error) {
	f := tensor.On(place)
	switch {
	case place.IsCPU():
		f = f.Shared()
	case !place.IsGPU():
		return nil, fmt.Errorf("tensors on %s: only CPU and CUDA tensors are made here", place)
	}
	t, err := f.Empty(dt, shape...)
	if err != nil {
		return nil, err
	}
	s := t.Storage()
	holds.hold(s)
	if b, ok := s.Backing().(cudaMemory); ok && s.Size() > 0 {
		if err := b.Sync(); err != nil {
			holds.drop(s)
			return nil, err
		}
	}
	return t, nil
}

// heldView returns a tensor of the view on s, a storage just made, and
// holds s once: the caller drops it. If the view is refused, dropping the
// hold gives s back.
func heldView(s *tensor.Storage, dt tensor.DType, off int64, shape, strides []int) (*tensor.Tensor, error) {
	holds.hold(s)
	t, err := tensor.FromStorage(s, dt, off, shape, strides)
	if err != nil {
		holds.drop(s)
		return nil, err
	}
	return t, nil
}

// gather copies the view at src (strides in elements of item bytes) into
// dst, compact. Runs that are contiguous in memory are copied whole.
func gather(dst []byte, src unsafe.Pointer, item int, shape, strides []int) {
	// Fold the innermost compact dimensions into one run.
	run, d := item, len(shape)
	for d > 0 && strides[d-1]*item == run {
		run *= shape[d-1]
		d--
	}
	var walk func(dim int, at unsafe.Pointer, out []byte) []byte
	walk = func(dim int, at unsafe.Pointer, out []byte) []byte {
		if dim == d {
			return out[copy(out, unsafe.Slice((*byte)(at), run)):]
		}
		for i := range shape[dim] {
			out = walk(dim+1, unsafe.Add(at, i*strides[dim]*item), out)
		}
		return out
	}
	walk(0, src, dst)
}

func contiguous(shape []int) []int {
	strides := make([]int, len(shape))
	step := 1
	for i := len(shape) - 1; i >= 0; i-- {
		strides[i] = step
		step *= max(shape[i], 1)
	}
	return strides
}

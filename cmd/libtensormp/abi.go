package main

/*
#include <stdint.h>
#include <stdlib.h>
#include "dlpack.h"

enum {
	TENSORMP_OK = 0,
	TENSORMP_ERROR = 1,     // see *err
	TENSORMP_TIMEOUT = 2,   // the timeout passed first; nothing was sent or taken
	TENSORMP_CLOSED = 3,    // the endpoint, or its peer, is closed
	TENSORMP_MALFORMED = 4, // the peer's message was not well formed; it was dropped, the endpoint goes on
};
*/
import "C"

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"
	"unsafe"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// status reports err through errOut (a C string the caller frees with
// tensormp_free) and returns its status code.
func status(err error, errOut **C.char) C.int {
	if err == nil {
		return C.TENSORMP_OK
	}
	if errOut != nil {
		*errOut = C.CString(err.Error())
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return C.TENSORMP_TIMEOUT
	case errors.Is(err, mp.ErrClosed):
		return C.TENSORMP_CLOSED
	case errors.Is(err, mp.ErrMalformed):
		return C.TENSORMP_MALFORMED
	}
	return C.TENSORMP_ERROR
}

// deadline returns a context that ends after timeoutMS milliseconds, or
// never when timeoutMS is negative.
func deadline(timeoutMS C.int64_t) (context.Context, context.CancelFunc) {
	if timeoutMS < 0 {
		return context.WithCancel(context.Background())
	}
	return context.WithTimeout(context.Background(), time.Duration(timeoutMS)*time.Millisecond)
}

func setHandle(out *C.int64_t, h int64) {
	if out != nil {
		*out = C.int64_t(h)
	}
}

// statuses names the status codes, for tensormp_statuses.
var statuses = map[string]C.int{
	"ok":        C.TENSORMP_OK,
	"error":     C.TENSORMP_ERROR,
	"timeout":   C.TENSORMP_TIMEOUT,
	"closed":    C.TENSORMP_CLOSED,
	"malformed": C.TENSORMP_MALFORMED,
}

// tensormp_statuses sets *out to a JSON object from the name of each
// status code ("ok", "error", "timeout", "closed", "malformed") to its
// value, which the caller frees with tensormp_free: a foreign binding
// reads the codes instead of restating them.
//
//export tensormp_statuses
func tensormp_statuses(out **C.char, errOut **C.char) C.int {
	if out == nil {
		return status(errors.New("no place for the status codes (out is NULL)"), errOut)
	}
	text, err := json.Marshal(statuses)
	if err == nil {
		*out = C.CString(string(text))
	}
	return status(err, errOut)
}

//export tensormp_free
func tensormp_free(p unsafe.Pointer) { C.free(p) }

// tensormp_shutdown is for a process about to exit: it gives the GPU
// contexts back, so that the CUDA driver removes the files it made in
// /dev/shm for this process's exports. GPU calls fail after it; CPU
// tensors keep working.
//
//export tensormp_shutdown
func tensormp_shutdown(errOut **C.char) C.int {
	return status(tensor.CloseBackends(), errOut)
}

//export tensormp_listen
func tensormp_listen(addr *C.char, mode C.uint32_t, out *C.int64_t, errOut **C.char) C.int {
	l, err := mp.Listen(C.GoString(addr), mp.WithMode(os.FileMode(mode)))
	if err == nil {
		setHandle(out, handles.add(l))
	}
	return status(err, errOut)
}

//export tensormp_accept
func tensormp_accept(listener C.int64_t, timeoutMS C.int64_t, out *C.int64_t, peerPID *C.int64_t, errOut **C.char) C.int {
	l, err := lookup[*mp.Listener](int64(listener))
	if err != nil {
		return status(err, errOut)
	}
	ctx, cancel := deadline(timeoutMS)
	defer cancel()
	p, cred, err := l.Accept(ctx)
	if err == nil {
		setHandle(out, handles.add(p))
		if peerPID != nil {
			*peerPID = C.int64_t(cred.PID)
		}
	}
	return status(err, errOut)
}

//export tensormp_dial
func tensormp_dial(addr *C.char, timeoutMS C.int64_t, out *C.int64_t, errOut **C.char) C.int {
	ctx, cancel := deadline(timeoutMS)
	defer cancel()
	p, err := mp.Dial(ctx, C.GoString(addr))
	if err == nil {
		setHandle(out, handles.add(p))
	}
	return status(err, errOut)
}

//export tensormp_queue_new
func tensormp_queue_new(capacity C.int64_t, out *C.int64_t, errOut **C.char) C.int {
	var opts []mp.QueueOption
	if capacity > 0 {
		opts = append(opts, mp.WithCapacity(int(capacity)))
	}
	q, err := mp.NewQueue(opts...)
	if err == nil {
		setHandle(out, handles.add(q))
	}
	return status(err, errOut)
}

//export tensormp_close
func tensormp_close(h C.int64_t, errOut **C.char) C.int {
	return status(handles.close(int64(h)), errOut)
}

// endpoint is what values are sent on and received from.
type endpoint interface {
	send(ctx context.Context, v any) error
	recv(ctx context.Context, v any) error
}

type queueEnd struct{ *mp.Queue }

func (q queueEnd) send(ctx context.Context, v any) error { return q.Put(ctx, v) }
func (q queueEnd) recv(ctx context.Context, v any) error { return q.Get(ctx, v) }

type pipeEnd struct{ *mp.Pipe }

func (p pipeEnd) send(ctx context.Context, v any) error { return p.Send(ctx, v) }
func (p pipeEnd) recv(ctx context.Context, v any) error { return p.Recv(ctx, v) }

func endpointOf(h C.int64_t) (endpoint, error) {
	obj, err := lookup[any](int64(h))
	if err != nil {
		return nil, err
	}
	switch x := obj.(type) {
	case *mp.Queue:
		return queueEnd{x}, nil
	case *mp.Pipe:
		return pipeEnd{x}, nil
	}
	return nil, errors.New("handle " + kindOf(obj) + " is neither a queue nor a pipe")
}

// tensormp_send sends the value whose JSON form is text on a queue (Put)
// or pipe (Send). The tensors in it are shared, not copied; the caller
// keeps its handles.
//
//export tensormp_send
func tensormp_send(h C.int64_t, text *C.char, timeoutMS C.int64_t, errOut **C.char) C.int {
	e, err := endpointOf(h)
	if err != nil {
		return status(err, errOut)
	}
	v, err := parseValue([]byte(C.GoString(text)))
	if err != nil {
		return status(err, errOut)
	}
	defer v.done()
	ctx, cancel := deadline(timeoutMS)
	defer cancel()
	return status(e.send(ctx, v.v), errOut)
}

// tensormp_recv receives a value from a queue (Get) or pipe (Recv) and
// sets *out to its JSON form, which the caller frees with tensormp_free.
// The handles in it are the caller's.
//
//export tensormp_recv
func tensormp_recv(h C.int64_t, timeoutMS C.int64_t, out **C.char, errOut **C.char) C.int {
	e, err := endpointOf(h)
	if err != nil {
		return status(err, errOut)
	}
	ctx, cancel := deadline(timeoutMS)
	defer cancel()
	text, err := receive(ctx, e)
	if err == nil && out != nil {
		*out = C.CString(string(text))
	}
	return status(err, errOut)
}

// receive receives a value and returns its JSON form. Its storages are
// held for the time it takes to name them (see holdTable).
func receive(ctx context.Context, e endpoint) ([]byte, error) {
	holds.beginReceive()
	var v any
	err := e.recv(ctx, &v)
	var got []*tensor.Storage
	var objs []any
	if err == nil {
		walk(v, func(o any) {
			objs = append(objs, o)
			if t, ok := o.(*tensor.Tensor); ok {
				got = append(got, t.Storage())
			}
		})
	}
	holds.endReceive(got)
	defer func() {
		for _, s := range got {
			holds.drop(s)
		}
	}()
	if err != nil {
		return nil, err
	}
	text, err := describe(v)
	if err != nil {
		for _, o := range objs {
			if _, ok := o.(*tensor.Tensor); !ok {
				_ = closeObject(o) // closing twice is harmless
			}
		}
		return nil, err
	}
	return text, nil
}

// tensormp_empty makes a tensor of the given dtype (by name: "float32",
// ...) and shape and sets *out to its handle. where names the device: NULL,
// "" or "cpu" for new shared memory, not cleared; "cuda:N" (or "gpu:N")
// for memory of GPU N, zeroed.
//
//export tensormp_empty
func tensormp_empty(dtype *C.char, shape *C.int64_t, ndim C.int32_t, where *C.char, out *C.int64_t, errOut **C.char) C.int {
	t, err := empty(C.GoString(dtype), shape, ndim, C.GoString(where))
	if err == nil {
		setHandle(out, handles.add(t))
		holds.drop(t.Storage())
	}
	return status(err, errOut)
}

func empty(name string, cshape *C.int64_t, ndim C.int32_t, where string) (*tensor.Tensor, error) {
	dt, err := tensor.ParseDType(name)
	if err != nil {
		return nil, err
	}
	place := device.CPU()
	if where != "" {
		if place, err = device.Parse(where); err != nil {
			return nil, err
		}
	}
	if ndim < 0 || ndim > tensor.MaxDims {
		return nil, fmt.Errorf("shape of %d dimensions (at most %d)", ndim, tensor.MaxDims)
	}
	if ndim > 0 && cshape == nil {
		return nil, errors.New("shape is NULL")
	}
	shape := make([]int, ndim)
	if ndim > 0 {
		for i, n := range unsafe.Slice(cshape, ndim) {
			shape[i] = int(n)
		}
	}
	return newTensor(place, dt, shape)
}

// tensormp_from_dlpack takes a DLPack tensor and sets *out to a handle to
// it: the same memory when it lies in a tensor this process received or
// made with tensormp_empty, else a copy in new shared memory. dtype, if
// not NULL or empty, names the element type to use instead of DLPack's, of
// the same size ("bool" for a tensor sent as uint8). It consumes m: m's
// deleter has been called when it returns, whatever it returns.
//
//export tensormp_from_dlpack
func tensormp_from_dlpack(m *C.DLManagedTensor, dtype *C.char, out *C.int64_t, errOut **C.char) C.int {
	as, err := parseAs(dtype)
	if err != nil {
		consume(m)
		return status(err, errOut)
	}
	t, err := fromDLPack(m, as)
	if err == nil {
		setHandle(out, handles.add(t))
		holds.drop(t.Storage())
	}
	return status(err, errOut)
}

// tensormp_describe sets *out to a tensor's JSON form (see the package
// doc), which the caller frees with tensormp_free.
//
//export tensormp_describe
func tensormp_describe(h C.int64_t, out **C.char, errOut **C.char) C.int {
	t, err := lookup[*tensor.Tensor](int64(h))
	if err != nil {
		return status(err, errOut)
	}
	text, err := json.Marshal(tensorForm(int64(h), t))
	if err == nil && out != nil {
		*out = C.CString(string(text))
	}
	return status(err, errOut)
}

// tensormp_to_dlpack sets *out to a DLManagedTensor viewing a tensor's
// memory. It holds the memory until its deleter is called, even if the
// handle is closed first. dtype, if not NULL or empty, names the element
// type DLPack is told instead of the tensor's, of the same size ("uint8"
// for a bool tensor, for consumers that take no DLPack bool).
//
//export tensormp_to_dlpack
func tensormp_to_dlpack(h C.int64_t, dtype *C.char, out **C.DLManagedTensor, errOut **C.char) C.int {
	if out == nil {
		return status(errors.New("no place for the DLManagedTensor (out is NULL)"), errOut)
	}
	as, err := parseAs(dtype)
	if err != nil {
		return status(err, errOut)
	}
	t, err := holdTensor(int64(h))
	if err != nil {
		return status(err, errOut)
	}
	defer holds.drop(t.Storage())
	m, err := toDLPack(t, as)
	if err == nil {
		*out = m
	}
	return status(err, errOut)
}

// parseAs parses an optional dtype name: NULL or empty is Invalid.
func parseAs(name *C.char) (tensor.DType, error) {
	if name == nil || *name == 0 {
		return tensor.Invalid, nil
	}
	return tensor.ParseDType(C.GoString(name))
}

//export tensormp_dlpack_deleter
func tensormp_dlpack_deleter(m *C.DLManagedTensor) {
	exports.mu.Lock()
	s, ok := exports.m[m]
	delete(exports.m, m)
	exports.mu.Unlock()
	if !ok {
		return // not ours, or deleted before: nothing to give back
	}
	// The consumer (PyTorch) calls the deleter as soon as its tensor
	// dies, with kernels on it still queued: the memory goes back to a
	// pool, whose next user (in any process) must not see them land.
	// cudaFree would wait; a pool waits here.
	if b, isGPU := s.Backing().(cudaMemory); isGPU {
		_ = b.SyncAll()
	}
	holds.drop(s)
	C.free(unsafe.Pointer(m))
}

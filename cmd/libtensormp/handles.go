package main

import (
	"fmt"
	"sync"

	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// handleTable names the objects the foreign caller holds. A handle is
// never reused, so a stale one fails instead of reaching another object.
type handleTable struct {
	mu   sync.Mutex
	last int64
	m    map[int64]any // *tensor.Tensor, *mp.Queue, *mp.Pipe, *mp.Listener
}

var handles = &handleTable{m: make(map[int64]any)}

// add names obj. A tensor's storage gains a hold, dropped by close.
func (t *handleTable) add(obj any) int64 {
	if x, ok := obj.(*tensor.Tensor); ok {
		holds.hold(x.Storage())
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.last++
	t.m[t.last] = obj
	return t.last
}

// lookup returns the object h names, if it is a T.
func lookup[T any](h int64) (T, error) {
	handles.mu.Lock()
	defer handles.mu.Unlock()
	return lookupLocked[T](h)
}

func lookupLocked[T any](h int64) (T, error) {
	var zero T
	obj, ok := handles.m[h]
	if !ok {
		return zero, fmt.Errorf("no object has handle %d (closed, or never made)", h)
	}
	x, ok := obj.(T)
	if !ok {
		return zero, fmt.Errorf("handle %d is a %s, not a %s", h, kindOf(obj), kindOf(zero))
	}
	return x, nil
}

// holdTensor returns the tensor h names with a hold on its storage, which
// the caller drops: the handle may be closed meanwhile.
func holdTensor(h int64) (*tensor.Tensor, error) {
	handles.mu.Lock()
	defer handles.mu.Unlock()
	x, err := lookupLocked[*tensor.Tensor](h)
	if err != nil {
		return nil, err
	}
	holds.hold(x.Storage())
	return x, nil
}

// close forgets h and gives its object's resources back: a tensor's hold
// on its storage, an endpoint's descriptors.
func (t *handleTable) close(h int64) error {
	t.mu.Lock()
	obj, ok := t.m[h]
	delete(t.m, h)
	t.mu.Unlock()
	if !ok {
		return fmt.Errorf("no object has handle %d (closed, or never made)", h)
	}
	return closeObject(obj)
}

func closeObject(obj any) error {
	switch x := obj.(type) {
	case *tensor.Tensor:
		holds.drop(x.Storage())
		return nil
	case interface{ Close() error }:
		return x.Close()
	}
	return nil
}

// kindOf names what a handle can name, as the JSON form of values does.
func kindOf(obj any) string {
	switch obj.(type) {
	case *tensor.Tensor:
		return "tensor"
	case *mp.Queue:
		return "queue"
	case *mp.Pipe:
		return "pipe"
	case *mp.Listener:
		return "listener"
	}
	return fmt.Sprintf("%T", obj)
}

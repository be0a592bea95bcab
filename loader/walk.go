package loader

import (
	"errors"
	"fmt"
	"reflect"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/tensor"
)

// maxWalk bounds how deep walk follows a value: a batch is not a cycle.
const maxWalk = 64

// walk calls fn on every tensor inside v and stores what it returns in
// its place where v's containers allow it.
func walk(v reflect.Value, depth int, fn func(*tensor.Tensor) (*tensor.Tensor, error)) error {
	if depth > maxWalk {
		return fmt.Errorf("loader: a batch nested more than %d deep", maxWalk)
	}
	switch v.Kind() {
	case reflect.Pointer:
		if v.IsNil() {
			return nil
		}
		if v.Type() == tensorType {
			t, err := fn(v.Interface().(*tensor.Tensor))
			if err == nil && v.CanSet() {
				v.Set(reflect.ValueOf(t))
			}
			return err
		}
		return walk(v.Elem(), depth+1, fn)
	case reflect.Interface:
		if v.IsNil() {
			return nil
		}
		inner := reflect.New(v.Elem().Type()).Elem()
		inner.Set(v.Elem())
		err := walk(inner, depth+1, fn)
		if v.CanSet() {
			v.Set(inner)
		}
		return err
	case reflect.Struct:
		var errs []error
		for i := range v.NumField() {
			if v.Type().Field(i).IsExported() {
				errs = append(errs, walk(v.Field(i), depth+1, fn))
			}
		}
		return errors.Join(errs...)
	case reflect.Slice, reflect.Array:
		var errs []error
		for i := range v.Len() {
			errs = append(errs, walk(v.Index(i), depth+1, fn))
		}
		return errors.Join(errs...)
	case reflect.Map:
		var errs []error
		iter := v.MapRange()
		for iter.Next() {
			inner := reflect.New(iter.Value().Type()).Elem()
			inner.Set(iter.Value())
			errs = append(errs, walk(inner, depth+1, fn))
			v.SetMapIndex(iter.Key(), inner)
		}
		return errors.Join(errs...)
	}
	return nil
}

// Release releases every tensor inside v, a batch: its shared memory goes
// back to the worker that made it, for a later batch.
func Release(v any) error {
	return walk(reflect.ValueOf(v), 0, func(t *tensor.Tensor) (*tensor.Tensor, error) {
		return t, t.Release()
	})
}

// moveTo replaces every tensor in *b by its copy on p, releasing the host
// tensor.
func moveTo[B any](b *B, p device.Place) error {
	return walk(reflect.ValueOf(b).Elem(), 0, func(t *tensor.Tensor) (*tensor.Tensor, error) {
		if t.Place() == p {
			return t, nil
		}
		moved, err := t.To(p)
		if err != nil {
			return t, fmt.Errorf("loader: copying a batch to %v: %w", p, err)
		}
		_ = t.Release()
		return moved, nil
	})
}

package loader

import (
	"context"
	"fmt"
	"reflect"
	"strings"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/tensor"
)

var tensorType = reflect.TypeFor[*tensor.Tensor]()

// Collate is the default collate (torch's default_collate): it turns a
// batch of samples into one value, column by column:
//
//   - tensors of one dtype and shape are stacked into one tensor with a
//     new first dimension, in shared memory;
//   - numbers and bools become a one-dimensional tensor (int and int64
//     as Int64, float64 as Float64, and so on);
//   - a struct becomes a map from its field names (msgpack tags if any)
//     to its fields' columns, and a map with string keys likewise, which
//     decode into a batch struct with the same field names;
//   - slices and arrays of one length become a []any of their positions'
//     columns; strings a []string.
//
// Samples made with Zeros lie in their batch already and are not copied.
func Collate(ctx context.Context, samples []any) (any, error) {
	if len(samples) == 0 {
		return nil, fmt.Errorf("loader: collate: no samples")
	}
	vs := make([]reflect.Value, len(samples))
	for i, s := range samples {
		vs[i] = reflect.ValueOf(s)
	}
	return collate(vs)
}

// collate is Collate over reflected samples of one type.
func collate(vs []reflect.Value) (any, error) {
	t := vs[0].Type()
	for _, v := range vs[1:] {
		if v.Type() != t {
			return nil, fmt.Errorf("loader: collate: samples of types %v and %v", t, v.Type())
		}
	}
	if t == tensorType {
		ts := make([]*tensor.Tensor, len(vs))
		for i, v := range vs {
			ts[i] = v.Interface().(*tensor.Tensor)
		}
		return Stack(ts)
	}
	switch t.Kind() {
	case reflect.Interface, reflect.Pointer:
		inner := make([]reflect.Value, len(vs))
		for i, v := range vs {
			if v.IsNil() {
				return nil, fmt.Errorf("loader: collate: a nil %v", t)
			}
			inner[i] = v.Elem()
		}
		return collate(inner)
	case reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint8, reflect.Float32, reflect.Float64:
		return numbers(vs)
	case reflect.String:
		out := make([]string, len(vs))
		for i, v := range vs {
			out[i] = v.String()
		}
		return out, nil
	case reflect.Struct:
		out := make(map[string]any, t.NumField())
		col := make([]reflect.Value, len(vs))
		for f := range t.NumField() {
			sf := t.Field(f)
			name, skip := fieldName(sf)
			if skip {
				continue
			}
			for i, v := range vs {
				col[i] = v.Field(f)
			}
			c, err := collate(col)
			if err != nil {
				return nil, fmt.Errorf("field %s: %w", sf.Name, err)
			}
			out[name] = c
		}
		return out, nil
	case reflect.Map:
		if t.Key().Kind() != reflect.String {
			break
		}
		out := make(map[string]any, vs[0].Len())
		col := make([]reflect.Value, len(vs))
		for _, k := range vs[0].MapKeys() {
			for i, v := range vs {
				if col[i] = v.MapIndex(k); !col[i].IsValid() {
					return nil, fmt.Errorf("loader: collate: sample %d has no key %q", i, k.String())
				}
			}
			c, err := collate(col)
			if err != nil {
				return nil, fmt.Errorf("key %q: %w", k.String(), err)
			}
			out[k.String()] = c
		}
		return out, nil
	case reflect.Slice, reflect.Array:
		n := vs[0].Len()
		out := make([]any, n)
		col := make([]reflect.Value, len(vs))
		for p := range n {
			for i, v := range vs {
				if v.Len() != n {
					return nil, fmt.Errorf("loader: collate: sequences of lengths %d and %d", n, v.Len())
				}
				col[i] = v.Index(p)
			}
			c, err := collate(col)
			if err != nil {
				return nil, fmt.Errorf("position %d: %w", p, err)
			}
			out[p] = c
		}
		return out, nil
	}
	return nil, fmt.Errorf("loader: collate: cannot collate %v (register a collate for it)", t)
}

// fieldName is the name a struct field is encoded under, as msgpack
// names it, and whether it is left out.
func fieldName(f reflect.StructField) (string, bool) {
	if !f.IsExported() {
		return "", true
	}
	tag := f.Tag.Get("msgpack")
	name, _, _ := strings.Cut(tag, ",")
	if name == "-" {
		return "", true
	}
	if name == "" {
		name = f.Name
	}
	return name, false
}

// numbers makes a one-dimensional tensor of numbers.
func numbers(vs []reflect.Value) (*tensor.Tensor, error) {
	var dt tensor.DType
	switch vs[0].Kind() {
	case reflect.Bool:
		dt = tensor.Bool
	case reflect.Uint8:
		dt = tensor.Uint8
	case reflect.Int8:
		dt = tensor.Int8
	case reflect.Int16:
		dt = tensor.Int16
	case reflect.Int32:
		dt = tensor.Int32
	case reflect.Int, reflect.Int64:
		dt = tensor.Int64
	case reflect.Float32:
		dt = tensor.Float32
	default:
		dt = tensor.Float64
	}
	t, err := tensor.On(device.CPU()).Shared().Empty(dt, len(vs))
	if err != nil {
		return nil, err
	}
	toInt := func(v reflect.Value) int64 { return v.Int() }
	switch dt {
	case tensor.Bool:
		err = fill(t, vs, func(v reflect.Value) bool { return v.Bool() })
	case tensor.Uint8:
		err = fill(t, vs, func(v reflect.Value) uint8 { return uint8(v.Uint()) })
	case tensor.Int8:
		err = fill(t, vs, func(v reflect.Value) int8 { return int8(toInt(v)) })
	case tensor.Int16:
		err = fill(t, vs, func(v reflect.Value) int16 { return int16(toInt(v)) })
	case tensor.Int32:
		err = fill(t, vs, func(v reflect.Value) int32 { return int32(toInt(v)) })
	case tensor.Int64:
		err = fill(t, vs, toInt)
	case tensor.Float32:
		err = fill(t, vs, func(v reflect.Value) float32 { return float32(v.Float()) })
	default:
		err = fill(t, vs, func(v reflect.Value) float64 { return v.Float() })
	}
	if err != nil {
		_ = t.Release()
		return nil, err
	}
	return t, nil
}

// fill sets t's elements to vs, converted by conv.
func fill[T tensor.Element](t *tensor.Tensor, vs []reflect.Value, conv func(reflect.Value) T) error {
	return tensor.Fill(t, func(i int) T { return conv(vs[i]) })
}

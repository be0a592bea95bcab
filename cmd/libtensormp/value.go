package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// objectKey marks a JSON object that stands for something JSON cannot
// say (see the package doc).
const objectKey = "$tensormp"

// maxDepth bounds the nesting of a value in either direction.
const maxDepth = 100

// outgoing is a value the caller sends, decoded from its JSON form.
// Its tensors' storages are held until done is called, so that closing a
// handle while the value is sent cannot unmap what is being sent.
type outgoing struct {
	v    any
	held []*tensor.Storage
}

func (o *outgoing) done() {
	for _, s := range o.held {
		holds.drop(s)
	}
	o.held = nil
}

// parseValue decodes a value's JSON form, resolving handles.
func parseValue(text []byte) (*outgoing, error) {
	dec := json.NewDecoder(bytes.NewReader(text))
	dec.UseNumber()
	var raw any
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("value is not JSON: %w", err)
	}
	if dec.More() {
		return nil, errors.New("value is not JSON: text after the value")
	}
	o := &outgoing{}
	v, err := o.resolve(raw, 0)
	if err != nil {
		o.done()
		return nil, err
	}
	o.v = v
	return o, nil
}

func (o *outgoing) resolve(raw any, depth int) (any, error) {
	if depth > maxDepth {
		return nil, fmt.Errorf("value nested deeper than %d", maxDepth)
	}
	switch x := raw.(type) {
	case json.Number:
		if i, err := strconv.ParseInt(string(x), 10, 64); err == nil {
			return i, nil
		}
		if u, err := strconv.ParseUint(string(x), 10, 64); err == nil {
			return u, nil
		}
		f, err := strconv.ParseFloat(string(x), 64)
		if err != nil {
			return nil, fmt.Errorf("number %s: %w", x, err)
		}
		return f, nil
	case []any:
		for i := range x {
			v, err := o.resolve(x[i], depth+1)
			if err != nil {
				return nil, fmt.Errorf("item %d: %w", i, err)
			}
			x[i] = v
		}
		return x, nil
	case map[string]any:
		if kind, ok := x[objectKey]; ok {
			return o.object(kind, x)
		}
		for k, e := range x {
			v, err := o.resolve(e, depth+1)
			if err != nil {
				return nil, fmt.Errorf("key %q: %w", k, err)
			}
			x[k] = v
		}
		return x, nil
	}
	return raw, nil // nil, bool, string
}

// object resolves a {"$tensormp": kind, ...} object.
func (o *outgoing) object(kind any, x map[string]any) (any, error) {
	switch kind {
	case "tensor", "queue", "pipe":
		n, ok := x["h"].(json.Number)
		if !ok {
			return nil, fmt.Errorf("%s object without a numeric handle \"h\"", kind)
		}
		h, err := strconv.ParseInt(string(n), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%s handle %s: %w", kind, n, err)
		}
		switch kind {
		case "tensor":
			t, err := holdTensor(h)
			if err != nil {
				return nil, err
			}
			o.held = append(o.held, t.Storage())
			return t, nil
		case "queue":
			return lookup[*mp.Queue](h)
		default:
			return lookup[*mp.Pipe](h)
		}
	case "bytes":
		s, ok := x["b64"].(string)
		if !ok {
			return nil, errors.New(`bytes object without a base64 string "b64"`)
		}
		b, err := base64.StdEncoding.DecodeString(s)
		if err != nil {
			return nil, fmt.Errorf("bytes object: %w", err)
		}
		return b, nil
	case "float":
		switch x["v"] {
		case "inf":
			return math.Inf(1), nil
		case "-inf":
			return math.Inf(-1), nil
		case "nan":
			return math.NaN(), nil
		}
		return nil, fmt.Errorf("float object with value %v, not \"inf\", \"-inf\" or \"nan\"", x["v"])
	}
	return nil, fmt.Errorf("unknown %s object kind %v", objectKey, kind)
}

// incoming turns a received value into its JSON form, naming each
// tensor, queue and pipe in it by a new handle.
type incoming struct {
	made []int64
}

// describe returns v's JSON form. On failure it closes the handles it
// made; the caller closes what v holds that got none.
func describe(v any) ([]byte, error) {
	in := &incoming{}
	tree, err := in.convert(v, 0)
	if err == nil {
		var text []byte
		if text, err = json.Marshal(tree); err == nil {
			return text, nil
		}
	}
	for _, h := range in.made {
		_ = handles.close(h)
	}
	return nil, err
}

func (in *incoming) handle(obj any) int64 {
	h := handles.add(obj)
	in.made = append(in.made, h)
	return h
}

func (in *incoming) convert(v any, depth int) (any, error) {
	if depth > maxDepth {
		return nil, fmt.Errorf("value nested deeper than %d", maxDepth)
	}
	switch x := v.(type) {
	case nil, bool, string,
		int8, int16, int32, int64, int, uint8, uint16, uint32, uint64, uint:
		return x, nil
	case float32:
		return float(float64(x)), nil
	case float64:
		return float(x), nil
	case []byte:
		return map[string]any{objectKey: "bytes", "b64": base64.StdEncoding.EncodeToString(x)}, nil
	case *tensor.Tensor:
		if x == nil {
			return nil, nil
		}
		return tensorForm(in.handle(x), x), nil
	case *mp.Queue:
		return map[string]any{objectKey: "queue", "h": in.handle(x)}, nil
	case *mp.Pipe:
		return map[string]any{objectKey: "pipe", "h": in.handle(x)}, nil
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			c, err := in.convert(e, depth+1)
			if err != nil {
				return nil, fmt.Errorf("item %d: %w", i, err)
			}
			out[i] = c
		}
		return out, nil
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			c, err := in.convert(e, depth+1)
			if err != nil {
				return nil, fmt.Errorf("key %q: %w", k, err)
			}
			out[k] = c
		}
		return out, nil
	case map[any]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			ks, ok := k.(string)
			if !ok {
				return nil, fmt.Errorf("map key %v is a %T: only string keys reach JSON", k, k)
			}
			c, err := in.convert(e, depth+1)
			if err != nil {
				return nil, fmt.Errorf("key %q: %w", ks, err)
			}
			out[ks] = c
		}
		return out, nil
	}
	return nil, fmt.Errorf("a %T has no JSON form", v)
}

// tensorForm is the JSON form of tensor t named by handle h.
func tensorForm(h int64, t *tensor.Tensor) map[string]any {
	return map[string]any{
		objectKey: "tensor", "h": h,
		"dtype": t.DType().String(), "shape": t.Shape(), "strides": t.Strides(),
		"device": t.Place().String(),
	}
}

// float returns f, or its object form if JSON has no number for it.
func float(f float64) any {
	switch {
	case math.IsInf(f, 1):
		return map[string]any{objectKey: "float", "v": "inf"}
	case math.IsInf(f, -1):
		return map[string]any{objectKey: "float", "v": "-inf"}
	case math.IsNaN(f):
		return map[string]any{objectKey: "float", "v": "nan"}
	}
	return f
}

// walk calls fn on every tensor, queue and pipe in a received value.
func walk(v any, fn func(any)) {
	switch x := v.(type) {
	case *tensor.Tensor, *mp.Queue, *mp.Pipe:
		fn(x)
	case []any:
		for _, e := range x {
			walk(e, fn)
		}
	case map[string]any:
		for _, e := range x {
			walk(e, fn)
		}
	case map[any]any:
		for _, e := range x {
			walk(e, fn)
		}
	}
}

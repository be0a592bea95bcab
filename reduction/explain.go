package reduction

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"

	"github.com/tensormp/tensormp/internal/carry"
)

// DecodeError is a message whose value does not fit the type it is
// decoded into. Its text names the Go field and types ("Batch.Index:
// cannot decode a string into int64"); Unwrap gives msgpack's own error.
type DecodeError struct {
	Path string // the field, from the target's type: Batch.Items[2].Index
	Got  string // what the message holds there: a string, an array, ...
	Want reflect.Type
	err  error
}

func (e *DecodeError) Error() string {
	return fmt.Sprintf("reduction: %s: cannot decode %s into %s", e.Path, e.Got, e.Want)
}

func (e *DecodeError) Unwrap() error { return e.err }

// explain walks a well-formed message beside t, the type it failed to
// decode into, and returns the first place where the two disagree, or nil
// if it finds none (the failure was elsewhere: a tensor, a descriptor).
func explain(b []byte, t reflect.Type, cause error) error {
	root := t
	for root.Kind() == reflect.Pointer {
		root = root.Elem()
	}
	name := root.Name()
	if name == "" {
		name = root.String()
	}
	if e := mismatch(b, root, name, 0); e != nil {
		e.err = cause
		return e
	}
	return nil
}

func mismatch(b []byte, t reflect.Type, path string, depth int) *DecodeError {
	if depth > maxDepth {
		return nil
	}
	k, items, head, _, err := peek(b)
	if err != nil || k == kindNil {
		return nil // nil decodes into anything as its zero value
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if carry.Is(reflect.PointerTo(t)) || carry.Is(t) || t == timeType {
		return nil // extensions check themselves
	}
	bad := func() *DecodeError { return &DecodeError{Path: path, Got: k.String(), Want: t} }
	switch t.Kind() {
	case reflect.Interface:
		return nil
	case reflect.Bool:
		if k != kindBool {
			return bad()
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		if k != kindInt {
			return bad()
		}
	case reflect.Float32, reflect.Float64:
		if k != kindInt && k != kindFloat {
			return bad()
		}
	case reflect.String:
		if k != kindString && k != kindBytes {
			return bad()
		}
	case reflect.Slice, reflect.Array:
		if t.Elem().Kind() == reflect.Uint8 && (k == kindBytes || k == kindString) {
			return nil
		}
		if k != kindArray {
			return bad()
		}
		return eachValue(b[head:], items, func(i int, item []byte) *DecodeError {
			return mismatch(item, t.Elem(), path+"["+strconv.Itoa(i)+"]", depth+1)
		})
	case reflect.Map:
		if k != kindMap {
			return bad()
		}
		return eachPair(b[head:], items/2, func(key, val []byte) *DecodeError {
			if e := mismatch(key, t.Key(), path+"[key]", depth+1); e != nil {
				return e
			}
			return mismatch(val, t.Elem(), path+"["+keyText(key)+"]", depth+1)
		})
	case reflect.Struct:
		if k == kindArray {
			return nil // an array-encoded struct: not ours to judge
		}
		if k != kindMap {
			return bad()
		}
		fields := structFields(t)
		return eachPair(b[head:], items/2, func(key, val []byte) *DecodeError {
			f, ok := fields[keyText(key)]
			if !ok {
				return nil // msgpack skips what the type lacks
			}
			return mismatch(val, f.Type, path+"."+f.Name, depth+1)
		})
	}
	return nil
}

// structFields maps the names msgpack gives a struct's fields (its tag, or
// the field's name; embedded structs inlined) to the fields.
func structFields(t reflect.Type) map[string]reflect.StructField {
	out := map[string]reflect.StructField{}
	for i := range t.NumField() {
		f := t.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("msgpack"), ",")
		if tag == "-" {
			continue
		}
		if f.Anonymous && tag == "" && f.Type.Kind() == reflect.Struct {
			for k, v := range structFields(f.Type) {
				if _, ok := out[k]; !ok {
					out[k] = v
				}
			}
			continue
		}
		if !f.IsExported() {
			continue
		}
		if tag == "" {
			tag = f.Name
		}
		out[tag] = f
	}
	return out
}

// eachValue calls f on each of n values at the start of b.
func eachValue(b []byte, n int, f func(i int, item []byte) *DecodeError) *DecodeError {
	for i := range n {
		size, err := skipValue(b, 0)
		if err != nil {
			return nil
		}
		if e := f(i, b[:size]); e != nil {
			return e
		}
		b = b[size:]
	}
	return nil
}

// eachPair calls f on each of n key-value pairs at the start of b.
func eachPair(b []byte, n int, f func(key, val []byte) *DecodeError) *DecodeError {
	var key []byte
	return eachValue(b, 2*n, func(i int, item []byte) *DecodeError {
		if i%2 == 0 {
			key = item
			return nil
		}
		return f(key, item)
	})
}

// keyText returns a map key as text: a string's own, a small integer's
// digits, else a placeholder.
func keyText(b []byte) string {
	k, _, head, body, err := peek(b)
	switch {
	case err == nil && k == kindString && head+body <= len(b):
		return string(b[head : head+body])
	case b[0] <= 0x7f:
		return strconv.Itoa(int(b[0]))
	}
	return "?"
}

package reduction

import (
	"encoding/binary"
	"fmt"
	"reflect"
	"strconv"
	"strings"
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
	if depth > maxDepth || len(b) == 0 {
		return nil
	}
	kind, n, head := header(b)
	if kind == "nil" {
		return nil // decodes into anything as its zero value
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if isCarried(reflect.PointerTo(t)) || isCarried(t) || t == timeType {
		return nil // extensions check themselves
	}
	bad := func() *DecodeError { return &DecodeError{Path: path, Got: kind, Want: t} }
	switch t.Kind() {
	case reflect.Interface:
		return nil
	case reflect.Bool:
		if kind != "a bool" {
			return bad()
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		if kind != "an integer" {
			return bad()
		}
	case reflect.Float32, reflect.Float64:
		if kind != "an integer" && kind != "a float" {
			return bad()
		}
	case reflect.String:
		if kind != "a string" && kind != "bytes" {
			return bad()
		}
	case reflect.Slice, reflect.Array:
		if t.Elem().Kind() == reflect.Uint8 && (kind == "bytes" || kind == "a string") {
			return nil
		}
		if kind != "an array" {
			return bad()
		}
		return items(b[head:], n, func(i int, item []byte) *DecodeError {
			return mismatch(item, t.Elem(), path+"["+strconv.Itoa(i)+"]", depth+1)
		})
	case reflect.Map:
		if kind != "a map" {
			return bad()
		}
		return pairs(b[head:], n, func(key, val []byte) *DecodeError {
			if e := mismatch(key, t.Key(), path+"[key]", depth+1); e != nil {
				return e
			}
			return mismatch(val, t.Elem(), path+"["+keyText(key)+"]", depth+1)
		})
	case reflect.Struct:
		if kind == "an array" {
			return nil // an array-encoded struct: not ours to judge
		}
		if kind != "a map" {
			return bad()
		}
		fields := structFields(t)
		return pairs(b[head:], n, func(key, val []byte) *DecodeError {
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

// header classifies the value at the start of b and returns, for arrays
// and maps, the number of items (pairs for maps), and the header's size.
func header(b []byte) (kind string, n, head int) {
	c := b[0]
	u := func(w int) int {
		if len(b) < 1+w {
			return 0
		}
		switch w {
		case 2:
			return int(binary.BigEndian.Uint16(b[1:]))
		default:
			return int(binary.BigEndian.Uint32(b[1:]))
		}
	}
	switch {
	case c <= 0x7f || c >= 0xe0 || c >= 0xcc && c <= 0xd3:
		return "an integer", 0, 1
	case c >= 0x80 && c <= 0x8f:
		return "a map", int(c & 0x0f), 1
	case c >= 0x90 && c <= 0x9f:
		return "an array", int(c & 0x0f), 1
	case c >= 0xa0 && c <= 0xbf || c >= 0xd9 && c <= 0xdb:
		return "a string", 0, 1
	}
	switch c {
	case 0xc0:
		return "nil", 0, 1
	case 0xc2, 0xc3:
		return "a bool", 0, 1
	case 0xca, 0xcb:
		return "a float", 0, 1
	case 0xc4, 0xc5, 0xc6:
		return "bytes", 0, 1
	case 0xdc:
		return "an array", u(2), 3
	case 0xdd:
		return "an array", u(4), 5
	case 0xde:
		return "a map", u(2), 3
	case 0xdf:
		return "a map", u(4), 5
	}
	return "an extension", 0, 1 // 0xc7-0xc9, 0xd4-0xd8: tensors and others
}

// items calls f on each of n values at the start of b.
func items(b []byte, n int, f func(i int, item []byte) *DecodeError) *DecodeError {
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

// pairs calls f on each of n key-value pairs at the start of b.
func pairs(b []byte, n int, f func(key, val []byte) *DecodeError) *DecodeError {
	for range n {
		ks, err := skipValue(b, 0)
		if err != nil {
			return nil
		}
		vs, err := skipValue(b[ks:], 0)
		if err != nil {
			return nil
		}
		if e := f(b[:ks], b[ks:ks+vs]); e != nil {
			return e
		}
		b = b[ks+vs:]
	}
	return nil
}

// keyText returns a map key as text: a string's own, else a placeholder.
func keyText(b []byte) string {
	c := b[0]
	var off, n int
	switch {
	case c >= 0xa0 && c <= 0xbf:
		off, n = 1, int(c&0x1f)
	case c == 0xd9 && len(b) >= 2:
		off, n = 2, int(b[1])
	case c == 0xda && len(b) >= 3:
		off, n = 3, int(binary.BigEndian.Uint16(b[1:]))
	case c == 0xdb && len(b) >= 5:
		off, n = 5, int(binary.BigEndian.Uint32(b[1:]))
	case c <= 0x7f:
		return strconv.Itoa(int(c))
	default:
		return "?"
	}
	if off+n > len(b) {
		return "?"
	}
	return string(b[off : off+n])
}

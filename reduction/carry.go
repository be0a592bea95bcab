package reduction

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"sync"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/tensor"
)

// typeErrs caches what checkType found for a type: an error, or
// errTypeOK.
var typeErrs sync.Map // reflect.Type -> error

var errTypeOK = errors.New("carried whole")

func init() {
	// Types whose values travel only through an extension of the codec
	// (these, and what other packages add with carry.Must). msgpack skips
	// unexported fields without a word; one that may hold such a value
	// makes Encode fail instead, naming it.
	carry.Must(reflect.TypeFor[*tensor.Tensor]())
	carry.Must(reflect.TypeFor[*tensor.Storage]())
	msgpack.RegisterExtEncoder(fileExt, (*os.File)(nil), func(_ *msgpack.Encoder, v reflect.Value) ([]byte, error) {
		return nil, errors.New("reduction: cannot carry an *os.File: pass a descriptor as a Queue, a Pipe or a tensor's storage")
	})
}

// fileExt is registered only to refuse *os.File.
const fileExt int8 = 0x46 // 'F'

// checkType returns why a value of type t cannot be carried whole, or nil:
// an unexported field that may hold a carried value, or an os.File.
func checkType(t reflect.Type) error {
	if e, ok := typeErrs.Load(t); ok {
		if e == errTypeOK {
			return nil
		}
		return e.(error)
	}
	err := walkType(t, t.String(), map[reflect.Type]bool{})
	if err == nil {
		typeErrs.Store(t, errTypeOK)
	} else {
		typeErrs.Store(t, err)
	}
	return err
}

var (
	fileType = reflect.TypeFor[os.File]()
	timeType = reflect.TypeFor[time.Time]()
)

func walkType(t reflect.Type, path string, seen map[reflect.Type]bool) error {
	if carry.Is(t) || seen[t] {
		return nil
	}
	seen[t] = true
	switch t.Kind() {
	case reflect.Pointer, reflect.Slice, reflect.Array:
		return walkType(t.Elem(), path, seen)
	case reflect.Map:
		if err := walkType(t.Key(), path+"[key]", seen); err != nil {
			return err
		}
		return walkType(t.Elem(), path+"[]", seen)
	case reflect.Struct:
		if t == fileType {
			return fmt.Errorf("reduction: %s is an os.File, which cannot be carried: pass a descriptor as a Queue, a Pipe or a tensor's storage", path)
		}
		if t == timeType {
			return nil
		}
		for i := range t.NumField() {
			f := t.Field(i)
			fpath := path + "." + f.Name
			if !f.IsExported() {
				if holder := holds(f.Type, map[reflect.Type]bool{}); holder != nil {
					return fmt.Errorf("reduction: %s is unexported and holds %s, which would not be sent: export the field", fpath, holder)
				}
				continue
			}
			if err := walkType(f.Type, fpath, seen); err != nil {
				return err
			}
		}
	}
	return nil
}

// holds returns the carried type that a value of type t may hold, or nil.
func holds(t reflect.Type, seen map[reflect.Type]bool) reflect.Type {
	if carry.Is(t) {
		return t
	}
	if seen[t] {
		return nil
	}
	seen[t] = true
	switch t.Kind() {
	case reflect.Pointer, reflect.Slice, reflect.Array:
		return holds(t.Elem(), seen)
	case reflect.Map:
		if h := holds(t.Key(), seen); h != nil {
			return h
		}
		return holds(t.Elem(), seen)
	case reflect.Struct:
		for i := range t.NumField() {
			if h := holds(t.Field(i).Type, seen); h != nil {
				return h
			}
		}
	}
	return nil
}

package tensor

import (
	"fmt"
	"math"
	"strings"
	"unsafe"
)

// DType is a tensor's element type.
type DType uint8

// The element types, numbered as they travel in metadata. Invalid is the
// zero DType.
const (
	Invalid DType = iota
	Bool
	Uint8
	Int8
	Int16
	Int32
	Int64
	Float16
	BFloat16
	Float32
	Float64
	Complex64
	Complex128
	numDTypes
)

var dtypeInfo = [numDTypes]struct {
	name string
	size int
}{
	Invalid:    {"invalid", 0},
	Bool:       {"bool", 1},
	Uint8:      {"uint8", 1},
	Int8:       {"int8", 1},
	Int16:      {"int16", 2},
	Int32:      {"int32", 4},
	Int64:      {"int64", 8},
	Float16:    {"float16", 2},
	BFloat16:   {"bfloat16", 2},
	Float32:    {"float32", 4},
	Float64:    {"float64", 8},
	Complex64:  {"complex64", 8},
	Complex128: {"complex128", 16},
}

// DTypes returns every valid element type.
func DTypes() []DType {
	out := make([]DType, 0, numDTypes-1)
	for d := Bool; d < numDTypes; d++ {
		out = append(out, d)
	}
	return out
}

// Valid reports whether d is one of the twelve element types.
func (d DType) Valid() bool { return d > Invalid && d < numDTypes }

// Size returns the size of one element in bytes; 0 for an invalid DType.
func (d DType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dtypeInfo[d].size
}

func (d DType) String() string {
	if d < numDTypes {
		return dtypeInfo[d].name
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// ParseDType returns the DType named name ("float32", "bfloat16", ...).
func ParseDType(name string) (DType, error) {
	for d := Bool; d < numDTypes; d++ {
		if dtypeInfo[d].name == name {
			return d, nil
		}
	}
	names := make([]string, 0, numDTypes-1)
	for _, d := range DTypes() {
		names = append(names, d.String())
	}
	return Invalid, fmt.Errorf("tensor: unknown dtype %q (valid: %s)", name, strings.Join(names, ", "))
}

// Half is an IEEE 754 binary16 value, the element of Float16 tensors.
type Half uint16

// BHalf is a bfloat16 value (the upper half of a float32), the element of
// BFloat16 tensors.
type BHalf uint16

// Element is the set of Go types that tensor elements have, one for each
// DType.
type Element interface {
	bool | uint8 | int8 | int16 | int32 | int64 | Half | BHalf | float32 | float64 | complex64 | complex128
}

// DTypeOf returns the DType whose elements have Go type T.
func DTypeOf[T Element]() DType {
	switch any((*T)(nil)).(type) {
	case *bool:
		return Bool
	case *uint8:
		return Uint8
	case *int8:
		return Int8
	case *int16:
		return Int16
	case *int32:
		return Int32
	case *int64:
		return Int64
	case *Half:
		return Float16
	case *BHalf:
		return BFloat16
	case *float32:
		return Float32
	case *float64:
		return Float64
	case *complex64:
		return Complex64
	case *complex128:
		return Complex128
	}
	return Invalid
}

// HalfFromFloat32 rounds f to the nearest binary16 value, ties to even.
func HalfFromFloat32(f float32) Half {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int(b>>23) & 0xff
	mant := b & 0x7fffff
	if exp == 0xff {
		if mant != 0 {
			return Half(sign | 0x7e00)
		}
		return Half(sign | 0x7c00)
	}
	e := exp - 127 + 15
	if e >= 0x1f {
		return Half(sign | 0x7c00)
	}
	if e <= 0 {
		if e < -10 {
			return Half(sign)
		}
		mant |= 0x800000
		shift := uint(14 - e)
		h := mant >> shift
		rem := mant & (1<<shift - 1)
		halfway := uint32(1) << (shift - 1)
		if rem > halfway || rem == halfway && h&1 == 1 {
			h++
		}
		return Half(sign | uint16(h))
	}
	h := uint32(e)<<10 | mant>>13
	rem := mant & 0x1fff
	if rem > 0x1000 || rem == 0x1000 && h&1 == 1 {
		h++ // a carry into the exponent is the correct rounding
	}
	return Half(sign | uint16(h))
}

// Float32 returns h exactly as a float32.
func (h Half) Float32() float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp == 0:
		if mant == 0 {
			return math.Float32frombits(sign)
		}
		e := uint32(127 - 15 + 1)
		for mant&0x400 == 0 {
			mant <<= 1
			e--
		}
		return math.Float32frombits(sign | e<<23 | (mant&0x3ff)<<13)
	}
	return math.Float32frombits(sign | (exp+127-15)<<23 | mant<<13)
}

// BHalfFromFloat32 rounds f to the nearest bfloat16 value, ties to even.
func BHalfFromFloat32(f float32) BHalf {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return BHalf(b>>16 | 0x40) // a quiet NaN
	}
	b += 0x7fff + (b>>16)&1
	return BHalf(b >> 16)
}

// Float32 returns b exactly as a float32.
func (b BHalf) Float32() float32 { return math.Float32frombits(uint32(b) << 16) }

// asSlice views b as elements of type T. len(b) must be a multiple of T's
// size and b suitably aligned; callers check both.
func asSlice[T any](b []byte) []T {
	var zero T
	n := len(b) / int(unsafe.Sizeof(zero))
	if n == 0 {
		return []T{}
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), n)
}

// setFloat stores v, converted to d, as element i of b.
func setFloat(d DType, b []byte, i int, v float64) {
	switch d {
	case Bool:
		asSlice[bool](b)[i] = v != 0
	case Uint8:
		asSlice[uint8](b)[i] = uint8(int64(v))
	case Int8:
		asSlice[int8](b)[i] = int8(v)
	case Int16:
		asSlice[int16](b)[i] = int16(v)
	case Int32:
		asSlice[int32](b)[i] = int32(v)
	case Int64:
		asSlice[int64](b)[i] = int64(v)
	case Float16:
		asSlice[Half](b)[i] = HalfFromFloat32(float32(v))
	case BFloat16:
		asSlice[BHalf](b)[i] = BHalfFromFloat32(float32(v))
	case Float32:
		asSlice[float32](b)[i] = float32(v)
	case Float64:
		asSlice[float64](b)[i] = v
	case Complex64:
		asSlice[complex64](b)[i] = complex(float32(v), 0)
	case Complex128:
		asSlice[complex128](b)[i] = complex(v, 0)
	}
}

// value returns element i of b, of type d, as a complex128 (the real part
// for real types, 0 or 1 for bool).
func value(d DType, b []byte, i int) complex128 {
	switch d {
	case Bool:
		if asSlice[bool](b)[i] {
			return 1
		}
		return 0
	case Uint8:
		return complex(float64(asSlice[uint8](b)[i]), 0)
	case Int8:
		return complex(float64(asSlice[int8](b)[i]), 0)
	case Int16:
		return complex(float64(asSlice[int16](b)[i]), 0)
	case Int32:
		return complex(float64(asSlice[int32](b)[i]), 0)
	case Int64:
		return complex(float64(asSlice[int64](b)[i]), 0)
	case Float16:
		return complex(float64(asSlice[Half](b)[i].Float32()), 0)
	case BFloat16:
		return complex(float64(asSlice[BHalf](b)[i].Float32()), 0)
	case Float32:
		return complex(float64(asSlice[float32](b)[i]), 0)
	case Float64:
		return complex(asSlice[float64](b)[i], 0)
	case Complex64:
		return complex128(asSlice[complex64](b)[i])
	case Complex128:
		return asSlice[complex128](b)[i]
	}
	return 0
}

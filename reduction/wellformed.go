package reduction

import (
	"encoding/binary"
	"fmt"
)

// maxDepth bounds the nesting of a received message.
const maxDepth = 256

// checkWellFormed walks a received msgpack message before it is decoded.
// It checks that every length fits in the bytes that remain, so that a
// hostile header ("an array of four billion elements") cannot make the
// decoder allocate gigabytes, that nesting stays under maxDepth, so that
// decoding cannot exhaust the stack, and that the message is exactly one
// value. An extension's payload is only checked to fit: msgpack's decoder
// never reads inside one, and the tensor metadata that tensors' and
// storages' carry is read by parseMeta, which checks every length and
// depth itself.
func checkWellFormed(b []byte) error { return CheckWellFormed(b) }

// CheckWellFormed checks a msgpack message received from a peer before
// any decoder sees it (see checkWellFormed): every length fits in the
// bytes that remain, nesting is bounded, and the message is one value.
// Decoders of package msgpack allocate a declared slice length at once,
// so a message that fails this check must not be decoded. Its errors wrap
// ErrMalformed.
func CheckWellFormed(b []byte) error {
	n, err := skipValue(b, 0)
	if err != nil {
		return fmt.Errorf("reduction: %w: %w", ErrMalformed, err)
	}
	if n != len(b) {
		return fmt.Errorf("reduction: %w: %d bytes after the value", ErrMalformed, len(b)-n)
	}
	return nil
}

// skipValue returns the size of the msgpack value at the start of b.
func skipValue(b []byte, depth int) (int, error) {
	if depth > maxDepth {
		return 0, fmt.Errorf("nested deeper than %d", maxDepth)
	}
	k, items, head, body, err := peek(b)
	switch {
	case err != nil:
		return 0, err
	case k == kindArray || k == kindMap:
		return skipItems(b, head, items, depth)
	}
	return span(b, head, body)
}

// kind is what a msgpack value is, as decoding it into a Go type sees it.
type kind uint8

const (
	kindNil kind = iota
	kindBool
	kindInt
	kindFloat
	kindString
	kindBytes
	kindArray
	kindMap
	kindExt
)

var kindNames = [...]string{"nil", "a bool", "an integer", "a float", "a string", "bytes", "an array", "a map", "an extension"}

func (k kind) String() string { return kindNames[k] }

// peek reads the header of the msgpack value at the start of b: its kind;
// for an array or a map, how many values follow (keys and values both, for
// a map); the header's size; and for any other value the size of its body
// (an extension's counts its type byte). It checks only that the header
// itself is present: the one place that knows msgpack's codes.
func peek(b []byte) (k kind, items, head, body int, err error) {
	if len(b) == 0 {
		return 0, 0, 0, 0, fmt.Errorf("unexpected end of message")
	}
	c := b[0]
	switch {
	case c <= 0x7f || c >= 0xe0:
		return kindInt, 0, 1, 0, nil
	case c <= 0x8f:
		return kindMap, 2 * int(c&0x0f), 1, 0, nil
	case c <= 0x9f:
		return kindArray, int(c & 0x0f), 1, 0, nil
	case c <= 0xbf:
		return kindString, 0, 1, int(c & 0x1f), nil
	}
	// sized is a value whose body length, w bytes wide, follows the code.
	sized := func(k kind, w int) (kind, int, int, int, error) {
		n, err := length(b, w)
		return k, 0, 1 + w, n, err
	}
	switch c {
	case 0xc0:
		return kindNil, 0, 1, 0, nil
	case 0xc2, 0xc3:
		return kindBool, 0, 1, 0, nil
	case 0xcc, 0xd0:
		return kindInt, 0, 1, 1, nil
	case 0xcd, 0xd1:
		return kindInt, 0, 1, 2, nil
	case 0xce, 0xd2:
		return kindInt, 0, 1, 4, nil
	case 0xcf, 0xd3:
		return kindInt, 0, 1, 8, nil
	case 0xca:
		return kindFloat, 0, 1, 4, nil
	case 0xcb:
		return kindFloat, 0, 1, 8, nil
	case 0xc4, 0xc5, 0xc6: // bin 8, 16, 32
		return sized(kindBytes, 1<<(c-0xc4))
	case 0xd9, 0xda, 0xdb: // str 8, 16, 32
		return sized(kindString, 1<<(c-0xd9))
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16
		return kindExt, 0, 1, 1 + 1<<(c-0xd4), nil
	case 0xc7, 0xc8, 0xc9: // ext 8, 16, 32
		k, _, head, n, err := sized(kindExt, 1<<(c-0xc7))
		return k, 0, head, 1 + n, err
	case 0xdc, 0xdd: // array 16, 32
		k, _, head, n, err := sized(kindArray, 2<<(c-0xdc))
		return k, n, head, 0, err
	case 0xde, 0xdf: // map 16, 32
		k, _, head, n, err := sized(kindMap, 2<<(c-0xde))
		return k, 2 * n, head, 0, err
	}
	return 0, 0, 0, 0, fmt.Errorf("invalid code %#x", c)
}

// length reads the w-byte big-endian length after the code byte.
func length(b []byte, w int) (int, error) {
	if len(b) < 1+w {
		return 0, fmt.Errorf("unexpected end of message")
	}
	switch w {
	case 1:
		return int(b[1]), nil
	case 2:
		return int(binary.BigEndian.Uint16(b[1:])), nil
	}
	return int(binary.BigEndian.Uint32(b[1:])), nil
}

// span checks that head+n bytes are present and returns head+n.
func span(b []byte, head, n int) (int, error) {
	if n < 0 || n > len(b)-head {
		return 0, fmt.Errorf("a value of %d bytes runs past the message", n)
	}
	return head + n, nil
}

// skipItems skips n values after a header of head bytes. Every value takes
// at least one byte, so a count larger than what remains is refused before
// anything is decoded.
func skipItems(b []byte, head, n, depth int) (int, error) {
	if n > len(b)-head {
		return 0, fmt.Errorf("a container of %d items runs past the message", n)
	}
	off := head
	for range n {
		used, err := skipValue(b[off:], depth+1)
		if err != nil {
			return 0, err
		}
		off += used
	}
	return off, nil
}

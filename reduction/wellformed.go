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
// value. Tensor metadata inside extensions (tensors' and storages') is
// checked the same way.
func checkWellFormed(b []byte) error {
	n, err := skipValue(b, 0)
	if err != nil {
		return fmt.Errorf("reduction: malformed message: %w", err)
	}
	if n != len(b) {
		return fmt.Errorf("reduction: %d bytes after the value", len(b)-n)
	}
	return nil
}

// skipValue returns the size of the msgpack value at the start of b.
func skipValue(b []byte, depth int) (int, error) {
	if depth > maxDepth {
		return 0, fmt.Errorf("nested deeper than %d", maxDepth)
	}
	if len(b) == 0 {
		return 0, fmt.Errorf("unexpected end of message")
	}
	c := b[0]
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return 1, nil
	case c >= 0x80 && c <= 0x8f:
		return skipItems(b, 1, 2*int(c&0x0f), depth)
	case c >= 0x90 && c <= 0x9f:
		return skipItems(b, 1, int(c&0x0f), depth)
	case c >= 0xa0 && c <= 0xbf:
		return span(b, 1, int(c&0x1f))
	}
	switch c {
	case 0xcc, 0xd0:
		return span(b, 1, 1)
	case 0xcd, 0xd1:
		return span(b, 1, 2)
	case 0xca, 0xce, 0xd2:
		return span(b, 1, 4)
	case 0xcb, 0xcf, 0xd3:
		return span(b, 1, 8)
	case 0xc4, 0xd9: // bin8, str8
		return sized(b, 1)
	case 0xc5, 0xda:
		return sized(b, 2)
	case 0xc6, 0xdb:
		return sized(b, 4)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16
		return ext(b, 1, 1<<(c-0xd4), depth)
	case 0xc7, 0xc8, 0xc9: // ext 8, 16, 32
		w := 1 << (c - 0xc7)
		n, err := length(b, w)
		if err != nil {
			return 0, err
		}
		return ext(b, 1+w, n, depth)
	case 0xdc, 0xdd: // array 16, 32
		w := 2 << (c - 0xdc)
		n, err := length(b, w)
		if err != nil {
			return 0, err
		}
		return skipItems(b, 1+w, n, depth)
	case 0xde, 0xdf: // map 16, 32
		w := 2 << (c - 0xde)
		n, err := length(b, w)
		if err != nil {
			return 0, err
		}
		return skipItems(b, 1+w, 2*n, depth)
	}
	return 0, fmt.Errorf("invalid code %#x", c)
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

// sized is span for a str or bin with a w-byte length.
func sized(b []byte, w int) (int, error) {
	n, err := length(b, w)
	if err != nil {
		return 0, err
	}
	return span(b, 1+w, n)
}

func ext(b []byte, head, n, depth int) (int, error) {
	end, err := span(b, head+1, n) // +1 for the type byte
	if err != nil {
		return 0, err
	}
	if t := int8(b[head]); t == tensorExt || t == storageExt { // both carry a Meta
		payload := b[head+1 : end]
		used, err := skipValue(payload, depth+1)
		if err != nil {
			return 0, err
		}
		if used != len(payload) {
			return 0, fmt.Errorf("tensor metadata has %d trailing bytes", len(payload)-used)
		}
	}
	return end, nil
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

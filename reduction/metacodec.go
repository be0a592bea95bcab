package reduction

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// Meta travels as a plain msgpack array of its fields in order. It is
// written and read by hand rather than by reflection: it is on the path of
// every tensor sent, and the reader is simpler to make strict.

const metaFields = 21

// appendMeta appends m's msgpack encoding to b.
func appendMeta(b []byte, m *Meta) []byte {
	b = appendArrayLen(b, metaFields)
	b = appendUint(b, uint64(m.Version))
	b = appendString(b, m.Strategy)
	b = appendInt(b, int64(m.FDIndex))
	b = appendUint(b, m.Dev)
	b = appendUint(b, m.Ino)
	b = appendString(b, m.Name)
	b = appendInt(b, m.Size)
	b = appendInt(b, m.SegmentSize)
	b = appendInt(b, m.BlockOffset)
	b = appendUint(b, m.Gen)
	b = appendInt(b, m.Offset)
	b = appendUint(b, uint64(m.DType))
	b = appendInts(b, m.Shape)
	b = appendInts(b, m.Strides)
	if m.LoD == nil {
		b = append(b, 0xc0)
	} else {
		b = appendArrayLen(b, len(m.LoD))
		for _, level := range m.LoD {
			b = appendInts(b, level)
		}
	}
	b = appendString(b, m.Place)
	b = appendBytes(b, m.IPC)
	b = appendBytes(b, m.IPCEvent)
	b = appendInt(b, m.DevOffset)
	b = appendInt(b, int64(m.MemFDIndex))
	return appendBytes(b, m.DevUUID)
}

func appendBytes(b, v []byte) []byte {
	if v == nil {
		return append(b, 0xc0)
	}
	switch n := len(v); {
	case n <= math.MaxUint8:
		b = append(b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xc5), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xc6), uint32(n))
	}
	return append(b, v...)
}

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v <= 0x7f:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

func appendInt(b []byte, v int64) []byte {
	switch {
	case v >= 0:
		return appendUint(b, uint64(v))
	case v >= -32:
		return append(b, byte(v))
	case v >= math.MinInt8:
		return append(b, 0xd0, byte(v))
	case v >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(v))
	case v >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
}

func appendString(b []byte, s string) []byte {
	switch n := len(s); {
	case n <= 31:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xda), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xdb), uint32(n))
	}
	return append(b, s...)
}

func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

func appendInts(b []byte, v []int) []byte {
	b = appendArrayLen(b, len(v))
	for _, x := range v {
		b = appendInt(b, int64(x))
	}
	return b
}

var errShort = errors.New("unexpected end of tensor metadata")

// metaReader reads msgpack values strictly: each read checks its type and
// that its bytes are there; the first error sticks. Reading moves off, never
// b: a reader writes no pointer per value, so it pays no write barrier
// while the collector runs.
type metaReader struct {
	b   []byte
	off int // bytes of b read
	err error
}

// left returns how many bytes of b are not read yet.
func (r *metaReader) left() int { return len(r.b) - r.off }

// next returns the byte next in b without reading it, or 0xc1 (never used
// by msgpack) at its end.
func (r *metaReader) next() byte {
	if r.off < len(r.b) {
		return r.b[r.off]
	}
	return 0xc1
}

func (r *metaReader) fail(err error) {
	if r.err == nil {
		r.err = err
	}
}

func (r *metaReader) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || n > r.left() {
		r.fail(errShort)
		return nil
	}
	out := r.b[r.off : r.off+n]
	r.off += n
	return out
}

func (r *metaReader) code() byte {
	b := r.take(1)
	if b == nil {
		return 0xc1 // never used by msgpack
	}
	return b[0]
}

// int reads any msgpack integer that fits an int64.
func (r *metaReader) int() int64 {
	if r.err == nil && r.off < len(r.b) {
		// A fixint, positive or negative, the commonest: one byte, its
		// value.
		if c := r.b[r.off]; c <= 0x7f || c >= 0xe0 {
			r.off++
			return int64(int8(c))
		}
	}
	c := r.code()
	if r.err != nil {
		return 0 // an earlier error, or the end of b
	}
	switch c {
	case 0xcc:
		if b := r.take(1); b != nil {
			return int64(b[0])
		}
	case 0xcd:
		if b := r.take(2); b != nil {
			return int64(binary.BigEndian.Uint16(b))
		}
	case 0xce:
		if b := r.take(4); b != nil {
			return int64(binary.BigEndian.Uint32(b))
		}
	case 0xcf:
		if b := r.take(8); b != nil {
			v := binary.BigEndian.Uint64(b)
			if v > math.MaxInt64 {
				r.fail(fmt.Errorf("integer %d out of range", v))
				return 0
			}
			return int64(v)
		}
	case 0xd0:
		if b := r.take(1); b != nil {
			return int64(int8(b[0]))
		}
	case 0xd1:
		if b := r.take(2); b != nil {
			return int64(int16(binary.BigEndian.Uint16(b)))
		}
	case 0xd2:
		if b := r.take(4); b != nil {
			return int64(int32(binary.BigEndian.Uint32(b)))
		}
	case 0xd3:
		if b := r.take(8); b != nil {
			return int64(binary.BigEndian.Uint64(b))
		}
	default:
		r.fail(fmt.Errorf("code %#x where an integer belongs", c))
	}
	return 0
}

// uint reads an integer that must not be negative; a uint64 above
// MaxInt64 is allowed.
func (r *metaReader) uint() uint64 {
	if r.next() == 0xcf {
		r.code()
		if b := r.take(8); b != nil {
			return binary.BigEndian.Uint64(b)
		}
		return 0
	}
	v := r.int()
	if v < 0 {
		r.fail(fmt.Errorf("negative value %d where an unsigned one belongs", v))
		return 0
	}
	return uint64(v)
}

// small reads an int that must fit an int (and a 32-bit one at that, for
// counts and indexes).
func (r *metaReader) small() int {
	v := r.int()
	if v < math.MinInt32 || v > math.MaxInt32 {
		if v > math.MaxInt32 {
			return math.MaxInt32 // out of range for any check that follows
		}
		return math.MinInt32
	}
	return int(v)
}

func (r *metaReader) str() string {
	c := r.code()
	n := 0
	switch {
	case r.err != nil:
		return ""
	case c >= 0xa0 && c <= 0xbf:
		n = int(c & 0x1f)
	case c == 0xd9:
		if b := r.take(1); b != nil {
			n = int(b[0])
		}
	case c == 0xda:
		if b := r.take(2); b != nil {
			n = int(binary.BigEndian.Uint16(b))
		}
	case c == 0xdb:
		if b := r.take(4); b != nil {
			n = int(binary.BigEndian.Uint32(b))
		}
	default:
		r.fail(fmt.Errorf("code %#x where a string belongs", c))
	}
	return intern(r.take(n))
}

// intern returns b as a string, without an allocation for the strings
// most metadata carries: the strategies and the CPU's place.
func intern(b []byte) string {
	switch string(b) { // compiled without a conversion
	case "":
		return ""
	case "file_descriptor":
		return "file_descriptor"
	case "file_system":
		return "file_system"
	case StrategyBody:
		return StrategyBody
	case StrategyCUDAIPC:
		return StrategyCUDAIPC
	case "cpu":
		return "cpu"
	}
	return string(b)
}

// bytes reads a bin value; nil reads as nil.
func (r *metaReader) bytes() []byte {
	c := r.code()
	n := 0
	switch {
	case r.err != nil:
		return nil
	case c == 0xc0:
		return nil
	case c == 0xc4:
		if b := r.take(1); b != nil {
			n = int(b[0])
		}
	case c == 0xc5:
		if b := r.take(2); b != nil {
			n = int(binary.BigEndian.Uint16(b))
		}
	case c == 0xc6:
		if b := r.take(4); b != nil {
			n = int(binary.BigEndian.Uint32(b))
		}
	default:
		r.fail(fmt.Errorf("code %#x where bytes belong", c))
	}
	if b := r.take(n); b != nil {
		return append([]byte{}, b...)
	}
	return nil
}

// arrayLen reads an array header; nil reads as -1.
func (r *metaReader) arrayLen() int {
	c := r.code()
	n := 0
	switch {
	case r.err != nil:
		return 0
	case c == 0xc0:
		return -1
	case c >= 0x90 && c <= 0x9f:
		n = int(c & 0x0f)
	case c == 0xdc:
		if b := r.take(2); b != nil {
			n = int(binary.BigEndian.Uint16(b))
		}
	case c == 0xdd:
		if b := r.take(4); b != nil {
			n = int(binary.BigEndian.Uint32(b))
		}
	default:
		r.fail(fmt.Errorf("code %#x where an array belongs", c))
	}
	if n > r.left() { // every element takes a byte at least
		r.fail(errShort)
		return 0
	}
	return n
}

// peekFixArray returns the length of the array next in r if it is a
// short one (up to 15 elements), else 0. It reads nothing.
func (r *metaReader) peekFixArray() int {
	if c := r.next(); c >= 0x90 && c <= 0x9f {
		return int(c & 0x0f)
	}
	return 0
}

func (r *metaReader) ints() []int { return r.appendInts(nil) }

// appendInts reads an array of ints onto the end of dst and returns the
// array read, which shares dst's memory when it has room. An empty array
// reads as an empty slice, and nil after an error.
func (r *metaReader) appendInts(dst []int) []int {
	n := r.arrayLen()
	if n <= 0 || r.err != nil {
		if n == 0 {
			return []int{}
		}
		return nil
	}
	dst = slices.Grow(dst, n)
	out := dst[len(dst) : len(dst)+n : len(dst)+n]
	for i := range out {
		v := r.int()
		if v > math.MaxInt || v < math.MinInt {
			r.fail(fmt.Errorf("integer %d out of range", v))
		}
		out[i] = int(v)
	}
	return out
}

// parseBlockRef reads from b a tensor's metadata as far as the pooled
// block it names (its strategy and descriptor index, its segment's
// identity and size, the block's offset, size and generation): what a
// lane's reader needs of the messages behind the one it takes, to lock
// their blocks ahead (fdReader.appendAhead). It reads no shape nor
// strides, and of a msgpack Meta nothing after the generation (a compact
// one's fixed part gives the view's offset and dtype too). Each
// message's metadata is parsed whole, and checked, when it is decoded.
func parseBlockRef(b []byte, m *Meta) error {
	if len(b) > 0 && b[0] == compactTag {
		return parseCompact(b, nil, m, true)
	}
	r := &metaReader{b: b}
	if err := r.head(m); err != nil {
		return err
	}
	if r.err != nil {
		return fmt.Errorf("decoding tensor metadata: %w", r.err)
	}
	return nil
}

// head reads into m the fields of a tensor's metadata up to the block's
// generation: those parseMeta and parseBlockRef share.
func (r *metaReader) head(m *Meta) error {
	if n := r.arrayLen(); r.err == nil && n != metaFields {
		return fmt.Errorf("tensor metadata has %d fields, want %d", n, metaFields)
	}
	version := r.uint()
	if r.err == nil && version != Version {
		return fmt.Errorf("metadata version %d, want %d", version, Version)
	}
	m.Version = uint8(version)
	m.Strategy = r.str()
	m.FDIndex = r.small()
	m.Dev = r.uint()
	m.Ino = r.uint()
	m.Name = r.str()
	m.Size = r.int()
	m.SegmentSize = r.int()
	m.BlockOffset = r.int()
	m.Gen = r.uint()
	return nil
}

// parseMeta reads into m a Meta from its encoding, which must be exactly
// one. Its Shape and Strides are made in room if it has the capacity, so
// they are the caller's only until it uses room again. On an error m
// holds what was read before it, which the caller must not use. m is
// written through a pointer, which pays a write barrier for its strings
// and slices while the collector runs, where a Meta returned by value
// would not; but a returned Meta is copied whole (288 bytes) into the
// caller's, and that cost more (see BenchmarkLaneHandOff).
func parseMeta(b []byte, room []int, m *Meta) error {
	if len(b) > 0 && b[0] == compactTag {
		return parseCompact(b, room, m, false)
	}
	r := &metaReader{b: b}
	if err := r.head(m); err != nil {
		return err
	}
	m.Offset = r.int()
	dt := r.uint()
	if dt > math.MaxUint8 {
		dt = 0
	}
	m.DType = tensor.DType(dt)
	// Shape and strides share one array, sized for as many strides as
	// dims.
	dims := room[:0]
	if n := 2 * r.peekFixArray(); cap(dims) < n {
		dims = make([]int, 0, n)
	}
	m.Shape = r.appendInts(dims)
	if n := len(m.Shape); n <= cap(dims) {
		dims = dims[n:n]
	} else {
		dims = nil
	}
	m.Strides = r.appendInts(dims)
	if n := r.arrayLen(); n >= 0 && r.err == nil {
		m.LoD = make([][]int, n)
		for i := range m.LoD {
			m.LoD[i] = r.ints()
		}
	}
	m.Place = r.str()
	m.IPC = r.bytes()
	m.IPCEvent = r.bytes()
	m.DevOffset = r.int()
	m.MemFDIndex = r.small()
	m.DevUUID = r.bytes()
	if r.err != nil {
		return fmt.Errorf("decoding tensor metadata: %w", r.err)
	}
	if n := r.left(); n != 0 {
		return fmt.Errorf("tensor metadata has %d trailing bytes", n)
	}
	return nil
}

// A tensor that a lane's message names by identity alone (a block of a
// segment the lane's reader maps, see carry.Lane), what a stream sends,
// travels with a compact Meta instead of the msgpack one: a fixed binary
// layout, written and read in a few stores and loads rather than field
// by field. Only lanes carry it: a lane's header version (package sock)
// keeps it from a peer that does not read it. It is read wherever a Meta
// is, and what it gives is checked as any Meta's.
//
//	0      compactTag
//	1      Version
//	2      DType
//	3      n, the dimensions (at most tensor.MaxDims)
//	4      Dev, Ino, Size, SegmentSize, BlockOffset, Gen, Offset: 7 x 8 bytes
//	60     Shape, then Strides: 2n x 8 bytes
//
// All integers are little-endian. The fields it has no room for are
// those of a CPU tensor's pooled block of file_descriptor named without
// a descriptor (see compactable).

// compactTag begins a compact Meta: a byte msgpack never uses, which no
// msgpack Meta starts with.
const compactTag = 0xc1

// compactHead is the length of a compact Meta's fixed part.
const compactHead = 4 + 7*8

// compactable reports whether m can travel compact, losing nothing.
func compactable(m *Meta) bool {
	return m.Strategy == string(strategy.FileDescriptor) && m.FDIndex == -1 && m.Name == "" && m.BlockOffset >= 0 &&
		m.LoD == nil && m.Place == "cpu" && m.IPC == nil && m.IPCEvent == nil && m.DevOffset == 0 &&
		m.MemFDIndex == -1 && m.DevUUID == nil && len(m.Shape) == len(m.Strides) && len(m.Shape) <= tensor.MaxDims
}

// appendCompact appends m's compact form to b; m must be compactable.
func appendCompact(b []byte, m *Meta) []byte {
	b = append(b, compactTag, m.Version, byte(m.DType), byte(len(m.Shape)))
	for _, v := range [...]uint64{m.Dev, m.Ino, uint64(m.Size), uint64(m.SegmentSize), uint64(m.BlockOffset), m.Gen, uint64(m.Offset)} {
		b = binary.LittleEndian.AppendUint64(b, v)
	}
	for _, v := range m.Shape {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	for _, v := range m.Strides {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	return b
}

// parseCompact is parseMeta for a compact Meta, b, and with head set
// parseBlockRef's: the fixed part alone, what follows unread.
func parseCompact(b []byte, room []int, m *Meta, head bool) error {
	if len(b) < compactHead {
		return fmt.Errorf("decoding tensor metadata: %w", errShort)
	}
	if b[1] != Version {
		return fmt.Errorf("metadata version %d, want %d", b[1], Version)
	}
	n := int(b[3])
	if n > tensor.MaxDims {
		return fmt.Errorf("compact tensor metadata of %d dimensions, more than %d", n, tensor.MaxDims)
	}
	le := binary.LittleEndian
	*m = Meta{
		Version: b[1], Strategy: string(strategy.FileDescriptor), FDIndex: -1,
		Dev: le.Uint64(b[4:]), Ino: le.Uint64(b[12:]),
		Size: int64(le.Uint64(b[20:])), SegmentSize: int64(le.Uint64(b[28:])), BlockOffset: int64(le.Uint64(b[36:])),
		Gen: le.Uint64(b[44:]), Offset: int64(le.Uint64(b[52:])), DType: tensor.DType(b[2]),
		Place: "cpu", MemFDIndex: -1,
	}
	if head {
		return nil
	}
	dims := b[compactHead:]
	if len(dims) != 16*n {
		return fmt.Errorf("compact tensor metadata of %d dimensions has %d bytes of them, want %d", n, len(dims), 16*n)
	}
	out := room[:0]
	if cap(out) < 2*n || out == nil {
		out = make([]int, 0, 2*n)
	}
	out = out[:2*n]
	for i := range out {
		v := int64(le.Uint64(dims[8*i:]))
		if int64(int(v)) != v {
			return fmt.Errorf("decoding tensor metadata: integer %d out of range", v)
		}
		out[i] = int(v)
	}
	m.Shape, m.Strides = out[:n:n], out[n:]
	return nil
}

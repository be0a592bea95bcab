package reduction

import (
	"math"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

func TestMetaCodecRoundTrip(t *testing.T) {
	cases := []Meta{
		validMeta(shm.ID{Dev: 1 << 40, Ino: math.MaxUint64}),
		{Version: Version, Strategy: "file_system", FDIndex: -1, Name: "tensormp_abc_1_0123456789abcdef", Size: math.MaxInt64,
			SegmentSize: 1 << 40, BlockOffset: -1, Gen: math.MaxUint64, Offset: -300000, DType: tensor.Complex128,
			Shape: []int{0, 70000, 3}, Strides: []int{math.MinInt32, 1, math.MaxInt64}, LoD: [][]int{{0, 2, 5}, {}}, Place: "gpu:3",
			IPC: make([]byte, 64), IPCEvent: []byte{1, 2, 3}, DevOffset: 1 << 33},
		{Version: Version, FDIndex: -1, BlockOffset: -1, Shape: []int{}, Strides: []int{}, Place: "cpu"},
		// Shape and strides are read into one array sized by the shape:
		// more strides than dims, more than 15 dims, none at all.
		{Version: Version, FDIndex: -1, BlockOffset: -1, Shape: []int{2, 3}, Strides: []int{3, 1, 7, 9}, Place: "cpu"},
		{Version: Version, FDIndex: -1, BlockOffset: -1, Shape: make([]int, 16), Strides: make([]int, 16), Place: "cpu"},
		{Version: Version, FDIndex: -1, BlockOffset: -1, Shape: []int{4}, Strides: []int{}, Place: "cpu"},
	}
	for _, m := range cases {
		b := appendMeta(nil, &m)
		got, err := parsedMeta(b, nil)
		require.NoError(t, err)
		assert.Equal(t, m, got)
		// Growing the shape leaves the strides as they are.
		_ = append(got.Shape, -1, -1, -1, -1)
		assert.Equal(t, m.Strides, got.Strides)
		// Room the dims fit in is used; room too small is not.
		for _, room := range [][]int{make([]int, 0, 3), make([]int, 40)} {
			inRoom, err := parsedMeta(b, room)
			require.NoError(t, err)
			assert.Equal(t, m, inRoom)
			fits := 2*len(m.Shape) <= cap(room) && len(m.Shape) > 0
			assert.Equal(t, fits, unsafe.SliceData(inRoom.Shape) == unsafe.SliceData(room), "shape in room, %d dims, room for %d", len(m.Shape), cap(room))
		}

		// The hand-written form is ordinary msgpack, both ways.
		var viaLib Meta
		require.NoError(t, msgpack.Unmarshal(b, &viaLib))
		assert.Equal(t, m, viaLib)
		lib, err := msgpack.Marshal(&m)
		require.NoError(t, err)
		fromLib, err := parsedMeta(lib, nil)
		require.NoError(t, err)
		assert.Equal(t, m.Shape, fromLib.Shape)
		assert.Equal(t, m.Gen, fromLib.Gen)
		assert.Equal(t, m.Offset, fromLib.Offset)

		// parseBlockRef reads the same fields as far as the generation,
		// and nothing after.
		ref, err := parsedBlockRef(b)
		require.NoError(t, err)
		head := Meta{Version: m.Version, Strategy: m.Strategy, FDIndex: m.FDIndex, Dev: m.Dev, Ino: m.Ino, Name: m.Name,
			Size: m.Size, SegmentSize: m.SegmentSize, BlockOffset: m.BlockOffset, Gen: m.Gen}
		assert.Equal(t, head, ref)
	}
}

// parseBlockRef refuses what parseMeta refuses before the block's
// generation, and metadata cut short before it.
func TestParseBlockRefRejects(t *testing.T) {
	m := validMeta(shm.ID{Dev: 7, Ino: 9})
	m.FDIndex, m.BlockOffset, m.Gen = -1, 4096, 3
	b := appendMeta(nil, &m)
	_, err := parsedBlockRef(b)
	require.NoError(t, err)
	end := 0 // where the generation ends
	for n := range len(b) {
		if _, err := parsedBlockRef(b[:n]); err == nil {
			end = n
			break
		}
	}
	require.NotZero(t, end, "some prefix holds the fields it reads")
	for n := range end {
		_, err := parsedBlockRef(b[:n])
		assert.Error(t, err, "cut to %d of %d bytes", n, len(b))
	}
	other := m
	other.Version = Version + 1
	_, err = parsedBlockRef(appendMeta(nil, &other))
	assert.Error(t, err, "another version")
	_, err = parsedBlockRef([]byte{0x91, 0x01})
	assert.Error(t, err, "too few fields")
}

func TestMetaCodecRejects(t *testing.T) {
	good := appendMeta(nil, &Meta{Version: Version, FDIndex: -1, MemFDIndex: -1, BlockOffset: -1, Shape: []int{2}, Strides: []int{1}, Place: "cpu"})
	for name, b := range map[string][]byte{
		"empty":          nil,
		"not an array":   {0xc0},
		"too few fields": {0x93, 0x02, 0xa0, 0x00},
		"truncated":      good[:len(good)-2],
		"trailing":       append(append([]byte(nil), good...), 0x00),
		"string as int":  append([]byte{0xdc, 0x00, metaFields, 0xa1, 'x'}, good[4:]...),
		"old version":    append([]byte{0xdc, 0x00, metaFields, 0x04}, good[4:]...),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := parsedMeta(b, nil)
			assert.Error(t, err)
		})
	}
}

func BenchmarkMetaCodec(b *testing.B) {
	m := validMeta(shm.ID{Dev: 64769, Ino: 1 << 20})
	var buf []byte
	var room [8]int
	b.ReportAllocs()
	for b.Loop() {
		buf = appendMeta(buf[:0], &m)
		var got Meta
		if err := parseMeta(buf, room[:], &got); err != nil {
			b.Fatal(err)
		}
	}
}

// A code that is not an integer's, where an integer belongs, is an error,
// those beside the fixints' ranges (0x00-0x7f, 0xe0-0xff) included.
func TestMetaReaderRefusesAnIntegersNeighbours(t *testing.T) {
	for _, c := range []byte{0x80, 0x8f, 0x90, 0xa0, 0xc0, 0xc1, 0xc2, 0xca, 0xd9, 0xdf} {
		r := &metaReader{b: []byte{c, 0, 0, 0, 0, 0, 0, 0, 0}}
		v := r.int()
		assert.Error(t, r.err, "code %#x read as the integer %d", c, v)
	}
	for c, want := range map[byte]int64{0x00: 0, 0x7f: 127, 0xe0: -32, 0xff: -1} {
		r := &metaReader{b: []byte{c}}
		assert.Equal(t, want, r.int(), "fixint %#x", c)
		assert.NoError(t, r.err)
		assert.Zero(t, r.left(), "fixint %#x is one byte", c)
	}
}

// parsedMeta is parseMeta returning the Meta it reads.
func parsedMeta(b []byte, room []int) (Meta, error) {
	var m Meta
	err := parseMeta(b, room, &m)
	return m, err
}

// parsedBlockRef is parseBlockRef returning the Meta it reads.
func parsedBlockRef(b []byte) (Meta, error) {
	var m Meta
	err := parseBlockRef(b, &m)
	return m, err
}

package dist

import (
	"bytes"
	"io"
	"testing"

	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/flight"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/tensormp/tensormp/tensor"
)

// The codec's bytes for tensormp's FlightData equal the standard proto
// codec's for the same message, whatever the pieces.
func TestCodecWireIdentity(t *testing.T) {
	desc, err := proto.Marshal(&flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{"queue", "q"}})
	require.NoError(t, err)
	big := bytes.Repeat([]byte{0xab}, 3<<10)
	cases := []struct {
		name string
		out  outData
	}{
		{"empty", outData{}},
		{"meta only", outData{meta: []byte("frame")}},
		{"descriptor and schema", outData{desc: desc, header: []byte("schema-header")}},
		{"small pieces", outData{header: []byte("h"), meta: []byte("m"), body: [][]byte{[]byte("abc"), {}, []byte("defgh")}}},
		{"large pieces", outData{header: []byte("h"), meta: []byte("m"), body: [][]byte{big, []byte("pad"), big[:2000]}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := newPins()
			c.out.pins = p
			got := newFlightCodec().Marshal
			bs, err := got(&c.out)
			require.NoError(t, err)
			want, err := proto.Marshal(&flight.FlightData{
				FlightDescriptor: unmarshalDesc(t, c.out.desc),
				DataHeader:       c.out.header,
				AppMetadata:      c.out.meta,
				DataBody:         bytes.Join(c.out.body, nil),
			})
			require.NoError(t, err)
			assert.Equal(t, string(want), string(bs.Materialize()))
			bs.Free()
			select {
			case <-p.released():
			default:
				t.Fatal("the pieces lent to gRPC are not back once it freed them")
			}
		})
	}
}

func unmarshalDesc(t *testing.T, b []byte) *flight.FlightDescriptor {
	if b == nil {
		return nil
	}
	var d flight.FlightDescriptor
	require.NoError(t, proto.Unmarshal(b, &d))
	return &d
}

// The codec reads what the standard codec writes, split anywhere across
// gRPC's buffers, and puts the body where dest says.
func TestCodecReadsStockBytes(t *testing.T) {
	body := bytes.Repeat([]byte("0123456789"), 500)
	msg := &flight.FlightData{
		FlightDescriptor: &flight.FlightDescriptor{Type: flight.DescriptorCMD, Cmd: []byte("c")},
		DataHeader:       []byte("header"),
		AppMetadata:      []byte("meta"),
		DataBody:         body,
	}
	wire, err := proto.Marshal(msg)
	require.NoError(t, err)
	for _, split := range []int{1, 2, 7, 100, 4096} {
		var bs mem.BufferSlice
		for off := 0; off < len(wire); off += split {
			bs = append(bs, mem.SliceBuffer(wire[off:min(off+split, len(wire))]))
		}
		dst := make([]byte, len(body))
		in := inData{dest: func(meta []byte, n int) ([]byte, error) {
			assert.Equal(t, "meta", string(meta), "app_metadata comes before the body")
			return dst, nil
		}}
		require.NoError(t, newFlightCodec().Unmarshal(bs, &in), "split %d", split)
		assert.Equal(t, "header", string(in.header))
		assert.Equal(t, body, dst)
		assert.Equal(t, &dst[0], &in.body[0], "the body lands in dest, not in a copy")
		assert.NotEmpty(t, in.desc)
	}
}

func TestCodecRejectsMalformed(t *testing.T) {
	cases := map[string][]byte{
		"truncated key":    {0x80},
		"length past end":  {0x12, 0x05, 'a'},
		"body past end":    {0xc2, 0x3e, 0x10, 1, 2},
		"group wire type":  {0x13},
		"field number 0":   {0x02, 0x00},
		"truncated length": {0x12, 0xff},
	}
	for name, wire := range cases {
		t.Run(name, func(t *testing.T) {
			var in inData
			assert.Error(t, newFlightCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(wire)}, &in))
		})
	}
}

func FuzzCodecUnmarshal(f *testing.F) {
	wire, err := proto.Marshal(&flight.FlightData{DataHeader: []byte("h"), AppMetadata: []byte("m"), DataBody: []byte("body")})
	require.NoError(f, err)
	f.Add(wire, uint8(3))
	f.Add([]byte{0xc2, 0x3e, 0x10}, uint8(0))
	f.Fuzz(func(t *testing.T, wire []byte, room uint8) {
		in := inData{dest: func(_ []byte, n int) ([]byte, error) { return make([]byte, min(n, int(room))), nil }}
		_ = newFlightCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(wire)}, &in)
	})
}

// flightDataReader hands a stock flight.Reader the messages a writer
// sent, decoded by the standard proto codec.
type flightDataReader struct{ ch chan []byte }

func (r flightDataReader) Recv() (*flight.FlightData, error) {
	select {
	case b := <-r.ch:
		var fd flight.FlightData
		if err := proto.Unmarshal(b, &fd); err != nil {
			return nil, err
		}
		return &fd, nil
	default:
		return nil, io.EOF
	}
}

// An unmodified arrow-go Flight reader reads what tensormp writes: a
// schema, then record batches of one uint8 column whose bytes are the
// tensors', each with its frame as app_metadata.
func TestStockFlightReaderReadsStreams(t *testing.T) {
	p := wirePipe{make(chan []byte, 64)}
	data := make([]uint8, 2*DefaultChunk+10)
	for i := range data {
		data[i] = uint8(i % 251)
	}
	x, err := tensor.FromSlice(data, len(data))
	require.NoError(t, err)
	w := newWriter(p, DefaultChunk)
	require.NoError(t, w.send(x))
	require.NoError(t, w.send(map[string]int{"empty": 0}))

	r, err := flight.NewRecordReader(flightDataReader(p))
	require.NoError(t, err)
	defer r.Release()
	assert.True(t, r.Schema().Equal(bodySchema))
	var got []byte
	var kinds []frameKind
	for r.Next() {
		f, err := parseFrame(r.LatestAppMetadata())
		require.NoError(t, err)
		kinds = append(kinds, f.Kind)
		col := r.RecordBatch().Column(0).(*array.Uint8)
		got = append(got, col.Uint8Values()...)
	}
	require.NoError(t, r.Err())
	assert.Equal(t, []frameKind{kindValue, kindChunk, kindChunk, kindChunk, kindValue}, kinds)
	assert.Equal(t, data, got)
}

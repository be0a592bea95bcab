package dist

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the codec flightCodec delegates to
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/tensormp/tensormp/mmapalloc"
)

// FlightData's fields on the wire (Flight.proto).
const (
	fieldDescriptor protowire.Number = 1
	fieldHeader     protowire.Number = 2
	fieldAppMeta    protowire.Number = 3
	fieldBody       protowire.Number = 1000
)

// flightCodec is gRPC's "proto" codec with a zero-copy path for the
// FlightData messages tensormp sends and receives. Every other message,
// and FlightData from any other code, goes to the standard codec. The
// bytes on the wire are the standard codec's, so any Flight peer reads
// what tensormp writes and the other way round.
type flightCodec struct{ std encoding.CodecV2 }

func newFlightCodec() flightCodec {
	return flightCodec{std: encoding.GetCodecV2("proto")}
}

func (flightCodec) Name() string { return "proto" }

func (c flightCodec) Marshal(v any) (mem.BufferSlice, error) {
	if d, ok := v.(*outData); ok {
		return d.marshal(), nil
	}
	return c.std.Marshal(v)
}

func (c flightCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if d, ok := v.(*inData); ok {
		return d.unmarshal(data)
	}
	return c.std.Unmarshal(data, v)
}

// outData is a FlightData message on its way out. Its body is a list of
// pieces, slices of the tensors' storages, which the codec hands to gRPC
// without copying; pins learns when gRPC lets go of each.
type outData struct {
	desc   []byte   // a marshalled FlightDescriptor, or nil
	header []byte   // an Arrow IPC message: schema or record batch
	meta   []byte   // app_metadata: a frame
	body   [][]byte // data_body, in pieces
	pins   *pins    // lends the body's pieces; required when there is a body
}

// marshal writes d as the standard codec would write the FlightData it
// stands for. Pieces gRPC may hold after SendMsg returns are lent through
// pins; pieces too small for gRPC to count are copied.
func (d *outData) marshal() mem.BufferSlice {
	var n int
	for _, p := range d.body {
		n += len(p)
	}
	head := make([]byte, 0, 32+len(d.desc)+len(d.header)+len(d.meta))
	head = appendField(head, fieldDescriptor, d.desc)
	head = appendField(head, fieldHeader, d.header)
	head = appendField(head, fieldAppMeta, d.meta)
	if n > 0 {
		head = protowire.AppendTag(head, fieldBody, protowire.BytesType)
		head = protowire.AppendVarint(head, uint64(n))
	}
	out := mem.BufferSlice{mem.SliceBuffer(head)}
	var small []byte
	for _, p := range d.body {
		if len(p) == 0 {
			continue
		}
		if mem.IsBelowBufferPoolingThreshold(len(p)) {
			small = append(small, p...)
			continue
		}
		if len(small) > 0 {
			out = append(out, mem.SliceBuffer(small))
			small = nil
		}
		out = append(out, d.pins.lend(p))
	}
	if len(small) > 0 {
		out = append(out, mem.SliceBuffer(small))
	}
	return out
}

func appendField(b []byte, num protowire.Number, v []byte) []byte {
	if len(v) == 0 {
		return b // proto3 leaves empty bytes out
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

// pins counts the body pieces gRPC holds. A sender waits for them before
// it lets the storages go: gRPC may write a piece after SendMsg returns,
// and frees it (or drops it, for a stream that failed) when done.
type pins struct {
	mu   sync.Mutex
	n    int
	zero chan struct{} // closed while n is 0
}

func newPins() *pins {
	z := make(chan struct{})
	close(z)
	return &pins{zero: z}
}

func (p *pins) lend(b []byte) mem.Buffer {
	p.mu.Lock()
	if p.n == 0 {
		p.zero = make(chan struct{})
	}
	p.n++
	p.mu.Unlock()
	b = b[:len(b):len(b)] // gRPC decides by capacity whether to count it
	return mem.NewBuffer(&b, p)
}

// Get is never called: gRPC only gives pieces back.
func (p *pins) Get(n int) *[]byte { b := make([]byte, n); return &b }

// Put is gRPC giving a piece back.
func (p *pins) Put(*[]byte) {
	p.mu.Lock()
	p.n--
	if p.n == 0 {
		close(p.zero)
	}
	p.mu.Unlock()
}

// released returns a channel closed once gRPC holds no piece.
func (p *pins) released() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.zero
}

// inData is a FlightData message received. Its body is copied once,
// straight into the slice dest returns for it; without dest, or when dest
// returns nil, into a new slice.
type inData struct {
	desc   []byte
	header []byte
	meta   []byte
	body   []byte
	dest   func(meta []byte, n int) ([]byte, error)
}

// maxField bounds the fields other than the body, which a tensor's bytes
// never travel in.
const maxField = 16 << 20

func (d *inData) unmarshal(data mem.BufferSlice) error {
	d.desc, d.header, d.meta, d.body = nil, nil, nil, nil
	r := data.Reader()
	defer r.Close()
	for r.Remaining() > 0 {
		key, err := binary.ReadUvarint(r)
		if err != nil {
			return malformedf("FlightData field key: %w", err)
		}
		num, typ := protowire.DecodeTag(key)
		if num <= 0 {
			return malformedf("FlightData field number %d", num)
		}
		switch typ {
		case protowire.VarintType:
			if _, err := binary.ReadUvarint(r); err != nil {
				return malformedf("FlightData field %d: %w", num, err)
			}
			continue
		case protowire.Fixed64Type, protowire.Fixed32Type:
			n := 8
			if typ == protowire.Fixed32Type {
				n = 4
			}
			if _, err := r.Discard(n); err != nil {
				return malformedf("FlightData field %d: %w", num, err)
			}
			continue
		case protowire.BytesType:
		default:
			return malformedf("FlightData field %d of wire type %d", num, typ)
		}
		ln, err := binary.ReadUvarint(r)
		if err != nil {
			return malformedf("FlightData field %d length: %w", num, err)
		}
		if ln > uint64(r.Remaining()) {
			return malformedf("FlightData field %d of %d bytes in a message with %d left", num, ln, r.Remaining())
		}
		n := int(ln)
		if num == fieldBody {
			if err := d.readBody(r, n); err != nil {
				return err
			}
			continue
		}
		if n > maxField {
			return malformedf("FlightData field %d of %d bytes", num, n)
		}
		var dst *[]byte
		switch num {
		case fieldDescriptor:
			dst = &d.desc
		case fieldHeader:
			dst = &d.header
		case fieldAppMeta:
			dst = &d.meta
		default:
			if _, err := r.Discard(n); err != nil {
				return err
			}
			continue
		}
		*dst = make([]byte, n)
		if _, err := io.ReadFull(r, *dst); err != nil {
			return malformedf("FlightData field %d: %w", num, err)
		}
	}
	return nil
}

func (d *inData) readBody(r *mem.Reader, n int) error {
	var dst []byte
	if d.dest != nil {
		var err error
		if dst, err = d.dest(d.meta, n); err != nil {
			return err
		}
		if len(dst) > n {
			return fmt.Errorf("dist: a body of %d bytes for a place of %d", n, len(dst))
		}
	}
	if dst == nil {
		dst = make([]byte, n)
	}
	if err := copyGuarded(dst, r); err != nil {
		return fmt.Errorf("dist: FlightData body: %w", err)
	}
	if _, err := r.Discard(n - len(dst)); err != nil {
		return fmt.Errorf("dist: FlightData body: %w", err)
	}
	d.body = dst
	return nil
}

// errShort is a message that ends inside its body.
var errShort = errors.New("the message ends inside its body")

// bodySchema is the Arrow schema of tensormp's Flight streams: one column
// of bytes, a chunk of one storage per record batch. A stock Flight
// reader (pyarrow's, arrow-go's) reads the chunks as uint8 arrays and
// each frame from the batch's app_metadata.
var bodySchema = arrow.NewSchema([]arrow.Field{{Name: "body", Type: arrow.PrimitiveTypes.Uint8}}, nil)

// schemaHeader is bodySchema as an Arrow IPC message.
var schemaHeader = sync.OnceValues(func() ([]byte, error) {
	var pw capture
	w := ipc.NewWriterWithPayloadWriter(&pw, ipc.WithSchema(bodySchema))
	if err := w.Close(); err != nil {
		return nil, err
	}
	if len(pw.headers) != 1 {
		return nil, fmt.Errorf("dist: arrow wrote %d messages for a schema", len(pw.headers))
	}
	return pw.headers[0], nil
})

// capture is an ipc.PayloadWriter that keeps a copy of each message's
// header: the writer reuses the payloads' memory.
type capture struct{ headers [][]byte }

func (c *capture) Start() error { return nil }
func (c *capture) WritePayload(p ipc.Payload) error {
	m := p.Meta()
	defer m.Release()
	c.headers = append(c.headers, append([]byte(nil), m.Bytes()...))
	return nil
}
func (c *capture) Close() error { return nil }

// batch returns the Arrow IPC header and body pieces of a record batch
// of one uint8 column holding chunk, as arrow-go lays it out: chunk itself
// (not copied), then padding to 8 bytes.
func batch(chunk []byte) (header []byte, body [][]byte, err error) {
	buf := memory.NewBufferBytes(chunk)
	data := array.NewData(arrow.PrimitiveTypes.Uint8, len(chunk), []*memory.Buffer{nil, buf}, nil, 0, 0)
	defer data.Release()
	col := array.MakeFromData(data)
	defer col.Release()
	rec := array.NewRecordBatch(bodySchema, []arrow.Array{col}, int64(len(chunk)))
	defer rec.Release()
	p, err := ipc.GetRecordBatchPayload(rec)
	if err != nil {
		return nil, nil, fmt.Errorf("dist: arrow record batch of %d bytes: %w", len(chunk), err)
	}
	defer p.Release()
	m := p.Meta()
	header = append([]byte(nil), m.Bytes()...)
	m.Release()
	var pieces collect
	if err := p.SerializeBody(&pieces); err != nil {
		return nil, nil, err
	}
	return header, pieces, nil
}

// collect is an io.Writer that keeps the slices it is given, uncopied.
type collect [][]byte

func (c *collect) Write(p []byte) (int, error) { *c = append(*c, p); return len(p), nil }

// copyGuarded fills dst from r. dst is shared memory, which a fault
// (a segment cut short under us) must turn into an error, not a crash.
func copyGuarded(dst []byte, r io.Reader) error {
	var err error
	if gerr := mmapalloc.Guard(func() { _, err = io.ReadFull(r, dst) }); gerr != nil {
		return gerr
	}
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return errShort
	}
	return err
}

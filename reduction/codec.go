package reduction

import (
	"errors"
	"fmt"
	"io"
	"reflect"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/tensor"
)

// tensorExt is the msgpack extension type that carries a tensor's Meta.
const tensorExt int8 = 0x54 // 'T'

// storageExt carries a bare storage, as the Meta of a uint8 tensor over
// all of it (torch sends bare storages too).
const storageExt int8 = 0x53 // 'S'

func init() {
	msgpack.RegisterExtEncoder(tensorExt, (*tensor.Tensor)(nil), encodeTensor)
	msgpack.RegisterExtDecoder(tensorExt, (*tensor.Tensor)(nil), decodeTensor)
	msgpack.RegisterExtEncoder(storageExt, (*tensor.Storage)(nil), encodeStorage)
	msgpack.RegisterExtDecoder(storageExt, (*tensor.Storage)(nil), decodeStorage)
}

// encodeStorage encodes a storage as a byte tensor that spans it.
func encodeStorage(enc *msgpack.Encoder, v reflect.Value) ([]byte, error) {
	s := v.Interface().(*tensor.Storage)
	t, err := tensor.FromStorage(s, tensor.Uint8, 0, []int{int(s.Size())}, []int{1})
	if err != nil {
		return nil, fmt.Errorf("reduction: encoding a storage: %w", err)
	}
	return encodeTensor(enc, reflect.ValueOf(t))
}

// decodeStorage rebuilds what encodeStorage sent and keeps its storage.
func decodeStorage(dec *msgpack.Decoder, v reflect.Value, extLen int) error {
	if !v.CanSet() {
		return errors.New("reduction: a storage decodes into a **tensor.Storage or a field of type *tensor.Storage")
	}
	var t *tensor.Tensor
	if err := decodeTensor(dec, reflect.ValueOf(&t).Elem(), extLen); err != nil {
		return err
	}
	v.Set(reflect.ValueOf(t.Storage()))
	return nil
}

// msgBuf is the bytes of one message, as msgpack writes them: the part
// the Encoder's and the BodyEncoder's writers share.
type msgBuf struct{ buf []byte }

func (b *msgBuf) Write(p []byte) (int, error) {
	b.buf = append(b.buf, p...)
	return len(p), nil
}

func (b *msgBuf) WriteByte(c byte) error {
	b.buf = append(b.buf, c)
	return nil
}

// tensorWriter is the writer of an Encoder or a BodyEncoder: the bytes of
// one message, and what travels beside them. msgpack hands it back to
// encodeTensor through Encoder.Writer, so that state never lives in a
// package variable.
type tensorWriter interface {
	io.Writer
	// tensor returns the encoding of t's Meta, adding what must travel
	// with it to the message. The bytes are valid until the next call.
	tensor(t *tensor.Tensor) ([]byte, error)
}

func encodeTensor(enc *msgpack.Encoder, v reflect.Value) ([]byte, error) {
	w, ok := enc.Writer().(tensorWriter)
	if !ok {
		return nil, errors.New("reduction: tensors must be encoded with reduction.Marshal or an Encoder, which carry their descriptors")
	}
	return w.tensor(v.Interface().(*tensor.Tensor))
}

// encodeChecked encodes v, which may carry only what can travel (see
// checkType), through msgpack.
func encodeChecked(enc *msgpack.Encoder, v any) error {
	if v != nil {
		if err := checkType(reflect.TypeOf(v)); err != nil {
			return err
		}
	}
	return enc.Encode(v)
}

// decodeChecked decodes one received message into v once it is known to
// be well formed, explaining a mismatch with v's type.
func decodeChecked(dec *msgpack.Decoder, data []byte, v any) error {
	if err := checkWellFormed(data); err != nil {
		return err
	}
	if err := dec.Decode(v); err != nil {
		if v != nil {
			if e := explain(data, reflect.TypeOf(v), err); e != nil {
				return e
			}
		}
		return err
	}
	return nil
}

// msgReader reads one received message's bytes, for msgpack and for the
// tensor extensions inside it.
type msgReader struct {
	data []byte
	pos  int
	// dims is room for the shape and strides of the tensor being
	// decoded, which its Tensor copies.
	dims [2 * roomDims]int
}

// roomDims is the most dimensions a reader parses without allocating:
// more than most tensors have.
const roomDims = 4

func (r *msgReader) Read(p []byte) (int, error) {
	if r.pos >= len(r.data) {
		return 0, io.EOF
	}
	n := copy(p, r.data[r.pos:])
	r.pos += n
	return n, nil
}

func (r *msgReader) ReadByte() (byte, error) {
	if r.pos >= len(r.data) {
		return 0, io.EOF
	}
	c := r.data[r.pos]
	r.pos++
	return c, nil
}

func (r *msgReader) UnreadByte() error {
	if r.pos == 0 {
		return errors.New("reduction: unread at start of message")
	}
	r.pos--
	return nil
}

// next returns the next n bytes of the message.
func (r *msgReader) next(n int) ([]byte, error) {
	if n < 0 || n > len(r.data)-r.pos {
		return nil, fmt.Errorf("reduction: tensor metadata of %d bytes runs past the message", n)
	}
	b := r.data[r.pos : r.pos+n]
	r.pos += n
	return b, nil
}

// checkUsed is the error of a message that carried n things (descriptors,
// bodies), unused of which no tensor used.
func checkUsed(n, unused int, what string) error {
	if unused > 0 {
		return fmt.Errorf("reduction: the message carried %d %s, %d of them not used by any tensor", n, what, unused)
	}
	return nil
}

// tensorOf rebuilds the tensor whose Meta payload holds (see rebuild).
func tensorOf(payload []byte, src fdSource, made *[]*tensor.Storage, room []int) (*tensor.Tensor, error) {
	var m Meta
	if err := parseMeta(payload, room, &m); err != nil {
		return nil, fmt.Errorf("reduction: %w", err)
	}
	return rebuild(&m, src, made)
}

// tensorReader is the reader of a Decoder or a BodyDecoder: the bytes of
// one message, where its tensors' memory comes from, and what the decode
// made so far.
type tensorReader interface {
	fdSource
	message() *msgReader
	// checkUsed fails for a message that carried memory no tensor used.
	checkUsed() error
	// end finishes the decode: on failure it lets go of what the
	// decode made and of what the message carried.
	end(failed bool)
	// made collects the storages the decode makes, or is nil.
	made() *[]*tensor.Storage
}

// finishDecode ends a decode from r whose error is err, or whose msgpack
// panicked with p, and returns its error, which wraps ErrMalformed
// unless the machine failed (see malformed).
func finishDecode(r tensorReader, p any, err error) error {
	if p != nil {
		err = fmt.Errorf("reduction: decoding panicked: %v", p)
	}
	if err == nil {
		err = r.checkUsed()
	}
	r.end(err != nil)
	return malformed(err)
}

func decodeTensor(dec *msgpack.Decoder, v reflect.Value, extLen int) error {
	r, ok := dec.Buffered().(tensorReader)
	if !ok {
		return errors.New("reduction: tensors must be decoded with reduction.Unmarshal or a Decoder, which carry their descriptors")
	}
	m := r.message()
	payload, err := m.next(extLen)
	if err != nil {
		return err
	}
	t, err := tensorOf(payload, r, r.made(), m.dims[:])
	if err != nil {
		return err
	}
	if v.CanSet() {
		v.Set(reflect.ValueOf(t))
	} else {
		*v.Interface().(*tensor.Tensor) = *t
	}
	return nil
}

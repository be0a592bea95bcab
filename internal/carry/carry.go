// Package carry lets msgpack encoders and decoders of types that travel
// as file descriptors (mp's Queue and Pipe) reach the descriptors of the
// message under way. Package reduction's Encoder and Decoder are the
// Writer and Reader; values encoded any other way carry no descriptors,
// and these functions refuse them.
package carry

import (
	"errors"
	"io"
	"reflect"
	"sync"
	"sync/atomic"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/internal/fd"
)

// A Writer is the writer of an encoder whose messages carry descriptors.
type Writer interface {
	// AddFD adds f to the message's descriptors, taking it over (it is
	// closed once the message is sent or discarded), and returns its
	// index there.
	AddFD(f *fd.FD) (int, error)
}

// A Reader is the buffered reader of a decoder whose messages carry
// descriptors.
type Reader interface {
	// TakeFD hands descriptor i of the message to the caller, who owns it
	// from then on.
	TakeFD(i int) (*fd.FD, error)
	// CloseIfFailed closes c, made of descriptors taken with TakeFD, if
	// the decode fails after all: its caller gets no value to close.
	CloseIfFailed(c io.Closer)
	// ReadExt returns the next n bytes: an extension's payload.
	ReadExt(n int) ([]byte, error)
}

var (
	errNoWriter = errors.New("values with descriptors must be encoded with reduction.Marshal or an Encoder")
	errNoReader = errors.New("values with descriptors must be decoded with reduction.Unmarshal or a Decoder")
)

// AddFD adds f to the descriptors of the message enc is encoding and
// returns its index there; called during an encode. The message takes f
// over, and closes it at once if enc carries no descriptors.
func AddFD(enc *msgpack.Encoder, f *fd.FD) (int, error) {
	w, ok := enc.Writer().(Writer)
	if !ok {
		_ = f.Close()
		return -1, errNoWriter
	}
	return w.AddFD(f)
}

// TakeFD hands descriptor i of the message dec is decoding to the caller,
// who owns it from then on. It is the decoding half of AddFD.
func TakeFD(dec *msgpack.Decoder, i int) (*fd.FD, error) {
	r, ok := dec.Buffered().(Reader)
	if !ok {
		return nil, errNoReader
	}
	return r.TakeFD(i)
}

// CloseIfFailed hands c, which a decoder made of descriptors it took with
// TakeFD, to the decode under way: should the decode fail after all, c is
// closed with the message's other descriptors.
func CloseIfFailed(dec *msgpack.Decoder, c io.Closer) {
	if r, ok := dec.Buffered().(Reader); ok {
		r.CloseIfFailed(c)
	}
}

// ReadExt returns the n payload bytes of an extension that dec is
// decoding, for the decoders of types registered with
// msgpack.RegisterExtDecoder.
func ReadExt(dec *msgpack.Decoder, n int) ([]byte, error) {
	r, ok := dec.Buffered().(Reader)
	if !ok {
		return nil, errNoReader
	}
	return r.ReadExt(n)
}

// types holds the types registered with Must.
var types sync.Map // reflect.Type -> struct{}

// Must records t as a type whose values travel only through a codec
// extension, so that reduction's Encode refuses a value with an
// unexported field that may hold one (and would otherwise arrive as nil).
func Must(t reflect.Type) { types.Store(t, struct{}{}) }

// Is reports whether t was recorded with Must.
func Is(t reflect.Type) bool {
	_, ok := types.Load(t)
	return ok
}

// Register registers T, a type that travels as descriptors, with msgpack
// as extension ext: encode writes a value's payload (adding its
// descriptors with AddFD), decode makes one of it (taking them with
// TakeFD). A value that fails to decode is left the zero value, not the
// empty one msgpack made; one that is made is closed if the rest of its
// message fails to decode.
func Register[T io.Closer](ext int8, encode func(T, *msgpack.Encoder) ([]byte, error), decode func(*msgpack.Decoder, int) (T, error)) {
	var zero T
	Must(reflect.TypeOf(zero))
	msgpack.RegisterExtEncoder(ext, zero, func(enc *msgpack.Encoder, v reflect.Value) ([]byte, error) {
		return encode(v.Interface().(T), enc)
	})
	msgpack.RegisterExtDecoder(ext, zero, func(dec *msgpack.Decoder, v reflect.Value, n int) error {
		x, err := decode(dec, n)
		if err != nil {
			if v.CanSet() {
				v.Set(reflect.Zero(v.Type()))
			}
			return err
		}
		CloseIfFailed(dec, x)
		v.Set(reflect.ValueOf(x))
		return nil
	})
}

// DecodeFunc decodes data, a received message, into v, with the
// descriptors fds owns: what the value keeps of them becomes its own, and
// the rest stay fds's, for its owner to close.
type DecodeFunc func(data []byte, fds *fd.Set, v any) error

var decoder atomic.Pointer[DecodeFunc]

// RegisterDecode makes f the process's Decode. Package reduction
// registers its Decoder's when it is initialised, so that a transport
// (package mp) hands it a received message's descriptors as the Set
// they are, not as numbers.
func RegisterDecode(f DecodeFunc) { decoder.Store(&f) }

// Decode decodes a received message with the registered DecodeFunc.
func Decode(data []byte, fds *fd.Set, v any) error {
	f := decoder.Load()
	if f == nil {
		return errors.New("no decoder registered: import package reduction")
	}
	return (*f)(data, fds, v)
}

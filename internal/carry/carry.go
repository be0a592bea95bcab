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
	"github.com/tensormp/tensormp/internal/shm"
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
// the rest stay fds's, for its owner to close. lane is the lane of the
// pipe direction the message came on, or nil (see Lane); byLane says
// whether it came by the lane itself, which alone may name blocks by
// their segments' identity.
type DecodeFunc func(data []byte, fds *fd.Set, v any, lane Lane, byLane bool) error

// A Lane is the shared-memory lane of one direction of a pipe (package
// sock's Way), as the encoders and decoders of its messages meet it: a
// block of a segment that the reading process keeps mapped for the lane
// travels by the segment's identity alone, with no descriptor, and the
// writer lends the block to the message until the reader holds it (see
// shm.Block.Lend and shm.Pin).
type Lane interface {
	// Maps reports whether a message may name b, a block of this
	// process's pool, by its segment's identity alone: the lane's reader
	// keeps the segment mapped. The writer's side.
	Maps(b *shm.Block) bool
	// Returns reports whether a message may name b, a block this process
	// received, by its segment's identity alone, as a return to its
	// producer: the lane's reader made it (see shm.Revive). The writer's
	// side.
	Returns(b *shm.Block) bool
	// Pin asks the lane's reader, this process, to keep segment id
	// mapped for the lane's next messages: a block of it was just
	// received by descriptor. The reader's side.
	Pin(id shm.ID)
	// Pinned reports whether the lane's reader, this process, pins
	// segment id for the lane: a message of the lane may name its blocks
	// by identity, the writer's loans holding them until the reader acks.
	// Blocks of any other segment are not the lane's to name.
	Pinned(id shm.ID) bool
	// Ahead calls yield with each message the lane holds after the one
	// being decoded, oldest first, until yield returns false: copies,
	// valid until yield returns, of what a writer published and the
	// reader has not taken yet, for the decoder to prepare their blocks'
	// holds (see shm.LockAhead). A hint: each message is checked when it
	// is decoded. The reader's side.
	Ahead(yield func(data []byte) bool)
}

// ErrNoLane is returned by a SendFunc given lent blocks when the message
// cannot go by the lane now: it must be encoded with descriptors.
var ErrNoLane = errors.New("the message cannot go by the lane now")

// A SendFunc sends an encoded message: its bytes, the descriptors it
// carries (borrowed until it returns), and the blocks it names by
// identity, lent to it. Given lent blocks, it sends by the lane, which
// takes the loans over, or returns an error, the loans still the
// caller's (ErrNoLane: the message must go otherwise).
type SendFunc func(data []byte, fds []int, lent []*shm.Block) error

// EncodeFunc encodes v for lane and sends it with send: by identity
// where the lane allows it, else with descriptors.
type EncodeFunc func(v any, lane Lane, send SendFunc) error

var laneEncoder atomic.Pointer[EncodeFunc]

// RegisterEncode makes f the process's EncodeLane. Package reduction
// registers its Encoder's when it is initialised.
func RegisterEncode(f EncodeFunc) { laneEncoder.Store(&f) }

// EncodeLane encodes v for lane with the registered EncodeFunc and sends
// it with send.
func EncodeLane(v any, lane Lane, send SendFunc) error {
	f := laneEncoder.Load()
	if f == nil {
		return errors.New("no encoder registered: import package reduction")
	}
	return (*f)(v, lane, send)
}

var decoder atomic.Pointer[DecodeFunc]

// RegisterDecode makes f the process's Decode. Package reduction
// registers its Decoder's when it is initialised, so that a transport
// (package mp) hands it a received message's descriptors as the Set
// they are, not as numbers.
func RegisterDecode(f DecodeFunc) { decoder.Store(&f) }

// Decode decodes a received message with the registered DecodeFunc.
func Decode(data []byte, fds *fd.Set, v any) error { return DecodeFrom(data, fds, v, nil, false) }

// DecodeFrom is Decode for a message that came on lane's pipe direction,
// by the lane itself if byLane.
func DecodeFrom(data []byte, fds *fd.Set, v any, lane Lane, byLane bool) error {
	f := decoder.Load()
	if f == nil {
		return errors.New("no decoder registered: import package reduction")
	}
	return (*f)(data, fds, v, lane, byLane)
}

package reduction

import (
	"errors"
	"fmt"
	"slices"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// StrategyBody is Meta.Strategy for a tensor whose bytes travel with the
// message by value, as one of its bodies, rather than as a descriptor:
// what a transport between hosts sends. FD is the body's index among the
// message's bodies and Size its length, the whole storage's.
const StrategyBody = "body"

// BodyEncoder encodes values with tensors inside them, like an Encoder,
// for a transport that copies bytes instead of passing descriptors: each
// distinct storage becomes one body, all of it, as torch sends a view's
// whole storage when it serialises one. Tensors on the same storage
// arrive on the same storage. Nothing is moved into shared memory. A GPU
// tensor is copied to host memory and arrives on the CPU.
//
// A BodyEncoder is not safe for concurrent use.
type BodyEncoder struct {
	w   bodyWriter
	enc *msgpack.Encoder
}

// NewBodyEncoder returns a BodyEncoder.
func NewBodyEncoder() *BodyEncoder {
	e := &BodyEncoder{}
	e.enc = msgpack.NewEncoder(&e.w)
	return e
}

// Encode encodes v. It returns the message's bytes, valid until the next
// Encode, and its bodies: the storages whose bytes must follow the
// message, in order. The storages stay their tensors'; the caller must
// keep them from being released until their bytes are sent.
func (e *BodyEncoder) Encode(v any) (data []byte, bodies []*tensor.Storage, err error) {
	e.w.reset()
	e.enc.Reset(&e.w)
	if err := encodeChecked(e.enc, v); err != nil {
		return nil, nil, err
	}
	return e.w.buf, e.w.bodies, nil
}

// bodyWriter is a BodyEncoder's writer: the message's bytes and bodies.
type bodyWriter struct {
	msgBuf
	meta   []byte
	bodies []*tensor.Storage
	index  map[*tensor.Storage]int
}

func (w *bodyWriter) reset() {
	w.buf = w.buf[:0]
	clear(w.bodies)
	w.bodies = w.bodies[:0]
	clear(w.index)
}

// tensor returns the encoding of t's Meta, naming its storage's body.
func (w *bodyWriter) tensor(t *tensor.Tensor) ([]byte, error) {
	if t.Storage().Released() {
		return nil, fmt.Errorf("reduction: encode %v: %w", t, tensor.ErrReleased)
	}
	if t.Place().IsGPU() {
		host, err := t.To(device.CPU())
		if err != nil {
			return nil, fmt.Errorf("reduction: staging %v on the host: %w", t, err)
		}
		t = host
	}
	if !t.Place().IsCPU() {
		return nil, fmt.Errorf("reduction: encode %v: %w", t, ErrDeviceTensor)
	}
	var m Meta
	viewMeta(&m, t, nil)
	if t.Numel() > 0 {
		s := t.Storage()
		i, ok := w.index[s]
		if !ok {
			if w.index == nil {
				w.index = map[*tensor.Storage]int{}
			}
			i = len(w.bodies)
			w.bodies = append(w.bodies, s)
			w.index[s] = i
		}
		m.Strategy, m.FDIndex, m.Size = StrategyBody, i, s.Size()
	}
	w.meta = appendMeta(w.meta[:0], &m)
	return w.meta, nil
}

// BodyDecoder rebuilds values encoded by a BodyEncoder from the bytes of
// one message and the storages its bodies were received into. It is not
// safe for concurrent use.
type BodyDecoder struct {
	r   bodyReader
	dec *msgpack.Decoder
}

// NewBodyDecoder returns a BodyDecoder.
func NewBodyDecoder() *BodyDecoder {
	d := &BodyDecoder{}
	d.dec = msgpack.NewDecoder(&d.r)
	return d
}

// Decode decodes data into v, a non-nil pointer, rebuilding each tensor
// on the storage that holds its body. The metadata is checked against
// the bodies as Decode checks it against descriptors: a view must lie
// inside its body, and a body must be as long as its tensors say.
//
// Decode takes ownership of bodies: they become their tensors' storages.
// A message with a body no tensor uses is an error; on error every body
// is released and v may hold partial results that must not be used.
func (d *BodyDecoder) Decode(data []byte, bodies []*tensor.Storage, v any) (err error) {
	d.r.reset(data, bodies)
	d.dec.ResetReader(&d.r)
	defer func() { err = finishDecode(&d.r, recover(), err) }()
	return decodeChecked(d.dec, data, v)
}

// bodyReader is a BodyDecoder's reader: the message's bytes and bodies,
// and which bodies some tensor used. As an fdSource it has no
// descriptors.
type bodyReader struct {
	msgReader
	bodies []*tensor.Storage
	used   []bool
}

func (r *bodyReader) reset(data []byte, bodies []*tensor.Storage) {
	r.msgReader = msgReader{data: data}
	r.bodies = bodies
	r.used = slices.Grow(r.used[:0], len(bodies))[:len(bodies)]
	clear(r.used)
}

func (r *bodyReader) body(i int, size int64) (*tensor.Storage, error) {
	if i < 0 || i >= len(r.bodies) {
		return nil, fmt.Errorf("body index %d out of range: the message has %d", i, len(r.bodies))
	}
	s := r.bodies[i]
	if s.Size() != size {
		return nil, fmt.Errorf("body %d holds %d bytes, the metadata says %d", i, s.Size(), size)
	}
	r.used[i] = true
	return s, nil
}

func (r *bodyReader) checkUsed() error {
	return checkUsed(len(r.used), len(r.used)-countTrue(r.used), "bodies")
}

func countTrue(bs []bool) int {
	n := 0
	for _, b := range bs {
		if b {
			n++
		}
	}
	return n
}

var errNoDescriptors = errors.New("descriptor metadata in a message that carries bodies")

func (r *bodyReader) fd(int) (int, error)      { return -1, errNoDescriptors }
func (r *bodyReader) take(int) (*fd.FD, error) { return nil, errNoDescriptors }
func (r *bodyReader) stat(int) (shm.SegmentRef, error) {
	return shm.SegmentRef{}, errNoDescriptors
}
func (r *bodyReader) covers(int, shm.ID) bool                { return false }
func (r *bodyReader) lane() (carry.Lane, bool)               { return nil, false }
func (r *bodyReader) attached(shm.BlockRef) *shm.Block       { return nil }
func (r *bodyReader) lockAhead(shm.BlockRef)                 {}
func (r *bodyReader) found() (*tensor.StorageRef, bool)      { return nil, false }
func (r *fdReader) body(int, int64) (*tensor.Storage, error) { return nil, errNoBodies }
func (b borrowed) body(int, int64) (*tensor.Storage, error)  { return nil, errNoBodies }

var errNoBodies = errors.New("body metadata in a message that carries descriptors")

func (r *bodyReader) message() *msgReader      { return &r.msgReader }
func (r *bodyReader) made() *[]*tensor.Storage { return nil }

// end finishes a Decode: on failure every body is released.
func (r *bodyReader) end(failed bool) {
	if failed {
		for _, s := range r.bodies {
			_ = s.Release()
		}
	}
	r.reset(nil, nil)
}

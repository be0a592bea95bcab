package reduction

import (
	"errors"
	"slices"
	"sync"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// Encoder turns values with tensors inside them (struct fields, slices,
// maps, interfaces, at any depth) into msgpack bytes plus the descriptors
// that must travel with them. Each tensor becomes a Meta; a storage that
// appears several times in one value gets one descriptor, so the receiver
// rebuilds tensors that share memory as tensors that share memory.
//
// An Encoder is not safe for concurrent use; make one per goroutine or use
// Marshal.
type Encoder struct {
	w   fdWriter
	enc *msgpack.Encoder
}

// NewEncoder returns an Encoder.
func NewEncoder() *Encoder {
	e := &Encoder{}
	e.enc = msgpack.NewEncoder(&e.w)
	return e
}

// Encode encodes v. The bytes are valid until the next Encode. The
// descriptors are borrowed (from the tensors' storages, and for pooled
// blocks from tickets that hold the blocks for the message, see Reduce):
// send the message, then call Done, or Discard if it will not be sent.
// The next Encode does Done for a message left without either.
func (e *Encoder) Encode(v any) (data []byte, fds []int, err error) { return e.encode(v, nil) }

// encode is Encode for a message that may take lane (see carry.Lane), or
// nil: the blocks it names by identity alone are lent to it, in e.w.lent.
func (e *Encoder) encode(v any, lane carry.Lane) (data []byte, fds []int, err error) {
	e.w.reset()
	e.w.lane = lane
	e.enc.Reset(&e.w)
	if t, ok := v.(*tensor.Tensor); ok && t != nil {
		err = e.encodeBare(t)
	} else if ts, ok := v.([]*tensor.Tensor); ok && ts != nil && !slices.Contains(ts, nil) {
		err = e.encodeBatch(ts)
	} else {
		err = encodeChecked(e.enc, v)
	}
	if err != nil {
		e.Discard()
		return nil, nil, err
	}
	return e.w.buf, e.w.fds, nil
}

// encodeBare encodes a bare tensor, the commonest message, as msgpack
// would (an extension holding its Meta) but without its reflection.
func (e *Encoder) encodeBare(t *tensor.Tensor) error {
	meta, err := e.w.tensor(t)
	if err != nil {
		return err
	}
	if err := e.enc.EncodeExtHeader(tensorExt, len(meta)); err != nil {
		return err
	}
	_, err = e.w.Write(meta)
	return err
}

// encodeBatch encodes a batch of tensors (what mp.PutMany sends) as
// msgpack would encode the slice, an array of extensions, without its
// reflection.
func (e *Encoder) encodeBatch(ts []*tensor.Tensor) error {
	if err := e.enc.EncodeArrayLen(len(ts)); err != nil {
		return err
	}
	for _, t := range ts {
		if err := e.encodeBare(t); err != nil {
			return err
		}
	}
	return nil
}

// Done tells the Encoder that the last message was sent: the descriptors
// it lent are no longer needed.
func (e *Encoder) Done() { e.w.settle(shm.Lease.Done) }

// encoders are the Encoders of carry.EncodeLane, which mp's pipes call.
var encoders = sync.Pool{New: func() any { return NewEncoder() }}

func init() { carry.RegisterEncode(encodeLane) }

// encodeLane encodes v for lane and sends it with send (carry.EncodeFunc):
// by identity alone if every block it names may go so, and nothing else
// needs a descriptor; else with descriptors, as Encode would.
func encodeLane(v any, lane carry.Lane, send carry.SendFunc) error {
	e := encoders.Get().(*Encoder)
	defer encoders.Put(e)
	data, fds, err := e.encode(v, lane)
	if err != nil {
		return err
	}
	if len(e.w.lent) > 0 {
		if len(fds) == 0 {
			err := send(data, nil, e.w.lent)
			switch {
			case err == nil:
				clear(e.w.lent) // the lane's now
				e.w.lent = e.w.lent[:0]
				e.Done()
				return nil
			case !errors.Is(err, carry.ErrNoLane):
				e.Discard() // the loans too
				return err
			}
		}
		// Some of it needs descriptors, or the lane cannot take it now:
		// all of it goes with descriptors. The first encoding is never
		// sent.
		e.Discard()
		if data, fds, err = e.encode(v, nil); err != nil {
			return err
		}
	}
	if err := send(data, fds, nil); err != nil {
		e.Discard()
		return err
	}
	e.Done()
	return nil
}

// Discard gives up the holds the last Encode took on pooled blocks for its
// receiver (see Reduce), for a message that will not be sent after all.
func (e *Encoder) Discard() { e.w.settle(shm.Lease.Discard) }

// ownedFD is a descriptor the message owns: closed once it is sent.
type ownedFD struct{ f *fd.FD }

func (o ownedFD) Done()    { _ = o.f.Return(); _ = o.f.Close() }
func (o ownedFD) Discard() { o.Done() }

// Marshal encodes v with a new Encoder. Unlike Encoder.Encode's, the
// descriptors it returns are the caller's, duplicates made for this
// message: send them, then close them (closing them unsent discards the
// message's holds).
func Marshal(v any) (data []byte, fds []int, err error) {
	e := NewEncoder()
	data, lent, err := e.Encode(v)
	if err != nil {
		return nil, nil, err
	}
	defer e.Done()
	fds = make([]int, 0, len(lent))
	for _, raw := range lent {
		d, err := fd.Dup(raw)
		if err != nil {
			fd.CloseAll(fds)
			return nil, nil, err
		}
		fds = append(fds, d)
	}
	return data, fds, nil
}

// fdWriter is the Encoder's writer: the per-call state of one Encode.
// msgpack hands it back to encodeTensor through Encoder.Writer, so the
// descriptor list never lives in a package variable.
type fdWriter struct {
	msgBuf
	fds   []int
	index map[int]int // descriptor -> its position in fds

	leases []shm.Lease  // on the message's descriptors, until it is sent
	ticket *shm.Ticket  // the last ticket among them, for tensors of its segment
	lane   carry.Lane   // the lane the message may take, or nil
	lent   []*shm.Block // blocks it names by identity alone, lent to it
	meta   []byte       // scratch for one tensor's metadata
	dims   []int        // scratch for its shape and strides
}

// settle ends every lease the same way, and returns the loans of blocks
// the message named by identity (a message sent by a lane hands them to
// the lane first).
func (w *fdWriter) settle(end func(shm.Lease)) {
	for _, l := range w.leases {
		end(l)
	}
	clear(w.leases)
	w.leases = w.leases[:0]
	w.ticket = nil
	for _, b := range w.lent {
		if b.Produced() { // a return is lent nothing
			b.Return()
		}
	}
	clear(w.lent)
	w.lent = w.lent[:0]
}

func (w *fdWriter) reset() {
	w.buf = w.buf[:0]
	w.fds = w.fds[:0]
	clear(w.index)
	w.settle(shm.Lease.Done)
}

func (w *fdWriter) addFD(fd int) int {
	if i, ok := w.index[fd]; ok {
		return i
	}
	if w.index == nil {
		w.index = make(map[int]int)
	}
	w.index[fd] = len(w.fds)
	w.fds = append(w.fds, fd)
	return len(w.fds) - 1
}

// The encoders of mp's Queue and Pipe add a message's descriptors
// through package carry.
var _ carry.Writer = (*fdWriter)(nil)

// AddFD adds f to the message's descriptors, taking it over, and returns
// its index there (carry.Writer).
func (w *fdWriter) AddFD(f *fd.FD) (int, error) {
	raw, err := f.Lend()
	if err != nil {
		return -1, err
	}
	w.leases = append(w.leases, ownedFD{f})
	return w.addFD(raw), nil
}

// tensor returns the encoding of t's Meta, adding its descriptor to the
// message's. The bytes are valid until the next tensor.
func (w *fdWriter) tensor(t *tensor.Tensor) ([]byte, error) {
	w.dims = slices.Grow(w.dims[:0], 2*t.Dim()) // room for reduce to fill
	var r reduced
	if err := reduce(&r, t, w.dims, w.ticket, w.lane); err != nil {
		return nil, err
	}
	if r.lent != nil {
		w.lent = append(w.lent, r.lent)
	}
	if r.memFD >= 0 {
		r.MemFDIndex = w.addFD(r.memFD) // the slab's own: open while its block is held
	}
	if r.lease != nil {
		w.leases = append(w.leases, r.lease)
		if tk, ok := r.lease.(*shm.Ticket); ok {
			w.ticket = tk
		}
	}
	if r.ticket >= 0 {
		r.FDIndex = w.addFD(r.ticket) // kept open by its lease until the message is sent
	}
	if r.lent != nil && compactable(&r.Meta) {
		w.meta = appendCompact(w.meta[:0], &r.Meta) // a lane carries it
	} else {
		w.meta = appendMeta(w.meta[:0], &r.Meta)
	}
	return w.meta, nil // written out before the next tensor reuses it
}

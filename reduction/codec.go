package reduction

import (
	"errors"
	"fmt"
	"io"
	"reflect"
	"slices"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
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
func (e *Encoder) Encode(v any) (data []byte, fds []int, err error) {
	e.w.reset()
	e.enc.Reset(&e.w)
	if t, ok := v.(*tensor.Tensor); ok && t != nil {
		err = e.encodeBare(t)
	} else if ts, ok := v.([]*tensor.Tensor); ok && ts != nil && !slices.Contains(ts, nil) {
		err = e.encodeBatch(ts)
	} else {
		err = e.encodeValue(v)
	}
	if err != nil {
		e.Discard()
		return nil, nil, err
	}
	return e.w.buf, e.w.fds, nil
}

// encodeValue encodes any value that carries only what can travel (see
// checkType) through msgpack.
func (e *Encoder) encodeValue(v any) error {
	if v != nil {
		if err := checkType(reflect.TypeOf(v)); err != nil {
			return err
		}
	}
	return e.enc.Encode(v)
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
func (e *Encoder) Done() { e.w.settle(lease.Done) }

// Discard gives up the holds the last Encode took on pooled blocks for its
// receiver (see Reduce), for a message that will not be sent after all.
func (e *Encoder) Discard() { e.w.settle(lease.Discard) }

// lease is what a message holds on one of its descriptors until it is
// sent: a pooled block's ticket, a segment's lent descriptor, or a
// descriptor the message owns.
type lease interface {
	Done()    // the message was sent
	Discard() // it never will be
}

// lentFD is an Allocation's descriptor lent to a message.
type lentFD struct{ a *shm.Allocation }

func (l lentFD) Done()    { l.a.ReturnFD() }
func (l lentFD) Discard() { l.a.ReturnFD() }

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
		d, err := shm.Dup(raw)
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

	leases []lease     // on the message's descriptors, until it is sent
	ticket *shm.Ticket // the last ticket among them, for tensors of its segment
	meta   []byte      // scratch for one tensor's metadata
	dims   []int       // scratch for its shape and strides
}

// settle ends every lease the same way.
func (w *fdWriter) settle(end func(lease)) {
	for _, l := range w.leases {
		end(l)
	}
	clear(w.leases)
	w.leases = w.leases[:0]
	w.ticket = nil
}

func (w *fdWriter) reset() {
	w.buf = w.buf[:0]
	w.fds = w.fds[:0]
	clear(w.index)
	w.settle(lease.Done)
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

// The encoders and decoders of mp's Queue and Pipe reach a message's
// descriptors through package carry.
var (
	_ carry.Writer = (*fdWriter)(nil)
	_ carry.Reader = (*fdReader)(nil)
)

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

// TakeFD hands descriptor i to the caller (carry.Reader).
func (r *fdReader) TakeFD(i int) (*fd.FD, error) {
	raw, err := r.take(i)
	if err != nil {
		return nil, err
	}
	return fd.New(raw), nil
}

// CloseIfFailed closes c with the message's descriptors should the decode
// fail (carry.Reader).
func (r *fdReader) CloseIfFailed(c io.Closer) { r.others = append(r.others, c) }

// ReadExt returns the next n bytes, an extension's payload (carry.Reader).
func (r *fdReader) ReadExt(n int) ([]byte, error) { return r.next(n) }

func encodeTensor(enc *msgpack.Encoder, v reflect.Value) ([]byte, error) {
	t := v.Interface().(*tensor.Tensor)
	if bw, ok := enc.Writer().(*bodyWriter); ok {
		return bw.encode(t)
	}
	w, ok := enc.Writer().(*fdWriter)
	if !ok {
		return nil, errors.New("reduction: tensors must be encoded with reduction.Marshal or an Encoder, which carry their descriptors")
	}
	return w.tensor(t)
}

// tensor returns the encoding of t's Meta, adding its descriptor to the
// message's. The bytes are valid until the next tensor.
func (w *fdWriter) tensor(t *tensor.Tensor) ([]byte, error) {
	w.dims = slices.Grow(w.dims[:0], 2*t.Dim()) // room for reduce to fill
	m, raw, memFD, l, err := reduce(t, w.dims, w.ticket)
	if err != nil {
		return nil, err
	}
	if memFD >= 0 {
		m.MemFD = w.addFD(memFD) // the slab's own: open while its block is held
	}
	if l != nil {
		w.leases = append(w.leases, l)
		if tk, ok := l.(*shm.Ticket); ok {
			w.ticket = tk
		}
	}
	if raw >= 0 {
		m.FD = w.addFD(raw) // kept open by its lease until the message is sent
	}
	w.meta = appendMeta(w.meta[:0], &m)
	return w.meta, nil // written out before the next tensor reuses it
}

// Decoder rebuilds values encoded by an Encoder from the bytes and
// descriptors of one message. It is not safe for concurrent use.
type Decoder struct {
	r   fdReader
	dec *msgpack.Decoder
}

// NewDecoder returns a Decoder.
func NewDecoder() *Decoder {
	d := &Decoder{}
	d.dec = msgpack.NewDecoder(&d.r)
	return d
}

// Decode decodes data into v, which must be a non-nil pointer, rebuilding
// every tensor with the descriptors fds that came with the message.
//
// Decode takes ownership of fds: the descriptors a new storage keeps
// become that storage's, and all others are closed before Decode returns,
// also on error. A message whose descriptors are not each used by some
// tensor is an error. On error, storages mapped by this call are
// released, what it handed to CloseIfFailed is closed, and v may hold
// partial results that must not be used.
func (d *Decoder) Decode(data []byte, fds []int, v any) (err error) {
	d.r.reset(data, fds)
	d.dec.ResetReader(&d.r)
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("reduction: malformed message: %v", p)
		}
		if err == nil {
			err = d.r.checkUsed()
		}
		if err != nil {
			// Let go of what was mapped before the descriptors that
			// covered it close.
			for _, s := range d.r.made {
				_ = s.Release()
			}
			for _, c := range d.r.others {
				_ = c.Close()
			}
		} else {
			d.r.adoptTickets()
		}
		d.r.closeRest()
		d.r.reset(nil, nil)
	}()
	switch p := v.(type) {
	case **tensor.Tensor:
		if payload, rest, ok := nextBare(data); ok && p != nil && len(rest) == 0 {
			return d.r.decodeBare(payload, p)
		}
	case *[]*tensor.Tensor:
		if items, n, ok := bareBatch(data); ok && p != nil {
			return d.r.decodeBatch(items, n, p)
		}
	}
	return decodeChecked(d.dec, data, v)
}

// nextBare splits the tensor extension at the start of b, returning its
// payload and what follows it. A bare tensor, the commonest message, is
// one of them and nothing else.
func nextBare(b []byte) (payload, rest []byte, ok bool) {
	k, _, head, body, err := peek(b)
	if err != nil || k != kindExt || head+body > len(b) || int8(b[head]) != tensorExt {
		return nil, nil, false
	}
	return b[head+1 : head+body], b[head+body:], true
}

// bareBatch reports whether data is an array of n tensor extensions and
// nothing else, a batch that mp.PutMany sent, and returns the extensions.
func bareBatch(data []byte) (items []byte, n int, ok bool) {
	k, n, head, _, err := peek(data)
	if err != nil || k != kindArray || n == 0 {
		return nil, 0, false
	}
	items = data[head:]
	for rest, i := items, 0; i < n; i++ {
		if _, rest, ok = nextBare(rest); !ok || (i == n-1) != (len(rest) == 0) {
			return nil, 0, false
		}
	}
	return items, n, true
}

// decodeBare decodes a bare tensor's payload into *p, as msgpack would
// through decodeTensor but without its reflection.
func (r *fdReader) decodeBare(payload []byte, p **tensor.Tensor) error {
	t, err := tensorOf(payload, r, &r.made, r.dims[:])
	if err != nil {
		return err
	}
	*p = t
	return nil
}

// decodeBatch decodes the n tensor extensions of items, which bareBatch
// checked, into *p, reusing its room as msgpack would but without its
// reflection.
func (r *fdReader) decodeBatch(items []byte, n int, p *[]*tensor.Tensor) error {
	ts := slices.Grow((*p)[:0], n)
	defer func() { *p = ts }()
	for range n {
		payload, rest, _ := nextBare(items)
		items = rest
		t, err := tensorOf(payload, r, &r.made, r.dims[:])
		if err != nil {
			return err
		}
		ts = append(ts, t)
	}
	return nil
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

// Unmarshal decodes one message with a new Decoder. See Decoder.Decode.
func Unmarshal(data []byte, fds []int, v any) error {
	return NewDecoder().Decode(data, fds, v)
}

// fdReader is the Decoder's reader and the per-call state of one Decode:
// the message's bytes and descriptors, which descriptors were used and
// taken, and the storages made. decodeTensor reaches it through
// msgpack's Decoder.Buffered.
type fdReader struct {
	msgReader
	fds  []int
	used []bool // referenced by some tensor
	kept []bool // owned by a storage now
	// tickets[i]: the segment whose blocks descriptor i covers, as their
	// ticket, until the message is decoded and mmapalloc adopts it; the
	// zero ID (which no segment has) if none.
	tickets []shm.ID
	stats   []shm.FileStat // stats[i]: descriptor i's, once statted[i]
	statted []bool
	made    []*tensor.Storage
	// others: what decoders of other types made of descriptors they
	// took (CloseIfFailed), closed if the decode fails.
	others []io.Closer
}

func (r *fdReader) reset(data []byte, fds []int) {
	r.msgReader = msgReader{data: data}
	r.fds = fds
	r.used = slices.Grow(r.used[:0], len(fds))[:len(fds)]
	r.kept = slices.Grow(r.kept[:0], len(fds))[:len(fds)]
	r.stats = slices.Grow(r.stats[:0], len(fds))[:len(fds)]
	r.statted = slices.Grow(r.statted[:0], len(fds))[:len(fds)]
	r.tickets = slices.Grow(r.tickets[:0], len(fds))[:len(fds)]
	clear(r.used)
	clear(r.kept)
	clear(r.statted)
	clear(r.tickets)
	clear(r.made)
	r.made = r.made[:0]
	clear(r.others)
	r.others = r.others[:0]
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

func (r *fdReader) fd(i int) (int, error) {
	if i < 0 || i >= len(r.fds) {
		return -1, fmt.Errorf("descriptor index %d out of range: the message has %d", i, len(r.fds))
	}
	r.used[i] = true
	return r.fds[i], nil
}

func (r *fdReader) stat(i int) (shm.FileStat, error) {
	fd, err := r.fd(i)
	if err != nil {
		return shm.FileStat{}, err
	}
	if !r.statted[i] {
		st, err := shm.StatFile(fd)
		if err != nil {
			return st, err
		}
		r.stats[i], r.statted[i] = st, true
	}
	return r.stats[i], nil
}

func (r *fdReader) take(i int) (int, error) {
	fd, err := r.fd(i)
	if err != nil {
		return -1, err
	}
	if r.kept[i] {
		// Already owned by a storage: map from a duplicate.
		return borrowed(r.fds).take(i)
	}
	r.kept[i] = true
	return fd, nil
}

// ticket lends descriptor i to cover blocks of segment id until the
// message is decoded, when adoptTickets hands it to shm. A
// descriptor that covers another segment, or that a storage owns, only
// lends itself to a lock taken at once.
func (r *fdReader) ticket(i int, id shm.ID) (int, bool) {
	fd := r.fds[i]
	if got := r.tickets[i]; got != (shm.ID{}) {
		return fd, got == id
	}
	if r.kept[i] || id == (shm.ID{}) {
		return fd, false
	}
	r.tickets[i] = id
	return fd, true
}

// adoptTickets hands the descriptors that covered blocks to mmapalloc,
// once every block of the message is held.
func (r *fdReader) adoptTickets() {
	for i, id := range r.tickets {
		if id != (shm.ID{}) && !r.kept[i] {
			r.kept[i] = true
			shm.AdoptTicket(r.fds[i], id)
		}
	}
}

func (r *fdReader) checkUsed() error { return checkUsed(r.used, "descriptors") }

// checkUsed is the error of a message that carried things (descriptors,
// bodies) some of which no tensor used.
func checkUsed(used []bool, what string) error {
	unused := 0
	for _, u := range used {
		if !u {
			unused++
		}
	}
	if unused > 0 {
		return fmt.Errorf("reduction: the message carried %d %s, %d of them not used by any tensor", len(used), what, unused)
	}
	return nil
}

func (r *fdReader) closeRest() {
	for i, fd := range r.fds {
		if !r.kept[i] {
			_ = unix.Close(fd)
		}
	}
}

// tensorOf rebuilds the tensor whose Meta payload holds (see rebuild).
func tensorOf(payload []byte, src fdSource, made *[]*tensor.Storage, room []int) (*tensor.Tensor, error) {
	m, err := parseMeta(payload, room)
	if err != nil {
		return nil, fmt.Errorf("reduction: %w", err)
	}
	return rebuild(m, src, made)
}

func decodeTensor(dec *msgpack.Decoder, v reflect.Value, extLen int) error {
	var (
		r    *msgReader
		src  fdSource
		made *[]*tensor.Storage
	)
	switch rd := dec.Buffered().(type) {
	case *fdReader:
		r, src, made = &rd.msgReader, rd, &rd.made
	case *bodyReader:
		r, src = &rd.msgReader, rd
	default:
		return errors.New("reduction: tensors must be decoded with reduction.Unmarshal or a Decoder, which carry their descriptors")
	}
	payload, err := r.next(extLen)
	if err != nil {
		return err
	}
	t, err := tensorOf(payload, src, made, r.dims[:])
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

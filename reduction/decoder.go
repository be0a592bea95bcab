package reduction

import (
	"fmt"
	"io"
	"slices"
	"sync"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

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
	d.r.yieldAhead = d.r.appendAhead
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
	d.r.own.Reset(fds)
	return d.decode(data, &d.r.own, v, nil, false)
}

// decode is Decode with the message's descriptors in fds, which it takes
// from or closes: fds is empty when it returns. lane and byLane say what
// lane the message came on, and whether by the lane itself (see
// carry.DecodeFunc).
func (d *Decoder) decode(data []byte, fds *fd.Set, v any, lane carry.Lane, byLane bool) (err error) {
	d.r.reset(data, fds)
	d.r.from, d.r.byLane = lane, byLane
	defer func() { err = finishDecode(&d.r, recover(), err) }()
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
	d.dec.ResetReader(&d.r) // not for a bare tensor or batch, which it does not read
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
	t, err := tensorOf(payload, r, &r.storages, r.dims[:])
	if err != nil {
		return err
	}
	*p = t
	return nil
}

// decodeBatch decodes the n tensor extensions of items, which bareBatch
// checked, into *p, reusing its room as msgpack would but without its
// reflection. It takes them batchWindow at a time: each tensor's
// metadata is parsed once, into r.batch, for attachAhead and for the
// tensor.
func (r *fdReader) decodeBatch(items []byte, n int, p *[]*tensor.Tensor) error {
	ts := slices.Grow((*p)[:0], min(n, batchWindow))
	defer func() { *p = ts }()
	// The room is zero beyond its length between decodes: each clears
	// all the room it used as it ends, so that what the metadata holds
	// (LoD, names) goes with the message, and each window clears the
	// last one's before it parses, so that it takes none of it.
	room := min(n, batchWindow)
	r.batch = slices.Grow(r.batch[:0], room)
	defer func() {
		clear(r.batch[:room])
		r.batch, r.cur = r.batch[:0], nil
	}()
	for left := n; left > 0; left -= len(r.batch) {
		clear(r.batch) // the last window's; parseMeta leaves what a tensor does not carry, its LoD say
		r.batch = r.batch[:min(left, batchWindow)]
		for i := range r.batch {
			payload, rest, _ := nextBare(items)
			items = rest
			it := &r.batch[i]
			it.err = parseMeta(payload, it.dims[:], &it.m)
		}
		if r.byLane {
			r.attachAhead()
		}
		for i := range r.batch {
			it := &r.batch[i]
			if it.err != nil {
				return fmt.Errorf("reduction: %w", it.err)
			}
			r.cur = it
			t, err := rebuild(&it.m, r, &r.storages)
			r.cur = nil
			if err != nil {
				return err
			}
			ts = append(ts, t)
		}
	}
	return nil
}

// batchWindow is the most tensors of a batch that decodeBatch parses and
// attaches at once: the room a message makes the decoder take before it
// checks a tensor is bounded, whatever count the message says (an item
// of the window is some 400 bytes, and a tensor extension as few as 3).
const batchWindow = 64

// batchItem is one tensor of a batch being decoded: its metadata, parsed
// once, and the user of its block that attachAhead found, if it looked.
type batchItem struct {
	m      Meta
	err    error // parseMeta's
	dims   [2 * roomDims]int
	user   *tensor.StorageRef
	looked bool
}

// attachAhead attaches the blocks that the tensors of r.batch, a batch
// that came by a lane, name by identity, all at once: one lock call per
// run of neighbouring slots instead of one per block (see shm.AttachAll).
// Their tensors take them from r.ahead; a batch that cannot be attached
// so is left to the tensors one by one, which say what is wrong with it.
// A batch does not look at the messages behind it (lockWithAhead): its
// own blocks share their calls already, and reading the batches behind
// it twice cost a stream of batches more than the calls it saved. The
// users it finds stay with the batch, for the tensors' opening (found).
func (r *fdReader) attachAhead() {
	refs := r.refs[:0]
	for i := range r.batch {
		it := &r.batch[i]
		if it.err != nil || !r.namedByLane(&it.m) {
			continue
		}
		it.user, it.looked = userOf(shm.SegmentRef{ID: it.m.segmentID()}, &it.m), true
		if liveUser(it.user, it.m.Size) != nil {
			continue // this process's own storage
		}
		refs = append(refs, laneRef(&it.m))
	}
	r.refs = refs
	if len(refs) < 2 {
		return
	}
	bs, err := shm.AttachAll(refs)
	if err != nil {
		return
	}
	kept := r.ahead[:0] // the last window's tensors took theirs
	for _, b := range r.ahead {
		if b != nil {
			kept = append(kept, b)
		}
	}
	clear(r.ahead[len(kept):])
	r.ahead = append(kept, bs...)
}

// found returns the user of the block of the batch's tensor being
// opened that attachAhead found, if it looked: the registry is not asked
// twice for a tensor. A user registered since, or released since, is as
// one a concurrent decode registers, or releases, between the registry's
// answer and the attach; adoptBlock and registerBlock take either.
func (r *fdReader) found() (*tensor.StorageRef, bool) {
	if r.cur == nil || !r.cur.looked {
		return nil, false
	}
	return r.cur.user, true
}

// namedByLane reports whether m, a tensor's metadata in a message that
// came by the lane r.from, names a block by identity that the lane may
// name and this process holds by a lock: a pooled block, on the CPU or in
// a device slab, of a segment the lane's reader pins, not one of its own
// pools' (a return, which its pool takes back with no lock: see
// openBlock).
func (r *fdReader) namedByLane(m *Meta) bool {
	return (m.Strategy == string(strategy.FileDescriptor) || m.Strategy == StrategyCUDAFD) && m.FDIndex == -1 && m.BlockOffset >= 0 &&
		r.from != nil && r.from.Pinned(m.segmentID()) && !shm.Returnable(m.segmentID())
}

// maxAhead is the most blocks a lane's reader locks at once for the
// messages it has not taken yet (lockWithAhead).
const maxAhead = 256

// lockAhead is lockWithAhead for ref alone: a block that a message by a
// lane names, which its decode attaches now.
func (r *fdReader) lockAhead(ref shm.BlockRef) {
	r.refs = append(r.refs[:0], ref)
	r.lockWithAhead()
}

// lockWithAhead locks the slots of r.refs, the blocks a message that came
// by a lane names by identity, together with those of the blocks that
// the messages behind it in the lane name, which it appends to r.refs:
// one call per run of neighbouring slots (see shm.LockAhead). It does
// nothing if this process holds or has locked the first of r.refs
// already: it locked it ahead, for an earlier message, with the others
// then in the lane. A stream of one tensor a message so costs its reader
// one lock call per run of messages in the lane, not one a message; each
// block is attached, its generation checked, when its message is decoded.
func (r *fdReader) lockWithAhead() {
	if !r.byLane || r.from == nil || len(r.refs) == 0 || shm.Locked(r.refs[0]) {
		return
	}
	r.from.Ahead(r.yieldAhead)
	shm.LockAhead(r.refs)
}

// appendAhead appends to r.refs the blocks that data, a message behind
// r's in its lane, names by identity, if it is a bare tensor or a batch
// of them: what a stream sends. Anything else names nothing here; it is
// checked when it is decoded. It reports whether r.refs has room for
// more. It is r.yieldAhead, made once: a closure made per call would be
// a heap object per look.
func (r *fdReader) appendAhead(data []byte) bool {
	items, n := data, 1
	if _, rest, ok := nextBare(data); !ok || len(rest) != 0 {
		if items, n, ok = bareBatch(data); !ok {
			return true
		}
	}
	for range n {
		payload, rest, _ := nextBare(items)
		items = rest
		var m Meta
		if err := parseBlockRef(payload, &m); err == nil && r.namedByLane(&m) {
			r.refs = append(r.refs, laneRef(&m))
		}
	}
	return len(r.refs) < maxAhead
}

// attached takes the block ref names from those attachAhead attached,
// if it is one of them.
func (r *fdReader) attached(ref shm.BlockRef) *shm.Block {
	for i, b := range r.ahead {
		if b != nil && b.Segment().ID() == ref.Seg.ID && b.Offset() == ref.Offset && b.Gen() == ref.Gen && b.Size() == ref.Size {
			r.ahead[i] = nil
			return b
		}
	}
	return nil
}

// Unmarshal decodes one message with a new Decoder. See Decoder.Decode.
func Unmarshal(data []byte, fds []int, v any) error {
	return NewDecoder().Decode(data, fds, v)
}

// decoders are the Decoders of carry.Decode, which mp's receives call.
var decoders = sync.Pool{New: func() any { return NewDecoder() }}

func init() {
	carry.RegisterDecode(func(data []byte, fds *fd.Set, v any, lane carry.Lane, byLane bool) error {
		d := decoders.Get().(*Decoder)
		defer decoders.Put(d)
		return d.decode(data, fds, v, lane, byLane)
	})
}

// fdReader is the Decoder's reader and the per-call state of one Decode:
// the message's bytes, the Set that owns its descriptors until each is
// taken, and the storages made. decodeTensor reaches it through msgpack's
// Decoder.Buffered.
type fdReader struct {
	msgReader
	fds *fd.Set
	own fd.Set // fds for Decode, whose caller hands numbers over
	// tickets[i]: the segment whose blocks descriptor i covers, as their
	// ticket, until the message is decoded and shm adopts it; the
	// zero ID (which no segment has) if none.
	tickets  []shm.ID
	stats    []shm.SegmentRef // stats[i]: descriptor i's, once statted[i]
	statted  []bool
	storages []*tensor.Storage
	// others: what decoders of other types made of descriptors they
	// took (CloseIfFailed), closed if the decode fails.
	others []io.Closer
	// from: the lane of the pipe direction the message came on, or nil;
	// byLane: it came by the lane itself.
	from   carry.Lane
	byLane bool
	// ahead: the blocks of a lane's batch attached at once, until their
	// tensors take them (see attachAhead); refs, its room.
	ahead []*shm.Block
	refs  []shm.BlockRef
	// batch: the tensors of the batch being decoded (decodeBatch); cur,
	// the one being opened.
	batch []batchItem
	cur   *batchItem
	// yieldAhead: appendAhead, made once.
	yieldAhead func(data []byte) bool
}

func (r *fdReader) reset(data []byte, fds *fd.Set) {
	r.msgReader = msgReader{data: data}
	r.fds = fds
	n := fds.Len()
	r.stats = slices.Grow(r.stats[:0], n)[:n]
	r.statted = slices.Grow(r.statted[:0], n)[:n]
	r.tickets = slices.Grow(r.tickets[:0], n)[:n]
	clear(r.statted)
	clear(r.tickets)
	clear(r.storages)
	r.storages = r.storages[:0]
	clear(r.others)
	r.others = r.others[:0]
	r.from, r.byLane = nil, false
	for i, b := range r.ahead {
		if b != nil {
			_ = b.Release() // no tensor took it: one before its own failed, say
		}
		r.ahead[i] = nil
	}
	r.ahead = r.ahead[:0]
}

func (r *fdReader) lane() (carry.Lane, bool) { return r.from, r.byLane }

func (r *fdReader) fd(i int) (int, error) { return r.fds.Borrow(i) }

func (r *fdReader) stat(i int) (shm.SegmentRef, error) {
	fd, err := r.fd(i)
	if err != nil {
		return shm.SegmentRef{}, err
	}
	if !r.statted[i] {
		st, err := shm.Stat(fd)
		if err != nil {
			return st, err
		}
		r.stats[i], r.statted[i] = st, true
	}
	return r.stats[i], nil
}

// take hands descriptor i to the storage being rebuilt; one taken
// already is duplicated (see fd.Set.Take).
func (r *fdReader) take(i int) (*fd.FD, error) { return r.fds.Take(i) }

// covers lends descriptor i, which fd checked, to cover blocks of
// segment id until the message is decoded, when adoptTickets hands it to
// shm. A descriptor that covers another segment, or that a storage owns,
// only lends itself to a lock taken at once.
func (r *fdReader) covers(i int, id shm.ID) bool {
	if got := r.tickets[i]; got != (shm.ID{}) {
		return got == id
	}
	if r.fds.Taken(i) || id == (shm.ID{}) {
		return false
	}
	r.tickets[i] = id
	return true
}

// adoptTickets hands the descriptors that covered blocks to internal/shm,
// once every block of the message is held.
func (r *fdReader) adoptTickets() {
	for i, id := range r.tickets {
		if id != (shm.ID{}) && !r.fds.Taken(i) {
			if raw, err := r.fds.Disown(i); err == nil {
				shm.AdoptTicket(raw, id)
			}
		}
	}
}

func (r *fdReader) checkUsed() error {
	return checkUsed(r.fds.Len(), r.fds.Unused(), "descriptors")
}

func (r *fdReader) message() *msgReader      { return &r.msgReader }
func (r *fdReader) made() *[]*tensor.Storage { return &r.storages }

// end finishes a Decode. On failure the storages it mapped are released
// before the descriptors that covered them close, and what it handed to
// CloseIfFailed is closed; on success the tickets it took over are
// adopted. The descriptors no storage took are closed either way.
func (r *fdReader) end(failed bool) {
	if failed {
		for _, s := range r.storages {
			_ = s.Release()
		}
		for _, c := range r.others {
			_ = c.Close()
		}
	} else {
		r.adoptTickets()
	}
	r.fds.Close()
	r.reset(nil, &r.own)
}

// The decoders of mp's Queue and Pipe take a message's descriptors
// through package carry.
var _ carry.Reader = (*fdReader)(nil)

// TakeFD hands descriptor i to the caller (carry.Reader).
func (r *fdReader) TakeFD(i int) (*fd.FD, error) { return r.take(i) }

// CloseIfFailed closes c with the message's descriptors should the decode
// fail (carry.Reader).
func (r *fdReader) CloseIfFailed(c io.Closer) { r.others = append(r.others, c) }

// ReadExt returns the next n bytes, an extension's payload (carry.Reader).
func (r *fdReader) ReadExt(n int) ([]byte, error) { return r.next(n) }

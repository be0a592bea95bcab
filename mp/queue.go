package mp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"sync"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/reduction"
)

// Extension types for queues and pipes inside values.
const (
	queueExt int8 = 0x51 // 'Q'
	pipeExt  int8 = 0x50 // 'P'
)

func init() {
	msgpack.RegisterExtEncoder(queueExt, (*Queue)(nil), func(enc *msgpack.Encoder, v reflect.Value) ([]byte, error) {
		return v.Interface().(*Queue).encode(enc)
	})
	msgpack.RegisterExtDecoder(queueExt, (*Queue)(nil), func(dec *msgpack.Decoder, v reflect.Value, n int) error {
		q, err := decodeQueue(dec, n)
		if err != nil {
			return err
		}
		v.Set(reflect.ValueOf(q))
		return nil
	})
	msgpack.RegisterExtEncoder(pipeExt, (*Pipe)(nil), func(enc *msgpack.Encoder, v reflect.Value) ([]byte, error) {
		return v.Interface().(*Pipe).encode(enc)
	})
	msgpack.RegisterExtDecoder(pipeExt, (*Pipe)(nil), func(dec *msgpack.Decoder, v reflect.Value, n int) error {
		p, err := decodePipe(dec, n)
		if err != nil {
			return err
		}
		v.Set(reflect.ValueOf(p))
		return nil
	})
}

var (
	encoders = sync.Pool{New: func() any { return reduction.NewEncoder() }}
	decoders = sync.Pool{New: func() any { return reduction.NewDecoder() }}
)

// put encodes v and sends it on c.
func put(ctx context.Context, c *conn, v any) error {
	enc := encoders.Get().(*reduction.Encoder)
	defer encoders.Put(enc)
	data, fds, err := enc.Encode(v)
	if err != nil {
		return fmt.Errorf("mp: encoding %T: %w", v, err)
	}
	if err := c.send(ctx, data, fds); err != nil {
		enc.Discard() // no receiver will take what Encode held for it
		return err
	}
	enc.Done()
	return nil
}

// get receives a message on c and decodes it into v.
func get(ctx context.Context, c *conn, v any) error {
	data, fds, done, err := c.recv(ctx)
	if err != nil {
		return err
	}
	defer done()
	dec := decoders.Get().(*reduction.Decoder)
	defer decoders.Put(dec)
	if err := dec.Decode(data, fds, v); err != nil {
		return fmt.Errorf("mp: decoding into %T: %w", v, err)
	}
	return nil
}

// Queue is a many-producer, many-consumer queue between any processes
// that hold it: pass it to workers in Spawn's arguments, or inside any
// value sent through another Queue or a Pipe. Each message is delivered
// whole to exactly one Get. Tensors in a value travel as shared memory,
// their descriptors in the same sendmsg as the bytes, so a sender may exit
// as soon as Put returns.
//
// A Queue owns two descriptors (the two ends of a SOCK_SEQPACKET socket
// pair) in each process that holds it; Close releases this process's.
type Queue struct {
	in  *conn // Put writes here
	out *conn // Get reads here
}

// NewQueue returns a new, empty Queue.
func NewQueue() (*Queue, error) {
	checkInit("mp.NewQueue")
	pair, err := socketPair()
	if err != nil {
		return nil, err
	}
	return queueFrom(pair[0], pair[1])
}

func queueFrom(in, out *fd.FD) (*Queue, error) {
	ci, err := newConn(in, "queue")
	if err != nil {
		_ = out.Close()
		return nil, err
	}
	co, err := newConn(out, "queue")
	if err != nil {
		_ = ci.close()
		return nil, err
	}
	return &Queue{in: ci, out: co}, nil
}

// Put sends v, which may hold tensors, queues and pipes anywhere inside
// it. It blocks while the queue is full, until ctx ends.
func (q *Queue) Put(ctx context.Context, v any) error { return put(ctx, q.in, v) }

// Get receives the next value into v, a pointer, blocking until one
// arrives, ctx ends or q is closed (ErrClosed).
func (q *Queue) Get(ctx context.Context, v any) error { return get(ctx, q.out, v) }

// Close releases this process's hold on the queue and wakes its blocked
// Put and Get calls with ErrClosed. Other processes keep theirs.
func (q *Queue) Close() error {
	return errors.Join(q.in.close(), q.out.close())
}

func (q *Queue) encode(enc *msgpack.Encoder) ([]byte, error) {
	return encodeConns(enc, q.in, q.out)
}

func decodeQueue(dec *msgpack.Decoder, n int) (*Queue, error) {
	fds, err := decodeConns(dec, n, 2)
	if err != nil {
		return nil, err
	}
	return queueFrom(fds[0], fds[1])
}

// Pipe is one end of a duplex connection between two processes: what one
// end sends, the other receives, in order. NewPipe returns both ends; give
// one to another process through Spawn's arguments or a Queue.
type Pipe struct {
	c *conn
}

// NewPipe returns the two connected ends of a new Pipe.
func NewPipe() (*Pipe, *Pipe, error) {
	checkInit("mp.NewPipe")
	pair, err := socketPair()
	if err != nil {
		return nil, nil, err
	}
	a, err := newConn(pair[0], "pipe")
	if err != nil {
		_ = pair[1].Close()
		return nil, nil, err
	}
	b, err := newConn(pair[1], "pipe")
	if err != nil {
		_ = a.close()
		return nil, nil, err
	}
	return &Pipe{c: a}, &Pipe{c: b}, nil
}

// Send sends v to the other end.
func (p *Pipe) Send(ctx context.Context, v any) error { return put(ctx, p.c, v) }

// Recv receives the next value from the other end into v. When the other
// end is closed in every process that held it, Recv returns ErrClosed.
func (p *Pipe) Recv(ctx context.Context, v any) error { return get(ctx, p.c, v) }

// Close releases this process's end and wakes blocked calls on it.
func (p *Pipe) Close() error { return p.c.close() }

func (p *Pipe) encode(enc *msgpack.Encoder) ([]byte, error) {
	return encodeConns(enc, p.c)
}

func decodePipe(dec *msgpack.Decoder, n int) (*Pipe, error) {
	fds, err := decodeConns(dec, n, 1)
	if err != nil {
		return nil, err
	}
	c, err := newConn(fds[0], "pipe")
	if err != nil {
		return nil, err
	}
	return &Pipe{c: c}, nil
}

// encodeConns adds duplicates of the connections' descriptors to the
// message, which owns them until it is sent, and returns their indexes as
// the extension's payload.
func encodeConns(enc *msgpack.Encoder, conns ...*conn) ([]byte, error) {
	payload := make([]byte, 0, 4*len(conns))
	for _, c := range conns {
		dup, err := c.dupSocket()
		if err != nil {
			return nil, fmt.Errorf("mp: sending a queue or pipe: %w", err)
		}
		i, err := reduction.AddFD(enc, dup)
		if err != nil {
			return nil, err
		}
		payload = binary.LittleEndian.AppendUint32(payload, uint32(i))
	}
	return payload, nil
}

// decodeConns takes the want descriptors an extension of n bytes names.
func decodeConns(dec *msgpack.Decoder, n, want int) ([]*fd.FD, error) {
	if n != 4*want {
		return nil, fmt.Errorf("mp: queue or pipe of %d bytes, want %d", n, 4*want)
	}
	payload, err := reduction.ReadExt(dec, n)
	if err != nil {
		return nil, err
	}
	fds := make([]*fd.FD, 0, want)
	for i := range want {
		f, err := reduction.TakeFD(dec, int(binary.LittleEndian.Uint32(payload[4*i:])))
		if err != nil {
			for _, f := range fds {
				_ = f.Close()
			}
			return nil, err
		}
		fds = append(fds, f)
	}
	return fds, nil
}

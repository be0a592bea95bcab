package mp

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"slices"
	"sync"

	"github.com/tensormp/tensormp/internal/sock"
)

// Func is a function registered with RegisterFunc that a Pool's workers
// can run: it takes an A and returns an R, either of which may hold
// tensors, queues and pipes.
type Func[A, R any] struct {
	name string
}

// Name returns the name f was registered under.
func (f *Func[A, R]) Name() string { return f.name }

// poolFunc is a registered function as a pool worker runs it: run decodes
// a task message of its argument type, calls the function on each item
// and returns the reply to send, from the worker of rank and gen, and the
// failing item's error if one failed.
type poolFunc struct {
	run func(ctx context.Context, rank, gen int, m sock.Msg) (any, error)
}

var poolFuncs sync.Map // name -> *poolFunc

// RegisterFunc makes fn available to Pool workers under name and returns
// the handle that Map, Imap, ImapUnordered and Apply take. Like Register,
// call it in every process of the program before Init (a package-level
// variable is the natural place); registering a name twice panics.
//
// fn runs in a worker process, under the worker's context, once per item;
// a panic in it is the item's error, and the worker goes on.
func RegisterFunc[A, R any](name string, fn func(ctx context.Context, arg A) (R, error)) *Func[A, R] {
	pf := &poolFunc{run: func(ctx context.Context, rank, gen int, m sock.Msg) (any, error) {
		var t task[A]
		if err := decodeMsg(m, &t); err != nil {
			return &reply[R]{Call: t.Call, Start: t.Start, Rank: rank, Gen: gen, Failed: true, At: t.Start, Err: err.Error()}, err
		}
		out := &reply[R]{Call: t.Call, Start: t.Start, Rank: rank, Gen: gen, Items: make([]R, 0, len(t.Items))}
		for i, a := range t.Items {
			r, err := recovered(func() (R, error) { return fn(ctx, a) })
			if err != nil {
				out.Failed, out.At, out.Err, out.Items = true, t.Start+i, err.Error(), nil
				return out, err
			}
			out.Items = append(out.Items, r)
		}
		return out, nil
	}}
	if _, dup := poolFuncs.LoadOrStore(name, pf); dup {
		panic(fmt.Sprintf("mp: RegisterFunc: %q registered twice", name))
	}
	return &Func[A, R]{name: name}
}

// ItemError is the failure of an item of a Pool call: the function
// returned an error or panicked on it, or the worker holding it died.
type ItemError struct {
	Index int // the item's index in the call's input
	Rank  int // the pool worker's rank
	// Err is the function's error, as its text, or, for a worker that
	// died, the worker's *ExitError or *WorkerError.
	Err error
}

func (e *ItemError) Error() string {
	return fmt.Sprintf("mp: pool item %d (worker %d): %v", e.Index, e.Rank, e.Err)
}

func (e *ItemError) Unwrap() error { return e.Err }

// CallOption configures a Map, Imap, ImapUnordered or Apply call.
type CallOption func(*callOptions)

type callOptions struct{ chunk int }

// ChunkSize sends items to workers n at a time (torch's chunksize): fewer,
// larger messages for many small items. Map's default spreads the items
// over about four chunks per worker; Imap's and ImapUnordered's is 1.
func ChunkSize(n int) CallOption { return func(o *callOptions) { o.chunk = n } }

// chunkResult is a chunk's outcome as its caller receives it.
type chunkResult[R any] struct {
	start int
	items []R
	err   error
}

// runCall runs f over items in chunks of size, at most window chunks in
// flight, and hands each chunk's outcome to handle as it arrives; handle
// returns how many chunks it has finished with (window room it gives
// back) and whether to go on.
func runCall[A, R any](ctx context.Context, p *Pool, f *Func[A, R], items iter.Seq[A], size int, handle func(chunkResult[R]) (freed int, more bool)) error {
	window := 2 * p.n
	out := make(chan chunkResult[R], window)
	pc := &poolCall{
		deliver: func(c *chunk, m sock.Msg) {
			var r reply[R]
			switch err := decodeMsg(m, &r); {
			case err != nil:
				out <- chunkResult[R]{start: c.start, err: &ItemError{Index: c.start, Rank: r.Rank, Err: err}}
			case r.Failed:
				out <- chunkResult[R]{start: c.start, err: &ItemError{Index: r.At, Rank: r.Rank, Err: errors.New(r.Err)}}
			case len(r.Items) != c.n:
				out <- chunkResult[R]{start: c.start, err: &ItemError{Index: c.start, Rank: r.Rank,
					Err: fmt.Errorf("%w: %d results for %d items", ErrMalformed, len(r.Items), c.n)}}
			default:
				out <- chunkResult[R]{start: c.start, items: r.Items}
			}
		},
		fail: func(c *chunk, err error) { out <- chunkResult[R]{start: c.start, err: err} },
	}
	if err := p.begin(pc); err != nil {
		return err
	}
	defer p.end(pc)
	next, stop := iter.Pull(items)
	defer stop()
	inflight, start, more := 0, 0, true
	for {
		for more && inflight < window {
			part := make([]A, 0, size)
			for len(part) < size {
				a, ok := next()
				if !ok {
					more = false
					break
				}
				part = append(part, a)
			}
			if len(part) == 0 {
				break
			}
			c := &chunk{call: pc, start: start, n: len(part)}
			c.put = func(ctx context.Context, q *Queue) error {
				return q.Put(ctx, &task[A]{Call: pc.id, Start: c.start, Fn: f.name, Items: part})
			}
			start += len(part)
			inflight++
			p.submit(c)
		}
		if inflight == 0 {
			return nil
		}
		select {
		case r := <-out:
			freed, goOn := handle(r)
			inflight -= freed
			if !goOn {
				return nil
			}
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

func callChunk(opts []CallOption, def int) int {
	o := callOptions{chunk: def}
	for _, opt := range opts {
		opt(&o)
	}
	return max(o.chunk, 1)
}

// Map runs f on every item on the pool's workers and returns the results
// in the items' order (torch's Pool.map). The first failure is returned
// as an *ItemError; the items still running are let go.
func Map[A, R any](ctx context.Context, p *Pool, f *Func[A, R], items []A, opts ...CallOption) ([]R, error) {
	size := callChunk(opts, (len(items)+4*p.n-1)/(4*p.n))
	out := make([]R, len(items))
	var failed error
	err := runCall(ctx, p, f, slices.Values(items), size, func(r chunkResult[R]) (int, bool) {
		if r.err != nil {
			failed = r.err
			return 1, false
		}
		copy(out[r.start:], r.items)
		return 1, true
	})
	if err == nil {
		err = failed
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Apply runs f on arg on one of the pool's workers (torch's
// Pool.apply).
func Apply[A, R any](ctx context.Context, p *Pool, f *Func[A, R], arg A) (R, error) {
	rs, err := Map(ctx, p, f, []A{arg})
	if err != nil {
		var zero R
		return zero, err
	}
	return rs[0], nil
}

// Imap runs f on the items as the iteration asks for them, a few chunks
// ahead, and yields the results in the items' order (torch's
// Pool.imap). A failure is yielded as an *ItemError, and ends the
// iteration; so does ctx ending. Stopping the iteration early lets go of
// the items still running.
func Imap[A, R any](ctx context.Context, p *Pool, f *Func[A, R], items iter.Seq[A], opts ...CallOption) iter.Seq2[R, error] {
	size := callChunk(opts, 1)
	return func(yield func(R, error) bool) {
		held := map[int]chunkResult[R]{}
		want := 0
		stopped := false
		err := runCall(ctx, p, f, items, size, func(r chunkResult[R]) (int, bool) {
			held[r.start] = r
			freed := 0
			for {
				r, ok := held[want]
				if !ok {
					return freed, true
				}
				delete(held, want)
				freed++
				if r.err != nil {
					var zero R
					stopped = true
					yield(zero, r.err)
					return freed, false
				}
				for _, v := range r.items {
					if !yield(v, nil) {
						stopped = true
						return freed, false
					}
				}
				want += len(r.items)
			}
		})
		if err != nil && !stopped {
			var zero R
			yield(zero, err)
		}
	}
}

// ImapUnordered is Imap yielding each chunk's results as soon as they
// come (torch's Pool.imap_unordered).
func ImapUnordered[A, R any](ctx context.Context, p *Pool, f *Func[A, R], items iter.Seq[A], opts ...CallOption) iter.Seq2[R, error] {
	size := callChunk(opts, 1)
	return func(yield func(R, error) bool) {
		stopped := false
		err := runCall(ctx, p, f, items, size, func(r chunkResult[R]) (int, bool) {
			if r.err != nil {
				var zero R
				stopped = true
				yield(zero, r.err)
				return 1, false
			}
			for _, v := range r.items {
				if !yield(v, nil) {
					stopped = true
					return 1, false
				}
			}
			return 1, true
		})
		if err != nil && !stopped {
			var zero R
			yield(zero, err)
		}
	}
}

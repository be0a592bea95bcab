package loader

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"reflect"
	"time"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/reduction"
)

// Options configures a Loader, as torch's DataLoader arguments do.
type Options struct {
	// BatchSize is the number of samples in a batch; 0 means 1.
	BatchSize int
	// Shuffle draws a new order of a map-style dataset's samples each
	// epoch, from Seed: the same orders for the same Seed.
	Shuffle bool
	// Seed seeds Shuffle and the workers' WorkerInfo.Seed.
	Seed int64
	// Sampler orders a map-style dataset's samples instead of Shuffle:
	// Distributed, say.
	Sampler Sampler
	// DropLast leaves out a last batch shorter than BatchSize.
	DropLast bool

	// NumWorkers is the number of worker processes; 0 reads the dataset
	// in the caller.
	NumWorkers int
	// PrefetchFactor is the number of batches each worker has asked of
	// it at a time; 0 means 2.
	PrefetchFactor int
	// PersistentWorkers keeps the workers from one epoch to the next.
	PersistentWorkers bool
	// WorkerInit names a function registered with RegisterWorkerInit
	// that each worker runs first.
	WorkerInit string
	// Collate names a collate registered with RegisterCollate; "" is
	// the default, Collate.
	Collate string
	// Timeout, if not 0, ends the epoch with an error when no batch has
	// come for that long.
	Timeout time.Duration
	// Place is where the caller wants its batches (torch's pin_memory
	// and .to(device)): a GPU place copies each batch to the device as
	// it is yielded. The zero Place is the CPU.
	Place device.Place
	// Spawn options for the workers (WithEnv, WithOutput, WithGrace...);
	// the default grace period is half a second.
	Spawn []mp.Option
}

// SampleError is an epoch ended by a worker: its dataset, collate or
// initializer failed, or the worker died.
type SampleError struct {
	Worker int // the worker's id; -1 in the caller (NumWorkers 0)
	// Index is the failing sample's index; for a worker that died, the
	// first sample of the earliest batch it held; for an iterable, the
	// sample's position in the worker's pass. -1 when no sample is to
	// blame (a collate, or a worker that failed to start).
	Index int
	Err   error // the error's text, or the worker's *mp.ExitError or *mp.WorkerError
}

func (e *SampleError) Error() string {
	where := "in the caller"
	if e.Worker >= 0 {
		where = fmt.Sprintf("worker %d", e.Worker)
	}
	if e.Index < 0 {
		return fmt.Sprintf("loader: %s: %v", where, e.Err)
	}
	return fmt.Sprintf("loader: %s, sample %d: %v", where, e.Index, e.Err)
}

func (e *SampleError) Unwrap() error { return e.Err }

// Loader reads a dataset in batches of type B (torch's DataLoader). A
// batch is whatever the collate makes, decoded into B: with the default
// collate, a struct of tensors whose field names are the sample's. One
// epoch at a time: a Loader is not for concurrent use.
type Loader[B any] struct {
	src      string // the source's name
	iterable bool
	opts     Options
	batches  BatchSampler // map-style
	spawn    func(ctx context.Context, info func(id int) WorkerInfo, tasks []*mp.Queue, results *mp.Queue) (*mp.Group, error)
	local    func(ctx context.Context) (batcher, error)

	epoch   int
	workers *workers // running, with PersistentWorkers
	inProc  batcher  // the dataset opened in the caller, with NumWorkers 0
}

// batcher is a fetcher without its sample type.
type batcher interface {
	batch(ctx context.Context, indices []int) (any, int, error)
	batchOf(ctx context.Context, epoch, size int, dropLast bool) (any, bool, int, error)
	len() int
	close()
}

// New returns a Loader of src's dataset opened with args, in batches of
// type B. Workers start with the first epoch.
func New[B, A, T any](src *Source[A, T], args A, opts Options) (*Loader[B], error) {
	if opts.BatchSize == 0 {
		opts.BatchSize = 1
	}
	if opts.PrefetchFactor == 0 {
		opts.PrefetchFactor = 2
	}
	switch {
	case opts.BatchSize < 0:
		return nil, fmt.Errorf("loader: batch size %d", opts.BatchSize)
	case opts.NumWorkers < 0:
		return nil, fmt.Errorf("loader: %d workers", opts.NumWorkers)
	case opts.PrefetchFactor < 0:
		return nil, fmt.Errorf("loader: prefetch factor %d", opts.PrefetchFactor)
	case src.iterable && (opts.Sampler != nil || opts.Shuffle):
		return nil, fmt.Errorf("loader: %q is an iterable dataset: it takes no sampler and no shuffle", src.name)
	}
	if opts.Collate != "" {
		c, ok := lookupCollate(opts.Collate)
		if !ok {
			return nil, fmt.Errorf("loader: no collate is registered as %q", opts.Collate)
		}
		if want := reflect.TypeFor[T](); c.sample != want {
			return nil, fmt.Errorf("loader: collate %q takes %v samples, dataset %q makes %v", opts.Collate, c.sample, src.name, want)
		}
	}
	if opts.WorkerInit != "" {
		if _, ok := lookupWorkerInit(opts.WorkerInit); !ok {
			return nil, fmt.Errorf("loader: no worker init is registered as %q", opts.WorkerInit)
		}
	}
	l := &Loader[B]{src: src.name, iterable: src.iterable, opts: opts}
	l.local = func(ctx context.Context) (batcher, error) {
		ds, err := src.open(ctx, args)
		if err != nil {
			return nil, fmt.Errorf("loader: opening dataset %q: %w", src.name, err)
		}
		return newFetcher(ds, opts.Collate)
	}
	l.spawn = func(ctx context.Context, info func(int) WorkerInfo, tasks []*mp.Queue, results *mp.Queue) (*mp.Group, error) {
		spawn := append([]mp.Option{mp.WithGrace(500 * time.Millisecond)}, opts.Spawn...)
		spawn = append(spawn, mp.WithRankArgs(func(id int) any {
			return &workerArgs[A]{Info: info(id), Args: args, Collate: opts.Collate, Init: opts.WorkerInit,
				BatchSize: opts.BatchSize, DropLast: opts.DropLast, Tasks: tasks[id], Results: results}
		}))
		return mp.Spawn(ctx, workerPrefix+src.name, opts.NumWorkers, spawn...)
	}
	if !src.iterable {
		s := opts.Sampler
		if s == nil {
			ds, err := l.open(context.Background())
			if err != nil {
				return nil, err
			}
			n := ds.len()
			if n < 1 {
				return nil, fmt.Errorf("%w: %q", errNoSamples, src.name)
			}
			if s = Sequential(n); opts.Shuffle {
				s = Random(n, opts.Seed)
			}
			if opts.NumWorkers > 0 {
				ds.close()
				l.inProc = nil
			}
		}
		l.batches = BatchSampler{Sampler: s, Size: opts.BatchSize, DropLast: opts.DropLast}
	}
	return l, nil
}

// open returns the dataset opened in the caller, opening it once.
func (l *Loader[B]) open(ctx context.Context) (batcher, error) {
	if l.inProc == nil {
		b, err := l.local(ctx)
		if err != nil {
			return nil, err
		}
		l.inProc = b
	}
	return l.inProc, nil
}

// Len returns the number of batches in an epoch of a map-style dataset,
// and -1 for an iterable one.
func (l *Loader[B]) Len() int {
	if l.iterable {
		return -1
	}
	return l.batches.Len()
}

// Epoch iterates over one epoch's batches, in order (each epoch's own
// order, with Shuffle). An error ends the iteration: a *SampleError for
// a batch a worker failed to read, in that batch's turn, or at once for
// a worker that died; ctx's cause once ctx ends (every worker stopped
// within a second); or a timeout. Breaking off early is fine.
func (l *Loader[B]) Epoch(ctx context.Context) iter.Seq2[B, error] {
	return func(yield func(B, error) bool) {
		epoch := l.epoch
		l.epoch++
		var err error
		if l.opts.NumWorkers == 0 {
			err = l.inProcess(ctx, epoch, yield)
		} else {
			err = l.fromWorkers(ctx, epoch, yield)
		}
		if err != nil {
			var zero B
			yield(zero, err)
		}
	}
}

// Close stops the workers kept with PersistentWorkers.
func (l *Loader[B]) Close() error {
	if l.inProc != nil {
		l.inProc.close()
		l.inProc = nil
	}
	if l.workers != nil {
		err := l.workers.stop(false)
		l.workers = nil
		return err
	}
	return nil
}

// deliver turns a collated value into a B at the caller's place.
func (l *Loader[B]) deliver(v any) (B, error) {
	var b B
	if x, ok := v.(B); ok {
		b = x
	} else {
		// In the caller the round trip maps nothing: b's tensors are
		// v's, on the same storages.
		data, fds, err := reduction.Marshal(v)
		if err == nil {
			err = reduction.Unmarshal(data, fds, &b)
		}
		if err != nil {
			_ = Release(v)
			return b, fmt.Errorf("loader: a batch of %T as %T: %w", v, b, err)
		}
	}
	if !l.opts.Place.IsCPU() {
		if err := moveTo(&b, l.opts.Place); err != nil {
			_ = Release(b)
			var zero B
			return zero, err
		}
	}
	return b, nil
}

// inProcess runs an epoch in the caller.
func (l *Loader[B]) inProcess(ctx context.Context, epoch int, yield func(B, error) bool) error {
	f, err := l.open(ctx)
	if err != nil {
		return err
	}
	emit := func(v any) (bool, error) {
		b, err := l.deliver(v)
		if err != nil {
			return false, err
		}
		return yield(b, nil), nil
	}
	if l.iterable {
		defer f.close()
		for {
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
			v, done, index, err := f.batchOf(ctx, epoch, l.opts.BatchSize, l.opts.DropLast)
			if err != nil {
				return &SampleError{Worker: -1, Index: index, Err: err}
			}
			if done {
				return nil
			}
			if goOn, err := emit(v); !goOn || err != nil {
				return err
			}
		}
	}
	for indices := range l.batches.Batches(epoch) {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		v, index, err := f.batch(ctx, indices)
		if err != nil {
			return &SampleError{Worker: -1, Index: index, Err: err}
		}
		if goOn, err := emit(v); !goOn || err != nil {
			return err
		}
	}
	return nil
}

// workers are a loader's worker processes and queues.
type workers struct {
	g       *mp.Group
	tasks   []*mp.Queue
	results *mp.Queue
	recv    chan received
	recvEnd chan struct{}
}

// received is a result, or the error decoding one.
type received struct {
	r   result[any]
	b   any // the batch, decoded as the loader's B
	err error
}

// startWorkers starts the workers for epoch.
func (l *Loader[B]) startWorkers(epoch int) (*workers, error) {
	n := l.opts.NumWorkers
	w := &workers{recv: make(chan received, n*(l.opts.PrefetchFactor+1)+1), recvEnd: make(chan struct{})}
	var err error
	if w.results, err = mp.NewQueue(); err != nil {
		return nil, err
	}
	for range n {
		q, err := mp.NewQueue()
		if err != nil {
			w.closeQueues()
			return nil, err
		}
		w.tasks = append(w.tasks, q)
	}
	info := func(id int) WorkerInfo {
		return WorkerInfo{ID: id, NumWorkers: n, Seed: seedOf(l.opts.Seed, epoch, id)}
	}
	if w.g, err = l.spawn(context.Background(), info, w.tasks, w.results); err != nil {
		w.closeQueues()
		return nil, err
	}
	go l.receive(w)
	return w, nil
}

// seedOf mixes a loader's seed, the epoch its workers started at and a
// worker's id into the worker's seed (splitmix64's finalizer).
func seedOf(seed int64, epoch, id int) int64 {
	z := uint64(seed) + uint64(epoch)<<32 + uint64(id) + 0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return int64(z ^ z>>31)
}

// receive decodes the workers' results into w.recv until the results
// queue is closed.
func (l *Loader[B]) receive(w *workers) {
	defer close(w.recvEnd)
	for {
		var r result[B]
		err := w.results.Get(context.Background(), &r)
		if errors.Is(err, mp.ErrClosed) {
			return
		}
		rec := received{err: err}
		if err == nil {
			rec.r = result[any]{Epoch: r.Epoch, Seq: r.Seq, Worker: r.Worker, Failed: r.Failed, Index: r.Index, Err: r.Err, Done: r.Done}
			rec.b = r.Batch
		}
		select {
		case w.recv <- rec:
		case <-w.g.Done():
			_ = Release(rec.b)
			return
		}
	}
}

// stop stops the workers: at once with kill, else once they have
// finished their tasks; then closes the queues.
func (w *workers) stop(kill bool) error {
	if kill {
		w.g.Stop(errStopped)
	} else {
		for _, q := range w.tasks {
			_ = q.Put(context.Background(), &task{Stop: true})
		}
	}
	err := w.g.Join()
	w.closeQueues()
	<-w.recvEnd
	for {
		select {
		case rec := <-w.recv:
			_ = Release(rec.b)
		default:
			if errors.Is(err, errStopped) {
				err = nil
			}
			return err
		}
	}
}

var errStopped = errors.New("loader: workers stopped")

func (w *workers) closeQueues() {
	if w.results != nil {
		_ = w.results.Close()
	}
	for _, q := range w.tasks {
		_ = q.Close()
	}
}

// fromWorkers runs an epoch on the workers.
func (l *Loader[B]) fromWorkers(ctx context.Context, epoch int, yield func(B, error) bool) (err error) {
	w := l.workers
	if w == nil {
		if w, err = l.startWorkers(epoch); err != nil {
			return err
		}
	}
	held := map[int]B{} // results ahead of the one to yield
	defer func() {
		for _, b := range held {
			_ = Release(b)
		}
		switch {
		case err != nil:
			_ = w.stop(true)
			l.workers = nil
		case l.opts.PersistentWorkers:
			l.workers = w
		default:
			err = w.stop(false)
			l.workers = nil
		}
	}()

	n := l.opts.NumWorkers
	owner := map[int]int{}        // seq -> worker, for tasks in flight
	firstIndex := map[int]int{}   // seq -> its first sample, map-style
	skip := map[int]bool{}        // seqs that yield nothing (an iterable's end)
	failed := map[int]error{}     // seqs a worker failed to read
	exhausted := make([]bool, n)  // iterable workers whose pass has ended
	var next func() ([]int, bool) // map-style batches
	more := true
	if !l.iterable {
		pull, stop := iter.Pull(l.batches.Batches(epoch))
		defer stop()
		next = pull
	}
	seq, want, rr := 0, 0, 0
	var timer <-chan time.Time
	for {
		// Ask for more, of the workers in turn (as torch does: a
		// worker's batches are every n-th), while fewer than
		// PrefetchFactor per worker are asked for.
		for more && len(owner) < l.opts.PrefetchFactor*n {
			k := -1
			for j := range n {
				if c := (rr + j) % n; !exhausted[c] {
					k = c
					break
				}
			}
			if k < 0 {
				break
			}
			t := task{Epoch: epoch, Seq: seq}
			if !l.iterable {
				indices, ok := next()
				if !ok {
					more = false
					break
				}
				t.Indices = indices
				firstIndex[seq] = indices[0]
			}
			if err := w.tasks[k].Put(ctx, &t); err != nil {
				return fmt.Errorf("loader: asking worker %d for batch %d: %w", k, seq, err)
			}
			owner[seq] = k
			seq++
			rr = k + 1
		}
		// Yield what is in order.
		for {
			if skip[want] {
				delete(skip, want)
				want++
				continue
			}
			if err := failed[want]; err != nil {
				return err
			}
			b, ok := held[want]
			if !ok {
				break
			}
			delete(held, want)
			want++
			if !yield(b, nil) {
				return nil
			}
		}
		if want == seq && (!more || l.iterable && allTrue(exhausted)) {
			return nil
		}
		if l.opts.Timeout > 0 {
			timer = time.After(l.opts.Timeout)
		}
		select {
		case rec := <-w.recv:
			if rec.err != nil {
				return fmt.Errorf("loader: receiving a batch: %w", rec.err)
			}
			r := rec.r
			if r.Epoch != epoch {
				_ = Release(rec.b) // an epoch broken off early
				continue
			}
			if k, ok := owner[r.Seq]; ok && k == r.Worker {
				delete(owner, r.Seq)
			}
			switch {
			case r.Failed:
				// Raised in its turn, as torch does: the batches
				// before it still arrive.
				_ = Release(rec.b)
				failed[r.Seq] = &SampleError{Worker: r.Worker, Index: r.Index, Err: errors.New(r.Err)}
			case r.Done:
				exhausted[r.Worker] = true
				skip[r.Seq] = true
			default:
				b, err := l.deliver(rec.b)
				if err != nil {
					return err
				}
				held[r.Seq] = b
			}
		case <-w.g.Done():
			return l.workerDied(w.g, owner, firstIndex)
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-timer:
			return fmt.Errorf("loader: no batch for %v (Timeout)", l.opts.Timeout)
		}
	}
}

// workerDied is the error of a worker that exited during an epoch.
func (l *Loader[B]) workerDied(g *mp.Group, owner, firstIndex map[int]int) error {
	err := g.Err()
	rank := -1
	var ee *mp.ExitError
	var we *mp.WorkerError
	switch {
	case errors.As(err, &ee):
		rank = ee.Rank
	case errors.As(err, &we):
		rank = we.Rank
	case err == nil:
		err = errors.New("the workers exited")
	}
	index, first := -1, -1
	for seq, k := range owner {
		if k == rank && (first < 0 || seq < first) {
			first = seq
		}
	}
	if i, ok := firstIndex[first]; ok && first >= 0 {
		index = i
	}
	return &SampleError{Worker: rank, Index: index, Err: err}
}

func allTrue(bs []bool) bool {
	for _, b := range bs {
		if !b {
			return false
		}
	}
	return true
}

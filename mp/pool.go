package mp

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/sock"
)

// PoolOption configures NewPool.
type PoolOption func(*poolOptions)

type poolOptions struct {
	spawn    []Option
	initName string
	initArg  any
	maxTasks int
}

// WithSpawnOptions passes opts to the Spawn that starts each worker:
// WithEnv, WithOutput, WithGrace, and WithPlace, which is given the pool
// rank. WithArgs and WithRankArgs are the pool's own and are ignored.
func WithSpawnOptions(opts ...Option) PoolOption {
	return func(o *poolOptions) { o.spawn = append(o.spawn, opts...) }
}

// WithInitializer has every worker, the ones that replace dead workers
// too, run f(arg) before its first task (torch's initializer and
// initargs). An error ends that worker; a pool whose new workers fail
// three times running, before finishing any task, is broken.
func WithInitializer[A, R any](f *Func[A, R], arg A) PoolOption {
	return func(o *poolOptions) { o.initName, o.initArg = f.name, arg }
}

// WithMaxTasks replaces each worker by a new process after it has run n
// chunks (torch's maxtasksperchild). The default, 0, keeps workers for
// the pool's life.
func WithMaxTasks(n int) PoolOption { return func(o *poolOptions) { o.maxTasks = n } }

// ErrPoolBroken wraps the error that made a Pool give up: its new workers
// kept failing before finishing any task.
var ErrPoolBroken = errors.New("mp: pool broken")

const (
	perWorker     = 2 // chunks a worker holds at once: one running, one waiting
	maxStartFails = 3 // this many new workers in a row failing before finishing a task break the pool
)

// Pool is a set of persistent worker processes that run registered
// functions over items (torch.multiprocessing.Pool). Its calls — Map,
// Imap, ImapUnordered, Apply — may run at once from many goroutines; each
// item's argument and result travel as Queue values do, tensors without
// copying.
//
// A worker that dies (killed, or a native crash) fails the items it was
// running with an *ItemError wrapping its *ExitError, gives back the
// chunks it had not begun to other workers, and is replaced by a new
// process. The Pool owns its workers and queues; Close or Terminate
// releases them.
type Pool struct {
	n       int
	opts    poolOptions
	results *Queue // every worker replies here; so do the exit notes
	ctx     context.Context
	cancel  context.CancelFunc
	procs   sync.WaitGroup // watchers of worker processes, and starters
	loop    sync.WaitGroup // the reply loop

	released sync.Once

	mu       sync.Mutex
	idle     *sync.Cond // signalled when a call ends
	workers  []*poolSlot
	pending  []*chunk // not yet given to a worker, oldest first
	calls    map[uint64]*poolCall
	next     uint64
	closing  bool  // no new calls
	stopping bool  // workers are told to stop, and not replaced
	broken   error // ErrPoolBroken, or ErrClosed once terminated
	fails    int   // new workers that failed before finishing a task, in a row

	stopAfter func() bool // unhooks terminating when ctx ends
}

// poolSlot is one of the pool's ranks and the process serving it now.
type poolSlot struct {
	rank, gen int
	g         *Group   // nil while a replacement starts
	tasks     *Queue   // the process's task queue, with g
	held      []*chunk // given to this process, not yet answered
	sent      int      // chunks given to this process
	retiring  bool     // sent its stop: takes nothing more
	worked    bool     // answered a task
}

// chunk is items [start, start+n) of a call.
type chunk struct {
	call     *poolCall
	start, n int
	put      func(ctx context.Context, q *Queue) error
	done     bool // answered or failed: under the pool's mu
}

// poolCall is one Map, Imap, ImapUnordered or Apply in progress.
type poolCall struct {
	id uint64
	// deliver decodes a reply to one of the call's chunks and hands it
	// to the caller; fail hands the caller a chunk's error. Neither
	// blocks: the caller's channel has room for every chunk in flight.
	deliver func(c *chunk, m sock.Msg)
	fail    func(c *chunk, err error)
	ended   bool // the caller has gone: replies are dropped
}

// work is a message for one worker process: a chunk, or its stop.
type work struct {
	s     *poolSlot
	tasks *Queue
	c     *chunk // nil: stop
}

// NewPool starts n worker processes (torch's Pool(processes=n)), without
// waiting for them to be ready. Cancelling ctx terminates the pool.
func NewPool(ctx context.Context, n int, opts ...PoolOption) (*Pool, error) {
	checkInit("mp.NewPool")
	if n < 1 {
		return nil, fmt.Errorf("mp: a pool of %d workers", n)
	}
	p := &Pool{n: n, calls: make(map[uint64]*poolCall), next: initCall + 1}
	for _, opt := range opts {
		opt(&p.opts)
	}
	p.idle = sync.NewCond(&p.mu)
	var err error
	if p.results, err = NewQueue(); err != nil {
		return nil, fmt.Errorf("mp: new pool: %w", err)
	}
	p.ctx, p.cancel = context.WithCancel(ctx)
	p.workers = make([]*poolSlot, n)
	for rank := range n {
		p.workers[rank] = &poolSlot{rank: rank, gen: -1}
	}
	p.loop.Add(1)
	go p.replies()
	for rank := range n {
		if err := p.start(rank); err != nil {
			_ = p.Terminate()
			return nil, fmt.Errorf("mp: new pool: starting worker %d: %w", rank, err)
		}
	}
	stop := context.AfterFunc(p.ctx, func() { _ = p.terminate(fmt.Errorf("%w: %w", ErrClosed, context.Cause(p.ctx))) })
	p.mu.Lock()
	p.stopAfter = stop
	p.mu.Unlock()
	return p, nil
}

// Size returns the number of workers.
func (p *Pool) Size() int { return p.n }

// start starts a new process for rank and watches it. Its initializer's
// task goes first on its task queue.
func (p *Pool) start(rank int) error {
	tasks, err := NewQueue()
	if err != nil {
		return err
	}
	if p.opts.initName != "" {
		if err := tasks.Put(p.ctx, &task[any]{Call: initCall, Fn: p.opts.initName, Items: []any{p.opts.initArg}}); err != nil {
			_ = tasks.Close()
			return fmt.Errorf("sending the initializer's argument: %w", err)
		}
	}
	p.mu.Lock()
	s := p.workers[rank]
	s.gen++
	gen := s.gen
	p.mu.Unlock()
	opts := append(slices.Clone(p.opts.spawn), func(o *options) {
		o.args, o.rankArgs = poolArgs{Rank: rank, Gen: gen, Tasks: tasks, Results: p.results}, nil
		if f := o.place; f != nil {
			o.place = func(int) device.Place { return f(rank) }
		}
	})
	g, err := Spawn(p.ctx, poolWorkerName, 1, opts...)
	if err != nil {
		_ = tasks.Close()
		return err
	}
	p.mu.Lock()
	s.g, s.tasks, s.held, s.sent, s.retiring, s.worked = g, tasks, nil, 0, false, false
	var ws []work
	if p.stopping {
		s.retiring = true
		ws = append(ws, work{s: s, tasks: tasks})
	} else {
		ws = p.assignLocked()
	}
	p.mu.Unlock()
	p.procs.Add(1)
	go func() {
		defer p.procs.Done()
		<-g.Done()
		// Behind everything the process sent: the reply loop takes its
		// exit after its last reply.
		_ = p.results.Put(context.Background(), &reply[struct{}]{Call: stopCall, Rank: rank, Gen: gen})
	}()
	p.send(ws)
	return nil
}

// assignLocked gives pending chunks, oldest first, to the least busy
// processes with room, and returns the messages to send.
func (p *Pool) assignLocked() []work {
	var ws []work
	for len(p.pending) > 0 && p.broken == nil {
		var best *poolSlot
		for _, s := range p.workers {
			if s.g != nil && !s.retiring && len(s.held) < perWorker && (best == nil || len(s.held) < len(best.held)) {
				best = s
			}
		}
		if best == nil {
			break
		}
		c := p.pending[0]
		p.pending = p.pending[1:]
		best.held = append(best.held, c)
		best.sent++
		ws = append(ws, work{s: best, tasks: best.tasks, c: c})
		if p.opts.maxTasks > 0 && best.sent >= p.opts.maxTasks {
			best.retiring = true
			ws = append(ws, work{s: best, tasks: best.tasks})
		}
	}
	return ws
}

// send sends what assignLocked decided, in order. A chunk that cannot be
// sent fails.
func (p *Pool) send(ws []work) {
	for _, w := range ws {
		if w.c == nil {
			_ = w.tasks.Put(p.ctx, &task[struct{}]{Call: stopCall})
			continue
		}
		if err := w.c.put(p.ctx, w.tasks); err != nil {
			p.mu.Lock()
			p.failLocked(w.c, w.s, &ItemError{Index: w.c.start, Rank: w.s.rank, Err: fmt.Errorf("sending the item: %w", err)})
			more := p.assignLocked()
			p.mu.Unlock()
			p.send(more)
		}
	}
}

// failLocked ends c with err, unless it has ended.
func (p *Pool) failLocked(c *chunk, s *poolSlot, err error) {
	if c.done {
		return
	}
	c.done = true
	if s != nil {
		s.held = slices.DeleteFunc(s.held, func(h *chunk) bool { return h == c })
	}
	c.call.fail(c, err)
}

// replies is the pool's reply loop: it hands each reply to its call and
// each worker's exit to exited, in the order they were sent, until the
// results queue is closed.
func (p *Pool) replies() {
	defer p.loop.Done()
	for {
		m, err := p.results.take(context.Background(), true)
		if err != nil {
			if !errors.Is(err, ErrClosed) {
				Logger().Error("pool: receiving a reply", "error", err)
			}
			return
		}
		call, start, rank, gen, err := peekReply(m.Data)
		if err != nil || call == stopCall || rank < 0 || rank >= p.n {
			m.Done() // closes what the reply held
			if err != nil {
				Logger().Error("pool: dropping a reply", "error", err)
			} else if call == stopCall && rank >= 0 && rank < p.n {
				p.exited(rank, gen)
			}
			continue
		}
		p.mu.Lock()
		s := p.workers[rank]
		var c *chunk
		if s.gen == gen {
			i := slices.IndexFunc(s.held, func(h *chunk) bool { return h.call.id == call && h.start == start })
			if i >= 0 {
				c = s.held[i]
				s.held = slices.Delete(s.held, i, i+1)
				c.done, s.worked, p.fails = true, true, 0
			}
		}
		deliver := c != nil && !c.call.ended
		ws := p.assignLocked()
		p.mu.Unlock()
		if deliver {
			c.call.deliver(c, m)
		}
		m.Done() // what the reply held and deliver did not take goes back
		p.send(ws)
	}
}

// exited handles the exit of rank's process gen: the chunks it never took
// go back to the pending, the ones it held fail, and a new process takes
// its place unless the pool is stopping.
func (p *Pool) exited(rank, gen int) {
	p.mu.Lock()
	s := p.workers[rank]
	if s.gen != gen || s.g == nil {
		p.mu.Unlock()
		return
	}
	g, tasks, held, worked := s.g, s.tasks, s.held, s.worked
	s.g, s.tasks, s.held = nil, nil, nil
	p.mu.Unlock()

	// What is still in its queue it never took.
	type key struct {
		call  uint64
		start int
	}
	untaken := map[key]bool{}
	for {
		m, err := tasks.take(context.Background(), false)
		if err != nil {
			break
		}
		call, start, _, err := peekTask(m.Data)
		m.Done() // closes what the task held
		if err == nil {
			untaken[key{call, start}] = true
		}
	}
	_ = tasks.Close()

	cause := g.Err()
	var ee *ExitError
	var we *WorkerError
	switch {
	case errors.As(cause, &ee):
		e := *ee
		e.Rank = rank
		cause = &e
	case errors.As(cause, &we):
		e := *we
		e.Rank = rank
		cause = &e
	case cause == nil:
		cause = errors.New("the worker exited")
	}

	p.mu.Lock()
	var back []*chunk
	for _, c := range held {
		if c.done {
			continue
		}
		if untaken[key{c.call.id, c.start}] {
			back = append(back, c)
			continue
		}
		p.failLocked(c, nil, &ItemError{Index: c.start, Rank: rank, Err: cause})
	}
	p.pending = append(back, p.pending...)
	failed := g.Err() != nil && !worked
	if failed {
		p.fails++
	}
	if p.fails >= maxStartFails && p.broken == nil {
		p.breakLocked(fmt.Errorf("%w: %d new workers in a row failed before finishing a task; the last: %w", ErrPoolBroken, p.fails, cause))
	}
	replace := !p.stopping && p.broken == nil
	if replace {
		p.procs.Add(1)
	}
	p.mu.Unlock()
	if replace {
		go func() {
			defer p.procs.Done()
			if err := p.start(rank); err != nil {
				p.mu.Lock()
				if p.broken == nil {
					p.breakLocked(fmt.Errorf("%w: replacing worker %d: %w", ErrPoolBroken, rank, err))
				}
				p.mu.Unlock()
			}
		}()
	}
}

// breakLocked makes err the pool's failure: every chunk not yet answered
// fails with it, and so does every new call.
func (p *Pool) breakLocked(err error) {
	p.broken = err
	for _, c := range p.pending {
		p.failLocked(c, nil, err)
	}
	p.pending = nil
	for _, s := range p.workers {
		for _, c := range slices.Clone(s.held) {
			p.failLocked(c, s, err)
		}
	}
}

// Close waits for the calls in progress to end, then stops the workers
// once they have finished, and releases the pool (torch's close then
// join). New calls fail with ErrClosed.
func (p *Pool) Close() error {
	p.mu.Lock()
	p.closing = true
	for len(p.calls) > 0 {
		p.idle.Wait()
	}
	if p.stopping {
		p.mu.Unlock()
		p.procs.Wait()
		return nil
	}
	p.stopping = true
	var ws []work
	for _, s := range p.workers {
		if s.g != nil && !s.retiring {
			s.retiring = true
			ws = append(ws, work{s: s, tasks: s.tasks})
		}
	}
	p.mu.Unlock()
	p.send(ws)
	p.release()
	return nil
}

// Terminate stops the workers now (torch's terminate): calls in progress
// fail with ErrClosed; workers get SIGTERM, and die of it after the grace
// period.
func (p *Pool) Terminate() error { return p.terminate(ErrClosed) }

func (p *Pool) terminate(err error) error {
	p.mu.Lock()
	if p.stopping && p.broken != nil {
		p.mu.Unlock()
		p.procs.Wait()
		return nil
	}
	p.closing, p.stopping = true, true
	if p.broken == nil {
		p.breakLocked(err)
	}
	var gs []*Group
	for _, s := range p.workers {
		if s.g != nil {
			gs = append(gs, s.g)
		}
	}
	p.mu.Unlock()
	for _, g := range gs {
		g.Stop(err)
	}
	p.release()
	return nil
}

// release waits for every worker process to exit, then closes the
// results queue, ends the reply loop and closes what is left.
func (p *Pool) release() {
	p.procs.Wait()
	p.released.Do(p.releaseOnce)
}

func (p *Pool) releaseOnce() {
	p.mu.Lock()
	stop := p.stopAfter
	p.mu.Unlock()
	if stop != nil {
		stop()
	}
	_ = p.results.Close()
	p.loop.Wait()
	p.mu.Lock()
	for _, s := range p.workers {
		if s.tasks != nil {
			_ = s.tasks.Close()
			s.tasks, s.g = nil, nil
		}
	}
	p.mu.Unlock()
	p.cancel()
}

// begin registers a new call, unless the pool is closing or broken.
func (p *Pool) begin(pc *poolCall) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.broken != nil:
		return p.broken
	case p.closing:
		return ErrClosed
	}
	pc.id = p.next
	p.next++
	p.calls[pc.id] = pc
	return nil
}

// end unregisters a call: its chunks not yet given out are dropped, and
// replies to the others are let go of as they come.
func (p *Pool) end(pc *poolCall) {
	p.mu.Lock()
	pc.ended = true
	p.pending = slices.DeleteFunc(p.pending, func(c *chunk) bool { return c.call == pc })
	delete(p.calls, pc.id)
	p.idle.Broadcast()
	p.mu.Unlock()
}

// submit queues a chunk for the workers.
func (p *Pool) submit(c *chunk) {
	p.mu.Lock()
	if p.broken != nil {
		p.failLocked(c, nil, p.broken)
		p.mu.Unlock()
		return
	}
	p.pending = append(p.pending, c)
	ws := p.assignLocked()
	p.mu.Unlock()
	p.send(ws)
}

package mp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/strategy"
)

// WorkerError is a worker that returned an error (or panicked).
type WorkerError struct {
	Rank int
	Pid  int
	Err  string // the worker's error text
}

func (e *WorkerError) Error() string {
	return fmt.Sprintf("mp: worker %d (pid %d) failed: %s", e.Rank, e.Pid, e.Err)
}

// ExitError is a worker process that exited with a non-zero code or was
// killed by a signal without reporting an error.
type ExitError struct {
	Rank   int
	Pid    int
	Code   int            // exit code; -1 when killed by a signal
	Signal syscall.Signal // the signal that killed it, or 0
}

func (e *ExitError) Error() string {
	if e.Signal != 0 {
		return fmt.Sprintf("mp: worker %d (pid %d) was killed by signal %v", e.Rank, e.Pid, e.Signal)
	}
	return fmt.Sprintf("mp: worker %d (pid %d) exited with code %d", e.Rank, e.Pid, e.Code)
}

// Option configures Spawn.
type Option func(*options)

type options struct {
	args   any
	grace  time.Duration
	place  func(rank int) device.Place
	stdout io.Writer
	stderr io.Writer
	env    []string
}

// WithArgs passes v to every worker, which reads it with Worker.Args.
// Tensors, queues and pipes may be anywhere inside v.
func WithArgs(v any) Option { return func(o *options) { o.args = v } }

// WithGrace sets how long workers get between SIGTERM and SIGKILL when
// the group is stopped after a failure or a cancelled context. The default
// is 3 seconds.
func WithGrace(d time.Duration) Option { return func(o *options) { o.grace = d } }

// WithPlace sets each worker's process default place, for example one GPU
// per rank: WithPlace(func(r int) device.Place { return device.GPU(r) }).
// Without it a worker starts with the parent's default at spawn time.
func WithPlace(f func(rank int) device.Place) Option { return func(o *options) { o.place = f } }

// WithOutput sends the workers' standard output and error to stdout and
// stderr, whole lines at a time, instead of the parent's own.
func WithOutput(stdout, stderr io.Writer) Option {
	return func(o *options) { o.stdout, o.stderr = stdout, stderr }
}

// WithEnv adds variables ("KEY=value") to the workers' environment.
func WithEnv(kv ...string) Option { return func(o *options) { o.env = append(o.env, kv...) } }

// Group is a set of workers started together by Spawn.
type Group struct {
	procs []*proc
	grace time.Duration
	done  chan struct{}

	mu      sync.Mutex
	first   error // the first failure, what Join returns
	stopped bool
	stopCtx func() bool

	ctx    context.Context // see Context
	cancel context.CancelCauseFunc
}

type proc struct {
	rank int
	cmd  *exec.Cmd
	ctl  *conn
	out  []*lineWriter
	done chan struct{}
}

// Spawn starts n workers running the function registered as name, each a
// new process of this program, and returns at once. Every worker knows its
// rank and the world size, starts with this process's sharing strategy and
// default place (see WithPlace), and dies with this process.
//
// The first worker to fail stops the others: SIGTERM, then SIGKILL after
// the grace period. Cancelling ctx stops them all the same way. Join waits
// for every worker and reports the first failure.
func Spawn(ctx context.Context, name string, n int, opts ...Option) (*Group, error) {
	o := options{grace: 3 * time.Second}
	for _, opt := range opts {
		opt(&o)
	}
	if n < 1 {
		return nil, fmt.Errorf("mp: spawn %q: %d workers", name, n)
	}
	if !reexec.Registered(workerPrefix + name) {
		return nil, fmt.Errorf("mp: spawn: no worker registered as %q (call mp.Register before mp.Init)", name)
	}
	lock, err := StartSession()
	if err != nil {
		return nil, err
	}
	enc := reduction.NewEncoder()
	g := &Group{grace: o.grace, done: make(chan struct{})}
	g.ctx, g.cancel = context.WithCancelCause(ctx)
	stdout, stderr := o.stdout, o.stderr
	if stdout == nil {
		stdout = os.Stdout
	}
	if stderr == nil {
		stderr = os.Stderr
	}
	outMu := &sync.Mutex{}
	for rank := range n {
		place := device.Default()
		if o.place != nil {
			place = o.place(rank)
		}
		p, err := start(ctx, name, rank, n, place, lock, o.env, newLineWriter(stdout, outMu), newLineWriter(stderr, outMu))
		if err == nil {
			g.procs = append(g.procs, p)
			// Encoded once per worker: each message carries its own
			// holds on the pooled blocks inside.
			var args []byte
			var fds []int
			if args, fds, err = enc.Encode(o.args); err != nil {
				err = fmt.Errorf("encoding arguments: %w", err)
			} else if err = p.ctl.send(ctx, args, fds); err != nil {
				enc.Discard()
			} else {
				enc.Done()
			}
		}
		if err != nil {
			err = fmt.Errorf("mp: spawn %q: starting worker %d: %w", name, rank, err)
			g.stop(err)
			for _, p := range g.procs {
				g.watch(p) // reap the ones already started
			}
			return nil, err
		}
	}
	runtime.KeepAlive(o.args)
	g.stopCtx = context.AfterFunc(ctx, func() { g.stop(fmt.Errorf("mp: workers stopped: %w", ctx.Err())) })
	var wg sync.WaitGroup
	for _, p := range g.procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g.watch(p)
		}()
	}
	go func() {
		wg.Wait()
		g.stopCtx()
		close(g.done)
	}()
	return g, nil
}

// Run is Spawn followed by Join.
func Run(ctx context.Context, name string, n int, opts ...Option) error {
	g, err := Spawn(ctx, name, n, opts...)
	if err != nil {
		return err
	}
	return g.Join()
}

func start(ctx context.Context, name string, rank, world int, place device.Place, lock *os.File, env []string, stdout, stderr *lineWriter) (*proc, error) {
	pair, err := socketPair()
	if err != nil {
		return nil, err
	}
	ctl, err := newConn(pair[0], "control")
	if err != nil {
		_ = pair[1].Close()
		return nil, err
	}
	raw, err := pair[1].Disown()
	if err != nil {
		_ = ctl.close()
		return nil, err
	}
	child := os.NewFile(uintptr(raw), "control")
	defer child.Close()

	cmd, err := reexec.Command(context.WithoutCancel(ctx), workerPrefix+name)
	if err != nil {
		_ = ctl.close()
		return nil, err
	}
	cmd.Env = append(cmd.Env,
		envRank+"="+strconv.Itoa(rank),
		envWorld+"="+strconv.Itoa(world),
		envPlace+"="+place.String(),
		envLockFD+"="+strconv.Itoa(lockFD),
		strategy.EnvVar+"="+strategy.Get().String(),
		mmapalloc.EnvSession+"="+mmapalloc.Session(),
	)
	cmd.Env = append(cmd.Env, env...)
	cmd.ExtraFiles = []*os.File{child, lock}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.SysProcAttr = workerAttr()
	cmd.WaitDelay = 2 * time.Second // a grandchild holding our pipes must not hang Wait
	if err := startOnSpawnerThread(cmd); err != nil {
		_ = ctl.close()
		return nil, fmt.Errorf("mp: starting worker %d: %w%s", rank, err, fdHint(err))
	}
	return &proc{rank: rank, cmd: cmd, ctl: ctl, out: []*lineWriter{stdout, stderr}, done: make(chan struct{})}, nil
}

// watch waits for one worker's report and exit, and stops the group on
// its failure.
func (g *Group) watch(p *proc) {
	defer close(p.done)
	var res result
	reportErr := get(context.Background(), p.ctl, &res)
	waitErr := p.cmd.Wait()
	_ = p.ctl.close()
	for _, w := range p.out {
		w.flush()
	}
	pid := p.cmd.Process.Pid
	var failure error
	switch {
	case reportErr == nil && res.Failed:
		failure = &WorkerError{Rank: p.rank, Pid: pid, Err: res.Err}
	case waitErr != nil:
		e := &ExitError{Rank: p.rank, Pid: pid, Code: -1}
		var xe *exec.ExitError
		if errors.As(waitErr, &xe) {
			ws := xe.Sys().(syscall.WaitStatus)
			if ws.Signaled() {
				e.Signal = ws.Signal()
			} else {
				e.Code = ws.ExitStatus()
			}
		}
		failure = e
	}
	if failure != nil {
		g.stop(failure)
	}
}

// stop records cause as the group's failure, unless one was recorded
// first, and terminates every worker still running.
func (g *Group) stop(cause error) {
	g.mu.Lock()
	if g.first == nil {
		g.first = cause
		g.cancel(cause)
	}
	if g.stopped {
		g.mu.Unlock()
		return
	}
	g.stopped = true
	procs := g.procs
	g.mu.Unlock()

	for _, p := range procs {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	go func() {
		timer := time.NewTimer(g.grace)
		defer timer.Stop()
		for _, p := range procs {
			select {
			case <-p.done:
			case <-timer.C:
				for _, q := range procs {
					_ = q.cmd.Process.Kill()
				}
				return
			}
		}
	}()
}

// Join waits until every worker has exited and been reaped. It returns
// nil if all succeeded, else the first failure: a *WorkerError, an
// *ExitError, or the context's error if ctx ended first.
func (g *Group) Join() error {
	<-g.done
	return g.Err()
}

// Done returns a channel that is closed once every worker has exited and
// been reaped: select on it beside a queue.
func (g *Group) Done() <-chan struct{} { return g.done }

// Err returns the group's first failure so far (what Join will return),
// or nil while there is none.
func (g *Group) Err() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.first
}

// Context returns a context derived from Spawn's that is cancelled at the
// group's first failure, with that failure (a *WorkerError, an *ExitError,
// or Spawn's context's end) as its cause: a Queue.Get under it that waits
// for a dead worker returns at once, and context.Cause says why. It is not
// cancelled when every worker succeeds, so that what they left in queues
// can still be taken under it.
func (g *Group) Context() context.Context { return g.ctx }

// Pids returns the workers' process ids, by rank.
func (g *Group) Pids() []int {
	pids := make([]int, len(g.procs))
	for i, p := range g.procs {
		pids[i] = p.cmd.Process.Pid
	}
	return pids
}

// Stop terminates every worker (SIGTERM, then SIGKILL after the grace
// period) and records cause as the failure Join reports.
func (g *Group) Stop(cause error) { g.stop(cause) }

// The spawner thread. The kernel sends Pdeathsig when the thread that
// forked a child exits, not the process (golang/go#27505), and the Go
// runtime may end an OS thread at any time; so every worker is started
// from one goroutine that is locked to its OS thread and never returns.
var (
	spawnerOnce sync.Once
	spawnerReq  chan func()
)

func startOnSpawnerThread(cmd *exec.Cmd) error {
	spawnerOnce.Do(func() {
		spawnerReq = make(chan func())
		go func() {
			runtime.LockOSThread()
			for f := range spawnerReq {
				f()
			}
		}()
	})
	errc := make(chan error, 1)
	spawnerReq <- func() { errc <- cmd.Start() }
	return <-errc
}

// lineWriter passes whole lines to w, so that the output of several
// workers writing at once interleaves by line, never inside one.
type lineWriter struct {
	w   io.Writer
	mu  *sync.Mutex // shared by the writers of one destination
	buf []byte
	own sync.Mutex
}

func newLineWriter(w io.Writer, mu *sync.Mutex) *lineWriter { return &lineWriter{w: w, mu: mu} }

func (l *lineWriter) Write(p []byte) (int, error) {
	l.own.Lock()
	defer l.own.Unlock()
	l.buf = append(l.buf, p...)
	if i := bytes.LastIndexByte(l.buf, '\n'); i >= 0 {
		l.mu.Lock()
		_, err := l.w.Write(l.buf[:i+1])
		l.mu.Unlock()
		l.buf = append(l.buf[:0], l.buf[i+1:]...)
		if err != nil {
			return len(p), nil // a broken destination must not break the worker's pipe
		}
	}
	return len(p), nil
}

func (l *lineWriter) flush() {
	l.own.Lock()
	defer l.own.Unlock()
	if len(l.buf) > 0 {
		l.mu.Lock()
		_, _ = l.w.Write(append(l.buf, '\n'))
		l.mu.Unlock()
		l.buf = l.buf[:0]
	}
}

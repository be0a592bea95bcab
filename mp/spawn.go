package mp

import (
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
	"github.com/tensormp/tensormp/internal/leftover"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/session"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/strategy"
)

// WorkerError is a worker that returned an error (or panicked). The error
// was the worker process's: what reaches the parent is its message.
type WorkerError struct {
	Rank int
	Pid  int
	Msg  string // the worker's error message, or its panic and stack
}

func (e *WorkerError) Error() string {
	return fmt.Sprintf("mp: worker %d (pid %d) failed: %s", e.Rank, e.Pid, e.Msg)
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
	args     any
	rankArgs func(rank int) any
	grace    time.Duration
	place    func(rank int) device.Place
	stdout   io.Writer
	stderr   io.Writer
	env      []string
}

// WithArgs passes v to every worker, which reads it with Worker.Args.
// Tensors, queues and pipes may be anywhere inside v.
func WithArgs(v any) Option { return func(o *options) { o.args = v } }

// WithRankArgs passes each worker the value f returns for its rank, which
// it reads with Worker.Args, as WithArgs does for one value: a queue or a
// shard of its own for each. f is called once per rank, in Spawn.
func WithRankArgs(f func(rank int) any) Option { return func(o *options) { o.rankArgs = f } }

// WithGrace sets how long a worker gets to return once its context is
// cancelled by SIGTERM: when the group is stopped (after a failure, a
// cancelled context or Stop), or when anyone else sends the worker
// SIGTERM. A worker still running after the grace period exits as killed
// by SIGTERM; one that cannot (it ignores SIGTERM) is killed with SIGKILL
// a second later. The default is 3 seconds.
func WithGrace(d time.Duration) Option { return func(o *options) { o.grace = d } }

// defaultGrace is the grace period without WithGrace.
const defaultGrace = 3 * time.Second

// killAfterGrace is how long after its grace period a stopped worker that
// has not died of SIGTERM is killed with SIGKILL.
const killAfterGrace = time.Second

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
	done  chan struct{}

	mu      sync.Mutex
	first   error // the first failure, what Join returns
	stopCtx func() bool

	parent context.Context // Spawn's

	// ctx is cancelled at the first failure (see Context); each
	// worker's command is tied to it, so that its cancellation stops
	// them all: SIGTERM, which they die of after the grace period, and
	// SIGKILL for any that does not.
	ctx    context.Context
	cancel context.CancelCauseFunc
}

type proc struct {
	rank int
	cmd  *exec.Cmd
	ctl  *sock.Conn
	out  []*lineWriter
	done chan struct{}

	state WorkerState // under the group's mu
}

// WorkerState is what Group.State knows of one worker.
type WorkerState struct {
	Rank int
	Pid  int
	// Exited is set once the worker has exited and been reaped.
	Exited bool
	// Code is the exit code once Exited; -1 when a signal killed it.
	Code int
	// Signal is the signal that killed it, or 0.
	Signal syscall.Signal
	// Err is the worker's failure, a *WorkerError or an *ExitError,
	// once Exited; nil when it succeeded.
	Err error
}

// Spawn starts n workers running the function registered as name, each a
// new process of this program, and returns at once. Every worker knows its
// rank and the world size, starts with this process's sharing strategy and
// default place (see WithPlace), and dies with this process.
//
// The first worker to fail stops the others: their contexts are cancelled
// (by SIGTERM) and those still running after the grace period (WithGrace)
// die of SIGTERM. Cancelling ctx stops them all the same way. Join waits for
// every worker and reports the first failure.
func Spawn(ctx context.Context, name string, n int, opts ...Option) (*Group, error) {
	checkInit("mp.Spawn")
	o := options{grace: defaultGrace}
	for _, opt := range opts {
		opt(&o)
	}
	if n < 1 {
		return nil, fmt.Errorf("mp: spawn %q: %d workers", name, n)
	}
	if !reexec.Registered(workerPrefix + name) {
		return nil, fmt.Errorf("mp: spawn: no worker registered as %q (call mp.Register before mp.Init)", name)
	}
	lock, err := session.Start(Logger())
	if err != nil {
		return nil, err
	}
	enc := reduction.NewEncoder()
	g := &Group{done: make(chan struct{}), parent: ctx}
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
		p, err := start(g.ctx, workerSpec{
			name: name, rank: rank, world: n, place: place,
			lock: lock, grace: o.grace, env: o.env,
			stdout: newLineWriter(stdout, outMu), stderr: newLineWriter(stderr, outMu),
		})
		if err == nil {
			g.procs = append(g.procs, p)
			// Encoded once per worker: each message carries its own
			// holds on the pooled blocks inside.
			v := o.args
			if o.rankArgs != nil {
				v = o.rankArgs(rank)
			}
			var args []byte
			var fds []int
			if args, fds, err = enc.Encode(v); err != nil {
				err = fmt.Errorf("encoding arguments: %w", err)
			} else if err = p.ctl.Send(ctx, args, fds); err != nil {
				enc.Discard()
				if said := p.setupFailure(err); said != nil {
					err = said
				}
			} else {
				enc.Done()
			}
			runtime.KeepAlive(v)
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
	g.stopCtx = context.AfterFunc(ctx, func() { g.stop(stoppedBy(ctx)) })
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

// workerSpec is what start needs to start one worker.
type workerSpec struct {
	name        string // the worker's, as registered
	rank, world int
	place       device.Place  // the worker's default place
	lock        *os.File      // the session lock, which the worker inherits
	grace       time.Duration // see WithGrace
	env         []string      // added to the worker's environment
	// stdout and stderr take the worker's output; the group flushes
	// them once the worker has exited.
	stdout, stderr *lineWriter
}

// start starts the worker spec describes. Its command is tied to ctx,
// the group's: once ctx is cancelled the worker gets SIGTERM, which it
// dies of spec.grace later (see workerContext), and SIGKILL if it has
// not exited killAfterGrace after that.
func start(ctx context.Context, spec workerSpec) (*proc, error) {
	pair, err := sock.Pair()
	if err != nil {
		return nil, err
	}
	ctl, err := sock.New(pair[0], "control")
	if err != nil {
		_ = pair[1].Close()
		return nil, err
	}
	raw, err := pair[1].Disown()
	if err != nil {
		_ = ctl.Close()
		return nil, err
	}
	child := os.NewFile(uintptr(raw), "control")
	defer child.Close()

	cmd, err := reexec.Command(ctx, workerPrefix+spec.name)
	if err != nil {
		_ = ctl.Close()
		return nil, err
	}
	cmd.Env = append(cmd.Env,
		envRank+"="+strconv.Itoa(spec.rank),
		envWorld+"="+strconv.Itoa(spec.world),
		envPlace+"="+spec.place.String(),
		envLockFD+"="+strconv.Itoa(lockFD),
		envGrace+"="+spec.grace.String(),
		strategy.EnvVar+"="+strategy.Get().String(),
		shm.EnvSession+"="+shm.Session(),
	)
	cmd.Env = append(cmd.Env, spec.env...)
	cmd.ExtraFiles = []*os.File{child, spec.lock}
	cmd.Stdout, cmd.Stderr = spec.stdout, spec.stderr
	cmd.SysProcAttr = workerAttr()
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	// The grace period after SIGTERM, and the SIGKILL for a worker that
	// outlives it; it also keeps a grandchild holding the worker's output
	// pipes from hanging Wait.
	cmd.WaitDelay = spec.grace + killAfterGrace
	if err := startOnSpawnerThread(cmd); err != nil {
		_ = ctl.Close()
		return nil, fmt.Errorf("mp: starting worker %d: %w%s", spec.rank, err, sock.FDHint(err))
	}
	return &proc{
		rank: spec.rank, cmd: cmd, ctl: ctl, out: []*lineWriter{spec.stdout, spec.stderr}, done: make(chan struct{}),
		state: WorkerState{Rank: spec.rank, Pid: cmd.Process.Pid},
	}, nil
}

// setupFailure returns why the worker could not start, as it said on its
// control socket before it closed it, when err, the failure to send its
// arguments, says it did close it: a worker that fails at once (mp.Init
// missing, say) may exit before its arguments come. Else it returns nil.
func (p *proc) setupFailure(err error) error {
	if !errors.Is(err, ErrClosed) {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var res result
	if get(ctx, p.ctl, &res, true) != nil || !res.Failed {
		return nil
	}
	return &WorkerError{Rank: p.rank, Pid: p.cmd.Process.Pid, Msg: res.Err}
}

// watch waits for one worker's report and exit, and stops the group on
// its failure.
func (g *Group) watch(p *proc) {
	defer close(p.done)
	var res result
	reportErr := get(context.Background(), p.ctl, &res, true)
	// A worker that died without cleaning up leaves files named after its
	// pid (the CUDA driver's, and named segments nobody else maps): they
	// go while its zombie keeps that pid from naming another process.
	if pid := p.cmd.Process.Pid; leftover.Any() && waitExited(pid) == nil {
		leftover.Remove(pid)
	}
	waitErr := p.cmd.Wait()
	_ = p.ctl.Close()
	for _, w := range p.out {
		w.flush()
	}
	pid := p.cmd.Process.Pid
	// The process state decides, not waitErr: after the group's context
	// is cancelled, Wait reports that even for a worker that then
	// returned cleanly.
	ps := p.cmd.ProcessState
	code, sig := -1, syscall.Signal(0)
	if ps != nil {
		ws := ps.Sys().(syscall.WaitStatus)
		code = ws.ExitStatus()
		if ws.Signaled() {
			sig = ws.Signal()
		}
	}
	var failure error
	switch {
	case reportErr == nil && res.Failed:
		failure = &WorkerError{Rank: p.rank, Pid: pid, Msg: res.Err}
	case ps == nil:
		failure = &WorkerError{Rank: p.rank, Pid: pid, Msg: fmt.Sprintf("waiting for it: %v", waitErr)}
	case !ps.Success():
		failure = &ExitError{Rank: p.rank, Pid: pid, Code: code, Signal: sig}
	case reportErr != nil:
		// Exited 0 without a word: its main returned instead of running
		// the worker, which is what a missing Init does.
		failure = &WorkerError{Rank: p.rank, Pid: pid, Msg: "exited without running the worker: " + initHint}
	}
	g.mu.Lock()
	p.state.Exited, p.state.Code, p.state.Signal, p.state.Err = true, code, sig, failure
	g.mu.Unlock()
	if failure != nil {
		g.stop(failure)
	}
}

// stop records cause as the group's failure, unless one was recorded
// first, and stops every worker still running: cancelling the group's
// context signals them (see start).
func (g *Group) stop(cause error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.first == nil {
		if g.parent.Err() != nil {
			// Spawn's context ended: that is why the workers stop,
			// whichever of them reports first.
			cause = stoppedBy(g.parent)
		}
		g.first = cause
	}
	g.cancel(cause)
}

// stoppedBy is the failure of a group whose Spawn context, ctx, ended.
func stoppedBy(ctx context.Context) error {
	return fmt.Errorf("mp: workers stopped: %w", ctx.Err())
}

// Join waits until every worker has exited and been reaped. It returns
// nil if all succeeded, else the first failure: a *WorkerError, an
// *ExitError, or the context's error if ctx ended first.
func (g *Group) Join() error {
	<-g.done
	return g.Err()
}

// JoinContext is Join, giving up when ctx ends: then it returns ctx's
// error and leaves the workers running (torch's join with a timeout).
func (g *Group) JoinContext(ctx context.Context) error {
	select {
	case <-g.done:
		return g.Err()
	case <-ctx.Done():
		return ctx.Err()
	}
}

// State returns what is known of each worker now, by rank.
func (g *Group) State() []WorkerState {
	g.mu.Lock()
	defer g.mu.Unlock()
	states := make([]WorkerState, len(g.procs))
	for i, p := range g.procs {
		states[i] = p.state
	}
	return states
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

// Stop stops every worker as a failure would (their contexts are
// cancelled, and those still running after the grace period die of
// SIGTERM) and records cause as the
// failure Join reports, unless there was one before.
func (g *Group) Stop(cause error) { g.stop(cause) }

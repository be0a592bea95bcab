package mp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/session"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
	"github.com/tensormp/tensormp/tensor"
)

// Environment a spawned worker starts with.
const (
	envRank   = "TENSORMP_RANK"
	envWorld  = "TENSORMP_WORLD_SIZE"
	envPlace  = "TENSORMP_PLACE"
	envLockFD = "TENSORMP_LOCK_FD"
	envGrace  = "TENSORMP_GRACE" // the group's grace period (WithGrace)
	// EnvLog sets the level of tensormp's loggers: trace, debug, info,
	// warn, error or off. The default is info.
	EnvLog = "TENSORMP_LOG"
)

// Descriptors a worker inherits.
const (
	ctlFD  = 3 // control socket to the parent
	lockFD = 4 // the session lock, held shared for the worker's life
)

const workerPrefix = "mp.worker."

// WorkerFunc is the body of a worker process. It returns nil on success;
// an error is reported to the parent's Join as a *WorkerError. Its ctx is
// cancelled when the process gets SIGTERM, from its group stopping or
// from anyone else: the worker then has the grace period (WithGrace) to
// return. One that has not returned by then exits as killed by SIGTERM,
// and a second SIGTERM ends it at once, as os/signal's NotifyContext
// convention has it: the first signal asks, the default action follows.
// A worker may also ask for SIGTERM itself (signal.Notify): its channel
// gets the signal too, and the grace period still ends the process.
type WorkerFunc func(ctx context.Context, w *Worker) error

// Register makes fn available to Spawn under name. Call it from an init
// function or from main before Init, in every process of the program: the
// workers are the same binary. Registering a name twice panics.
func Register(name string, fn WorkerFunc) {
	reexec.Register(workerPrefix+name, func() int { return runWorker(name, fn) })
}

// Worker is what a worker function knows about itself: its rank, the
// number of workers, its arguments and its logger.
type Worker struct {
	rank, world int
	log         hclog.Logger
	ctl         *sock.Conn

	argsOnce sync.Once
	argsData []byte
	argsFDs  *fd.Set
	argsErr  error
}

// Rank returns the worker's index, 0 to WorldSize()-1.
func (w *Worker) Rank() int { return w.rank }

// WorldSize returns the number of workers Spawn started together.
func (w *Worker) WorldSize() int { return w.world }

// Logger returns the worker's logger, named after its rank.
func (w *Worker) Logger() hclog.Logger { return w.log }

// Args decodes the value given to Spawn with WithArgs into v, a pointer.
// Tensors, queues and pipes inside it arrive ready to use. It may be
// called once.
func (w *Worker) Args(v any) error {
	err := errors.New("mp: Args called twice")
	w.argsOnce.Do(func() {
		err = w.argsErr
		if err == nil {
			err = decode(w.argsData, w.argsFDs, v)
		}
		w.argsFDs.Close() // empty unless the decode never ran
		w.argsData, w.argsFDs = nil, nil
	})
	return err
}

// result is what a worker reports on its control socket before exiting.
type result struct {
	Failed bool
	Err    string
}

// runWorker is a spawned process's main: it sets up the worker's state
// from what the parent passed, runs fn and reports how it went.
func runWorker(name string, fn WorkerFunc) int {
	// First, so that a group stopped while this worker starts finds its
	// SIGTERM handled.
	grace, err := time.ParseDuration(os.Getenv(envGrace))
	if err != nil || grace < 0 {
		grace = defaultGrace
	}
	ctx, stop := workerContext(grace)
	unix.CloseOnExec(ctlFD)
	unix.CloseOnExec(lockFD)
	session.Join(lockFD, Logger())

	rank, _ := strconv.Atoi(os.Getenv(envRank))
	world, _ := strconv.Atoi(os.Getenv(envWorld))
	log := newLogger(fmt.Sprintf("worker.%d", rank))
	fail := func(err error) int {
		log.Error("worker setup failed", "worker", name, "error", err)
		return 2
	}
	if p := os.Getenv(envPlace); p != "" {
		place, err := device.Parse(p)
		if err != nil {
			return fail(err)
		}
		if err := device.SetDefault(place); err != nil {
			return fail(err)
		}
	}
	ctl, err := sock.New(fd.New(ctlFD), "control")
	if err != nil {
		return fail(err)
	}
	w := &Worker{rank: rank, world: world, log: log, ctl: ctl}
	setup, cancel := context.WithTimeout(context.Background(), time.Minute)
	m, err := ctl.Recv(setup)
	cancel()
	if err != nil {
		return fail(fmt.Errorf("receiving arguments: %w", err))
	}
	w.argsData, w.argsFDs = append([]byte(nil), m.Data...), m.FDs.Move()
	m.Done()

	// The backstop to Pdeathsig: the parent closing the control socket,
	// or dying, ends the worker. Any other failure of the wait is this
	// process's (its descriptors exhausted, so that the receive cannot
	// park, say: the worker's function may lower its own limit), and the
	// wait begins again a little later.
	go func() {
		for {
			err := backstopWait(ctl)
			if err == nil {
				return // nothing comes after the arguments: a message ends the watch
			}
			if errors.Is(err, ErrClosed) {
				log.Debug("control socket closed: exiting", "error", err)
				os.Exit(3)
			}
			log.Debug("waiting on the control socket", "error", err)
			time.Sleep(backstopRetry)
		}
	}()

	err = call(ctx, fn, w)
	terminated := context.Cause(ctx) == errTerminated
	stop()
	res := result{}
	if err != nil {
		res = result{Failed: true, Err: err.Error()}
		if terminated {
			res.Err += " (after " + errTerminated.Error() + ")"
		}
		log.Debug("worker failed", "error", err)
	}
	// The worker is done with what it received: let go of it now, so that
	// a named segment nobody else holds goes with this process, not at the
	// session's end.
	shm.DropRefsForExit()
	shm.Trim()
	if err := tensor.CloseBackends(); err != nil {
		log.Warn("closing device backends", "error", err)
	}
	if err := report(ctl, res); err != nil {
		log.Error("reporting the result", "error", err)
	}
	if res.Failed {
		return 1
	}
	return 0
}

// backstopRetry is how long a worker's wait on its control socket
// pauses after a failure of its own before it waits again.
const backstopRetry = 10 * time.Millisecond

// backstopWait is the backstop's wait on the control socket ctl, for a
// message that never comes: it returns the receive's error. Tests set it
// as the package initialises, before any worker runs.
var backstopWait = func(ctl *sock.Conn) error {
	var x struct{}
	return get(context.Background(), ctl, &x, true)
}

// errTerminated is the cause of a worker's context cancelled by SIGTERM.
var errTerminated = errors.New("SIGTERM cancelled the worker's context")

// workerContext returns the context a worker function runs under and the
// function to call once it has returned. The first SIGTERM, which the
// parent sends to stop the group and anyone else may send, cancels the
// context with errTerminated as its cause; if the function has not
// returned grace later, the worker dies of SIGTERM, so that its parent
// sees a worker killed by SIGTERM. A second SIGTERM kills it at once,
// also one that came before this process got to the first: the channel
// holds two.
//
// The worker's own signal.Notify(SIGTERM), made before or after the
// first, keeps working through the grace period: this function stops
// only its own channel, and gives SIGTERM back its default action
// (signal.Reset, which undoes every Notify) only as the process dies.
func workerContext(grace time.Duration) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(context.Background())
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM)
	returned := make(chan struct{})
	go func() {
		select {
		case <-sigs:
		case <-returned:
			return
		}
		cancel(errTerminated)
		deadline := time.NewTimer(grace)
		defer deadline.Stop()
		select {
		case <-sigs:
			dieOf(syscall.SIGTERM)
		case <-deadline.C:
			dieOf(syscall.SIGTERM)
		case <-returned:
		}
	}()
	return ctx, func() {
		close(returned)
		signal.Stop(sigs)
		cancel(nil)
	}
}

// dieOf ends the process by sig, whose default action must be to
// terminate, after giving sig back that action (signal.Reset: whoever
// asked to be notified of it, the process is going). A process that
// inherited sig ignored exits with the shell's code for it instead.
func dieOf(sig syscall.Signal) {
	signal.Reset(sig)
	_ = unix.Kill(os.Getpid(), sig)
	time.Sleep(100 * time.Millisecond)
	os.Exit(128 + int(sig))
}

// report sends a worker's result to its parent on ctl, giving up after
// 10 seconds.
func report(ctl *sock.Conn, res result) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return put(ctx, ctl, &res, true)
}

// call runs fn, turning a panic into an error with its stack.
func call(ctx context.Context, fn WorkerFunc, w *Worker) error {
	_, err := recovered(func() (struct{}, error) { return struct{}{}, fn(ctx, w) })
	return err
}

// recovered calls fn, turning a panic in it into an error with its stack:
// what a worker runs of its user's code, its function or a pool's item,
// fails the one call, not the process.
func recovered[R any](fn func() (R, error)) (r R, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v\n%s", p, debug.Stack())
		}
	}()
	return fn()
}

// newLogger returns a logger named name at the level TENSORMP_LOG sets.
func newLogger(name string) hclog.Logger {
	level := hclog.Info
	if v := os.Getenv(EnvLog); v != "" {
		if l := hclog.LevelFromString(v); l != hclog.NoLevel {
			level = l
		}
	}
	return hclog.New(&hclog.LoggerOptions{Name: name, Level: level, Output: os.Stderr})
}

var (
	loggerOnce sync.Once
	logger     hclog.Logger
)

// Logger returns the program's own tensormp logger.
func Logger() hclog.Logger {
	loggerOnce.Do(func() { logger = newLogger("tensormp") })
	return logger
}

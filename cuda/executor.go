package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
)

// ErrStopped is returned by an Executor that was stopped.
var ErrStopped = errors.New("cuda: executor stopped")

// Executor runs work for one device on one OS thread, where the device's
// primary context is current. The CUDA current context belongs to an OS
// thread, and goroutines move between threads, so every driver call that
// uses the context goes through the device's Executor: a goroutine locked
// to its own thread, fed by a ready queue (the device-thread design of
// PyTorch's autograd engine). A call made from the executor's own thread,
// work that calls Do again, runs inline instead of waiting for itself.
type Executor struct {
	dev   int
	drv   Driver
	ready chan task
	done  chan struct{}

	tidMu sync.Mutex
	tid   int // the executor's OS thread id, once started

	stopOnce sync.Once
	mu       sync.RWMutex // held shared by Do while it enqueues; Stop takes it exclusively
	stopped  bool
}

type task struct {
	fn   func() error
	errc chan error
}

// NewExecutor starts an executor for device dev: it locks a new goroutine
// to its thread, retains the device's primary context and makes it
// current. Stop ends it.
func NewExecutor(drv Driver, dev int) (*Executor, error) {
	e := &Executor{dev: dev, drv: drv, ready: make(chan task), done: make(chan struct{})}
	started := make(chan error, 1)
	go e.loop(started)
	if err := <-started; err != nil {
		return nil, err
	}
	return e, nil
}

func (e *Executor) loop(started chan<- error) {
	runtime.LockOSThread() // never unlocked: the thread dies with the loop
	defer close(e.done)
	ctx, err := e.drv.RetainPrimaryContext(e.dev)
	if err == nil {
		if err = e.drv.SetCurrent(ctx); err != nil {
			_ = e.drv.ReleasePrimaryContext(e.dev)
		}
	}
	if err != nil {
		started <- fmt.Errorf("cuda: starting the executor of device %d: %w", e.dev, err)
		return
	}
	e.tidMu.Lock()
	e.tid = gettid()
	e.tidMu.Unlock()
	started <- nil
	for t := range e.ready {
		t.errc <- run(t.fn)
	}
	_ = e.drv.ReleasePrimaryContext(e.dev)
}

// run calls fn, turning a panic into an error so that the executor
// survives it.
func run(fn func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("cuda: panic in device work: %v", p)
		}
	}()
	return fn()
}

// Device returns the executor's device ordinal.
func (e *Executor) Device() int { return e.dev }

// onThread reports whether the caller runs on the executor's thread.
func (e *Executor) onThread() bool {
	e.tidMu.Lock()
	defer e.tidMu.Unlock()
	return e.tid > 0 && e.tid == gettid()
}

// Do runs fn on the executor's thread and returns its error. Calls from
// many goroutines run one at a time, in arrival order; a call from the
// executor's thread itself runs at once.
func (e *Executor) Do(fn func() error) error {
	if e.onThread() {
		return run(fn)
	}
	e.mu.RLock()
	if e.stopped {
		e.mu.RUnlock()
		return ErrStopped
	}
	errc := make(chan error, 1)
	e.ready <- task{fn: fn, errc: errc}
	e.mu.RUnlock()
	return <-errc
}

// Stop finishes the queued work, releases the device's context and ends
// the executor's thread. Later calls to Do return ErrStopped.
func (e *Executor) Stop() {
	e.stopOnce.Do(func() {
		e.mu.Lock()
		e.stopped = true
		close(e.ready)
		e.mu.Unlock()
		<-e.done
	})
}

// Executors starts one Executor per device on first use and keeps it
// until Stop.
type Executors struct {
	drv     Driver
	mu      sync.Mutex
	m       map[int]*Executor
	stopped bool
}

// NewExecutors returns an empty set of executors for drv's devices.
func NewExecutors(drv Driver) *Executors {
	return &Executors{drv: drv, m: map[int]*Executor{}}
}

// Get returns device dev's executor, starting it the first time.
func (x *Executors) Get(dev int) (*Executor, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.stopped {
		return nil, ErrStopped
	}
	if e, ok := x.m[dev]; ok {
		return e, nil
	}
	n, err := x.drv.DeviceCount()
	if err != nil {
		return nil, err
	}
	if dev < 0 || dev >= n {
		return nil, fmt.Errorf("cuda: device %d does not exist (%d devices)", dev, n)
	}
	e, err := NewExecutor(x.drv, dev)
	if err != nil {
		return nil, err
	}
	x.m[dev] = e
	return e, nil
}

// Stop stops every executor started so far; Get returns ErrStopped
// afterwards.
func (x *Executors) Stop() {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.stopped = true
	for dev, e := range x.m {
		e.Stop()
		delete(x.m, dev)
	}
}

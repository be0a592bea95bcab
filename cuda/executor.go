package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
)

// ErrStopped is returned by an executor that was stopped.
var ErrStopped = errors.New("cuda: executor stopped")

// executor runs driver work for one device with the device's primary
// context current. The CUDA current context belongs to an OS thread, and
// goroutines move between threads, so Do locks the calling goroutine to
// its thread for the call, makes the context current there, and puts
// back whatever was current before: a thread that another library uses
// too (a Python thread calling into tensormp, whose current device
// PyTorch keeps in that context) finds it as it was. Each call adds at
// most three cheap driver calls (get, set, set back), where handing it to
// a device thread of its own cost two thread wake-ups (20-40 µs on a busy
// two-core machine). Calls from several goroutines run at once, as the
// driver allows; work may call Do again.
type executor struct {
	dev int
	drv driver
	ctx cuContext // the device's primary context, retained until Stop

	mu       sync.RWMutex // held shared while Do admits a call; Stop takes it exclusively
	stopped  bool
	pins     int            // guarded by mu: what needs the context for its teardown (see pin)
	released bool           // guarded by mu: the context is given back
	calls    sync.WaitGroup // admitted calls not yet returned
	stopOnce sync.Once
}

// newExecutor returns an executor for device dev: it retains the device's
// primary context. Stop releases it.
func newExecutor(drv driver, dev int) (*executor, error) {
	ctx, err := drv.RetainPrimaryContext(dev)
	if err != nil {
		return nil, fmt.Errorf("cuda: retaining the primary context of device %d%s: %w", dev, contextHint(drv, dev), err)
	}
	return &executor{dev: dev, drv: drv, ctx: ctx}, nil
}

// contextHint says why device dev may refuse this process a context: a
// device in exclusive-process compute mode takes one process at a time,
// a prohibited one none.
func contextHint(drv driver, dev int) string {
	switch mode, err := drv.ComputeMode(dev); {
	case err != nil:
		return ""
	case mode == 3:
		return " (the device is in exclusive-process compute mode: another process holds it; tensormp's processes share a GPU only in the default mode, or through MPS)"
	case mode == 2:
		return " (the device's compute mode prohibits contexts)"
	}
	return ""
}

// run calls fn, turning a panic into an error.
func run(fn func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("cuda: panic in device work: %v", p)
		}
	}()
	return fn()
}

// Device returns the executor's device ordinal.
func (e *executor) Device() int { return e.dev }

// Do runs fn on the calling goroutine's thread with the device's context
// current, and returns fn's error.
func (e *executor) Do(fn func() error) (err error) {
	e.mu.RLock()
	if e.stopped {
		e.mu.RUnlock()
		return ErrStopped
	}
	e.calls.Add(1)
	e.mu.RUnlock()
	defer e.calls.Done()
	return e.inContext(fn)
}

// inContext runs fn on the calling goroutine's thread with the device's
// context current, and puts the thread's context back.
func (e *executor) inContext(fn func() error) (err error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	prev, err := e.drv.Current()
	if err != nil {
		return err
	}
	if prev != e.ctx {
		if err := e.drv.SetCurrent(e.ctx); err != nil {
			return err
		}
		defer func() { err = errors.Join(err, e.drv.SetCurrent(prev)) }()
	}
	return run(fn)
}

// Stop waits for the calls under way, then releases the device's context,
// or, while something pinned it, leaves that to the last unpin. Later
// calls to Do return ErrStopped.
func (e *executor) Stop() {
	e.stopOnce.Do(func() {
		e.mu.Lock()
		e.stopped = true
		e.mu.Unlock()
		e.calls.Wait()
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.pins == 0 {
			e.releaseLocked()
		}
	})
}

func (e *executor) releaseLocked() {
	if !e.released {
		e.released = true
		_ = e.drv.ReleasePrimaryContext(e.dev)
	}
}

// pin keeps the device's context retained, after Stop too, until unpin:
// for device memory whose teardown needs it (a slab is unmapped and
// released inside its device's context, which may be gone otherwise).
func (e *executor) pin() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stopped {
		return ErrStopped
	}
	e.pins++
	return nil
}

// unpin undoes a pin; the last one after Stop gives the context back.
func (e *executor) unpin() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pins--; e.pins == 0 && e.stopped {
		e.releaseLocked()
	}
}

// teardown runs fn as Do does, also after Stop, for what holds a pin,
// and then unpins.
func (e *executor) teardown(fn func() error) error {
	defer e.unpin()
	return e.inContext(fn)
}

// executors starts one executor per device on first use and keeps it
// until Stop.
type executors struct {
	drv     driver
	mu      sync.Mutex
	m       map[int]*executor
	stopped bool
}

// newExecutors returns an empty set of executors for drv's devices.
func newExecutors(drv driver) *executors {
	return &executors{drv: drv, m: map[int]*executor{}}
}

// Get returns device dev's executor, starting it the first time.
func (x *executors) Get(dev int) (*executor, error) {
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
	e, err := newExecutor(x.drv, dev)
	if err != nil {
		return nil, err
	}
	x.m[dev] = e
	return e, nil
}

// Stop stops every executor started so far; Get returns ErrStopped
// afterwards.
func (x *executors) Stop() {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.stopped = true
	for dev, e := range x.m {
		e.Stop()
		delete(x.m, dev)
	}
}

// syncAll waits for every stream of each device's context this process
// uses.
func (x *executors) syncAll() {
	x.mu.Lock()
	es := make([]*executor, 0, len(x.m))
	for _, e := range x.m {
		es = append(es, e)
	}
	x.mu.Unlock()
	for _, e := range es {
		_ = e.Do(x.drv.CtxSynchronize)
	}
}

package cuda

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// Runtime is the process's GPU state: the driver, one executor per device,
// the allocations exported to other processes, the handles opened from
// them, and the limbo of freed allocations other processes still use.
type Runtime struct {
	drv   driver
	execs *executors

	mu       sync.Mutex
	pools    map[int]*shm.Pool           // each device's slabs, nil for a device without them (see pool)
	opened   map[ipcMemHandle]*openedMem // handles this process opened
	exported map[ipcMemHandle]*Buffer    // allocations made here and exported, until freed for good
	limbo    []*Buffer                   // freed here, still used elsewhere
	uuids    [][16]byte                  // each device's UUID by ordinal, asked once (nil before)
	legacy   bool                        // every device shares by legacy IPC (see EnvLegacy)
}

var (
	rtMu sync.Mutex
	rt   *Runtime
)

// Default returns the process's Runtime, made on first use with the
// driver Load returns.
func Default() (*Runtime, error) {
	rtMu.Lock()
	defer rtMu.Unlock()
	if rt != nil {
		return rt, nil
	}
	d, err := load()
	if err != nil {
		return nil, err
	}
	rt = newRuntime(d)
	return rt, nil
}

// newRuntime returns a Runtime on driver d.
func newRuntime(d driver) *Runtime {
	return &Runtime{
		drv: d, execs: newExecutors(d), pools: map[int]*shm.Pool{},
		opened: map[ipcMemHandle]*openedMem{}, exported: map[ipcMemHandle]*Buffer{},
	}
}

// deviceUUIDs returns every device's UUID, by ordinal: the driver is
// asked once per Runtime, so a message that names a device costs no
// driver call.
func (r *Runtime) deviceUUIDs() ([][16]byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.uuids != nil {
		return r.uuids, nil
	}
	n, err := r.drv.DeviceCount()
	if err != nil {
		return nil, err
	}
	uuids := make([][16]byte, n)
	for dev := range uuids {
		if uuids[dev], err = r.drv.DeviceUUID(dev); err != nil {
			return nil, fmt.Errorf("cuda: the UUID of gpu:%d: %w", dev, err)
		}
	}
	r.uuids = uuids
	return uuids, nil
}

// UUID returns device dev's UUID, the name other processes know it by:
// ordinals are per process (CUDA_VISIBLE_DEVICES).
func (r *Runtime) UUID(dev int) ([16]byte, error) {
	uuids, err := r.deviceUUIDs()
	if err != nil {
		return [16]byte{}, err
	}
	if dev < 0 || dev >= len(uuids) {
		return [16]byte{}, fmt.Errorf("cuda: device %d does not exist (%d devices)", dev, len(uuids))
	}
	return uuids[dev], nil
}

// Ordinal returns this process's ordinal of the device named uuid, or an
// error when this process does not see it.
func (r *Runtime) Ordinal(uuid [16]byte) (int, error) {
	uuids, err := r.deviceUUIDs()
	if err != nil {
		return 0, err
	}
	for dev, u := range uuids {
		if u == uuid {
			return dev, nil
		}
	}
	return 0, fmt.Errorf("cuda: device %s is not one of this process's %d (CUDA_VISIBLE_DEVICES, or another MIG instance)", FormatUUID(uuid), len(uuids))
}

// FormatUUID writes a device UUID as nvidia-smi writes a GPU's:
// GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (a MIG instance's is MIG-...).
func FormatUUID(u [16]byte) string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// Close frees what the limbo holds that nobody uses any more, then gives
// every device's context back to the driver and stops the executors; every
// later GPU call of r fails with ErrStopped, so memory of the closed
// contexts is never touched again. It is for a process about to exit: the
// driver removes its interprocess-event files (/dev/shm/cuda.shm.*) only
// when the context that made them goes, and an exit without Close leaves
// them behind. tensor.CloseBackends calls it for the Default Runtime.
func (r *Runtime) Close() {
	r.CollectLimbo()
	r.trimSlabs()
	shm.WaitExtentsClosed() // received slabs' too
	r.execs.syncAll()
	r.execs.Stop()
}

func init() {
	tensor.RegisterBackend(device.TypeGPU, backend{})
}

// backend is tensor's allocator for gpu places. It loads the driver on
// the first allocation, so a program that never makes a GPU tensor never
// touches CUDA.
type backend struct{}

func (backend) Alloc(p device.Place, n int64) (tensor.Buffer, error) {
	r, err := Default()
	if err != nil {
		return nil, err
	}
	return r.Alloc(p.Index(), n)
}

// Close closes the Default Runtime, if there is one (see Runtime.Close),
// and removes the files libcuda keeps in /dev/shm for this process's
// exports even when another library holds the contexts on.
func (backend) Close() error {
	rtMu.Lock()
	r := rt
	rtMu.Unlock()
	if r != nil {
		r.Close()
		removeOwnDriverFiles(r.drv)
	}
	return nil
}

// Buffer is device memory that a tensor's storage owns: allocated here,
// or opened from another process's export.
type Buffer struct {
	rt   *Runtime
	dev  int
	ptr  DevicePtr // where the storage's bytes start
	size int64

	// Allocated here.
	base   DevicePtr // the allocation's start; ptr == base
	export *export   // set once the buffer has been sent to another process

	// Opened from another process.
	from  *openedMem
	token *shm.Block      // this process's hold on the producer's memory
	desc  gpushare.Handle // how it was described to us, to send it on

	// A block of a device slab (see slab.go), made here or received
	// (received); nil for a buffer allocated on its own.
	block    *shm.Block
	received bool

	// queued counts the work this process queued on the buffer (its
	// clearing, a copy into or out of it), and waited the count a wait
	// saw done: while they differ, work may still run, and a block is
	// given back only after it, else it would touch memory that its
	// next user owns.
	queued, waited atomic.Uint64
	freed          atomic.Bool
}

// Alloc returns n bytes of zeroed memory on device dev. When the device is
// out of memory it collects the limbo and tries once more.
func (r *Runtime) Alloc(dev int, n int64) (*Buffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("cuda: allocating %d bytes", n)
	}
	e, err := r.execs.Get(dev)
	if err != nil {
		return nil, err
	}
	b := &Buffer{rt: r, dev: dev, size: n}
	if n == 0 {
		return b, nil
	}
	p, err := r.pool(dev)
	if err != nil {
		return nil, err
	}
	if p != nil {
		if b, err = r.allocBlock(p, dev, n); err != nil {
			return nil, err
		}
		// A recycled block holds its last user's bytes, a new one the
		// device's garbage.
		b.queued.Add(1)
		if err := e.Do(func() error { return r.drv.MemsetD8(b.ptr, n) }); err != nil {
			_ = b.Release()
			return nil, fmt.Errorf("cuda: clearing %d bytes on gpu:%d: %w", n, dev, err)
		}
		return b, nil
	}
	alloc := func() error {
		p, err := r.drv.MemAlloc(n)
		if err != nil {
			return err
		}
		b.ptr, b.base = p, p
		if err := r.drv.MemsetD8(p, n); err != nil {
			_ = r.drv.MemFree(p)
			return err
		}
		return nil
	}
	err = e.Do(alloc)
	if err != nil {
		r.CollectLimbo()
		err = e.Do(alloc)
	}
	if err != nil {
		return nil, fmt.Errorf("cuda: allocating %d bytes on gpu:%d: %w", n, dev, err)
	}
	return b, nil
}

func (b *Buffer) exec() (*executor, error) { return b.rt.execs.Get(b.dev) }

// Device returns the buffer's device ordinal.
func (b *Buffer) Device() int { return b.dev }

// Ptr returns the device address of the buffer's first byte.
func (b *Buffer) Ptr() DevicePtr { return b.ptr }

// Size returns the buffer's size in bytes.
func (b *Buffer) Size() int64 { return b.size }

// Bytes returns nil: the host reaches device memory by Read and Write.
func (b *Buffer) Bytes() []byte { return nil }

func (b *Buffer) check(off, n int64) error {
	if b.freed.Load() {
		return errors.New("cuda: buffer freed")
	}
	if off < 0 || n < 0 || off > b.size-n {
		return fmt.Errorf("cuda: range %d+%d outside a buffer of %d bytes", off, n, b.size)
	}
	return nil
}

// Read copies len(dst) bytes from off into host memory.
func (b *Buffer) Read(dst []byte, off int64) error {
	if err := b.check(off, int64(len(dst))); err != nil || len(dst) == 0 {
		return err
	}
	e, err := b.exec()
	if err != nil {
		return err
	}
	return e.Do(func() error { return b.rt.drv.MemcpyDtoH(dst, b.ptr+DevicePtr(off)) })
}

// Write copies src into the buffer at off and returns once the bytes are
// in device memory: a copy from pageable host memory returns as soon as
// the host's bytes are staged, so Write waits for it, and what comes
// after (a message to another process that reads them, say) sees them.
func (b *Buffer) Write(src []byte, off int64) error {
	if err := b.check(off, int64(len(src))); err != nil || len(src) == 0 {
		return err
	}
	e, err := b.exec()
	if err != nil {
		return err
	}
	return e.Do(func() error {
		if err := b.rt.drv.MemcpyHtoD(b.ptr+DevicePtr(off), src); err != nil {
			return err
		}
		return b.rt.drv.Synchronize()
	})
}

// CopyFrom copies n bytes from another GPU buffer, starting at srcOff,
// device to device (tensor.DeviceCopier). The copy runs in order after
// the work queued on b's device, and both buffers count it as their
// queued work (see Release). From another device it is waited for: the
// source's queued work first, and the copy before CopyFrom returns,
// since the two devices' streams are not ordered with each other and the
// source's Release waits only for its own device.
func (b *Buffer) CopyFrom(src tensor.Buffer, srcOff, n int64) (bool, error) {
	s, ok := src.(*Buffer)
	if !ok || s.rt != b.rt {
		return false, nil
	}
	if err := s.check(srcOff, n); err != nil {
		return false, err
	}
	if err := b.check(0, n); err != nil {
		return false, err
	}
	peer := s.dev != b.dev
	if peer {
		if err := s.Sync(); err != nil {
			return false, err
		}
		// b's device must reach s's memory; else the copy goes
		// through the host (tensor's copy, when this one says no).
		if ok, err := b.rt.drv.CanAccessPeer(b.dev, s.dev); err != nil || !ok {
			return false, err
		}
	}
	e, err := b.exec()
	if err != nil {
		return false, err
	}
	b.queued.Add(1)
	s.queued.Add(1)
	return true, e.Do(func() error {
		if err := b.rt.drv.MemcpyDtoD(b.ptr, s.ptr+DevicePtr(srcOff), n); err != nil || !peer {
			return err
		}
		return b.rt.drv.Synchronize()
	})
}

// CopyIn copies n bytes from device address src to the start of b and
// returns once the copy is done, so that src may be freed at once. src is
// memory of b's device that this process got by other means: another
// library's allocation, handed over through DLPack, say. The n bytes must
// lie within memory the driver knows of: one allocation, or mappings that
// follow each other without a gap (the chunks of an expandable segment of
// PyTorch's, which the driver reports one by one); anything else is an
// error, and nothing is copied.
func (b *Buffer) CopyIn(src DevicePtr, n int64) error {
	if err := b.check(0, n); err != nil || n == 0 {
		return err
	}
	e, err := b.exec()
	if err != nil {
		return err
	}
	return e.Do(func() error {
		if err := b.rt.covered(src, n, b.dev); err != nil {
			return err
		}
		if err := b.rt.drv.MemcpyDtoD(b.ptr, src, n); err != nil {
			return err
		}
		return b.rt.drv.Synchronize()
	})
}

// covered checks that [src, src+n) is device memory the driver knows of,
// range after range: for memory of the virtual memory calls, it reports
// only the mapping that holds an address.
func (r *Runtime) covered(src DevicePtr, n int64, dev int) error {
	end := uint64(src) + uint64(n)
	for at := src; uint64(at) < end; {
		base, size, err := r.drv.MemGetAddressRange(at)
		switch {
		case err != nil && at == src:
			return fmt.Errorf("cuda: copying from %#x on gpu:%d: %w", uint64(src), dev, err)
		case err != nil || base > at || size <= 0:
			return fmt.Errorf("cuda: copying %d bytes from %#x on gpu:%d: the memory there ends at %#x", n, uint64(src), dev, uint64(at))
		}
		at = base + DevicePtr(size)
	}
	return nil
}

// Sync returns once the work tensormp queued on b's device so far (its
// zeroing, copies into it) is done. Code that uses b's memory on streams
// of its own calls it first; a buffer received from another process has
// waited for its producer's work already.
func (b *Buffer) Sync() error {
	if b.freed.Load() {
		return errors.New("cuda: buffer freed")
	}
	e, err := b.exec()
	if err != nil {
		return err
	}
	q := b.queued.Load() // queued before the wait, so done after it
	if err := e.Do(b.rt.drv.Synchronize); err != nil {
		return err
	}
	raise(&b.waited, q)
	return nil
}

// raise sets v to n unless it holds more already.
func raise(v *atomic.Uint64, n uint64) {
	for w := v.Load(); w < n; w = v.Load() {
		if v.CompareAndSwap(w, n) {
			return
		}
	}
}

// SyncAll returns once every stream of b's device's context, another
// library's included, has done the work queued on it so far: what
// another library gives back through DLPack is released after it.
func (b *Buffer) SyncAll() error {
	if b.freed.Load() {
		return errors.New("cuda: buffer freed")
	}
	e, err := b.exec()
	if err != nil {
		return err
	}
	return e.Do(b.rt.drv.CtxSynchronize)
}

// Release gives the memory back, once. An allocation that other processes
// still use waits in the limbo until they let go; an opened one is
// closed when no storage of this process uses it. A block of a slab is
// given back once the work this process queued on it is done: its next
// user, in any process, must find only its own bytes there.
func (b *Buffer) Release() error {
	if !b.freed.CompareAndSwap(false, true) || b.size == 0 && b.from == nil {
		return nil
	}
	if b.block != nil {
		var err error
		if b.queued.Load() != b.waited.Load() {
			if e, xerr := b.exec(); xerr != nil {
				err = xerr
			} else {
				err = e.Do(b.rt.drv.Synchronize)
			}
		}
		switch {
		case errors.Is(err, ErrStopped):
			err = nil // a closed runtime's work was waited for by its Close
		case err != nil:
			err = fmt.Errorf("cuda: waiting for the work on a block of gpu:%d before giving it back: %w", b.dev, err)
		}
		return errors.Join(err, b.block.Release())
	}
	if b.from != nil {
		return b.rt.closeOpened(b)
	}
	if b.export != nil && b.export.token.Busy() {
		b.rt.mu.Lock()
		b.rt.limbo = append(b.rt.limbo, b)
		b.rt.mu.Unlock()
		b.rt.CollectLimbo()
		return nil
	}
	err := b.rt.release(b)
	b.rt.CollectLimbo()
	return err
}

// release frees an allocation made here for good: its memory, its event
// and the producer's reference on its token.
func (r *Runtime) release(b *Buffer) error {
	e, err := b.exec()
	if err != nil {
		return err
	}
	err = e.Do(func() error {
		// cuMemFree waits for the device's work in practice, but does
		// not promise to: tensormp's own work on the allocation, all on
		// the default stream, is waited for first. (Another library's,
		// on memory it was handed through DLPack, was waited for when it
		// gave the memory back.)
		if err := r.drv.Synchronize(); err != nil {
			return err
		}
		errs := []error{r.drv.MemFree(b.base)}
		if b.export != nil {
			errs = append(errs, r.drv.EventDestroy(b.export.event))
		}
		return errors.Join(errs...)
	})
	if b.export != nil {
		r.mu.Lock()
		delete(r.exported, b.export.mem)
		r.mu.Unlock()
		err = errors.Join(err, b.export.token.Release())
	}
	return err
}

// CollectLimbo frees the allocations in the limbo that no other process
// holds any more. Release calls it; a program may call it at any time.
func (r *Runtime) CollectLimbo() {
	r.mu.Lock()
	var ready []*Buffer
	kept := r.limbo[:0]
	for _, b := range r.limbo {
		if !b.export.token.Busy() {
			ready = append(ready, b)
		} else {
			kept = append(kept, b)
		}
	}
	clear(r.limbo[len(kept):])
	r.limbo = kept
	r.mu.Unlock()
	for _, b := range ready {
		_ = r.release(b)
	}
}

// MemInfo returns the free and total bytes of device dev's memory, as the
// driver counts them for every process.
func (r *Runtime) MemInfo(dev int) (free, total int64, err error) {
	e, err := r.execs.Get(dev)
	if err != nil {
		return 0, 0, err
	}
	err = e.Do(func() error {
		var err error
		free, total, err = r.drv.MemGetInfo()
		return err
	})
	return free, total, err
}

// Limbo returns how many freed allocations wait for other processes.
func (r *Runtime) Limbo() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.limbo)
}

package cuda

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/shm"
)

// Device slabs: GPU memory that travels as file descriptors.
//
// Where the driver can export an allocation as a POSIX file descriptor
// (FDExportSupported), a device's buffers are blocks of pooled slabs, as
// shared CPU memory is: an extent pool of internal/shm (see
// shm.NewExtentPool) whose slabs' data are device allocations made
// with MemCreate, many small buffers to a slab and a large one in a slab
// of its own, a released block reused once no process holds it. Each
// slab's segment, a small sealed memfd, holds its slot table and names
// it; the kernel counts who holds each block, by the locks on it, as for
// a CPU block.
//
// A message that carries a buffer carries its block's ticket (the slab's
// segment) and the slab's exported descriptor, in the same sendmsg. A
// receiver imports and maps each slab once, the first time a message
// names it, and keeps the descriptor so that it can send the slab on; a
// message naming a slab it maps costs no driver call. The allocation
// lives while any process holds a handle, a mapping or a descriptor of
// it: a producer may exit, killed or not, before its message is taken,
// and the memory goes with the last process, or message, to let it go.
//
// Before a buffer is described to another process, the work queued on
// its device so far is waited for (share): the receiver has nothing to
// wait for, and no interprocess event, whose files the driver keeps in
// /dev/shm, is needed.

// EnvDeviceCache names the environment variable that bounds, in bytes,
// the unused device memory a process keeps per device for reuse. The
// default is 256 MiB.
const EnvDeviceCache = "TENSORMP_GPU_CACHE"

// EnvLegacy names the environment variable that makes devices share
// their buffers by legacy CUDA IPC even where they could export
// descriptors: the path older drivers and some virtualised GPUs take, run
// on hardware that has both. "1" means every device; a comma-separated
// list of places ("gpu:1,gpu:3") means those of this process.
const EnvLegacy = "TENSORMP_GPU_LEGACY"

// forcedLegacy reports whether EnvLegacy names device dev.
func forcedLegacy(dev int) bool {
	v := os.Getenv(EnvLegacy)
	if v == "1" {
		return true
	}
	for _, p := range strings.Split(v, ",") {
		if strings.TrimSpace(p) == "gpu:"+strconv.Itoa(dev) {
			return true
		}
	}
	return false
}

// deviceCache is what a device's pool keeps of unused slabs.
var deviceCache = func() int64 {
	if v, err := strconv.ParseInt(os.Getenv(EnvDeviceCache), 10, 64); err == nil && v >= 0 {
		return v
	}
	return 256 << 20
}()

// slab is one device allocation in this process: a pool's, which it made
// and exported, or a received one, imported and mapped. It is the
// extent of its slab's segment (see shm.NewExtentPool).
type slab struct {
	rt   *Runtime
	exec *executor // its device's, pinned for the slab's life
	dev  int
	h    memHandle
	fd   int       // the allocation's descriptor: exported here, or the message's
	ptr  DevicePtr // where it is mapped
	size int64     // the bytes mapped: the allocation's, a multiple of the granularity
	once sync.Once
}

// Close unmaps the slab and lets go of its handle and descriptor, on its
// device's executor, which keeps the device's context for it even after
// the Runtime's Close (see executor.pin). It first waits for every stream
// of the context: the driver's unmap does not wait for work queued on the
// memory, and such work would fault the context, another library's
// (PyTorch's) included, for good.
func (s *slab) Close() error {
	var err error
	s.once.Do(func() {
		err = s.exec.teardown(func() error {
			// A failed wait is a broken context (Error.Sticky), whose
			// work will never run: the unmap and release are tried all
			// the same (a broken context may refuse them; the memory
			// then goes with the process), and the descriptor closed.
			err := s.rt.drv.CtxSynchronize()
			if err != nil {
				err = fmt.Errorf("cuda: waiting for the work on a slab of gpu:%d before unmapping it: %w", s.dev, err)
			}
			return errors.Join(err, s.rt.drv.MemUnmap(s.ptr, s.size), s.rt.drv.MemAddressFree(s.ptr, s.size), s.rt.drv.MemRelease(s.h))
		})
		err = errors.Join(err, unix.Close(s.fd))
	})
	return err
}

// slabDevice returns device dev's executor and the size its allocations
// and mappings are multiples of.
func (r *Runtime) slabDevice(dev int) (*executor, int64, error) {
	e, err := r.execs.Get(dev)
	if err != nil {
		return nil, 0, err
	}
	var g int64
	err = e.Do(func() error {
		var err error
		g, err = r.drv.MemGranularity(dev)
		return err
	})
	if err != nil {
		return nil, 0, fmt.Errorf("cuda: the allocation granularity of gpu:%d: %w", dev, err)
	}
	return e, g, nil
}

// accessors returns the devices that may touch memory of device dev: dev
// and every device that can access its memory as a peer. A mapping of
// the virtual memory calls is reachable only by the devices its access
// list names (peer access enabled on a context does not count), so a
// copy to another device (To), or another library's kernel on a peer,
// needs them all.
func (r *Runtime) accessors(dev int) ([]int, error) {
	n, err := r.drv.DeviceCount()
	if err != nil {
		return nil, err
	}
	devs := []int{dev}
	for peer := range n {
		if peer == dev {
			continue
		}
		ok, err := r.drv.CanAccessPeer(peer, dev)
		if err != nil {
			return nil, fmt.Errorf("cuda: can gpu:%d access gpu:%d: %w", peer, dev, err)
		}
		if ok {
			devs = append(devs, peer)
		}
	}
	return devs, nil
}

// roundUp rounds n up to a multiple of g.
func roundUp(n, g int64) int64 { return (n + g - 1) / g * g }

// mapSlab maps allocation h of size bytes on the device of e, whose
// allocations are multiples of g, for that device and its peers, and
// returns the slab, which owns h and fd from then on (and closes them if
// it fails).
func (r *Runtime) mapSlab(e *executor, h memHandle, fd int, size, g int64) (*slab, error) {
	s := &slab{rt: r, exec: e, dev: e.Device(), h: h, fd: fd, size: size}
	devs, err := r.accessors(s.dev)
	if err == nil {
		err = e.pin()
	}
	if err == nil {
		err = e.Do(func() error {
			p, err := r.drv.MemAddressReserve(size, g)
			if err != nil {
				return err
			}
			if err := r.drv.MemMap(p, size, h); err != nil {
				_ = r.drv.MemAddressFree(p, size)
				return err
			}
			if err := r.drv.MemSetAccess(p, size, devs); err != nil {
				_ = r.drv.MemUnmap(p, size)
				_ = r.drv.MemAddressFree(p, size)
				return err
			}
			s.ptr = p
			return nil
		})
		if err != nil {
			e.unpin()
		}
	}
	if err != nil {
		_ = e.Do(func() error { return r.drv.MemRelease(h) })
		_ = unix.Close(fd)
		return nil, err
	}
	return s, nil
}

// newSlab makes a slab of at least n bytes on device dev: the extent of a
// new segment of dev's pool.
func (r *Runtime) newSlab(dev int, n int64) (io.Closer, error) {
	e, g, err := r.slabDevice(dev)
	if err != nil {
		return nil, err
	}
	size := roundUp(n, g)
	var h memHandle
	fd := -1
	err = e.Do(func() error {
		var err error
		if h, err = r.drv.MemCreate(dev, size); err != nil {
			return err
		}
		if fd, err = r.drv.MemExportFD(h); err != nil {
			_ = r.drv.MemRelease(h)
			return err
		}
		// The driver does not promise close-on-exec: without it every
		// worker spawned later would inherit the descriptor and pin the
		// slab's memory for its whole life.
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, unix.FD_CLOEXEC); err != nil {
			_ = unix.Close(fd)
			_ = r.drv.MemRelease(h)
			return fmt.Errorf("cuda: marking a slab's descriptor close-on-exec: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: making a slab of %d bytes on gpu:%d: %w", size, dev, err)
	}
	return r.mapSlab(e, h, fd, size, g)
}

// pool returns device dev's pool of slabs, or nil when the device cannot
// export allocations as descriptors (then buffers are allocated one by
// one and travel by legacy CUDA IPC).
func (r *Runtime) pool(dev int) (*shm.Pool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p, ok := r.pools[dev]; ok {
		return p, nil
	}
	ok, err := r.drv.FDExportSupported(dev)
	if err != nil {
		return nil, fmt.Errorf("cuda: asking gpu:%d whether it exports descriptors: %w", dev, err)
	}
	if r.legacy || forcedLegacy(dev) {
		ok = false
	}
	var p *shm.Pool
	if ok {
		p = shm.NewExtentPool(deviceCache, func(n int64) (io.Closer, error) { return r.newSlab(dev, n) })
	}
	r.pools[dev] = p
	return p, nil
}

// FDShared reports whether buffers on device dev are slabs that travel
// as descriptors (else by legacy CUDA IPC).
func (r *Runtime) FDShared(dev int) (bool, error) {
	p, err := r.pool(dev)
	return p != nil, err
}

// allocBlock returns n bytes in a block of device dev's pool p.
func (r *Runtime) allocBlock(p *shm.Pool, dev int, n int64) (*Buffer, error) {
	blk, err := p.Alloc(n)
	if err != nil {
		return nil, fmt.Errorf("cuda: allocating %d bytes on gpu:%d: %w", n, dev, err)
	}
	s := blk.Extent().(*slab)
	return &Buffer{rt: r, dev: dev, ptr: s.ptr + DevicePtr(blk.Offset()), size: n, block: blk}, nil
}

// share describes b, a buffer in a device slab, to another process, once
// the work queued on its device so far is done. ok is false for a buffer
// that is not in a slab (see FDShared): it travels by exportIPC.
func (b *Buffer) share() (sh gpushare.Slab, ok bool, err error) {
	if b.block == nil {
		return gpushare.Slab{}, false, nil
	}
	if b.freed.Load() {
		return gpushare.Slab{}, true, errors.New("cuda: sharing a freed buffer")
	}
	e, err := b.exec()
	if err != nil {
		return gpushare.Slab{}, true, err
	}
	if err := e.Do(b.rt.drv.Synchronize); err != nil {
		return gpushare.Slab{}, true, fmt.Errorf("cuda: waiting for the work on gpu:%d before sending: %w", b.dev, err)
	}
	s, _ := b.block.Extent().(*slab)
	if s == nil {
		return gpushare.Slab{}, true, errors.New("cuda: a buffer whose slab is gone")
	}
	return gpushare.Slab{Device: b.dev, Block: b.block, MemFD: s.fd}, true, nil
}

// importBlock returns the buffer of size bytes that blk, a block of a
// device slab this process received (attached from the message's
// ticket), holds on device dev; the buffer takes blk over, and its Release
// releases it. The first block of a slab imports and maps the slab from
// memFD, the message's descriptor of it, which stays the caller's; the
// others find it mapped, and memFD must then be of the same allocation
// (sameDescription), or -1, for a block a lane named by the slab's
// identity alone. A descriptor that is no allocation of dev's, or one
// smaller than the slab's table says, is an error, and nothing is mapped;
// so is a block of a slab not mapped yet with no descriptor.
func (r *Runtime) importBlock(dev int, blk *shm.Block, size int64, fd int) (*Buffer, error) {
	if !blk.InExtent() {
		return nil, fmt.Errorf("cuda: importing a block of gpu:%d: %w", dev, shm.ErrNoExtent)
	}
	if size <= 0 || size > blk.Size() {
		return nil, fmt.Errorf("cuda: importing %d bytes of a block of %d", size, blk.Size())
	}
	s, _ := blk.Extent().(*slab)
	switch {
	case s != nil && fd < 0: // named by a lane, in a slab mapped already
	case s != nil:
		if err := s.describedBy(fd); err != nil {
			return nil, err
		}
	case fd < 0:
		return nil, fmt.Errorf("cuda: a block of gpu:%d named without the slab's descriptor, in a slab not mapped here: %w", dev, shm.ErrNotMapped)
	default:
		var err error
		if s, err = r.importSlab(dev, fd, blk.ExtentSize()); err != nil {
			return nil, err
		}
		x, err := blk.SetExtent(s)
		if err != nil {
			_ = s.Close()
			return nil, err
		}
		if x != io.Closer(s) {
			_ = s.Close() // another goroutine mapped it first
		}
		s, _ = x.(*slab)
	}
	if s == nil || s.dev != dev {
		return nil, fmt.Errorf("cuda: a block of gpu:%d in a slab mapped for another device", dev)
	}
	return &Buffer{rt: r, dev: dev, ptr: s.ptr + DevicePtr(blk.Offset()), size: size, block: blk, received: true}, nil
}

// describedBy checks that fd, a message's descriptor of the slab, is of
// this slab's allocation (see sameDescription).
func (s *slab) describedBy(fd int) error {
	if err := sameDescription(s.fd, fd); err != nil {
		return fmt.Errorf("cuda: a block of a slab of gpu:%d: %w", s.dev, err)
	}
	return nil
}

// importSlab imports and maps the allocation fd describes, which must be
// one of device dev's, of at least n bytes.
func (r *Runtime) importSlab(dev int, fd int, n int64) (*slab, error) {
	e, g, err := r.slabDevice(dev)
	if err != nil {
		return nil, err
	}
	own, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("cuda: keeping a slab's descriptor: %w", err)
	}
	var h memHandle
	err = e.Do(func() error {
		var err error
		if h, err = r.drv.MemImportFD(own); err != nil {
			return err
		}
		d, err := r.drv.MemDevice(h)
		if err == nil && d != dev {
			err = fmt.Errorf("an allocation of device %d, not of gpu:%d", d, dev)
		}
		if err != nil {
			_ = r.drv.MemRelease(h)
		}
		return err
	})
	if err != nil {
		_ = unix.Close(own)
		return nil, fmt.Errorf("cuda: importing a slab of gpu:%d: %w", dev, err)
	}
	s, err := r.mapSlab(e, h, own, roundUp(n, g), g)
	if err != nil {
		return nil, fmt.Errorf("cuda: mapping a slab of %d bytes on gpu:%d: %w", roundUp(n, g), dev, err)
	}
	return s, nil
}

// InUse returns how many blocks of device dev's slabs are in use: held by
// a buffer of this process, or by another process or a message in flight
// after this process let go of them. It is 0 for a device without slabs.
func (r *Runtime) InUse(dev int) int {
	r.mu.Lock()
	p := r.pools[dev]
	r.mu.Unlock()
	if p == nil {
		return 0
	}
	return p.InUse()
}

// trimSlabs closes the unused slabs every device's pool keeps for reuse.
func (r *Runtime) trimSlabs() {
	r.mu.Lock()
	pools := make([]*shm.Pool, 0, len(r.pools))
	for _, p := range r.pools {
		if p != nil {
			pools = append(pools, p)
		}
	}
	r.mu.Unlock()
	for _, p := range pools {
		p.Trim(0)
	}
}

//go:build cgo && linux

package cuda

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// deviceFacts asks the driver, of device dev, what its documentation
// leaves open and tensormp relies on, one line each: whether an exported
// descriptor is close-on-exec and what it is a descriptor of, whether a
// process may import its own export, the properties an imported handle
// reports, what cuMemGetAddressRange says of a host pointer, what the
// calls of the send and allocation paths cost, whether an unmap works
// once the last context reference is gone, and what unmapping memory that
// queued work still writes does to the context. The last one can leave
// the device's context broken for good in this process: run it in a
// process of its own.
func deviceFacts(drv driver, dev int) (lines []string, err error) {
	say := func(format string, args ...any) { lines = append(lines, fmt.Sprintf(format, args...)) }
	e, err := newExecutor(drv, dev)
	if err != nil {
		return nil, err
	}
	stopped := false
	defer func() {
		if !stopped {
			e.Stop()
		}
	}()
	var g int64
	var p DevicePtr
	err = e.Do(func() error {
		var err error
		if g, err = drv.MemGranularity(dev); err != nil {
			return err
		}
		say("granularity: %d bytes", g)
		t0 := time.Now()
		h, err := drv.MemCreate(dev, g)
		if err != nil {
			return err
		}
		fd, err := drv.MemExportFD(h)
		say("cuMemCreate + export of %d bytes: %v", g, time.Since(t0))
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		say("exported descriptor close-on-exec: %v (F_GETFD %d, %v)", err == nil && flags&unix.FD_CLOEXEC != 0, flags, err)
		target, _ := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
		var st unix.Stat_t
		_ = unix.Fstat(fd, &st)
		say("exported descriptor: %s, inode %d", target, st.Ino)

		imported, err := drv.MemImportFD(fd)
		say("importing one's own export: %s", errText(err))
		if err == nil {
			typ, handleTypes, locType, locID, err := memProperties(imported)
			say("imported handle's properties: type %d, requestedHandleTypes %d, location type %d id %d (%s)", typ, handleTypes, locType, locID, errText(err))
			_ = drv.MemRelease(imported)
		}
		var host [64]byte
		_, _, err = drv.MemGetAddressRange(DevicePtr(uintptr(unsafe.Pointer(&host[0]))))
		say("cuMemGetAddressRange of a host pointer: %s", errText(err))

		if p, err = drv.MemAddressReserve(g, g); err != nil {
			return err
		}
		if err := drv.MemMap(p, g, h); err != nil {
			return err
		}
		if err := drv.MemSetAccess(p, g, []int{dev}); err != nil {
			return err
		}
		say("cost, median of 1000: %s", costs(drv, p))
		return drv.MemRelease(h) // the mapping keeps the memory
	})
	if err != nil {
		return lines, err
	}

	// The executor's reference is the only one this process holds:
	// Stop destroys the context, and the mapping is let go of without,
	// on a thread with no context current.
	e.Stop()
	stopped = true
	runtime.LockOSThread()
	_ = drv.SetCurrent(0)
	say("cuMemUnmap after the last context reference is released: %s", errText(drv.MemUnmap(p, g)))
	say("cuMemAddressFree then: %s", errText(drv.MemAddressFree(p, g)))
	runtime.UnlockOSThread()

	say("unmapping memory that a queued memset writes: %s", unmapUnderWork(drv, dev))
	return lines, nil
}

// costs times the driver calls of the send and allocation paths on the
// mapping at p: an idle cuStreamSynchronize, cuCtxSetCurrent, and a 4 KiB
// memset waited for.
func costs(drv driver, p DevicePtr) string {
	ctx, _ := drv.Current()
	median := func(fn func()) time.Duration {
		ds := make([]time.Duration, 1000)
		for i := range ds {
			t0 := time.Now()
			fn()
			ds[i] = time.Since(t0)
		}
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	sync := median(func() { _ = drv.Synchronize() })
	set := median(func() { _ = drv.SetCurrent(ctx) })
	memset := median(func() { _ = drv.MemsetD8(p, 4096); _ = drv.Synchronize() })
	return fmt.Sprintf("idle cuStreamSynchronize %v, cuCtxSetCurrent %v, 4 KiB cuMemsetD8 + sync %v", sync, set, memset)
}

// unmapUnderWork maps 256 MiB, queues a memset of it, unmaps it at once,
// and says what the context's next synchronisation returns.
func unmapUnderWork(drv driver, dev int) string {
	e, err := newExecutor(drv, dev)
	if err != nil {
		return errText(err)
	}
	defer e.Stop()
	var out string
	err = e.Do(func() error {
		const n = 256 << 20
		h, err := drv.MemCreate(dev, n)
		if err != nil {
			return err
		}
		p, err := drv.MemAddressReserve(n, n)
		if err != nil {
			return errors.Join(err, drv.MemRelease(h))
		}
		if err := drv.MemMap(p, n, h); err != nil {
			return errors.Join(err, drv.MemAddressFree(p, n), drv.MemRelease(h))
		}
		if err := drv.MemSetAccess(p, n, []int{dev}); err != nil {
			return err
		}
		if err := drv.MemsetD8(p, n); err != nil {
			return err
		}
		unmap := drv.MemUnmap(p, n)
		sync := drv.CtxSynchronize()
		out = fmt.Sprintf("the unmap %s; the next cuCtxSynchronize %s", errText(unmap), errText(sync))
		return errors.Join(drv.MemAddressFree(p, n), drv.MemRelease(h))
	})
	if err != nil {
		out += " (then " + err.Error() + ")"
	}
	return out
}

func errText(err error) string {
	if err == nil {
		return "works"
	}
	return "fails: " + err.Error()
}

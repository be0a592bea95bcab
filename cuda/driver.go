package cuda

import (
	"errors"
	"fmt"
	"sync"
)

// ErrNoDriver is returned when no CUDA driver can be used: the program was
// built without cgo, libcuda.so.1 is not installed, or it reports no
// device.
var ErrNoDriver = errors.New("cuda: no CUDA driver available")

// Error is a failed driver call.
type Error struct {
	Call string // the driver function, "cuMemAlloc_v2"
	Code int    // its CUresult
	Name string // "CUDA_ERROR_OUT_OF_MEMORY"
	Msg  string // the driver's description
}

func (e *Error) Error() string {
	s := fmt.Sprintf("cuda: %s: %s (%d): %s", e.Call, e.Name, e.Code, e.Msg)
	if e.Sticky() {
		s += " (the context is broken for good: every later call of this process on the device fails)"
	}
	return s
}

// Sticky reports whether the error broke the device's context for good,
// as a fault on the device does: every later call in the context, another
// library's included, returns it, and only a new process can use the
// device again.
func (e *Error) Sticky() bool {
	switch e.Code {
	case 214, 700, 702, 710, 714, 715, 716, 717, 718, 719:
		// ECC_UNCORRECTABLE, ILLEGAL_ADDRESS, LAUNCH_TIMEOUT, ASSERT,
		// HARDWARE_STACK_ERROR, ILLEGAL_INSTRUCTION, MISALIGNED_ADDRESS,
		// INVALID_ADDRESS_SPACE, INVALID_PC, LAUNCH_FAILED (UNKNOWN, 999,
		// may be either, so it is not counted)
		return true
	}
	return false
}

// DevicePtr is an address in a device's memory.
type DevicePtr uint64

// cuContext is a driver context (CUcontext).
type cuContext uintptr

// cuEvent is a driver event (CUevent).
type cuEvent uintptr

// ipcMemHandle names a device allocation to other processes.
type ipcMemHandle [64]byte

// ipcEventHandle names an interprocess event to other processes.
type ipcEventHandle [64]byte

// driver is the part of the CUDA driver API tensormp uses: libcuda.so.1,
// opened at run time (libcuda). Tests run it on a stand-in library under
// the same binding (internal/cudastub), not on a Go double. Calls that
// act on "the current context" must be made on a thread where the
// device's context is current: inside an executor's Do.
type driver interface {
	DeviceCount() (int, error)
	RetainPrimaryContext(dev int) (cuContext, error)
	ReleasePrimaryContext(dev int) error
	// Current returns the context current on the calling thread, or 0.
	Current() (cuContext, error)
	// SetCurrent makes ctx current on the calling thread; 0 makes none.
	SetCurrent(ctx cuContext) error

	MemAlloc(n int64) (DevicePtr, error)
	MemFree(p DevicePtr) error
	MemsetD8(p DevicePtr, n int64) error // zeroes n bytes
	MemcpyHtoD(dst DevicePtr, src []byte) error
	MemcpyDtoH(dst []byte, src DevicePtr) error
	MemcpyDtoD(dst, src DevicePtr, n int64) error
	// MemGetAddressRange returns the allocation that contains p.
	MemGetAddressRange(p DevicePtr) (base DevicePtr, size int64, err error)
	// Synchronize waits for the work queued on the current context's
	// default stream: every copy and memset above queues there (a copy
	// from pageable host memory returns once the host's bytes are
	// staged, before they land).
	Synchronize() error
	// CtxSynchronize waits for the work queued on every stream of the
	// current context, another library's included: memory is unmapped
	// or given back only after it, since the driver's unmap and release
	// do not wait, and a queued kernel that touches unmapped memory
	// faults the context for good.
	CtxSynchronize() error
	// MemGetInfo returns the free and total bytes of the current
	// context's device.
	MemGetInfo() (free, total int64, err error)

	IPCGetMemHandle(p DevicePtr) (ipcMemHandle, error)
	IPCOpenMemHandle(h ipcMemHandle) (DevicePtr, error)
	IPCCloseMemHandle(p DevicePtr) error

	EventCreateInterprocess() (cuEvent, error)
	EventRecord(e cuEvent) error
	EventSynchronize(e cuEvent) error
	EventDestroy(e cuEvent) error
	IPCGetEventHandle(e cuEvent) (ipcEventHandle, error)
	IPCOpenEventHandle(h ipcEventHandle) (cuEvent, error)

	// DeviceUUID returns device dev's UUID: ordinals are per process
	// (CUDA_VISIBLE_DEVICES), the UUID names the device everywhere.
	DeviceUUID(dev int) ([16]byte, error)
	// CanAccessPeer reports whether device dev can access peer's memory.
	CanAccessPeer(dev, peer int) (bool, error)
	// ComputeMode returns device dev's compute mode (CU_COMPUTEMODE_*:
	// 0 default, 2 prohibited, 3 exclusive-process).
	ComputeMode(dev int) (int, error)

	// The virtual memory calls, for allocations that travel between
	// processes as POSIX file descriptors. Each is made with a context
	// of the device current, inside an executor's Do.

	// FDExportSupported reports whether allocations on dev can be
	// exported as file descriptors: the driver has the calls, and the
	// device says CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED.
	FDExportSupported(dev int) (bool, error)
	// MemGranularity returns the size every allocation on dev, and every
	// mapping of one, is a multiple of.
	MemGranularity(dev int) (int64, error)
	// MemCreate makes an allocation of size bytes on dev, exportable as
	// a file descriptor. Its memory is not cleared.
	MemCreate(dev int, size int64) (memHandle, error)
	// MemRelease lets go of a handle; the memory lives on while a
	// mapping of it or an exported descriptor does, in any process.
	MemRelease(h memHandle) error
	// MemExportFD returns a new descriptor of the allocation, the
	// caller's to close.
	MemExportFD(h memHandle) (int, error)
	// MemImportFD returns a handle of the allocation fd describes; fd
	// stays the caller's. A descriptor of anything else is an error.
	MemImportFD(fd int) (memHandle, error)
	// MemDevice returns the device an allocation lives on, or -1 for
	// memory that is no device's.
	MemDevice(h memHandle) (dev int, err error)
	// MemAddressReserve reserves size bytes of device address space,
	// aligned to align.
	MemAddressReserve(size, align int64) (DevicePtr, error)
	MemAddressFree(p DevicePtr, size int64) error
	// MemMap maps the first size bytes of the allocation at p, which
	// must lie in a reservation; more than the allocation holds is an
	// error.
	MemMap(p DevicePtr, size int64, h memHandle) error
	MemUnmap(p DevicePtr, size int64) error
	// MemSetAccess lets each of devs read and write the mapping at p;
	// no other device may touch it.
	MemSetAccess(p DevicePtr, size int64, devs []int) error
}

// memHandle is an allocation made with the virtual memory calls
// (CUmemGenericAllocationHandle).
type memHandle uint64

var (
	driverMu   sync.Mutex
	procDriver driver
	driverErr  error
	opened     bool
)

// load returns the process's driver, opening libcuda.so.1 the first time.
// Without one it returns ErrNoDriver (wrapped with the reason).
func load() (driver, error) {
	driverMu.Lock()
	defer driverMu.Unlock()
	if !opened {
		procDriver, driverErr = openLibcuda()
		opened = true
	}
	return procDriver, driverErr
}

// Available reports whether a driver with at least one device is usable.
func Available() bool {
	d, err := load()
	if err != nil {
		return false
	}
	n, err := d.DeviceCount()
	return err == nil && n > 0
}

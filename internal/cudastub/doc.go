// Package cudastub is a stand-in for NVIDIA's CUDA driver library,
// libcuda.so.1, that runs on machines without a GPU. It is a C library
// (embedded here, built by Dir) exporting the driver calls tensormp uses,
// with cuda.h's signatures, so that tests exercise the real cgo binding
// of package cuda, dlopen and dlsym included. Enter makes a test binary
// run on it.
//
// It is at least as strict as the real driver wherever a test could
// tell, so that bugs a GPU would expose fail in CI:
//
//   - a context has two streams: the legacy default stream, which the
//     driver calls queue on, and a non-blocking stream of another
//     library's (SideMemset), as PyTorch's are: cuStreamSynchronize(0)
//     and copies to the host wait for the first only, cuCtxSynchronize
//     for both;
//   - memset, copies from pageable host memory, device-to-device copies
//     and event records are queued per context and land later, in order:
//     Config's Delay after they were queued, and no sooner than their
//     length (10 bytes a nanosecond) after the one before landed, so that
//     big work is under way a while; only a synchronization, a
//     copy to the host (which waits for its own context only) or an
//     event waits for them;
//   - unmapping or freeing memory that queued work still touches
//     succeeds, drops that work and gives its context the sticky error
//     CUDA_ERROR_ILLEGAL_ADDRESS (700), which every later call needing the
//     context returns until it is destroyed; so does touching memory the
//     current device was given no access to with cuMemSetAccess;
//   - every call that acts on the current context, the virtual memory
//     calls included, fails with CUDA_ERROR_INVALID_CONTEXT (201) on a
//     thread with none, or once it was destroyed; destroying a context
//     waits for its work and frees what it owns (cuMemAlloc memory, IPC
//     opens, events), but not VMM handles or mappings;
//   - ordinals are per process (CUDA_VISIBLE_DEVICES, by index or UUID
//     prefix); handles, descriptors and tables name physical devices;
//   - legacy IPC handles open only in another process and only while
//     their exporter lives; interprocess events are shared through the
//     state directory, and the driver's /dev/shm/cuda.shm.0.<pid>.1 file
//     comes and goes as the real one does;
//   - exported VMM descriptors are all opens of one file per device (as
//     every real one is an open of /dev/nvidiactl), lack FD_CLOEXEC, and
//     keep their memory alive after the exporter is gone; an imported
//     handle reports no requested handle types;
//   - device memory is never host-accessible: every device pointer is a
//     PROT_NONE mapping, so host code that dereferences one crashes;
//   - only the device attributes it models (20, 102, 103) may be asked.
//
// Device memory lives in the state directory, one sparse file per
// physical device with a table of allocations beside it. A process holds
// an allocation by an open-file-description lock on its range (its own
// state descriptor, or an exported descriptor) or by a mapping, so the
// kernel lets go of a killed process's memory as a GPU driver does, and
// Held and cuMemGetInfo count what every process holds.
//
// The stand-in reads these environment variables at cuInit:
//
//	TMSTUB_DIR        the state directory (required; without it cuInit
//	                  returns CUDA_ERROR_NO_DEVICE)
//	TMSTUB_DEVICES    physical devices, default 1
//	TMSTUB_NO_VMM=1   devices without VMM or descriptor export
//	TMSTUB_DELAY_US   microseconds before queued work runs, default 500
//	TMSTUB_MEMORY     bytes per device, default 8 GiB
//	CUDA_VISIBLE_DEVICES, as the real driver reads it
//
// The state directory belongs to the process that called Enter: it makes
// a fresh one, every process of the test run (the re-executed test
// binary and all its children, which inherit TMSTUB_DIR) shares it, and
// Enter removes it when the re-executed binary exits. Nothing else may
// write there.
//
// The introspection functions (Contexts, Allocs and the rest) read this
// process's state through the loaded library; they return -1 in a
// process not on the stand-in (see Active), and the setters panic there.
package cudastub

import "time"

// The environment variables the stand-in reads.
const (
	EnvDir     = "TMSTUB_DIR"
	EnvDevices = "TMSTUB_DEVICES"
	EnvNoVMM   = "TMSTUB_NO_VMM"
	EnvNoPeer  = "TMSTUB_NO_PEER"
	EnvDelayUS = "TMSTUB_DELAY_US"
	EnvMemory  = "TMSTUB_MEMORY"
)

// LibName is the file Dir builds: the real driver's soname.
const LibName = "libcuda.so.1"

// Config is the machine the stand-in plays. Zero values mean defaults.
type Config struct {
	Devices int           // physical GPUs, default 1
	NoVMM   bool          // devices say they cannot export allocations as POSIX fds (attribute 103 reads 0, cuMemCreate with POSIX_FD handle type returns CUDA_ERROR_NOT_SUPPORTED 801), so the legacy IPC path runs
	NoPeer  bool          // no device can reach another's memory (PCIe without peer-to-peer): cuDeviceCanAccessPeer says 0, and cuMemSetAccess refuses to give a device access to another's memory
	Delay   time.Duration // how long after enqueue each asynchronous operation runs, default 500µs
	Memory  int64         // bytes per device, default 8 GiB
	Env     []string      // extra environment for the re-executed process
}

// Defaults.
const (
	DefaultDelay  = 500 * time.Microsecond
	DefaultMemory = int64(8) << 30
)

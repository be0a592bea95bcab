//go:build cgo && linux

package cudastub

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>

static void *tm_lib;

// tm_open loads libcuda.so.1 as package cuda does (the same handle if it
// is loaded already) and keeps it if it is the stand-in.
static int tm_open(void) {
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!h)
		return 0;
	if (!dlsym(h, "tmstub_version")) {
		dlclose(h);
		return 0;
	}
	tm_lib = h;
	return 1;
}

static void *tm_sym(const char *name) { return dlsym(tm_lib, name); }
static long long tm_call_v(void *f) { return ((long long (*)(void))f)(); }
static long long tm_call_i(void *f, int a) { return ((long long (*)(int))f)(a); }
static int tm_call_ll(void *f, long long a) { return ((int (*)(long long))f)(a); }
static int tm_call_ii(void *f, int a, int b) { return ((int (*)(int, int))f)(a, b); }
static int tm_call_fds(void *f, int *out, int max) { return ((int (*)(int *, int))f)(out, max); }
static int tm_call_side(void *f, unsigned long long p, unsigned long long n, int v) { return ((int (*)(unsigned long long, unsigned long long, int))f)(p, n, v); }
*/
import "C"

import (
	"fmt"
	"os"
	"sync"
	"time"
	"unsafe"
)

var loaded = sync.OnceValue(func() bool {
	if os.Getenv(EnvDir) == "" {
		return false
	}
	return C.tm_open() != 0
})

// Active reports whether this process runs on the stand-in: TMSTUB_DIR is
// set and libcuda.so.1 resolves to the stand-in.
func Active() bool { return loaded() }

var (
	symMu sync.Mutex
	syms  = map[string]unsafe.Pointer{}
)

// sym returns the stand-in's function name, or nil if not Active.
func sym(name string) unsafe.Pointer {
	if !Active() {
		return nil
	}
	symMu.Lock()
	defer symMu.Unlock()
	if p, ok := syms[name]; ok {
		return p
	}
	cn := C.CString(name)
	defer C.free(unsafe.Pointer(cn))
	p := C.tm_sym(cn)
	if p == nil {
		panic("cudastub: the loaded stand-in lacks " + name)
	}
	syms[name] = p
	return p
}

func callV(name string) int {
	f := sym(name)
	if f == nil {
		return -1
	}
	return int(C.tm_call_v(f))
}

func callI(name string, a int) int {
	f := sym(name)
	if f == nil {
		return -1
	}
	return int(C.tm_call_i(f, C.int(a)))
}

// Contexts returns the primary-context references this process holds on
// ordinal (as this process numbers devices); -1 if not Active or for an
// ordinal it does not have.
func Contexts(ordinal int) int { return callI("tmstub_contexts", ordinal) }

// Allocs returns the cuMemAlloc allocations not freed; -1 if not Active.
func Allocs() int { return callV("tmstub_allocs") }

// Handles returns the VMM allocation handles (cuMemCreate and
// cuMemImportFromShareableHandle) not released; -1 if not Active.
func Handles() int { return callV("tmstub_handles") }

// Mappings returns the cuMemMap mappings not unmapped; -1 if not Active.
func Mappings() int { return callV("tmstub_mappings") }

// IPCOpened returns the cuIpcOpenMemHandle opens not closed, each open
// counted; -1 if not Active.
func IPCOpened() int { return callV("tmstub_ipc_opened") }

// Events returns the events (created or opened) not destroyed; -1 if not
// Active.
func Events() int { return callV("tmstub_events") }

// Syncs returns how many cuStreamSynchronize and cuCtxSynchronize calls
// were made with a context current; -1 if not Active.
func Syncs() int { return callV("tmstub_syncs") }

// Ops returns how many asynchronous operations (memset, HtoD, DtoD) were
// queued under ordinal's context; -1 if not Active.
func Ops(ordinal int) int { return callI("tmstub_ops", ordinal) }

// Sticky returns the sticky error of ordinal's primary context in this
// process, 0 if none; -1 if not Active.
func Sticky(ordinal int) int { return callI("tmstub_sticky", ordinal) }

// Physical returns the physical device this process's ordinal is; -1 if
// not Active or for an ordinal it does not have.
func Physical(ordinal int) int { return callI("tmstub_physical", ordinal) }

func mustActive(what string) unsafe.Pointer {
	f := sym(what)
	if f == nil {
		panic("cudastub: " + what + " in a process not on the stand-in")
	}
	return f
}

// SetMemory changes the per-device memory size this process believes in,
// for out-of-memory tests. It panics if not Active.
func SetMemory(bytes int64) {
	if C.tm_call_ll(mustActive("tmstub_set_memory"), C.longlong(bytes)) != 0 {
		panic(fmt.Sprintf("cudastub: SetMemory(%d)", bytes))
	}
}

// SetDelay changes how long after enqueue this process's asynchronous
// operations run, from now on. It panics if not Active.
func SetDelay(d time.Duration) {
	if C.tm_call_ll(mustActive("tmstub_set_delay_us"), C.longlong(d.Microseconds())) != 0 {
		panic(fmt.Sprintf("cudastub: SetDelay(%v)", d))
	}
}

// SetComputeMode writes the compute mode of physical device physical
// (0 default, 3 exclusive-process) into the state directory, where every
// process sees it from then on. It panics if not Active or if the
// device does not exist.
func SetComputeMode(physical, mode int) {
	if C.tm_call_ii(mustActive("tmstub_set_compute_mode"), C.int(physical), C.int(mode)) != 0 {
		panic(fmt.Sprintf("cudastub: SetComputeMode(%d, %d)", physical, mode))
	}
}

// OwnFDs returns the descriptors the stand-in keeps for itself in this
// process (its state files, tables and exclusive-mode locks), as the real
// driver keeps /dev/nvidia* open; nil if not Active. A leak check excuses
// exactly these: an exported allocation's descriptor is never among them.
func OwnFDs() []int {
	f := sym("tmstub_own_fds")
	if f == nil {
		return nil
	}
	var buf [64]C.int
	n := int(C.tm_call_fds(f, &buf[0], C.int(len(buf))))
	fds := make([]int, 0, min(n, len(buf)))
	for _, fd := range buf[:min(n, len(buf))] {
		fds = append(fds, int(fd))
	}
	return fds
}

// SideMemset queues a memset of n bytes at device address ptr with v on
// a non-blocking stream of another library's (PyTorch's, say) in the
// context current on the calling thread, which must be locked to it: a
// synchronisation of the default stream does not wait for it, one of the
// context does. It returns the CUresult, 0 for success; -1 if not Active.
func SideMemset(ptr uint64, n int64, v byte) int {
	f := sym("tmstub_side_memset")
	if f == nil {
		return -1
	}
	return int(C.tm_call_side(f, C.ulonglong(ptr), C.ulonglong(n), C.int(v)))
}

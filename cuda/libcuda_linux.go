//go:build cgo && linux

package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef void *CUevent;
typedef void *CUstream;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
	int type;                 // CUmemAllocationType
	int requestedHandleTypes; // CUmemAllocationHandleType
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

enum {
	F_INIT, F_DEVCOUNT, F_DEVGET, F_PCTXRETAIN, F_PCTXRELEASE, F_CTXGET, F_CTXSET,
	F_MALLOC, F_FREE, F_MEMSET, F_HTOD, F_DTOH, F_DTOD, F_ADDRRANGE,
	F_IPCGETMEM, F_IPCOPENMEM, F_IPCCLOSEMEM,
	F_STREAMSYNC, F_EVCREATE, F_EVRECORD, F_EVSYNC, F_EVDESTROY, F_IPCGETEV, F_IPCOPENEV,
	F_ERRNAME, F_ERRSTR, F_MEMINFO, F_CTXSYNC, F_DEVATTR, F_DEVUUID, F_CANPEER,
	// The virtual memory calls, which drivers before CUDA 10.2 lack.
	F_MEMCREATE, F_MEMRELEASE, F_MEMEXPORT, F_MEMIMPORT, F_MEMPROPS, F_MEMGRAN,
	F_ADDRRESERVE, F_ADDRFREE, F_MEMMAP, F_MEMUNMAP, F_MEMSETACCESS,
	F_COUNT
};

// The first of the calls a driver may lack.
enum { F_OPTIONAL = F_MEMCREATE };

enum {
	ATTR_COMPUTE_MODE = 20,         // CU_DEVICE_ATTRIBUTE_COMPUTE_MODE
	ATTR_VMM_SUPPORTED = 102,       // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
	ATTR_POSIX_FD_SUPPORTED = 103,  // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
	ALLOC_PINNED = 1,               // CU_MEM_ALLOCATION_TYPE_PINNED
	HANDLE_POSIX_FD = 1,            // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	LOCATION_DEVICE = 1,            // CU_MEM_LOCATION_TYPE_DEVICE
	ACCESS_READWRITE = 3,           // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
	GRANULARITY_MINIMUM = 0,        // CU_MEM_ALLOC_GRANULARITY_MINIMUM
};

static void *tm_fns[F_COUNT];

static void *tm_dlopen(const char *name) { return dlopen(name, RTLD_NOW | RTLD_LOCAL); }
static char *tm_dlerror(void) { return dlerror(); }
static void *tm_dlsym(void *h, const char *name) { return dlsym(h, name); }
static void tm_set(int i, void *p) { tm_fns[i] = p; }

static CUresult tm_init(void) { return ((CUresult (*)(unsigned int))tm_fns[F_INIT])(0); }
static CUresult tm_devcount(int *n) { return ((CUresult (*)(int *))tm_fns[F_DEVCOUNT])(n); }
static CUresult tm_devget(CUdevice *d, int ordinal) { return ((CUresult (*)(CUdevice *, int))tm_fns[F_DEVGET])(d, ordinal); }
static CUresult tm_pctxretain(CUcontext *c, CUdevice d) { return ((CUresult (*)(CUcontext *, CUdevice))tm_fns[F_PCTXRETAIN])(c, d); }
static CUresult tm_pctxrelease(CUdevice d) { return ((CUresult (*)(CUdevice))tm_fns[F_PCTXRELEASE])(d); }
static CUresult tm_ctxget(CUcontext *c) { return ((CUresult (*)(CUcontext *))tm_fns[F_CTXGET])(c); }
static CUresult tm_ctxset(CUcontext c) { return ((CUresult (*)(CUcontext))tm_fns[F_CTXSET])(c); }
static CUresult tm_malloc(CUdeviceptr *p, size_t n) { return ((CUresult (*)(CUdeviceptr *, size_t))tm_fns[F_MALLOC])(p, n); }
static CUresult tm_free(CUdeviceptr p) { return ((CUresult (*)(CUdeviceptr))tm_fns[F_FREE])(p); }
static CUresult tm_memset(CUdeviceptr p, size_t n) { return ((CUresult (*)(CUdeviceptr, unsigned char, size_t))tm_fns[F_MEMSET])(p, 0, n); }
static CUresult tm_htod(CUdeviceptr dst, const void *src, size_t n) { return ((CUresult (*)(CUdeviceptr, const void *, size_t))tm_fns[F_HTOD])(dst, src, n); }
static CUresult tm_dtoh(void *dst, CUdeviceptr src, size_t n) { return ((CUresult (*)(void *, CUdeviceptr, size_t))tm_fns[F_DTOH])(dst, src, n); }
static CUresult tm_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n) { return ((CUresult (*)(CUdeviceptr, CUdeviceptr, size_t))tm_fns[F_DTOD])(dst, src, n); }
static CUresult tm_addrrange(CUdeviceptr *base, size_t *size, CUdeviceptr p) { return ((CUresult (*)(CUdeviceptr *, size_t *, CUdeviceptr))tm_fns[F_ADDRRANGE])(base, size, p); }
static CUresult tm_ipcgetmem(void *h, CUdeviceptr p) { return ((CUresult (*)(CUipcMemHandle *, CUdeviceptr))tm_fns[F_IPCGETMEM])((CUipcMemHandle *)h, p); }
static CUresult tm_ipcopenmem(CUdeviceptr *p, const void *h) {
	CUipcMemHandle handle;
	memcpy(&handle, h, sizeof handle);
	// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
	return ((CUresult (*)(CUdeviceptr *, CUipcMemHandle, unsigned int))tm_fns[F_IPCOPENMEM])(p, handle, 1);
}
static CUresult tm_ipcclosemem(CUdeviceptr p) { return ((CUresult (*)(CUdeviceptr))tm_fns[F_IPCCLOSEMEM])(p); }
static CUresult tm_evcreate(CUevent *e) {
	// CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS
	return ((CUresult (*)(CUevent *, unsigned int))tm_fns[F_EVCREATE])(e, 0x2 | 0x4);
}
static CUresult tm_ctxsync(void) { return ((CUresult (*)(void))tm_fns[F_CTXSYNC])(); }
static CUresult tm_devuuid(unsigned char *uuid, CUdevice d) { return ((CUresult (*)(unsigned char *, CUdevice))tm_fns[F_DEVUUID])(uuid, d); }
static CUresult tm_canpeer(int *can, CUdevice d, CUdevice peer) { return ((CUresult (*)(int *, CUdevice, CUdevice))tm_fns[F_CANPEER])(can, d, peer); }
static CUresult tm_streamsync(void) { return ((CUresult (*)(CUstream))tm_fns[F_STREAMSYNC])(0); }
static CUresult tm_evrecord(CUevent e) { return ((CUresult (*)(CUevent, CUstream))tm_fns[F_EVRECORD])(e, 0); }
static CUresult tm_evsync(CUevent e) { return ((CUresult (*)(CUevent))tm_fns[F_EVSYNC])(e); }
static CUresult tm_evdestroy(CUevent e) { return ((CUresult (*)(CUevent))tm_fns[F_EVDESTROY])(e); }
static CUresult tm_ipcgetev(void *h, CUevent e) { return ((CUresult (*)(CUipcEventHandle *, CUevent))tm_fns[F_IPCGETEV])((CUipcEventHandle *)h, e); }
static CUresult tm_ipcopenev(CUevent *e, const void *h) {
	CUipcEventHandle handle;
	memcpy(&handle, h, sizeof handle);
	return ((CUresult (*)(CUevent *, CUipcEventHandle))tm_fns[F_IPCOPENEV])(e, handle);
}
static int tm_has(int i) { return tm_fns[i] != 0; }
static CUresult tm_meminfo(size_t *free, size_t *total) { return ((CUresult (*)(size_t *, size_t *))tm_fns[F_MEMINFO])(free, total); }
static CUresult tm_devattr(int *v, int attr, CUdevice d) { return ((CUresult (*)(int *, int, CUdevice))tm_fns[F_DEVATTR])(v, attr, d); }
static void tm_prop(CUmemAllocationProp *p, int dev) {
	memset(p, 0, sizeof *p);
	p->type = ALLOC_PINNED;
	p->requestedHandleTypes = HANDLE_POSIX_FD;
	p->location.type = LOCATION_DEVICE;
	p->location.id = dev;
}
static CUresult tm_memgran(size_t *g, int dev) {
	CUmemAllocationProp p;
	tm_prop(&p, dev);
	return ((CUresult (*)(size_t *, const CUmemAllocationProp *, int))tm_fns[F_MEMGRAN])(g, &p, GRANULARITY_MINIMUM);
}
static CUresult tm_memcreate(CUmemGenericAllocationHandle *h, size_t n, int dev) {
	CUmemAllocationProp p;
	tm_prop(&p, dev);
	return ((CUresult (*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))tm_fns[F_MEMCREATE])(h, n, &p, 0);
}
static CUresult tm_memrelease(CUmemGenericAllocationHandle h) { return ((CUresult (*)(CUmemGenericAllocationHandle))tm_fns[F_MEMRELEASE])(h); }
static CUresult tm_memexport(int *fd, CUmemGenericAllocationHandle h) {
	return ((CUresult (*)(void *, CUmemGenericAllocationHandle, int, unsigned long long))tm_fns[F_MEMEXPORT])(fd, h, HANDLE_POSIX_FD, 0);
}
static CUresult tm_memimport(CUmemGenericAllocationHandle *h, int fd) {
	return ((CUresult (*)(CUmemGenericAllocationHandle *, void *, int))tm_fns[F_MEMIMPORT])(h, (void *)(long)fd, HANDLE_POSIX_FD);
}
// tm_memprops_all returns every property of an allocation the driver
// reports.
static CUresult tm_memprops_all(int *type, int *handleTypes, int *locType, int *locID, CUmemGenericAllocationHandle h) {
	CUmemAllocationProp p;
	memset(&p, 0, sizeof p);
	CUresult r = ((CUresult (*)(CUmemAllocationProp *, CUmemGenericAllocationHandle))tm_fns[F_MEMPROPS])(&p, h);
	*type = p.type;
	*handleTypes = p.requestedHandleTypes;
	*locType = p.location.type;
	*locID = p.location.id;
	return r;
}
static CUresult tm_addrreserve(CUdeviceptr *p, size_t n, size_t align) {
	return ((CUresult (*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))tm_fns[F_ADDRRESERVE])(p, n, align, 0, 0);
}
static CUresult tm_addrfree(CUdeviceptr p, size_t n) { return ((CUresult (*)(CUdeviceptr, size_t))tm_fns[F_ADDRFREE])(p, n); }
static CUresult tm_memmap(CUdeviceptr p, size_t n, CUmemGenericAllocationHandle h) {
	return ((CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))tm_fns[F_MEMMAP])(p, n, 0, h, 0);
}
static CUresult tm_memunmap(CUdeviceptr p, size_t n) { return ((CUresult (*)(CUdeviceptr, size_t))tm_fns[F_MEMUNMAP])(p, n); }
// tm_memsetaccess lets each of the n devices read and write the mapping.
static CUresult tm_memsetaccess(CUdeviceptr p, size_t size, const int *devs, int n) {
	CUmemAccessDesc d[64];
	if (n < 1 || n > 64) return 1; // CUDA_ERROR_INVALID_VALUE
	memset(d, 0, sizeof d);
	for (int i = 0; i < n; i++) {
		d[i].location.type = LOCATION_DEVICE;
		d[i].location.id = devs[i];
		d[i].flags = ACCESS_READWRITE;
	}
	return ((CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))tm_fns[F_MEMSETACCESS])(p, size, d, (size_t)n);
}
static const char *tm_errname(CUresult r) {
	const char *s = 0;
	if (tm_fns[F_ERRNAME]) ((CUresult (*)(CUresult, const char **))tm_fns[F_ERRNAME])(r, &s);
	return s;
}
static const char *tm_errstr(CUresult r) {
	const char *s = 0;
	if (tm_fns[F_ERRSTR]) ((CUresult (*)(CUresult, const char **))tm_fns[F_ERRSTR])(r, &s);
	return s;
}
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// symbols lists, per function slot, the names to try in libcuda, newest
// ABI first.
var symbols = [C.F_COUNT][]string{
	C.F_INIT:         {"cuInit"},
	C.F_DEVCOUNT:     {"cuDeviceGetCount"},
	C.F_DEVGET:       {"cuDeviceGet"},
	C.F_PCTXRETAIN:   {"cuDevicePrimaryCtxRetain"},
	C.F_PCTXRELEASE:  {"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"},
	C.F_CTXGET:       {"cuCtxGetCurrent"},
	C.F_CTXSET:       {"cuCtxSetCurrent"},
	C.F_MALLOC:       {"cuMemAlloc_v2"},
	C.F_FREE:         {"cuMemFree_v2"},
	C.F_MEMSET:       {"cuMemsetD8_v2"},
	C.F_HTOD:         {"cuMemcpyHtoD_v2"},
	C.F_DTOH:         {"cuMemcpyDtoH_v2"},
	C.F_DTOD:         {"cuMemcpyDtoD_v2"},
	C.F_ADDRRANGE:    {"cuMemGetAddressRange_v2"},
	C.F_IPCGETMEM:    {"cuIpcGetMemHandle"},
	C.F_IPCOPENMEM:   {"cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"},
	C.F_IPCCLOSEMEM:  {"cuIpcCloseMemHandle"},
	C.F_STREAMSYNC:   {"cuStreamSynchronize"},
	C.F_EVCREATE:     {"cuEventCreate"},
	C.F_EVRECORD:     {"cuEventRecord"},
	C.F_EVSYNC:       {"cuEventSynchronize"},
	C.F_EVDESTROY:    {"cuEventDestroy_v2", "cuEventDestroy"},
	C.F_IPCGETEV:     {"cuIpcGetEventHandle"},
	C.F_IPCOPENEV:    {"cuIpcOpenEventHandle"},
	C.F_ERRNAME:      {"cuGetErrorName"},
	C.F_ERRSTR:       {"cuGetErrorString"},
	C.F_MEMINFO:      {"cuMemGetInfo_v2"},
	C.F_CTXSYNC:      {"cuCtxSynchronize"},
	C.F_DEVUUID:      {"cuDeviceGetUuid_v2", "cuDeviceGetUuid"},
	C.F_CANPEER:      {"cuDeviceCanAccessPeer"},
	C.F_DEVATTR:      {"cuDeviceGetAttribute"},
	C.F_MEMCREATE:    {"cuMemCreate"},
	C.F_MEMRELEASE:   {"cuMemRelease"},
	C.F_MEMEXPORT:    {"cuMemExportToShareableHandle"},
	C.F_MEMIMPORT:    {"cuMemImportFromShareableHandle"},
	C.F_MEMPROPS:     {"cuMemGetAllocationPropertiesFromHandle"},
	C.F_MEMGRAN:      {"cuMemGetAllocationGranularity"},
	C.F_ADDRRESERVE:  {"cuMemAddressReserve"},
	C.F_ADDRFREE:     {"cuMemAddressFree"},
	C.F_MEMMAP:       {"cuMemMap"},
	C.F_MEMUNMAP:     {"cuMemUnmap"},
	C.F_MEMSETACCESS: {"cuMemSetAccess"},
}

// libcuda is the real driver, reached through function pointers that
// openLibcuda looked up once; it holds no other state.
type libcuda struct{}

// openLibcuda opens libcuda.so.1 and looks up every function tensormp
// calls. dlerror's message is per thread, so the lookups run on one
// locked OS thread.
func openLibcuda() (driver, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	name := C.CString("libcuda.so.1")
	defer C.free(unsafe.Pointer(name))
	h := C.tm_dlopen(name)
	if h == nil {
		return nil, fmt.Errorf("%w: %s", ErrNoDriver, C.GoString(C.tm_dlerror()))
	}
	for slot, names := range symbols {
		if len(names) == 0 {
			return nil, fmt.Errorf("%w: cuda: no symbol name for driver slot %d", ErrNoDriver, slot)
		}
		var fn unsafe.Pointer
		for _, n := range names {
			cn := C.CString(n)
			fn = C.tm_dlsym(h, cn)
			C.free(unsafe.Pointer(cn))
			if fn != nil {
				break
			}
		}
		if fn == nil && slot < C.F_OPTIONAL {
			return nil, fmt.Errorf("%w: libcuda.so.1 lacks %s: %s", ErrNoDriver, names[0], C.GoString(C.tm_dlerror()))
		}
		C.tm_set(C.int(slot), fn)
	}
	d := libcuda{}
	if err := check("cuInit", C.tm_init()); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	return d, nil
}

// handle turns an opaque driver handle kept as an integer back into the
// pointer type C expects. The driver's handles never point into Go memory.
func handle(u uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&u)) }

func check(call string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	return &Error{Call: call, Code: int(r), Name: C.GoString(C.tm_errname(r)), Msg: C.GoString(C.tm_errstr(r))}
}

func (libcuda) DeviceCount() (int, error) {
	var n C.int
	err := check("cuDeviceGetCount", C.tm_devcount(&n))
	return int(n), err
}

func (libcuda) RetainPrimaryContext(dev int) (cuContext, error) {
	var d C.CUdevice
	if err := check("cuDeviceGet", C.tm_devget(&d, C.int(dev))); err != nil {
		return 0, err
	}
	var c C.CUcontext
	err := check("cuDevicePrimaryCtxRetain", C.tm_pctxretain(&c, d))
	return cuContext(unsafe.Pointer(c)), err
}

func (libcuda) ReleasePrimaryContext(dev int) error {
	var d C.CUdevice
	if err := check("cuDeviceGet", C.tm_devget(&d, C.int(dev))); err != nil {
		return err
	}
	return check("cuDevicePrimaryCtxRelease", C.tm_pctxrelease(d))
}

func (libcuda) Current() (cuContext, error) {
	var c C.CUcontext
	err := check("cuCtxGetCurrent", C.tm_ctxget(&c))
	return cuContext(unsafe.Pointer(c)), err
}

func (libcuda) SetCurrent(ctx cuContext) error {
	return check("cuCtxSetCurrent", C.tm_ctxset(C.CUcontext(handle(uintptr(ctx)))))
}

func (libcuda) MemAlloc(n int64) (DevicePtr, error) {
	var p C.CUdeviceptr
	err := check("cuMemAlloc_v2", C.tm_malloc(&p, C.size_t(n)))
	return DevicePtr(p), err
}

func (libcuda) MemFree(p DevicePtr) error {
	return check("cuMemFree_v2", C.tm_free(C.CUdeviceptr(p)))
}

func (libcuda) MemsetD8(p DevicePtr, n int64) error {
	return check("cuMemsetD8_v2", C.tm_memset(C.CUdeviceptr(p), C.size_t(n)))
}

func (libcuda) MemcpyHtoD(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return check("cuMemcpyHtoD_v2", C.tm_htod(C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

func (libcuda) MemcpyDtoH(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	return check("cuMemcpyDtoH_v2", C.tm_dtoh(unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst))))
}

func (libcuda) MemcpyDtoD(dst, src DevicePtr, n int64) error {
	return check("cuMemcpyDtoD_v2", C.tm_dtod(C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n)))
}

func (libcuda) MemGetAddressRange(p DevicePtr) (DevicePtr, int64, error) {
	var base C.CUdeviceptr
	var size C.size_t
	err := check("cuMemGetAddressRange_v2", C.tm_addrrange(&base, &size, C.CUdeviceptr(p)))
	return DevicePtr(base), int64(size), err
}

func (libcuda) IPCGetMemHandle(p DevicePtr) (ipcMemHandle, error) {
	var h ipcMemHandle
	err := check("cuIpcGetMemHandle", C.tm_ipcgetmem(unsafe.Pointer(&h[0]), C.CUdeviceptr(p)))
	return h, err
}

func (libcuda) IPCOpenMemHandle(h ipcMemHandle) (DevicePtr, error) {
	var p C.CUdeviceptr
	err := check("cuIpcOpenMemHandle", C.tm_ipcopenmem(&p, unsafe.Pointer(&h[0])))
	return DevicePtr(p), err
}

func (libcuda) IPCCloseMemHandle(p DevicePtr) error {
	return check("cuIpcCloseMemHandle", C.tm_ipcclosemem(C.CUdeviceptr(p)))
}

func (libcuda) Synchronize() error { return check("cuStreamSynchronize", C.tm_streamsync()) }

func (libcuda) EventCreateInterprocess() (cuEvent, error) {
	var e C.CUevent
	err := check("cuEventCreate", C.tm_evcreate(&e))
	return cuEvent(unsafe.Pointer(e)), err
}

func (libcuda) EventRecord(e cuEvent) error {
	return check("cuEventRecord", C.tm_evrecord(C.CUevent(handle(uintptr(e)))))
}

func (libcuda) EventSynchronize(e cuEvent) error {
	return check("cuEventSynchronize", C.tm_evsync(C.CUevent(handle(uintptr(e)))))
}

func (libcuda) EventDestroy(e cuEvent) error {
	return check("cuEventDestroy", C.tm_evdestroy(C.CUevent(handle(uintptr(e)))))
}

func (libcuda) IPCGetEventHandle(e cuEvent) (ipcEventHandle, error) {
	var h ipcEventHandle
	err := check("cuIpcGetEventHandle", C.tm_ipcgetev(unsafe.Pointer(&h[0]), C.CUevent(handle(uintptr(e)))))
	return h, err
}

func (libcuda) IPCOpenEventHandle(h ipcEventHandle) (cuEvent, error) {
	var e C.CUevent
	err := check("cuIpcOpenEventHandle", C.tm_ipcopenev(&e, unsafe.Pointer(&h[0])))
	return cuEvent(unsafe.Pointer(e)), err
}

// errNoVMM is the error of a virtual memory call the driver lacks.
var errNoVMM = &Error{Call: "cuMemCreate", Code: 801, Name: "CUDA_ERROR_NOT_SUPPORTED", Msg: "this driver has no virtual memory calls (CUDA 10.2 or newer has them)"}

func hasVMM() bool {
	for slot := C.F_OPTIONAL; slot < C.F_COUNT; slot++ {
		if C.tm_has(C.int(slot)) == 0 {
			return false
		}
	}
	return true
}

// attribute returns device dev's attribute attr.
func attribute(dev int, attr C.int) (int, error) {
	var d C.CUdevice
	if err := check("cuDeviceGet", C.tm_devget(&d, C.int(dev))); err != nil {
		return 0, err
	}
	var v C.int
	err := check("cuDeviceGetAttribute", C.tm_devattr(&v, attr, d))
	return int(v), err
}

func (libcuda) FDExportSupported(dev int) (bool, error) {
	if !hasVMM() {
		return false, nil
	}
	for _, attr := range []C.int{C.ATTR_VMM_SUPPORTED, C.ATTR_POSIX_FD_SUPPORTED} {
		if v, err := attribute(dev, attr); err != nil || v == 0 {
			return false, err
		}
	}
	return true, nil
}

func (libcuda) ComputeMode(dev int) (int, error) { return attribute(dev, C.ATTR_COMPUTE_MODE) }

func (libcuda) DeviceUUID(dev int) ([16]byte, error) {
	var uuid [16]byte
	var d C.CUdevice
	if err := check("cuDeviceGet", C.tm_devget(&d, C.int(dev))); err != nil {
		return uuid, err
	}
	err := check("cuDeviceGetUuid", C.tm_devuuid((*C.uchar)(unsafe.Pointer(&uuid[0])), d))
	return uuid, err
}

func (libcuda) CanAccessPeer(dev, peer int) (bool, error) {
	var d, p C.CUdevice
	if err := check("cuDeviceGet", C.tm_devget(&d, C.int(dev))); err != nil {
		return false, err
	}
	if err := check("cuDeviceGet", C.tm_devget(&p, C.int(peer))); err != nil {
		return false, err
	}
	var can C.int
	err := check("cuDeviceCanAccessPeer", C.tm_canpeer(&can, d, p))
	return can != 0, err
}

func (libcuda) CtxSynchronize() error { return check("cuCtxSynchronize", C.tm_ctxsync()) }

func (libcuda) MemGranularity(dev int) (int64, error) {
	if !hasVMM() {
		return 0, errNoVMM
	}
	var g C.size_t
	err := check("cuMemGetAllocationGranularity", C.tm_memgran(&g, C.int(dev)))
	return int64(g), err
}

func (libcuda) MemCreate(dev int, size int64) (memHandle, error) {
	if !hasVMM() {
		return 0, errNoVMM
	}
	var h C.CUmemGenericAllocationHandle
	err := check("cuMemCreate", C.tm_memcreate(&h, C.size_t(size), C.int(dev)))
	return memHandle(h), err
}

func (libcuda) MemRelease(h memHandle) error {
	return check("cuMemRelease", C.tm_memrelease(C.CUmemGenericAllocationHandle(h)))
}

func (libcuda) MemExportFD(h memHandle) (int, error) {
	fd := C.int(-1)
	err := check("cuMemExportToShareableHandle", C.tm_memexport(&fd, C.CUmemGenericAllocationHandle(h)))
	return int(fd), err
}

func (libcuda) MemImportFD(fd int) (memHandle, error) {
	if !hasVMM() {
		return 0, errNoVMM
	}
	var h C.CUmemGenericAllocationHandle
	err := check("cuMemImportFromShareableHandle", C.tm_memimport(&h, C.int(fd)))
	return memHandle(h), err
}

// MemDevice reads nothing of the properties but the location: the
// driver does not promise what an imported handle reports of the handle
// types it was made with.
func (libcuda) MemDevice(h memHandle) (int, error) {
	typ, _, locType, locID, err := memProperties(h)
	if typ != C.ALLOC_PINNED || locType != C.LOCATION_DEVICE {
		return -1, err
	}
	return locID, err
}

func (libcuda) MemAddressReserve(size, align int64) (DevicePtr, error) {
	var p C.CUdeviceptr
	err := check("cuMemAddressReserve", C.tm_addrreserve(&p, C.size_t(size), C.size_t(align)))
	return DevicePtr(p), err
}

func (libcuda) MemAddressFree(p DevicePtr, size int64) error {
	return check("cuMemAddressFree", C.tm_addrfree(C.CUdeviceptr(p), C.size_t(size)))
}

func (libcuda) MemMap(p DevicePtr, size int64, h memHandle) error {
	return check("cuMemMap", C.tm_memmap(C.CUdeviceptr(p), C.size_t(size), C.CUmemGenericAllocationHandle(h)))
}

func (libcuda) MemUnmap(p DevicePtr, size int64) error {
	return check("cuMemUnmap", C.tm_memunmap(C.CUdeviceptr(p), C.size_t(size)))
}

func (libcuda) MemSetAccess(p DevicePtr, size int64, devs []int) error {
	if len(devs) == 0 || len(devs) > 64 {
		return fmt.Errorf("cuda: access for %d devices", len(devs))
	}
	cdevs := make([]C.int, len(devs))
	for i, d := range devs {
		cdevs[i] = C.int(d)
	}
	return check("cuMemSetAccess", C.tm_memsetaccess(C.CUdeviceptr(p), C.size_t(size), &cdevs[0], C.int(len(devs))))
}

func (libcuda) MemGetInfo() (int64, int64, error) {
	var free, total C.size_t
	err := check("cuMemGetInfo_v2", C.tm_meminfo(&free, &total))
	return int64(free), int64(total), err
}

// memProperties returns what the driver reports of allocation h: its
// type, the handle types it was requested with, and its location.
func memProperties(h memHandle) (typ, handleTypes, locType, locID int, err error) {
	var t, ht, lt, li C.int
	err = check("cuMemGetAllocationPropertiesFromHandle", C.tm_memprops_all(&t, &ht, &lt, &li, C.CUmemGenericAllocationHandle(h)))
	return int(t), int(ht), int(lt), int(li), err
}

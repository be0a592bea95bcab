//go:build cgo && linux

package drv

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUevent;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUhandle;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
	int type;
	int requestedHandleTypes;
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

static void *lib;

static int d_open(void) {
	if (!lib)
		lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	return lib != 0;
}

#define CALL(name, type, ...) ((type)dlsym(lib, #name))(__VA_ARGS__)

static CUresult d_init(void) { return CALL(cuInit, CUresult (*)(unsigned), 0); }
static CUresult d_count(int *n) { return CALL(cuDeviceGetCount, CUresult (*)(int *), n); }
static CUresult d_get(CUdevice *d, int o) { return CALL(cuDeviceGet, CUresult (*)(CUdevice *, int), d, o); }
static CUresult d_attr(int *v, int a, CUdevice d) { return CALL(cuDeviceGetAttribute, CUresult (*)(int *, int, CUdevice), v, a, d); }
static CUresult d_uuid(void *u, CUdevice d) { return CALL(cuDeviceGetUuid_v2, CUresult (*)(CUuuid *, CUdevice), (CUuuid *)u, d); }
static CUresult d_peer(int *c, CUdevice d, CUdevice p) { return CALL(cuDeviceCanAccessPeer, CUresult (*)(int *, CUdevice, CUdevice), c, d, p); }
static CUresult d_retain(uintptr_t *c, CUdevice d) {
	CUcontext x = 0;
	CUresult r = CALL(cuDevicePrimaryCtxRetain, CUresult (*)(CUcontext *, CUdevice), &x, d);
	*c = (uintptr_t)x;
	return r;
}
static CUresult d_release(CUdevice d) { return CALL(cuDevicePrimaryCtxRelease_v2, CUresult (*)(CUdevice), d); }
static CUresult d_ctxget(uintptr_t *c) {
	CUcontext x = 0;
	CUresult r = CALL(cuCtxGetCurrent, CUresult (*)(CUcontext *), &x);
	*c = (uintptr_t)x;
	return r;
}
static CUresult d_ctxset(uintptr_t c) { return CALL(cuCtxSetCurrent, CUresult (*)(CUcontext), (CUcontext)c); }
static CUresult d_ctxsync(void) { return CALL(cuCtxSynchronize, CUresult (*)(void)); }
static CUresult d_streamsync(uintptr_t s) { return CALL(cuStreamSynchronize, CUresult (*)(CUstream), (CUstream)s); }
static CUresult d_alloc(CUdeviceptr *p, size_t n) { return CALL(cuMemAlloc_v2, CUresult (*)(CUdeviceptr *, size_t), p, n); }
static CUresult d_free(CUdeviceptr p) { return CALL(cuMemFree_v2, CUresult (*)(CUdeviceptr), p); }
static CUresult d_memset(CUdeviceptr p, unsigned char v, size_t n) { return CALL(cuMemsetD8_v2, CUresult (*)(CUdeviceptr, unsigned char, size_t), p, v, n); }
static CUresult d_htod(CUdeviceptr p, const void *s, size_t n) { return CALL(cuMemcpyHtoD_v2, CUresult (*)(CUdeviceptr, const void *, size_t), p, s, n); }
static CUresult d_dtoh(void *d, CUdeviceptr p, size_t n) { return CALL(cuMemcpyDtoH_v2, CUresult (*)(void *, CUdeviceptr, size_t), d, p, n); }
static CUresult d_dtod(CUdeviceptr d, CUdeviceptr s, size_t n) { return CALL(cuMemcpyDtoD_v2, CUresult (*)(CUdeviceptr, CUdeviceptr, size_t), d, s, n); }
static CUresult d_range(CUdeviceptr *b, size_t *s, CUdeviceptr p) { return CALL(cuMemGetAddressRange_v2, CUresult (*)(CUdeviceptr *, size_t *, CUdeviceptr), b, s, p); }
static CUresult d_info(size_t *f, size_t *t) { return CALL(cuMemGetInfo_v2, CUresult (*)(size_t *, size_t *), f, t); }
static CUresult d_ipcgetmem(void *h, CUdeviceptr p) { return CALL(cuIpcGetMemHandle, CUresult (*)(CUipcMemHandle *, CUdeviceptr), (CUipcMemHandle *)h, p); }
static CUresult d_ipcopenmem(CUdeviceptr *p, const void *h, unsigned flags) {
	CUipcMemHandle x;
	memcpy(&x, h, sizeof x);
	return CALL(cuIpcOpenMemHandle_v2, CUresult (*)(CUdeviceptr *, CUipcMemHandle, unsigned), p, x, flags);
}
static CUresult d_ipcclosemem(CUdeviceptr p) { return CALL(cuIpcCloseMemHandle, CUresult (*)(CUdeviceptr), p); }
static CUresult d_evcreate(uintptr_t *e, unsigned flags) {
	CUevent x = 0;
	CUresult r = CALL(cuEventCreate, CUresult (*)(CUevent *, unsigned), &x, flags);
	*e = (uintptr_t)x;
	return r;
}
static CUresult d_evrecord(uintptr_t e, uintptr_t s) { return CALL(cuEventRecord, CUresult (*)(CUevent, CUstream), (CUevent)e, (CUstream)s); }
static CUresult d_evsync(uintptr_t e) { return CALL(cuEventSynchronize, CUresult (*)(CUevent), (CUevent)e); }
static CUresult d_evdestroy(uintptr_t e) { return CALL(cuEventDestroy_v2, CUresult (*)(CUevent), (CUevent)e); }
static CUresult d_ipcgetev(void *h, uintptr_t e) { return CALL(cuIpcGetEventHandle, CUresult (*)(CUipcEventHandle *, CUevent), (CUipcEventHandle *)h, (CUevent)e); }
static CUresult d_ipcopenev(uintptr_t *e, const void *h) {
	CUipcEventHandle x;
	CUevent ev = 0;
	memcpy(&x, h, sizeof x);
	CUresult r = CALL(cuIpcOpenEventHandle, CUresult (*)(CUevent *, CUipcEventHandle), &ev, x);
	*e = (uintptr_t)ev;
	return r;
}
static CUresult d_errname(CUresult c, const char **s) { return CALL(cuGetErrorName, CUresult (*)(CUresult, const char **), c, s); }
static CUresult d_errstr(CUresult c, const char **s) { return CALL(cuGetErrorString, CUresult (*)(CUresult, const char **), c, s); }
static void d_prop(CUmemAllocationProp *p, int type, int handles, int loctype, int id) {
	memset(p, 0, sizeof *p);
	p->type = type;
	p->requestedHandleTypes = handles;
	p->location.type = loctype;
	p->location.id = id;
}
static CUresult d_create(CUhandle *h, size_t n, int type, int handles, int loctype, int id) {
	CUmemAllocationProp p;
	d_prop(&p, type, handles, loctype, id);
	return CALL(cuMemCreate, CUresult (*)(CUhandle *, size_t, const CUmemAllocationProp *, unsigned long long), h, n, &p, 0);
}
static CUresult d_memrelease(CUhandle h) { return CALL(cuMemRelease, CUresult (*)(CUhandle), h); }
static CUresult d_export(int *fd, CUhandle h) { return CALL(cuMemExportToShareableHandle, CUresult (*)(void *, CUhandle, int, unsigned long long), fd, h, 1, 0); }
static CUresult d_import(CUhandle *h, int fd) { return CALL(cuMemImportFromShareableHandle, CUresult (*)(CUhandle *, void *, int), h, (void *)(intptr_t)fd, 1); }
static CUresult d_props(CUhandle h, int *type, int *handles, int *loctype, int *id) {
	CUmemAllocationProp p;
	memset(&p, 0x5a, sizeof p);
	CUresult r = CALL(cuMemGetAllocationPropertiesFromHandle, CUresult (*)(CUmemAllocationProp *, CUhandle), &p, h);
	*type = p.type;
	*handles = p.requestedHandleTypes;
	*loctype = p.location.type;
	*id = p.location.id;
	return r;
}
static CUresult d_gran(size_t *g, int type, int handles, int loctype, int id, int option) {
	CUmemAllocationProp p;
	d_prop(&p, type, handles, loctype, id);
	return CALL(cuMemGetAllocationGranularity, CUresult (*)(size_t *, const CUmemAllocationProp *, int), g, &p, option);
}
static CUresult d_reserve(CUdeviceptr *p, size_t n, size_t align) { return CALL(cuMemAddressReserve, CUresult (*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long), p, n, align, 0, 0); }
static CUresult d_addrfree(CUdeviceptr p, size_t n) { return CALL(cuMemAddressFree, CUresult (*)(CUdeviceptr, size_t), p, n); }
static CUresult d_map(CUdeviceptr p, size_t n, CUhandle h) { return CALL(cuMemMap, CUresult (*)(CUdeviceptr, size_t, size_t, CUhandle, unsigned long long), p, n, 0, h, 0); }
static CUresult d_unmap(CUdeviceptr p, size_t n) { return CALL(cuMemUnmap, CUresult (*)(CUdeviceptr, size_t), p, n); }
static CUresult d_access(CUdeviceptr p, size_t n, const int *devflags, size_t count) {
	CUmemAccessDesc d[8];
	if (count > 8)
		return 1;
	for (size_t i = 0; i < count; i++) {
		d[i].location.type = 1;
		d[i].location.id = devflags[2 * i];
		d[i].flags = devflags[2 * i + 1];
	}
	return CALL(cuMemSetAccess, CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t), p, n, d, count);
}
*/
import "C"

import (
	"unsafe"
)

// Open loads libcuda.so.1 as package cuda does; it reports whether that
// worked.
func Open() bool { return C.d_open() != 0 }

func Init() int { return int(C.d_init()) }

func DeviceCount() (int, int) {
	var n C.int
	r := C.d_count(&n)
	return int(n), int(r)
}

func DeviceGet(ordinal int) (int, int) {
	var d C.CUdevice
	r := C.d_get(&d, C.int(ordinal))
	return int(d), int(r)
}

func Attribute(attr, dev int) (int, int) {
	var v C.int
	r := C.d_attr(&v, C.int(attr), C.CUdevice(dev))
	return int(v), int(r)
}

func UUID(dev int) ([16]byte, int) {
	var u [16]byte
	r := C.d_uuid(unsafe.Pointer(&u[0]), C.CUdevice(dev))
	return u, int(r)
}

func CanAccessPeer(dev, peer int) (int, int) {
	var c C.int
	r := C.d_peer(&c, C.CUdevice(dev), C.CUdevice(peer))
	return int(c), int(r)
}

func Retain(dev int) (uintptr, int) {
	var c C.uintptr_t
	r := C.d_retain(&c, C.CUdevice(dev))
	return uintptr(c), int(r)
}

func Release(dev int) int { return int(C.d_release(C.CUdevice(dev))) }

func CtxGet() (uintptr, int) {
	var c C.uintptr_t
	r := C.d_ctxget(&c)
	return uintptr(c), int(r)
}

func CtxSet(c uintptr) int { return int(C.d_ctxset(C.uintptr_t(c))) }

func CtxSync() int { return int(C.d_ctxsync()) }

func StreamSync(s uintptr) int { return int(C.d_streamsync(C.uintptr_t(s))) }

func Alloc(n int) (uint64, int) {
	var p C.CUdeviceptr
	r := C.d_alloc(&p, C.size_t(n))
	return uint64(p), int(r)
}

func Free(p uint64) int { return int(C.d_free(C.CUdeviceptr(p))) }

func Memset(p uint64, v byte, n int) int {
	return int(C.d_memset(C.CUdeviceptr(p), C.uchar(v), C.size_t(n)))
}

func HtoD(p uint64, b []byte) int {
	return int(C.d_htod(C.CUdeviceptr(p), unsafe.Pointer(unsafe.SliceData(b)), C.size_t(len(b))))
}

func DtoH(b []byte, p uint64) int {
	return int(C.d_dtoh(unsafe.Pointer(unsafe.SliceData(b)), C.CUdeviceptr(p), C.size_t(len(b))))
}

func DtoD(dst, src uint64, n int) int {
	return int(C.d_dtod(C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n)))
}

func AddressRange(p uint64) (uint64, int, int) {
	var b C.CUdeviceptr
	var s C.size_t
	r := C.d_range(&b, &s, C.CUdeviceptr(p))
	return uint64(b), int(s), int(r)
}

func MemInfo() (free, total int64, rc int) {
	var f, t C.size_t
	r := C.d_info(&f, &t)
	return int64(f), int64(t), int(r)
}

func IPCGetMem(p uint64) ([64]byte, int) {
	var h [64]byte
	r := C.d_ipcgetmem(unsafe.Pointer(&h[0]), C.CUdeviceptr(p))
	return h, int(r)
}

func IPCOpenMem(h [64]byte, flags uint) (uint64, int) {
	var p C.CUdeviceptr
	r := C.d_ipcopenmem(&p, unsafe.Pointer(&h[0]), C.uint(flags))
	return uint64(p), int(r)
}

func IPCCloseMem(p uint64) int { return int(C.d_ipcclosemem(C.CUdeviceptr(p))) }

func EventCreate(flags uint) (uintptr, int) {
	var e C.uintptr_t
	r := C.d_evcreate(&e, C.uint(flags))
	return uintptr(e), int(r)
}

func EventRecord(e, stream uintptr) int {
	return int(C.d_evrecord(C.uintptr_t(e), C.uintptr_t(stream)))
}

func EventSync(e uintptr) int { return int(C.d_evsync(C.uintptr_t(e))) }

func EventDestroy(e uintptr) int { return int(C.d_evdestroy(C.uintptr_t(e))) }

func IPCGetEvent(e uintptr) ([64]byte, int) {
	var h [64]byte
	r := C.d_ipcgetev(unsafe.Pointer(&h[0]), C.uintptr_t(e))
	return h, int(r)
}

func IPCOpenEvent(h [64]byte) (uintptr, int) {
	var e C.uintptr_t
	r := C.d_ipcopenev(&e, unsafe.Pointer(&h[0]))
	return uintptr(e), int(r)
}

// ErrorName returns cuGetErrorName's string (nil if it left it NULL)
// and code.
func ErrorName(code int) (*string, int) {
	var s *C.char
	r := C.d_errname(C.CUresult(code), &s)
	if s == nil {
		return nil, int(r)
	}
	g := C.GoString(s)
	return &g, int(r)
}

func ErrorString(code int) (*string, int) {
	var s *C.char
	r := C.d_errstr(C.CUresult(code), &s)
	if s == nil {
		return nil, int(r)
	}
	g := C.GoString(s)
	return &g, int(r)
}

// Prop is the part of CUmemAllocationProp the tests set and read.
type Prop struct {
	Type, HandleTypes, LocType, LocID int
}

// DeviceProp is a pinned allocation of device dev exportable as a POSIX
// descriptor.
func DeviceProp(dev int) Prop { return Prop{Type: 1, HandleTypes: 1, LocType: 1, LocID: dev} }

func MemCreate(size int, p Prop) (uint64, int) {
	var h C.CUhandle
	r := C.d_create(&h, C.size_t(size), C.int(p.Type), C.int(p.HandleTypes), C.int(p.LocType), C.int(p.LocID))
	return uint64(h), int(r)
}

func MemRelease(h uint64) int { return int(C.d_memrelease(C.CUhandle(h))) }

func Export(h uint64) (int, int) {
	fd := C.int(-1)
	r := C.d_export(&fd, C.CUhandle(h))
	return int(fd), int(r)
}

func Import(fd int) (uint64, int) {
	var h C.CUhandle
	r := C.d_import(&h, C.int(fd))
	return uint64(h), int(r)
}

func Props(h uint64) (Prop, int) {
	var t, ht, lt, id C.int
	r := C.d_props(C.CUhandle(h), &t, &ht, &lt, &id)
	return Prop{int(t), int(ht), int(lt), int(id)}, int(r)
}

func Granularity(p Prop, option int) (int, int) {
	var g C.size_t
	r := C.d_gran(&g, C.int(p.Type), C.int(p.HandleTypes), C.int(p.LocType), C.int(p.LocID), C.int(option))
	return int(g), int(r)
}

func Reserve(size, align int) (uint64, int) {
	var p C.CUdeviceptr
	r := C.d_reserve(&p, C.size_t(size), C.size_t(align))
	return uint64(p), int(r)
}

func AddressFree(p uint64, size int) int { return int(C.d_addrfree(C.CUdeviceptr(p), C.size_t(size))) }

func Map(p uint64, size int, h uint64) int {
	return int(C.d_map(C.CUdeviceptr(p), C.size_t(size), C.CUhandle(h)))
}

func Unmap(p uint64, size int) int { return int(C.d_unmap(C.CUdeviceptr(p), C.size_t(size))) }

// Access is one CUmemAccessDesc for a device location.
type Access struct{ Dev, Flags int }

func SetAccess(p uint64, size int, descs ...Access) int {
	flat := make([]C.int, 0, 2*len(descs)+1)
	for _, d := range descs {
		flat = append(flat, C.int(d.Dev), C.int(d.Flags))
	}
	flat = append(flat, 0)
	return int(C.d_access(C.CUdeviceptr(p), C.size_t(size), &flat[0], C.size_t(len(descs))))
}

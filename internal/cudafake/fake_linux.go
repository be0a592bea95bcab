package cudafake

import (
	"encoding/binary"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/internal/cudashm"
)

// Driver is the fake. Its zero value is not usable; call New.
type Driver struct {
	mu       sync.Mutex
	devices  int
	current  map[int]cuda.Context // OS thread -> current context
	retained map[int]int          // device -> primary context references
	allocs   map[cuda.DevicePtr]*alloc
	next     cuda.DevicePtr
	opened   map[cuda.DevicePtr]int // IPC opens per allocation
	events   map[cuda.Event]int     // event -> times recorded
	nextEv   cuda.Event
	limit    int64 // bytes that may be allocated at once; 0: no limit
	used     int64
	syncs    int // Synchronize calls
	// The virtual memory calls' state (see vmm_linux.go).
	mems       map[cuda.MemHandle]*vmem
	nextMem    cuda.MemHandle
	reserved   map[cuda.DevicePtr]int64 // address reservations and their sizes
	mapped     map[cuda.DevicePtr]*vmap
	noFDExport map[int]bool // devices that say they cannot export descriptors

	// shmFile is the file the real driver keeps in /dev/shm for the
	// process's interprocess events, made with the first one and
	// removed when the last context reference is released; "" while
	// there is none.
	shmFile string

	// Threads records, per device, the OS threads device work ran on.
	Threads map[int]map[int]bool
}

type alloc struct {
	dev  int
	data []byte
}

// New returns a fake with n devices.
func New(n int) *Driver {
	return &Driver{
		devices: n, current: map[int]cuda.Context{}, retained: map[int]int{},
		allocs: map[cuda.DevicePtr]*alloc{}, next: 1 << 32, opened: map[cuda.DevicePtr]int{},
		events: map[cuda.Event]int{}, nextEv: 1, Threads: map[int]map[int]bool{},
		mems: map[cuda.MemHandle]*vmem{}, reserved: map[cuda.DevicePtr]int64{}, mapped: map[cuda.DevicePtr]*vmap{},
		noFDExport: map[int]bool{},
	}
}

// SetLimit makes allocations beyond limit bytes in use fail as the real
// driver does when a device is out of memory.
func (d *Driver) SetLimit(limit int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.limit = limit
}

func fail(call string, code int, name string) error {
	return &cuda.Error{Call: call, Code: code, Name: name, Msg: "fake driver"}
}

// ctxDev returns the device whose context is current on this thread.
func (d *Driver) ctxDev(call string) (int, error) {
	c, ok := d.current[unix.Gettid()]
	if !ok {
		return 0, fail(call, 201, "CUDA_ERROR_INVALID_CONTEXT")
	}
	dev := int(c) - 1
	if d.Threads[dev] == nil {
		d.Threads[dev] = map[int]bool{}
	}
	d.Threads[dev][unix.Gettid()] = true
	return dev, nil
}

// find returns the memory of [p, p+n): an allocation's, or an
// accessible mapping's.
func (d *Driver) find(p cuda.DevicePtr, n int64) (*alloc, int64, bool) {
	for base, a := range d.allocs {
		if p >= base && int64(p-base)+n <= int64(len(a.data)) {
			return a, int64(p - base), true
		}
	}
	for base, v := range d.mapped {
		if v.accessible && p >= base && int64(p-base)+n <= int64(len(v.data)) {
			return &alloc{dev: v.mem.dev, data: v.data}, int64(p - base), true
		}
	}
	return nil, 0, false
}

func (d *Driver) DeviceCount() (int, error) { return d.devices, nil }

func (d *Driver) RetainPrimaryContext(dev int) (cuda.Context, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if dev < 0 || dev >= d.devices {
		return 0, fail("cuDeviceGet", 101, "CUDA_ERROR_INVALID_DEVICE")
	}
	d.retained[dev]++
	return cuda.Context(dev + 1), nil
}

func (d *Driver) ReleasePrimaryContext(dev int) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.retained[dev]--
	for _, n := range d.retained {
		if n > 0 {
			return nil
		}
	}
	// The last context is destroyed: the driver removes its file.
	if d.shmFile != "" {
		_ = os.Remove(d.shmFile)
		d.shmFile = ""
	}
	return nil
}

func (d *Driver) Current() (cuda.Context, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.current[unix.Gettid()], nil
}

func (d *Driver) SetCurrent(c cuda.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if c == 0 {
		delete(d.current, unix.Gettid())
	} else {
		d.current[unix.Gettid()] = c
	}
	return nil
}

func (d *Driver) MemAlloc(n int64) (cuda.DevicePtr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dev, err := d.ctxDev("cuMemAlloc_v2")
	if err != nil {
		return 0, err
	}
	if d.limit > 0 && d.used+n > d.limit {
		return 0, fail("cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY")
	}
	p := d.next
	d.next += cuda.DevicePtr(n+4095) &^ 4095
	data := make([]byte, n)
	for i := range data {
		data[i] = 0xab // device memory starts as garbage, as on a real GPU
	}
	d.allocs[p] = &alloc{dev: dev, data: data}
	d.used += n
	return p, nil
}

func (d *Driver) MemFree(p cuda.DevicePtr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuMemFree_v2"); err != nil {
		return err
	}
	a, ok := d.allocs[p]
	if !ok {
		return fail("cuMemFree_v2", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	d.used -= int64(len(a.data))
	delete(d.allocs, p)
	return nil
}

func (d *Driver) MemsetD8(p cuda.DevicePtr, n int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuMemsetD8_v2"); err != nil {
		return err
	}
	a, off, ok := d.find(p, n)
	if !ok {
		return fail("cuMemsetD8_v2", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	clear(a.data[off : off+n])
	return nil
}

func (d *Driver) MemcpyHtoD(dst cuda.DevicePtr, src []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuMemcpyHtoD_v2"); err != nil {
		return err
	}
	a, off, ok := d.find(dst, int64(len(src)))
	if !ok {
		return fail("cuMemcpyHtoD_v2", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	copy(a.data[off:], src)
	return nil
}

func (d *Driver) MemcpyDtoH(dst []byte, src cuda.DevicePtr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuMemcpyDtoH_v2"); err != nil {
		return err
	}
	a, off, ok := d.find(src, int64(len(dst)))
	if !ok {
		return fail("cuMemcpyDtoH_v2", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	copy(dst, a.data[off:])
	return nil
}

func (d *Driver) MemcpyDtoD(dst, src cuda.DevicePtr, n int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuMemcpyDtoD_v2"); err != nil {
		return err
	}
	da, doff, ok1 := d.find(dst, n)
	sa, soff, ok2 := d.find(src, n)
	if !ok1 || !ok2 {
		return fail("cuMemcpyDtoD_v2", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	copy(da.data[doff:doff+n], sa.data[soff:soff+n])
	return nil
}

func (d *Driver) MemGetAddressRange(p cuda.DevicePtr) (cuda.DevicePtr, int64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuMemGetAddressRange_v2"); err != nil {
		return 0, 0, err
	}
	for base, a := range d.allocs {
		if p >= base && int64(p-base) < int64(len(a.data)) {
			return base, int64(len(a.data)), nil
		}
	}
	for base, v := range d.mapped {
		if p >= base && int64(p-base) < int64(len(v.data)) {
			return base, int64(len(v.data)), nil
		}
	}
	return 0, 0, fail("cuMemGetAddressRange_v2", 1, "CUDA_ERROR_INVALID_VALUE")
}

func (d *Driver) IPCGetMemHandle(p cuda.DevicePtr) (cuda.IPCMemHandle, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var h cuda.IPCMemHandle
	if _, ok := d.allocs[p]; !ok {
		return h, fail("cuIpcGetMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	copy(h[:], "fakeipc")
	binary.LittleEndian.PutUint64(h[8:], uint64(p))
	return h, nil
}

// IPCOpenMemHandle maps the allocation at its own address: unlike the
// real driver, the fake lets a process open its own handles, so that one
// test process can play both sides.
func (d *Driver) IPCOpenMemHandle(h cuda.IPCMemHandle) (cuda.DevicePtr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuIpcOpenMemHandle"); err != nil {
		return 0, err
	}
	p := cuda.DevicePtr(binary.LittleEndian.Uint64(h[8:]))
	if string(h[:7]) != "fakeipc" {
		return 0, fail("cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	if _, ok := d.allocs[p]; !ok {
		return 0, fail("cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	d.opened[p]++
	return p, nil
}

func (d *Driver) IPCCloseMemHandle(p cuda.DevicePtr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.opened[p] <= 0 {
		return fail("cuIpcCloseMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	d.opened[p]--
	return nil
}

// Synchronize waits for nothing: the fake does its work at once. It
// counts the calls (Syncs).
func (d *Driver) Synchronize() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuStreamSynchronize"); err != nil {
		return err
	}
	d.syncs++
	return nil
}

// MemGetInfo answers for this process's own allocations: the fake has
// no device shared by processes. Its total is the limit, or 80 GiB.
func (d *Driver) MemGetInfo() (int64, int64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuMemGetInfo_v2"); err != nil {
		return 0, 0, err
	}
	total := d.limit
	if total == 0 {
		total = 80 << 30
	}
	return total - d.used, total, nil
}

func (d *Driver) CtxSynchronize() error { return d.Synchronize() }

func (d *Driver) DeviceUUID(dev int) ([16]byte, error) {
	var u [16]byte
	copy(u[:], "cudafake-gpu")
	u[15] = byte(dev)
	return u, nil
}

func (d *Driver) CanAccessPeer(dev, peer int) (bool, error) { return dev != peer, nil }

func (d *Driver) ComputeMode(int) (int, error) { return 0, nil }

// Syncs returns how many times Synchronize was called.
func (d *Driver) Syncs() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.syncs
}

func (d *Driver) EventCreateInterprocess() (cuda.Event, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.ctxDev("cuEventCreate"); err != nil {
		return 0, err
	}
	if d.shmFile == "" {
		// The real driver keeps the interprocess events of a process in
		// a file of its own, named after the process, until its context
		// is destroyed: a process killed first leaves it.
		name := cudashm.Name(os.Getpid(), 1)
		f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return 0, fail("cuEventCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
		}
		_ = f.Close()
		d.shmFile = name
	}
	e := d.nextEv
	d.nextEv++
	d.events[e] = 0
	return e, nil
}

func (d *Driver) EventRecord(e cuda.Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.events[e]; !ok {
		return fail("cuEventRecord", 400, "CUDA_ERROR_INVALID_HANDLE")
	}
	d.events[e]++
	return nil
}

func (d *Driver) EventSynchronize(e cuda.Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.events[e]; !ok {
		return fail("cuEventSynchronize", 400, "CUDA_ERROR_INVALID_HANDLE")
	}
	return nil
}

func (d *Driver) EventDestroy(e cuda.Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.events, e)
	return nil
}

func (d *Driver) IPCGetEventHandle(e cuda.Event) (cuda.IPCEventHandle, error) {
	var h cuda.IPCEventHandle
	binary.LittleEndian.PutUint64(h[:], uint64(e))
	return h, nil
}

// IPCOpenEventHandle gives the opener an event of its own, as the real
// driver does; the fake's shares the producer's record count.
func (d *Driver) IPCOpenEventHandle(h cuda.IPCEventHandle) (cuda.Event, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := cuda.Event(binary.LittleEndian.Uint64(h[:]))
	if _, ok := d.events[e]; !ok {
		return 0, fail("cuIpcOpenEventHandle", 400, "CUDA_ERROR_INVALID_HANDLE")
	}
	o := d.nextEv
	d.nextEv++
	d.events[o] = 0
	return o, nil
}

// Live returns the number of allocations not freed.
func (d *Driver) Live() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.allocs)
}

// Opened returns the number of IPC opens not closed.
func (d *Driver) Opened() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, c := range d.opened {
		n += c
	}
	return n
}

// Events returns the number of events not destroyed.
func (d *Driver) Events() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.events)
}

// Contexts returns the primary-context references held on dev.
func (d *Driver) Contexts(dev int) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.retained[dev]
}

package cudafake

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/cuda"
)

// The virtual memory calls. An allocation is a sealed memfd named
// after its device, so that its descriptor travels between processes
// as the real driver's does, and a mapping is a mapping of it: processes
// that import one allocation share its bytes, and the memory is gone
// once no process holds a descriptor or a mapping of it, killed or not.
// Unlike the real driver's, whose descriptors all name /dev/nvidiactl,
// each allocation's descriptor names a file of its own; nothing may rely
// on either.

// Granularity is the fake's allocation granularity, the real one's on
// current GPUs.
const Granularity = 2 << 20

// memName is the name of device dev's allocations; MemFDPrefix is what
// every one's starts with.
func memName(dev int) string { return MemFDPrefix + strconv.Itoa(dev) }

// MemFDPrefix begins the name of every allocation's memfd: a process
// that holds one, by descriptor or mapping, holds fake device memory.
const MemFDPrefix = "cudafake-gpu"

// vmem is an allocation made or imported here.
type vmem struct {
	fd   int // the memfd, this process's own
	dev  int
	size int64
	refs int // the handle and each mapping
}

// vmap is a mapping of an allocation at a reserved address.
type vmap struct {
	mem        *vmem
	data       []byte
	accessible bool // MemSetAccess was called
}

func (d *Driver) unref(m *vmem) {
	if m.refs--; m.refs == 0 {
		_ = unix.Close(m.fd)
		d.used -= m.size
	}
}

// SetFDExport sets what FDExportSupported answers for dev (true by
// default), to test the path for devices that cannot export descriptors,
// which older drivers and some virtualised GPUs cannot.
func (d *Driver) SetFDExport(dev int, ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.noFDExport[dev] = !ok
}

func (d *Driver) FDExportSupported(dev int) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if dev < 0 || dev >= d.devices {
		return false, fail("cuDeviceGet", 101, "CUDA_ERROR_INVALID_DEVICE")
	}
	return !d.noFDExport[dev], nil
}

func (d *Driver) MemGranularity(dev int) (int64, error) {
	if dev < 0 || dev >= d.devices {
		return 0, fail("cuMemGetAllocationGranularity", 101, "CUDA_ERROR_INVALID_DEVICE")
	}
	return Granularity, nil
}

func (d *Driver) MemCreate(dev int, size int64) (cuda.MemHandle, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case dev < 0 || dev >= d.devices:
		return 0, fail("cuMemCreate", 101, "CUDA_ERROR_INVALID_DEVICE")
	case size <= 0 || size%Granularity != 0:
		return 0, fail("cuMemCreate", 1, "CUDA_ERROR_INVALID_VALUE")
	case d.limit > 0 && d.used+size > d.limit:
		return 0, fail("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
	}
	fd, err := unix.MemfdCreate(memName(dev), unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return 0, fail("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
	}
	if err := newMemory(fd, size); err != nil {
		_ = unix.Close(fd)
		return 0, fail("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
	}
	return d.addMem(&vmem{fd: fd, dev: dev, size: size, refs: 1}), nil
}

// newMemory gives memfd fd its size, fills it with garbage as a GPU's
// fresh memory holds, and seals its size.
func newMemory(fd int, size int64) error {
	if err := unix.Fallocate(fd, 0, 0, size); err != nil {
		return err
	}
	data, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	for i := range data {
		data[i] = 0xab
	}
	_ = unix.Munmap(data)
	_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL)
	return err
}

func (d *Driver) addMem(m *vmem) cuda.MemHandle {
	d.used += m.size
	d.nextMem++
	d.mems[d.nextMem] = m
	return d.nextMem
}

func (d *Driver) MemRelease(h cuda.MemHandle) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	m, ok := d.mems[h]
	if !ok {
		return fail("cuMemRelease", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	delete(d.mems, h)
	d.unref(m)
	return nil
}

func (d *Driver) MemExportFD(h cuda.MemHandle) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	m, ok := d.mems[h]
	if !ok {
		return -1, fail("cuMemExportToShareableHandle", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	fd, err := unix.FcntlInt(uintptr(m.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, fail("cuMemExportToShareableHandle", 2, "CUDA_ERROR_OUT_OF_MEMORY")
	}
	return fd, nil
}

// MemImportFD takes a descriptor of a fake allocation: a sealed memfd
// with an allocation's name. Anything else is refused, as the real
// driver refuses what is not one of its allocations.
func (d *Driver) MemImportFD(fd int) (cuda.MemHandle, error) {
	dev, size, ok := memOf(fd)
	if !ok || dev >= d.devices {
		return 0, fail("cuMemImportFromShareableHandle", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	own, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return 0, fail("cuMemImportFromShareableHandle", 2, "CUDA_ERROR_OUT_OF_MEMORY")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.addMem(&vmem{fd: own, dev: dev, size: size, refs: 1}), nil
}

// memOf returns the device and size of the fake allocation fd is a
// descriptor of.
func memOf(fd int) (dev int, size int64, ok bool) {
	target, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return 0, 0, false
	}
	name, found := strings.CutPrefix(target, "/memfd:"+MemFDPrefix)
	if !found {
		return 0, 0, false
	}
	name, _, _ = strings.Cut(name, " ")
	if dev, err = strconv.Atoi(name); err != nil || dev < 0 {
		return 0, 0, false
	}
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Size <= 0 || st.Size%Granularity != 0 {
		return 0, 0, false
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_GROW) != unix.F_SEAL_SHRINK|unix.F_SEAL_GROW {
		return 0, 0, false
	}
	return dev, st.Size, true
}

func (d *Driver) MemDevice(h cuda.MemHandle) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	m, ok := d.mems[h]
	if !ok {
		return 0, fail("cuMemGetAllocationPropertiesFromHandle", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	return m.dev, nil
}

func (d *Driver) MemAddressReserve(size, _ int64) (cuda.DevicePtr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if size <= 0 || size%Granularity != 0 {
		return 0, fail("cuMemAddressReserve", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	d.next = (d.next + Granularity - 1) &^ (Granularity - 1)
	p := d.next
	d.next += cuda.DevicePtr(size)
	d.reserved[p] = size
	return p, nil
}

func (d *Driver) MemAddressFree(p cuda.DevicePtr, size int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.reserved[p] != size {
		return fail("cuMemAddressFree", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	for q := range d.mapped {
		if q >= p && q < p+cuda.DevicePtr(size) {
			return fail("cuMemAddressFree", 1, "CUDA_ERROR_INVALID_VALUE") // still mapped
		}
	}
	delete(d.reserved, p)
	return nil
}

// reservedAt reports whether [p, p+size) lies in one reservation.
func (d *Driver) reservedAt(p cuda.DevicePtr, size int64) bool {
	for base, n := range d.reserved {
		if p >= base && int64(p-base)+size <= n {
			return true
		}
	}
	return false
}

func (d *Driver) MemMap(p cuda.DevicePtr, size int64, h cuda.MemHandle) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	m, ok := d.mems[h]
	if !ok || size <= 0 || size%Granularity != 0 || size > m.size || !d.reservedAt(p, size) || d.mapped[p] != nil {
		return fail("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	data, err := unix.Mmap(m.fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail("cuMemMap", 2, "CUDA_ERROR_OUT_OF_MEMORY")
	}
	m.refs++
	d.mapped[p] = &vmap{mem: m, data: data}
	return nil
}

func (d *Driver) MemUnmap(p cuda.DevicePtr, size int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	v, ok := d.mapped[p]
	if !ok || int64(len(v.data)) != size {
		return fail("cuMemUnmap", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	delete(d.mapped, p)
	_ = unix.Munmap(v.data)
	d.unref(v.mem)
	return nil
}

func (d *Driver) MemSetAccess(p cuda.DevicePtr, size int64, devs []int) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	v, ok := d.mapped[p]
	if !ok || int64(len(v.data)) != size || len(devs) == 0 {
		return fail("cuMemSetAccess", 1, "CUDA_ERROR_INVALID_VALUE")
	}
	v.accessible = true
	return nil
}

// Mapped returns how many mappings of allocations this process has.
func (d *Driver) Mapped() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.mapped)
}

// MemHandles returns how many allocation handles this process holds.
func (d *Driver) MemHandles() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.mems)
}

// Held returns how many bytes of fake device memory the processes pids
// hold between them now, by descriptor or mapping, each allocation
// counted once: what the real driver's used memory would show of them.
func Held(pids ...int) int64 {
	seen := map[uint64]bool{}
	var bytes int64
	for _, pid := range pids {
		bytes += held(pid, seen)
	}
	return bytes
}

// held returns the bytes of the allocations process pid holds that are
// not in seen, and adds them to it.
func held(pid int, seen map[uint64]bool) int64 {
	var bytes int64
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	for _, f := range fds {
		path := fmt.Sprintf("/proc/%d/fd/%s", pid, f.Name())
		if target, err := os.Readlink(path); err == nil && strings.HasPrefix(target, "/memfd:"+MemFDPrefix) {
			var st unix.Stat_t
			if unix.Stat(path, &st) == nil && !seen[st.Ino] {
				seen[st.Ino] = true
				bytes += st.Size
			}
		}
	}
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return bytes
	}
	for line := range strings.Lines(string(maps)) {
		f := strings.Fields(line)
		if len(f) < 6 || !strings.HasPrefix(f[5], "/memfd:"+MemFDPrefix) {
			continue
		}
		ino, _ := strconv.ParseUint(f[4], 10, 64)
		if !seen[ino] {
			seen[ino] = true
			var lo, hi uint64
			_, _ = fmt.Sscanf(f[0], "%x-%x", &lo, &hi)
			bytes += int64(hi - lo)
		}
	}
	return bytes
}

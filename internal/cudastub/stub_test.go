//go:build cgo && linux

package cudastub_test

import (
	"bytes"
	"encoding/hex"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/cudastub/internal/drv"
)

func TestErrorNames(t *testing.T) {
	name, rc := drv.ErrorName(0)
	require.Equal(t, 0, rc)
	assert.Equal(t, "CUDA_SUCCESS", *name)
	name, rc = drv.ErrorName(700)
	require.Equal(t, 0, rc)
	assert.Equal(t, "CUDA_ERROR_ILLEGAL_ADDRESS", *name)
	text, rc := drv.ErrorString(700)
	require.Equal(t, 0, rc)
	assert.Equal(t, "an illegal memory access was encountered", *text)

	// An unknown code: INVALID_VALUE, and the string left NULL.
	name, rc = drv.ErrorName(12345)
	assert.Equal(t, errInvalidValue, rc)
	assert.Nil(t, name)
	text, rc = drv.ErrorString(12345)
	assert.Equal(t, errInvalidValue, rc)
	assert.Nil(t, text)
}

func TestNothingBeforeInitAndNoDeviceWithoutStateDir(t *testing.T) {
	c := startChild(t, "nodir", []string{cudastub.EnvDir})
	assert.Equal(t, []string{strconv.Itoa(errNotInitialized)}, c.expect("count"))
	assert.Equal(t, []string{"CUDA_ERROR_ILLEGAL_ADDRESS", "0"}, c.expect("name"))
	assert.Equal(t, []string{strconv.Itoa(errNoDevice)}, c.expect("init"))
	assert.Equal(t, 0, c.wait())
}

func TestDevicesAndContexts(t *testing.T) {
	begin(t)
	n, rc := drv.DeviceCount()
	require.Equal(t, 0, rc)
	assert.Equal(t, 2, n)
	d, rc := drv.DeviceGet(1)
	assert.Equal(t, 0, rc)
	assert.Equal(t, 1, d)
	_, rc = drv.DeviceGet(2)
	assert.Equal(t, errInvalidDevice, rc)
	_, rc = drv.Retain(2)
	assert.Equal(t, errInvalidDevice, rc)

	// Only the attributes the stand-in models.
	v, rc := drv.Attribute(103, 0)
	assert.Equal(t, 0, rc)
	assert.Equal(t, 1, v)
	v, rc = drv.Attribute(102, 1)
	assert.Equal(t, 0, rc)
	assert.Equal(t, 1, v)
	v, rc = drv.Attribute(20, 0)
	assert.Equal(t, 0, rc)
	assert.Equal(t, 0, v)
	_, rc = drv.Attribute(1, 0)
	assert.Equal(t, errInvalidValue, rc)
	_, rc = drv.Attribute(103, 5)
	assert.Equal(t, errInvalidDevice, rc)

	can, rc := drv.CanAccessPeer(0, 1)
	assert.Equal(t, 0, rc)
	assert.Equal(t, 1, can)
	can, _ = drv.CanAccessPeer(1, 1)
	assert.Equal(t, 0, can)
	u0, _ := drv.UUID(0)
	u1, _ := drv.UUID(1)
	assert.NotEqual(t, u0, u1)

	// No context current: every call acting on one refuses, the virtual
	// memory calls included.
	require.Equal(t, 0, drv.CtxSet(0))
	_, rc = drv.Alloc(4096)
	assert.Equal(t, errInvalidContext, rc)
	_, rc = drv.Granularity(drv.DeviceProp(0), 0)
	assert.Equal(t, errInvalidContext, rc)
	_, rc = drv.MemCreate(granule, drv.DeviceProp(0))
	assert.Equal(t, errInvalidContext, rc)
	_, rc = drv.Reserve(granule, 0)
	assert.Equal(t, errInvalidContext, rc)
	assert.Equal(t, errInvalidContext, drv.Unmap(1<<40, granule))
	assert.Equal(t, errInvalidContext, drv.CtxSync())
	_, _, rc = drv.MemInfo()
	assert.Equal(t, errInvalidContext, rc)
	assert.Equal(t, errInvalidContext, drv.CtxSet(0xdead0))

	// Contexts are counted; the last release destroys the context, and
	// a thread where it is still current can do nothing with it.
	c := retain(t, 0)
	c2, rc := drv.Retain(0)
	require.Equal(t, 0, rc)
	assert.Equal(t, c, c2)
	assert.Equal(t, 2, cudastub.Contexts(0))
	g, rc := drv.Granularity(drv.DeviceProp(0), 0)
	assert.Equal(t, 0, rc)
	assert.Equal(t, granule, g)
	_, rc = drv.Granularity(drv.DeviceProp(3), 0)
	assert.Equal(t, errInvalidDevice, rc)
	require.Equal(t, 0, drv.Release(0))
	assert.Equal(t, 1, cudastub.Contexts(0))
	ok(t, drv.CtxSync(), "sync")

	p, rc := drv.Alloc(4096)
	require.Equal(t, 0, rc)
	_, rc = drv.EventCreate(0)
	require.Equal(t, 0, rc)
	assert.Equal(t, 1, cudastub.Allocs())
	assert.Equal(t, 1, cudastub.Events())
	require.Equal(t, 0, drv.Release(0))
	assert.Equal(t, 0, cudastub.Contexts(0))
	// Destroying the context freed what it owned.
	assert.Equal(t, 0, cudastub.Allocs())
	assert.Equal(t, 0, cudastub.Events())
	assert.Equal(t, errInvalidContext, drv.Free(p))
	cur, rc := drv.CtxGet()
	assert.Equal(t, 0, rc)
	assert.Equal(t, c, cur)
	assert.Equal(t, errInvalidContext, drv.CtxSync())
	assert.Equal(t, errInvalidContext, drv.Release(0))
	assert.Equal(t, errInvalidContext, drv.CtxSet(c))
}

func TestAsyncWorkLandsLater(t *testing.T) {
	begin(t)
	cudastub.SetDelay(100 * time.Millisecond)
	c1 := onDevice(t, 1)
	c0 := onDevice(t, 0)
	p, rc := drv.Alloc(4096)
	require.Equal(t, 0, rc)
	defer func() { ok(t, drv.Free(p), "free") }()
	garbage := bytes.Repeat([]byte{0xab}, 4096)

	ops := cudastub.Ops(0)
	ok(t, drv.Memset(p, 0x11, 4096), "memset")
	assert.Equal(t, ops+1, cudastub.Ops(0))
	// Another context's copy does not wait for this one's queue.
	ok(t, drv.CtxSet(c1), "set")
	assert.Equal(t, garbage, read(t, p, 4096), "the memset landed at once")

	ok(t, drv.CtxSet(c0), "set")
	want := pattern(3, 4096)
	ok(t, drv.HtoD(p, want), "htod")
	want2 := append([]byte(nil), want...)
	want[0] ^= 0xff // the source is staged at the call
	ok(t, drv.CtxSet(c1), "set")
	assert.Equal(t, garbage, read(t, p, 4096), "the copy landed at once")

	ok(t, drv.CtxSet(c0), "set")
	syncs := cudastub.Syncs()
	ok(t, drv.StreamSync(0), "sync")
	assert.Equal(t, syncs+1, cudastub.Syncs())
	ok(t, drv.CtxSet(c1), "set")
	assert.Equal(t, want2, read(t, p, 4096))
	assert.Equal(t, errInvalidHandle, drv.StreamSync(1), "only the legacy stream exists")
	ok(t, drv.CtxSet(c0), "set")
}

func TestCopyToHostWaits(t *testing.T) {
	begin(t)
	cudastub.SetDelay(100 * time.Millisecond)
	onDevice(t, 0)
	p, rc := drv.Alloc(8192)
	require.Equal(t, 0, rc)
	q, rc := drv.Alloc(8192)
	require.Equal(t, 0, rc)
	want := pattern(9, 8192)
	start := time.Now()
	ok(t, drv.HtoD(p, want), "htod")
	ok(t, drv.DtoD(q, p, 8192), "dtod")
	assert.Equal(t, want, read(t, q, 8192))
	assert.GreaterOrEqual(t, time.Since(start), 90*time.Millisecond, "the copy to the host did not wait")
	// A range beyond the allocation is refused, not sticky.
	assert.Equal(t, errInvalidValue, drv.Memset(p, 0, 8193))
	assert.Equal(t, errInvalidValue, drv.DtoH(make([]byte, 16), p+8190))
	assert.Equal(t, 0, cudastub.Sticky(0))
	ok(t, drv.Free(q), "free")
	assert.Equal(t, errInvalidValue, drv.Free(p+16), "only the base is freed")
	ok(t, drv.Free(p), "free")
}

func TestDestroyingAContextWaitsForItsWork(t *testing.T) {
	begin(t)
	cudastub.SetDelay(150 * time.Millisecond)
	retain(t, 0)
	p, rc := drv.Alloc(4096)
	require.Equal(t, 0, rc)
	ok(t, drv.Memset(p, 1, 4096), "memset")
	start := time.Now()
	ok(t, drv.Release(0), "release")
	assert.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond)
	assert.Equal(t, 0, cudastub.Allocs())
}

func TestUnmapUnderQueuedWorkFaults(t *testing.T) {
	begin(t)
	cudastub.SetDelay(200 * time.Millisecond)
	retain(t, 0)
	h, p := vmm(t, 0, granule)
	ok(t, drv.Memset(p, 0, granule), "memset")
	// Unmapping does not wait for the work (it is not cudaFree): it
	// succeeds, and the work faults.
	ok(t, drv.Unmap(p, granule), "unmap")
	assert.Equal(t, errIllegalAddress, drv.CtxSync())
	assert.Equal(t, errIllegalAddress, drv.StreamSync(0))
	_, rc := drv.Alloc(4096)
	assert.Equal(t, errIllegalAddress, rc)
	assert.Equal(t, errIllegalAddress, cudastub.Sticky(0))
	// Tearing down needs a context: this one is dead until destroyed.
	assert.Equal(t, errIllegalAddress, drv.AddressFree(p, granule))
	ok(t, drv.Release(0), "release")
	retain(t, 0)
	assert.Equal(t, 0, cudastub.Sticky(0))
	ok(t, drv.AddressFree(p, granule), "address free")
	ok(t, drv.MemRelease(h), "release")
	ok(t, drv.CtxSync(), "sync")
	ok(t, drv.Release(0), "release")
}

func TestFreeUnderAnotherContextsWorkFaultsThatContext(t *testing.T) {
	begin(t)
	cudastub.SetDelay(200 * time.Millisecond)
	c1 := onDevice(t, 1)
	c0 := onDevice(t, 0)
	p, rc := drv.Alloc(4096)
	require.Equal(t, 0, rc)
	ok(t, drv.CtxSet(c1), "set")
	ok(t, drv.Memset(p, 7, 4096), "memset from device 1")
	ok(t, drv.CtxSet(c0), "set")
	ok(t, drv.Free(p), "free")
	ok(t, drv.CtxSync(), "device 0's context is fine")
	ok(t, drv.CtxSet(c1), "set")
	assert.Equal(t, errIllegalAddress, drv.CtxSync())
	assert.Equal(t, errIllegalAddress, cudastub.Sticky(1))
	assert.Equal(t, 0, cudastub.Sticky(0))
	// Destroy and retain device 1's context afresh.
	ok(t, drv.Release(1), "release")
	retain(t, 1)
	ok(t, drv.CtxSet(c0), "set")
}

func TestAccessOnlyWhereGranted(t *testing.T) {
	begin(t)
	c1 := onDevice(t, 1)
	retain(t, 0)
	h, rc := drv.MemCreate(granule, drv.DeviceProp(0))
	require.Equal(t, 0, rc)
	p, rc := drv.Reserve(granule, 0)
	require.Equal(t, 0, rc)
	ok(t, drv.Map(p, granule, h), "map")
	// Mapped memory no device may touch yet: a fault, sticky.
	assert.Equal(t, errIllegalAddress, drv.Memset(p, 0, 4096))
	assert.Equal(t, errIllegalAddress, cudastub.Sticky(0))
	assert.Equal(t, errIllegalAddress, drv.CtxSync())
	ok(t, drv.Release(0), "release")
	c0 := retain(t, 0)

	assert.Equal(t, errInvalidValue, drv.SetAccess(p, granule, drv.Access{Dev: 0, Flags: 2}))
	assert.Equal(t, errInvalidDevice, drv.SetAccess(p, granule, drv.Access{Dev: 4, Flags: 3}))
	assert.Equal(t, errInvalidValue, drv.SetAccess(p, granule/2, drv.Access{Dev: 0, Flags: 3}))
	ok(t, drv.SetAccess(p, granule, drv.Access{Dev: 0, Flags: 3}, drv.Access{Dev: 1, Flags: 1}), "access")
	ok(t, drv.Memset(p, 7, 4096), "memset")
	ok(t, drv.CtxSync(), "sync")
	// Device 1 may read, not write.
	ok(t, drv.CtxSet(c1), "set")
	assert.Equal(t, bytes.Repeat([]byte{7}, 16), read(t, p, 16))
	assert.Equal(t, errIllegalAddress, drv.HtoD(p, []byte{1}))
	assert.Equal(t, errIllegalAddress, cudastub.Sticky(1))
	ok(t, drv.Release(1), "release")
	retain(t, 1)

	ok(t, drv.CtxSet(c0), "set")
	vmmFree(t, h, p, granule)
	ok(t, drv.Release(0), "release")
}

func TestAdjacentMappingsAreSeparateRanges(t *testing.T) {
	begin(t)
	onDevice(t, 0)
	h1, rc := drv.MemCreate(granule, drv.DeviceProp(0))
	require.Equal(t, 0, rc)
	h2, rc := drv.MemCreate(granule, drv.DeviceProp(0))
	require.Equal(t, 0, rc)
	p, rc := drv.Reserve(2*granule, 0)
	require.Equal(t, 0, rc)
	assert.Zero(t, p%granule)
	ok(t, drv.Map(p, granule, h1), "map")
	ok(t, drv.Map(p+granule, granule, h2), "map")
	assert.Equal(t, errInvalidValue, drv.Map(p, granule, h2), "mapped twice")
	ok(t, drv.SetAccess(p, granule, drv.Access{Dev: 0, Flags: 3}), "access")
	ok(t, drv.SetAccess(p+granule, granule, drv.Access{Dev: 0, Flags: 3}), "access")

	base, size, rc := drv.AddressRange(p + granule + 10)
	require.Equal(t, 0, rc)
	assert.Equal(t, p+granule, base)
	assert.Equal(t, granule, size)
	base, size, rc = drv.AddressRange(p + 5)
	require.Equal(t, 0, rc)
	assert.Equal(t, p, base)
	assert.Equal(t, granule, size)
	// One copy may not span two mappings.
	assert.Equal(t, errInvalidValue, drv.Memset(p+granule-16, 1, 32))
	assert.Equal(t, 0, cudastub.Sticky(0))

	var local int
	_, _, rc = drv.AddressRange(uint64(uintptr(unsafe.Pointer(&local))))
	assert.Equal(t, errInvalidValue, rc, "a host pointer")
	q, rc := drv.Alloc(100)
	require.Equal(t, 0, rc)
	base, size, rc = drv.AddressRange(q + 50)
	require.Equal(t, 0, rc)
	assert.Equal(t, q, base)
	assert.Equal(t, 100, size)
	ok(t, drv.Free(q), "free")

	assert.Equal(t, errInvalidValue, drv.AddressFree(p, 2*granule), "still mapped")
	assert.Equal(t, errInvalidValue, drv.Unmap(p, 2*granule), "not one mapping")
	ok(t, drv.Unmap(p, granule), "unmap")
	ok(t, drv.Unmap(p+granule, granule), "unmap")
	ok(t, drv.AddressFree(p, 2*granule), "address free")
	ok(t, drv.MemRelease(h1), "release")
	ok(t, drv.MemRelease(h2), "release")
}

func TestOutOfMemory(t *testing.T) {
	begin(t)
	onDevice(t, 0)
	cudastub.SetMemory(64 * mib)
	defer cudastub.SetMemory(cudastub.DefaultMemory)
	free, total, rc := drv.MemInfo()
	require.Equal(t, 0, rc)
	assert.Equal(t, int64(64*mib), total)
	assert.Equal(t, int64(64*mib), free)
	_, rc = drv.MemCreate(128*mib, drv.DeviceProp(0))
	assert.Equal(t, errOutOfMemory, rc)
	h, rc := drv.MemCreate(32*mib, drv.DeviceProp(0))
	require.Equal(t, 0, rc)
	free, _, _ = drv.MemInfo()
	assert.Equal(t, int64(32*mib), free)
	_, rc = drv.MemCreate(48*mib, drv.DeviceProp(0))
	assert.Equal(t, errOutOfMemory, rc)
	_, rc = drv.MemCreate(granule+1, drv.DeviceProp(0))
	assert.Equal(t, errInvalidValue, rc)
	_, rc = drv.MemCreate(granule, drv.Prop{Type: 1, HandleTypes: 2, LocType: 1})
	assert.Equal(t, 801, rc)
	ok(t, drv.MemRelease(h), "release")
	free, _, _ = drv.MemInfo()
	assert.Equal(t, int64(64*mib), free)
}

func TestExportsAreOneFileWithoutCloseOnExec(t *testing.T) {
	begin(t)
	onDevice(t, 0)
	h1, rc := drv.MemCreate(granule, drv.DeviceProp(0))
	require.Equal(t, 0, rc)
	h2, rc := drv.MemCreate(2*granule, drv.DeviceProp(0))
	require.Equal(t, 0, rc)
	fd1, rc := drv.Export(h1)
	require.Equal(t, 0, rc)
	defer unix.Close(fd1)
	fd2, rc := drv.Export(h2)
	require.Equal(t, 0, rc)
	defer unix.Close(fd2)

	var st1, st2 unix.Stat_t
	require.NoError(t, unix.Fstat(fd1, &st1))
	require.NoError(t, unix.Fstat(fd2, &st2))
	assert.Equal(t, st1.Ino, st2.Ino, "exports are opens of one file")
	assert.Equal(t, st1.Dev, st2.Dev)
	flags, err := unix.FcntlInt(uintptr(fd1), unix.F_GETFD, 0)
	require.NoError(t, err)
	assert.Zero(t, flags&unix.FD_CLOEXEC, "the driver promises no close-on-exec")

	// Properties: what was asked for a created handle; no handle types
	// for an imported one.
	pr, rc := drv.Props(h1)
	require.Equal(t, 0, rc)
	assert.Equal(t, drv.Prop{Type: 1, HandleTypes: 1, LocType: 1, LocID: 0}, pr)
	hi, rc := drv.Import(fd2)
	require.Equal(t, 0, rc)
	pr, rc = drv.Props(hi)
	require.Equal(t, 0, rc)
	assert.Equal(t, drv.Prop{Type: 1, HandleTypes: 0, LocType: 1, LocID: 0}, pr)
	_, rc = drv.Export(hi)
	assert.Equal(t, errInvalidValue, rc, "an imported handle is not exportable")
	h0, rc := drv.MemCreate(granule, drv.Prop{Type: 1, LocType: 1})
	require.Equal(t, 0, rc)
	_, rc = drv.Export(h0)
	assert.Equal(t, errInvalidValue, rc, "not made exportable")

	// Anything but an export of this machine is refused.
	null, err := os.Open("/dev/null")
	require.NoError(t, err)
	_, rc = drv.Import(int(null.Fd()))
	assert.Equal(t, errInvalidValue, rc)
	_ = null.Close()

	// An export holds its memory by itself.
	assert.Equal(t, int64(4*granule), cudastub.Held(os.Getpid()))
	ok(t, drv.MemRelease(hi), "release")
	ok(t, drv.MemRelease(h2), "release")
	ok(t, drv.MemRelease(h0), "release")
	assert.Equal(t, int64(3*granule), cudastub.Held(os.Getpid()))

	// A process started now inherits the exports; it holds them.
	c := startChild(t, "hold", nil)
	c.expect("ready")
	assert.Equal(t, int64(3*granule), cudastub.Held(c.pid()))
	assert.Equal(t, 0, c.wait())
	assert.Equal(t, int64(0), cudastub.Held(c.pid()), "a dead process holds nothing")
	_, err = unix.FcntlInt(uintptr(fd1), unix.F_SETFD, unix.FD_CLOEXEC)
	require.NoError(t, err)
	c = startChild(t, "hold", nil)
	c.expect("ready")
	assert.Equal(t, int64(2*granule), cudastub.Held(c.pid()), "only the export still without close-on-exec")
	assert.Equal(t, 0, c.wait())

	ok(t, drv.MemRelease(h1), "release")
	require.NoError(t, unix.Close(fd1))
	require.NoError(t, unix.Close(fd2))
	fd1, fd2 = -1, -1
}

func TestVMMExportOutlivesItsExporter(t *testing.T) {
	begin(t)
	onDevice(t, 0)
	free0, _, rc := drv.MemInfo()
	require.Equal(t, 0, rc)
	sock, theirs := socketpair(t)
	c := startChild(t, "vmmexport", nil, theirs)
	c.expect("sent")
	fd := recvFD(t, sock)
	require.Equal(t, 0, c.wait())

	// The exporter is gone; the descriptor keeps the memory.
	assert.Equal(t, int64(0), cudastub.Held(c.pid()))
	assert.Equal(t, int64(granule), cudastub.Held(os.Getpid()))
	free1, _, _ := drv.MemInfo()
	assert.Equal(t, free0-granule, free1)

	h, rc := drv.Import(fd)
	require.Equal(t, 0, rc)
	require.NoError(t, unix.Close(fd))
	p, rc := drv.Reserve(granule, 0)
	require.Equal(t, 0, rc)
	ok(t, drv.Map(p, granule, h), "map")
	ok(t, drv.MemRelease(h), "release: the mapping keeps the memory")
	ok(t, drv.SetAccess(p, granule, drv.Access{Dev: 0, Flags: 3}), "access")
	assert.Equal(t, pattern('A', 4096), read(t, p, 4096))
	assert.Equal(t, int64(granule), cudastub.Held(os.Getpid()))

	ok(t, drv.Unmap(p, granule), "unmap")
	ok(t, drv.AddressFree(p, granule), "address free")
	free2, _, _ := drv.MemInfo()
	assert.Equal(t, free0, free2, "the memory is back")
}

func TestVisibleDevicesNumberPerProcess(t *testing.T) {
	begin(t)
	onDevice(t, 1)
	u1, rc := drv.UUID(1)
	require.Equal(t, 0, rc)
	hex1 := hex.EncodeToString(u1[:])
	uuidString := "GPU-" + hex1[0:8] + "-" + hex1[8:12] + "-" + hex1[12:16] + "-" + hex1[16:20] + "-" + hex1[20:]

	require.True(t, strings.HasPrefix(uuidString, "GPU-11"))
	for _, tc := range []struct{ visible, count string }{
		{"1", "1"},
		{uuidString, "1"},
		{"GPU-11", "1"}, // a unique prefix
		{"1,0", "2"},
		{"1,7,0", "1"}, // up to the first invalid entry
		{"1,1", "1"},
	} {
		c := startChild(t, "uuid", []string{"CUDA_VISIBLE_DEVICES=" + tc.visible})
		assert.Equal(t, []string{tc.count}, c.expect("count"), tc.visible)
		assert.Equal(t, []string{"0", hex1, "1"}, c.expect("uuid"), "%s: ordinal 0 is physical 1", tc.visible)
		assert.Equal(t, 0, c.wait())
	}
	for _, visible := range []string{"GPU-1", "", "GPU-99", "x,1"} {
		c := startChild(t, "uuid", []string{"CUDA_VISIBLE_DEVICES=" + visible})
		assert.Equal(t, []string{strconv.Itoa(errNoDevice)}, c.expect("init"), "%q: no device", visible)
		assert.Equal(t, 0, c.wait())
	}

	// An allocation crosses processes by physical device: the importer
	// reports its own ordinal, and one that cannot see it refuses.
	h, p := vmm(t, 1, granule)
	want := pattern('V', 16)
	ok(t, drv.HtoD(p, want), "htod")
	ok(t, drv.CtxSync(), "sync")
	fd, rc := drv.Export(h)
	require.Equal(t, 0, rc)
	f := os.NewFile(uintptr(fd), "export")
	defer f.Close()
	c := startChild(t, "import", []string{"CUDA_VISIBLE_DEVICES=1"}, f)
	assert.Equal(t, []string{"0"}, c.expect("import"))
	assert.Equal(t, []string{"0", "0"}, c.expect("props"))
	assert.Equal(t, []string{hex.EncodeToString(want)}, c.expect("data"))
	assert.Equal(t, 0, c.wait())
	c = startChild(t, "import", []string{"CUDA_VISIBLE_DEVICES=0"}, f)
	assert.Equal(t, []string{strconv.Itoa(errInvalidDevice)}, c.expect("import"))
	assert.Equal(t, 0, c.wait())
	require.NoError(t, f.Close())
	vmmFree(t, h, p, granule)
}

func TestLegacyIPC(t *testing.T) {
	begin(t)
	onDevice(t, 0)
	p, rc := drv.Alloc(4096)
	require.Equal(t, 0, rc)
	want := pattern('P', 4096)
	ok(t, drv.HtoD(p, want), "htod")
	ok(t, drv.CtxSync(), "sync")
	_, rc = drv.IPCGetMem(p + 64)
	assert.Equal(t, errInvalidValue, rc, "not an allocation's base")
	h, rc := drv.IPCGetMem(p)
	require.Equal(t, 0, rc)
	_, rc = drv.IPCOpenMem(h, 1)
	assert.Equal(t, errInvalidContext, rc, "the real driver refuses same-process opens")

	env := []string{"TMSTUB_TEST_HANDLE=" + hex.EncodeToString(h[:])}
	c := startChild(t, "ipcopen", env)
	assert.Equal(t, []string{"0"}, c.expect("open"))
	assert.Equal(t, []string{hex.EncodeToString(want[:16])}, c.expect("data"))
	assert.Equal(t, []string{"0", "true", "2"}, c.expect("again"), "opened twice: one mapping, counted")
	assert.Equal(t, []string{"0", "0", "0"}, c.expect("close"))
	assert.Equal(t, 0, c.wait())
	c = startChild(t, "ipcopen", append(env, "CUDA_VISIBLE_DEVICES=1"))
	assert.Equal(t, []string{strconv.Itoa(errInvalidDevice)}, c.expect("open"))
	assert.Equal(t, 0, c.wait())

	ok(t, drv.Free(p), "free")
	c = startChild(t, "ipcopen", env)
	assert.Equal(t, []string{strconv.Itoa(errInvalidHandle)}, c.expect("open"), "freed")
	assert.Equal(t, 0, c.wait())

	// Another process's memory, open while it lives and not after.
	c = startChild(t, "ipcowner", nil)
	ho := decodeHandle(t, c.expect("handle")[0])
	_, rc = drv.IPCOpenMem(ho, 2)
	assert.Equal(t, errInvalidValue, rc, "flags")
	q, rc := drv.IPCOpenMem(ho, 1)
	require.Equal(t, 0, rc)
	assert.Equal(t, 1, cudastub.IPCOpened())
	assert.Equal(t, pattern('O', 4096), read(t, q, 4096))
	base, size, rc := drv.AddressRange(q + 100)
	require.Equal(t, 0, rc)
	assert.Equal(t, q, base)
	assert.Equal(t, 4096, size)
	assert.Equal(t, int64(4096), cudastub.Held(c.pid()))
	ok(t, drv.IPCCloseMem(q), "close")
	assert.Equal(t, errInvalidValue, drv.IPCCloseMem(q))
	assert.Equal(t, 0, c.wait())
	_, rc = drv.IPCOpenMem(ho, 1)
	assert.Equal(t, errInvalidHandle, rc, "the exporter has exited")
}

func TestExclusiveProcessComputeMode(t *testing.T) {
	begin(t)
	cudastub.SetComputeMode(0, 3)
	defer cudastub.SetComputeMode(0, 0)
	mode, rc := drv.Attribute(20, 0)
	require.Equal(t, 0, rc)
	assert.Equal(t, 3, mode)

	retain(t, 0)
	c := startChild(t, "retain", nil)
	assert.Equal(t, []string{strconv.Itoa(errUnavailable), "3"}, c.expect("retain"))
	assert.Equal(t, 0, c.wait())
	// Device 1 stays open to everyone.
	c = startChild(t, "retain", []string{"CUDA_VISIBLE_DEVICES=1"})
	assert.Equal(t, []string{"0", "0"}, c.expect("retain"))
	assert.Equal(t, 0, c.wait())

	ok(t, drv.Release(0), "release")
	c = startChild(t, "retain", nil)
	assert.Equal(t, []string{"0", "3"}, c.expect("retain"))
	assert.Equal(t, 0, c.wait())
}

func TestInterprocessEvents(t *testing.T) {
	begin(t)
	shm := shmFile(os.Getpid())
	retain(t, 0)
	_, rc := drv.EventCreate(4)
	assert.Equal(t, errInvalidValue, rc, "interprocess events must not time")
	plain, rc := drv.EventCreate(2)
	require.Equal(t, 0, rc)
	_, rc = drv.IPCGetEvent(plain)
	assert.Equal(t, errInvalidHandle, rc)
	assert.False(t, exists(shm))
	e, rc := drv.EventCreate(2 | 4)
	require.Equal(t, 0, rc)
	assert.True(t, exists(shm), "the driver's file for interprocess events")
	h, rc := drv.IPCGetEvent(e)
	require.Equal(t, 0, rc)
	_, rc = drv.IPCOpenEvent(h)
	assert.Equal(t, errInvalidContext, rc, "same-process open")

	c := startChild(t, "evwait", []string{"TMSTUB_TEST_HANDLE=" + hex.EncodeToString(h[:])})
	assert.Equal(t, []string{"0"}, c.expect("open"))
	cudastub.SetDelay(300 * time.Millisecond)
	ok(t, drv.EventRecord(e, 0), "record")
	assert.Equal(t, errInvalidHandle, drv.EventRecord(e, 1))
	c.send("go")
	words := c.expect("sync")
	require.Len(t, words, 2)
	assert.Equal(t, "0", words[0])
	ms, _ := strconv.Atoi(words[1])
	assert.GreaterOrEqual(t, ms, 100, "the other process did not wait for the record")
	ok(t, drv.EventSync(e), "sync")
	assert.Equal(t, 0, c.wait())
	ok(t, drv.EventDestroy(plain), "destroy")
	ok(t, drv.EventDestroy(e), "destroy")
	assert.Equal(t, errInvalidHandle, drv.EventDestroy(e))
	assert.True(t, exists(shm), "kept while a context is")
	ok(t, drv.Release(0), "release")
	assert.False(t, exists(shm), "removed with the last context")
}

func TestEventOfAKilledProcess(t *testing.T) {
	begin(t)
	onDevice(t, 0)
	c := startChild(t, "evowner", nil)
	h := decodeHandle(t, c.expect("handle")[0])
	shm := shmFile(c.pid())
	t.Cleanup(func() { _ = os.Remove(shm) })
	assert.True(t, exists(shm))
	e, rc := drv.IPCOpenEvent(h)
	require.Equal(t, 0, rc)
	time.AfterFunc(200*time.Millisecond, c.kill)
	start := time.Now()
	assert.Equal(t, errUnknown, drv.EventSync(e), "an error, not a hang")
	assert.Less(t, time.Since(start), 10*time.Second)
	<-c.exited
	assert.True(t, exists(shm), "a killed process leaves the driver's file")
	_, rc = drv.IPCOpenEvent(h)
	assert.Equal(t, errInvalidHandle, rc)
	ok(t, drv.EventDestroy(e), "destroy")
}

func TestNoVMM(t *testing.T) {
	c := startChild(t, "novmm", []string{cudastub.EnvNoVMM + "=1"})
	assert.Equal(t, []string{"0", "0", "801", "801"}, c.expect("novmm"))
	assert.Equal(t, 0, c.wait())
}

func TestEnter(t *testing.T) {
	// A process not on the stand-in (no TMSTUB_DIR) goes through Enter:
	// it runs again on a fresh state directory, removed afterwards, and
	// exits as the process it ran did.
	c := startChild(t, "exit", []string{cudastub.EnvDir, "TMSTUB_TEST_CODE=7"})
	words := c.expect("dir")
	require.Len(t, words, 2)
	assert.NotEqual(t, os.Getenv(cudastub.EnvDir), words[0], "a fresh state directory")
	assert.Equal(t, "1", words[1])
	assert.Equal(t, 7, c.wait())
	assert.NoDirExists(t, words[0])

	c = startChild(t, "exit", []string{cudastub.EnvDir, "TMSTUB_TEST_SIGNAL=15"})
	c.expect("dir")
	assert.Equal(t, 128+15, c.wait())

	// Already on it: Enter returns at once, with the same directory.
	c = startChild(t, "exit", nil)
	assert.Equal(t, os.Getenv(cudastub.EnvDir), c.expect("dir")[0])
	assert.Equal(t, 0, c.wait())
}

// Another library's non-blocking stream (SideMemset): the default
// stream's synchronisation and a copy to the host do not wait for it,
// the context's does.
func TestSideStream(t *testing.T) {
	begin(t)
	cudastub.SetDelay(150 * time.Millisecond)
	defer cudastub.SetDelay(cudastub.DefaultDelay)
	retain(t, 0)
	h, p := vmm(t, 0, granule)
	ok(t, drv.Memset(p, 1, 4096), "memset")
	ok(t, drv.CtxSync(), "sync")
	assert.Equal(t, 0, cudastub.SideMemset(p, 4096, 9))
	ok(t, drv.StreamSync(0), "stream sync")
	assert.Equal(t, bytes.Repeat([]byte{1}, 16), read(t, p, 16), "dtoh waited for side stream")
	ok(t, drv.CtxSync(), "ctx sync")
	assert.Equal(t, bytes.Repeat([]byte{9}, 16), read(t, p, 16))
	// Both streams queued at once: each keeps its order.
	for i := 0; i < 20; i++ {
		ok(t, drv.Memset(p, byte(i), 1024), "memset")
		assert.Equal(t, 0, cudastub.SideMemset(p+2048, 1024, byte(100+i)))
	}
	ok(t, drv.CtxSync(), "ctx sync")
	assert.Equal(t, byte(19), read(t, p, 1)[0])
	assert.Equal(t, byte(119), read(t, p+2048, 1)[0])
	vmmFree(t, h, p, granule)
	ok(t, drv.Release(0), "release")
}

//go:build cgo && linux

package cudastub_test

import (
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/cudastub/internal/drv"
)

// children are the functions a re-executed test binary runs (childVar):
// each talks to its test through lines on stdout ("key words...") and
// returns the exit code.
var children = map[string]func() int{
	"vmmexport": childVMMExport,
	"import":    childImport,
	"uuid":      childUUID,
	"ipcopen":   childIPCOpen,
	"ipcowner":  childIPCOwner,
	"retain":    childRetain,
	"evwait":    childEventWait,
	"evowner":   childEventOwner,
	"hold":      childHold,
	"novmm":     childNoVMM,
	"exit":      childExit,
}

func say(format string, args ...any) { fmt.Printf(format+"\n", args...) }

// must ends the child with a message when a call fails.
func must(what string, rc int) {
	if rc != 0 {
		say("fail %s %d", what, rc)
		os.Exit(1)
	}
}

func childRetainCurrent(ord int) {
	c, rc := drv.Retain(ord)
	must("retain", rc)
	must("set", drv.CtxSet(c))
}

func waitStdin() { _, _ = io.Copy(io.Discard, os.Stdin) }

// childNoDir runs without TMSTUB_DIR (and before Enter).
func childNoDir() int {
	if !drv.Open() {
		say("fail open")
		return 1
	}
	_, rc := drv.DeviceCount()
	say("count %d", rc)
	name, rc := drv.ErrorName(700)
	say("name %s %d", *name, rc)
	say("init %d", drv.Init())
	return 0
}

// childVMMExport makes an allocation, writes it, sends an export of it
// down the socket on descriptor 3, and exits holding on to everything.
func childVMMExport() int {
	childRetainCurrent(0)
	h, rc := drv.MemCreate(granule, drv.DeviceProp(0))
	must("create", rc)
	p, rc := drv.Reserve(granule, 0)
	must("reserve", rc)
	must("map", drv.Map(p, granule, h))
	must("access", drv.SetAccess(p, granule, drv.Access{Dev: 0, Flags: 3}))
	must("htod", drv.HtoD(p, pattern('A', 4096)))
	must("sync", drv.CtxSync())
	fd, rc := drv.Export(h)
	must("export", rc)
	if err := unix.Sendmsg(3, []byte{1}, unix.UnixRights(fd), nil, 0); err != nil {
		say("fail send %v", err)
		return 1
	}
	say("sent")
	return 0
}

// childImport imports the export on descriptor 3 on the ordinal
// TMSTUB_TEST_ORDINAL (default 0), and reports its properties and
// first bytes.
func childImport() int {
	ord, _ := strconv.Atoi(os.Getenv("TMSTUB_TEST_ORDINAL"))
	childRetainCurrent(ord)
	h, rc := drv.Import(3)
	say("import %d", rc)
	if rc != 0 {
		must("release", drv.Release(ord))
		return 0
	}
	pr, rc := drv.Props(h)
	must("props", rc)
	say("props %d %d", pr.LocID, pr.HandleTypes)
	p, rc := drv.Reserve(granule, 0)
	must("reserve", rc)
	must("map", drv.Map(p, granule, h))
	must("access", drv.SetAccess(p, granule, drv.Access{Dev: ord, Flags: 3}))
	b := make([]byte, 16)
	must("dtoh", drv.DtoH(b, p))
	say("data %s", hex.EncodeToString(b))
	must("unmap", drv.Unmap(p, granule))
	must("free", drv.AddressFree(p, granule))
	must("release", drv.MemRelease(h))
	must("release", drv.Release(ord))
	return 0
}

// childUUID reports the devices this process sees.
func childUUID() int {
	n, rc := drv.DeviceCount()
	must("count", rc)
	say("count %d", n)
	for ord := range n {
		u, rc := drv.UUID(ord)
		must("uuid", rc)
		say("uuid %d %s %d", ord, hex.EncodeToString(u[:]), cudastub.Physical(ord))
	}
	return 0
}

// childIPCOpen opens the legacy IPC handle TMSTUB_TEST_HANDLE twice,
// reads it, and closes it twice.
func childIPCOpen() int {
	childRetainCurrent(0)
	defer drv.Release(0)
	var h [64]byte
	b, _ := hex.DecodeString(os.Getenv("TMSTUB_TEST_HANDLE"))
	copy(h[:], b)
	p, rc := drv.IPCOpenMem(h, 1)
	say("open %d", rc)
	if rc != 0 {
		return 0
	}
	data := make([]byte, 16)
	must("dtoh", drv.DtoH(data, p))
	say("data %s", hex.EncodeToString(data))
	q, rc := drv.IPCOpenMem(h, 1)
	say("again %d %t %d", rc, p == q, cudastub.IPCOpened())
	say("close %d %d %d", drv.IPCCloseMem(p), drv.IPCCloseMem(p), cudastub.IPCOpened())
	return 0
}

// childIPCOwner exports a written allocation and holds it until its
// stdin ends, then exits without freeing it.
func childIPCOwner() int {
	childRetainCurrent(0)
	p, rc := drv.Alloc(4096)
	must("alloc", rc)
	must("htod", drv.HtoD(p, pattern('O', 4096)))
	must("sync", drv.CtxSync())
	h, rc := drv.IPCGetMem(p)
	must("handle", rc)
	say("handle %s", hex.EncodeToString(h[:]))
	waitStdin()
	return 0
}

// childRetain tries to retain ordinal 0's context.
func childRetain() int {
	mode, rc := drv.Attribute(20, 0)
	must("attribute", rc)
	_, rc = drv.Retain(0)
	say("retain %d %d", rc, mode)
	if rc == 0 {
		must("release", drv.Release(0))
	}
	return 0
}

// childEventWait opens the event TMSTUB_TEST_HANDLE, then, when told,
// waits for it.
func childEventWait() int {
	childRetainCurrent(0)
	var h [64]byte
	b, _ := hex.DecodeString(os.Getenv("TMSTUB_TEST_HANDLE"))
	copy(h[:], b)
	e, rc := drv.IPCOpenEvent(h)
	say("open %d", rc)
	if rc != 0 {
		return 0
	}
	var line [8]byte
	_, _ = os.Stdin.Read(line[:])
	start := time.Now()
	rc = drv.EventSync(e)
	say("sync %d %d", rc, time.Since(start).Milliseconds())
	must("destroy", drv.EventDestroy(e))
	must("release", drv.Release(0))
	return 0
}

// childEventOwner records an interprocess event whose record will not
// run for a minute, says its handle, and waits to be killed.
func childEventOwner() int {
	childRetainCurrent(0)
	e, rc := drv.EventCreate(2 | 4)
	must("create", rc)
	cudastub.SetDelay(time.Minute)
	must("record", drv.EventRecord(e, 0))
	h, rc := drv.IPCGetEvent(e)
	must("handle", rc)
	say("handle %s", hex.EncodeToString(h[:]))
	waitStdin()
	return 0
}

// childHold says it is ready and waits for its stdin to end: a process
// that inherited whatever descriptors its parent let it.
func childHold() int {
	say("ready")
	waitStdin()
	return 0
}

// childNoVMM reports what a device without VMM support says.
func childNoVMM() int {
	v102, rc1 := drv.Attribute(102, 0)
	v103, rc2 := drv.Attribute(103, 0)
	must("attribute", rc1|rc2)
	childRetainCurrent(0)
	_, rc := drv.MemCreate(granule, drv.DeviceProp(0))
	_, rc0 := drv.MemCreate(granule, drv.Prop{Type: 1, LocType: 1})
	say("novmm %d %d %d %d", v102, v103, rc, rc0)
	p, rc := drv.Alloc(4096)
	must("alloc", rc)
	_, rc = drv.IPCGetMem(p)
	must("ipc", rc)
	must("free", drv.Free(p))
	must("release", drv.Release(0))
	return 0
}

// childExit says where its state directory is and exits with the code
// TMSTUB_TEST_CODE, or kills itself with signal TMSTUB_TEST_SIGNAL.
func childExit() int {
	say("dir %s %d", os.Getenv(cudastub.EnvDir), len(os.Getenv(cudastub.EnvDevices)))
	if sig, _ := strconv.Atoi(os.Getenv("TMSTUB_TEST_SIGNAL")); sig != 0 {
		_ = unix.Kill(os.Getpid(), unix.Signal(sig))
		time.Sleep(10 * time.Second)
	}
	code, _ := strconv.Atoi(os.Getenv("TMSTUB_TEST_CODE"))
	return code
}

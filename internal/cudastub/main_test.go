//go:build cgo && linux

package cudastub_test

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/cudastub/internal/drv"
	"github.com/tensormp/tensormp/internal/leakcheck"
)

// childVar names the function a re-executed test binary runs (children).
const childVar = "TMSTUB_TEST_CHILD"

const (
	mib     = 1 << 20
	granule = 2 * mib
)

// The CUDA codes the tests expect.
const (
	errInvalidValue   = 1
	errOutOfMemory    = 2
	errNotInitialized = 3
	errUnavailable    = 46
	errNoDevice       = 100
	errInvalidDevice  = 101
	errInvalidContext = 201
	errInvalidHandle  = 400
	errIllegalAddress = 700
	errUnknown        = 999
)

func TestMain(m *testing.M) {
	// A child that must run without the stand-in's state directory runs
	// before Enter, which would give it one.
	if os.Getenv(childVar) == "nodir" {
		os.Exit(childNoDir())
	}
	cudastub.Enter(cudastub.Config{Devices: 2})
	if name := os.Getenv(childVar); name != "" {
		fn := children[name]
		if fn == nil {
			fmt.Fprintf(os.Stderr, "no child %q\n", name)
			os.Exit(2)
		}
		runtime.LockOSThread()
		if !drv.Open() {
			fmt.Fprintln(os.Stderr, "child: no driver")
			os.Exit(2)
		}
		if rc := drv.Init(); rc != 0 {
			fmt.Printf("init %d\n", rc)
			os.Exit(0)
		}
		os.Exit(fn())
	}
	if !cudastub.Active() || !drv.Open() {
		fmt.Fprintln(os.Stderr, "cudastub: the test binary does not run on the stand-in")
		os.Exit(1)
	}
	if rc := drv.Init(); rc != 0 {
		fmt.Fprintf(os.Stderr, "cudastub: cuInit: %d\n", rc)
		os.Exit(1)
	}
	// The safety net of testmain.Run, which this binary cannot use: its
	// children run before the stand-in is entered, not through mp.Init.
	before, err := leakcheck.Take()
	if err != nil {
		fmt.Fprintln(os.Stderr, "cudastub:", err)
		os.Exit(2)
	}
	code := m.Run()
	if code == 0 {
		for _, leak := range before.Leaks(3 * time.Second) {
			fmt.Fprintln(os.Stderr, "cudastub: after the tests:", leak)
			code = 1
		}
	}
	os.Exit(code)
}

// begin starts a test: it keeps the test on one OS thread (never
// unlocked, so the thread and whatever context is current on it end with
// the test), and checks at the end that the test let go of everything.
func begin(t *testing.T) {
	runtime.LockOSThread()
	t.Cleanup(func() {
		for ord := range 2 {
			assert.Equal(t, 0, cudastub.Contexts(ord), "contexts left on %d", ord)
			assert.Equal(t, 0, cudastub.Sticky(ord), "sticky error left on %d", ord)
		}
		assert.Equal(t, 0, cudastub.Allocs(), "allocations left")
		assert.Equal(t, 0, cudastub.Handles(), "handles left")
		assert.Equal(t, 0, cudastub.Mappings(), "mappings left")
		assert.Equal(t, 0, cudastub.IPCOpened(), "IPC opens left")
		assert.Equal(t, 0, cudastub.Events(), "events left")
		assert.Equal(t, int64(0), cudastub.Held(os.Getpid()), "device memory held")
		// The descriptors the stand-in keeps: one of each device's memory
		// and table, one of the event table, and a lock file only while
		// a context lives.
		for name, n := range stateFDs(t) {
			assert.Equal(t, 1, n, "descriptors of %s", name)
			assert.NotContains(t, name, ".excl", "a context's lock file outlived it")
		}
		cudastub.SetDelay(cudastub.DefaultDelay)
	})
}

// retain retains ordinal's primary context and makes it current.
func retain(t *testing.T, ord int) uintptr {
	t.Helper()
	c, rc := drv.Retain(ord)
	require.Equal(t, 0, rc, "cuDevicePrimaryCtxRetain(%d)", ord)
	require.Equal(t, 0, drv.CtxSet(c))
	return c
}

// onDevice retains ordinal's context for the whole test and makes it
// current.
func onDevice(t *testing.T, ord int) uintptr {
	t.Helper()
	c := retain(t, ord)
	t.Cleanup(func() { assert.Equal(t, 0, drv.Release(ord), "release %d", ord) })
	return c
}

func ok(t *testing.T, rc int, what string, args ...any) {
	t.Helper()
	require.Equal(t, 0, rc, append([]any{what}, args...)...)
}

// vmm makes an allocation of size on ord, exportable, mapped at a new
// reservation and accessible to ord.
func vmm(t *testing.T, ord, size int) (h, p uint64) {
	t.Helper()
	h, rc := drv.MemCreate(size, drv.DeviceProp(ord))
	ok(t, rc, "cuMemCreate")
	p, rc = drv.Reserve(size, 0)
	ok(t, rc, "cuMemAddressReserve")
	ok(t, drv.Map(p, size, h), "cuMemMap")
	ok(t, drv.SetAccess(p, size, drv.Access{Dev: ord, Flags: 3}), "cuMemSetAccess")
	return h, p
}

func vmmFree(t *testing.T, h, p uint64, size int) {
	t.Helper()
	ok(t, drv.Unmap(p, size), "cuMemUnmap")
	ok(t, drv.AddressFree(p, size), "cuMemAddressFree")
	ok(t, drv.MemRelease(h), "cuMemRelease")
}

func pattern(seed byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

func read(t *testing.T, p uint64, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	ok(t, drv.DtoH(b, p), "cuMemcpyDtoH")
	return b
}

// child is a re-executed test binary running one of children.
type child struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdin  *os.File
	lines  chan string
	exited chan struct{}
}

// startChild runs children[name] in a new process with env changed
// ("K=V" sets, "K" unsets) and files as descriptors 3, 4, ...
func startChild(t *testing.T, name string, env []string, files ...*os.File) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	// A race-detecting binary sleeps a second at exit unless told not to.
	vars := append(os.Environ(), childVar+"="+name, "GORACE="+os.Getenv("GORACE")+" atexit_sleep_ms=0")
	for _, kv := range env {
		if k, _, set := strings.Cut(kv, "="); set {
			vars = append(vars, kv)
		} else {
			vars = without(vars, k)
		}
	}
	cmd.Env = vars
	cmd.ExtraFiles = files
	cmd.Stderr = os.Stderr
	inR, inW, err := os.Pipe()
	require.NoError(t, err)
	outR, outW, err := os.Pipe()
	require.NoError(t, err)
	cmd.Stdin, cmd.Stdout = inR, outW
	require.NoError(t, cmd.Start())
	_ = inR.Close()
	_ = outW.Close()
	c := &child{t: t, cmd: cmd, stdin: inW, lines: make(chan string, 16), exited: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(outR)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		_ = outR.Close()
		close(c.lines)
	}()
	go func() {
		_ = cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(func() {
		_ = c.stdin.Close()
		select {
		case <-c.exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-c.exited
		}
	})
	return c
}

func without(env []string, key string) []string {
	var out []string
	for _, kv := range env {
		if k, _, _ := strings.Cut(kv, "="); k != key {
			out = append(out, kv)
		}
	}
	return out
}

// expect returns the words after key of the child's next line, which
// must begin with key.
func (c *child) expect(key string) []string {
	c.t.Helper()
	select {
	case line, open := <-c.lines:
		require.True(c.t, open, "the child ended before saying %q", key)
		f := strings.Fields(line)
		require.True(c.t, len(f) > 0 && f[0] == key, "the child said %q, not %q", line, key)
		return f[1:]
	case <-time.After(15 * time.Second):
		c.t.Fatalf("the child did not say %q", key)
		return nil
	}
}

func (c *child) send(line string) {
	_, err := c.stdin.WriteString(line + "\n")
	require.NoError(c.t, err)
}

// wait closes the child's stdin and returns its exit code.
func (c *child) wait() int {
	c.t.Helper()
	_ = c.stdin.Close()
	select {
	case <-c.exited:
	case <-time.After(15 * time.Second):
		c.t.Fatal("the child did not exit")
	}
	return c.cmd.ProcessState.ExitCode()
}

func (c *child) kill() {
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.exited
}

func (c *child) pid() int { return c.cmd.Process.Pid }

// socketpair returns a connected pair: this process's end and the
// child's, as a file for ExtraFiles.
func socketpair(t *testing.T) (int, *os.File) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Close(fds[0]) })
	f := os.NewFile(uintptr(fds[1]), "socket")
	t.Cleanup(func() { _ = f.Close() })
	return fds[0], f
}

func recvFD(t *testing.T, sock int) int {
	t.Helper()
	buf, oob := make([]byte, 1), make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(sock, buf, oob, unix.MSG_CMSG_CLOEXEC)
	require.NoError(t, err)
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	require.NoError(t, err)
	require.Len(t, msgs, 1)
	fds, err := unix.ParseUnixRights(&msgs[0])
	require.NoError(t, err)
	require.Len(t, fds, 1)
	return fds[0]
}

func decodeHandle(t *testing.T, s string) [64]byte {
	var h [64]byte
	b, err := hex.DecodeString(s)
	require.NoError(t, err)
	require.Len(t, b, 64)
	copy(h[:], b)
	return h
}

// shmFile is the file the driver keeps in /dev/shm for process pid's
// interprocess events.
func shmFile(pid int) string { return fmt.Sprintf("/dev/shm/cuda.shm.0.%x.1", pid) }

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// stateFDs counts this process's descriptors of each file of the state
// directory.
func stateFDs(t *testing.T) map[string]int {
	dir := os.Getenv(cudastub.EnvDir)
	fds, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	n := map[string]int{}
	for _, fd := range fds {
		target, err := os.Readlink("/proc/self/fd/" + fd.Name())
		if err == nil && strings.HasPrefix(target, dir+"/") {
			n[strings.TrimPrefix(target, dir+"/")]++
		}
	}
	return n
}

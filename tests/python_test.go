package tests

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/cudashm"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/pytorch"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

// requirePythonEnv, when set, makes a missing Python with torch and NumPy
// fail the Python tests instead of skipping them (CI sets it).
const requirePythonEnv = "TENSORMP_REQUIRE_PYTHON"

// libEnv names a libtensormp.so built already, for the Python tests to
// use instead of building one (on a machine without Go, say). The Python
// package reads the same variable.
const libEnv = "TENSORMP_LIB"

// installedEnv, when set, says the Python interpreter has the tensormp
// package installed (python3 -m pip install ./python): the tests run that
// copy, with the library its wheel holds, instead of this tree's.
const installedEnv = "TENSORMP_PYTHON_INSTALLED"

// pythonSetup is the Python interpreter the tests run and the package and
// library they give it, found and built once.
var pythonSetup = sync.OnceValues(func() (pythonRun, error) {
	var run pythonRun
	var err error
	if run.python, err = pytorch.Find(pytorch.Candidates(os.Getenv(pytorch.EnvVar))...); err != nil {
		return run, err
	}
	tree, err := filepath.Abs("../python")
	if err != nil {
		return run, err
	}
	if os.Getenv(installedEnv) != "" {
		return run, checkInstalled(run, tree)
	}
	run.env = append(run.env, "PYTHONPATH="+tree)
	if lib := os.Getenv(libEnv); lib != "" {
		lib, err = filepath.Abs(lib)
		run.env = append(run.env, libEnv+"="+lib)
		return run, err
	}
	dir, err := os.MkdirTemp("", "tensormp-python")
	if err != nil {
		return run, err
	}
	pythonCleanup = func() { _ = os.RemoveAll(dir) }
	lib := filepath.Join(dir, "libtensormp.so")
	build := exec.Command("go", "build", "-buildmode=c-shared", "-o", lib, "./cmd/libtensormp")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		return run, fmt.Errorf("building libtensormp: %v\n%s", err, out)
	}
	run.env = append(run.env, libEnv+"="+lib)
	return run, nil
})

// checkInstalled reports whether run's interpreter imports an installed
// tensormp package, with its own library: neither may be tree's.
func checkInstalled(run pythonRun, tree string) error {
	cmd := exec.Command(run.python, "-c", "import tensormp, tensormp._lib; print(tensormp.__file__); print(tensormp._lib.path)")
	cmd.Env = run.environ()
	cmd.Dir = os.TempDir()
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s=%s, but %s does not import tensormp: %v\n%s", installedEnv, os.Getenv(installedEnv), run.python, err, out)
	}
	for _, path := range strings.Fields(string(out)) {
		if rel, err := filepath.Rel(tree, path); err == nil && !strings.HasPrefix(rel, "..") {
			return fmt.Errorf("%s=%s, but %s imports tensormp from this tree: %s", installedEnv, os.Getenv(installedEnv), run.python, path)
		}
	}
	return nil
}

// pythonCleanup removes what pythonSetup made; TestMain calls it.
var pythonCleanup = func() {}

// pythonRun is the interpreter the Python tests run, and what its
// environment adds to this process's to find the package and library.
type pythonRun struct {
	python string
	env    []string
}

// environ returns the environment of a Python process: this process's,
// without a package path or library of its own, and run's additions.
func (run pythonRun) environ() []string {
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "PYTHONPATH=") || strings.HasPrefix(kv, libEnv+"=")
	})
	return append(env, run.env...)
}

// pythonPeer is a running tests/testdata/python_peer.py.
type pythonPeer struct {
	cmd  *exec.Cmd
	out  bytes.Buffer
	done chan error
}

// startPython runs python_peer.py in role, reaching addr. Without a
// Python that has torch and NumPy it skips t, unless TENSORMP_REQUIRE_PYTHON
// is set.
func startPython(t *testing.T, role, addr string) *pythonPeer {
	t.Helper()
	run, err := pythonSetup()
	if err != nil {
		if os.Getenv(requirePythonEnv) != "" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	script, err := filepath.Abs("testdata/python_peer.py")
	require.NoError(t, err)
	p := &pythonPeer{cmd: exec.Command(run.python, script, role), done: make(chan error, 1)}
	p.cmd.Env = append(run.environ(), "ENDPOINT="+addr)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	require.NoError(t, p.cmd.Start())
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

// wait waits for the peer to exit and fails t, with its output, unless it
// exited 0.
func (p *pythonPeer) wait(t *testing.T) {
	t.Helper()
	select {
	case err := <-p.done:
		p.done <- err
		require.NoError(t, err, "python peer:\n%s", p.out.String())
	case <-time.After(time.Minute):
		_ = p.cmd.Process.Kill()
		t.Fatalf("python peer did not exit:\n%s", p.output())
	}
}

// output returns what the peer printed, once it has exited: it is given
// a few seconds, then killed.
func (p *pythonPeer) output() string {
	select {
	case err := <-p.done:
		p.done <- err
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		p.done <- <-p.done
	}
	return p.out.String()
}

// check fails t on err, with what was being done and the peer's output.
func (p *pythonPeer) check(t *testing.T, err error, format string, args ...any) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v\npython peer:\n%s", fmt.Sprintf(format, args...), err, p.output())
	}
}

// pythonAddr returns a fresh abstract name for t's peer to dial.
func pythonAddr(t *testing.T) string {
	return "@tensormp-python-" + strconv.Itoa(os.Getpid()) + "-" + strings.ReplaceAll(t.Name(), "/", "-")
}

// acceptPython listens on a fresh abstract name, starts the peer in role
// and returns the peer and its pipe.
func acceptPython(t *testing.T, ctx context.Context, role string) (*pythonPeer, *mp.Pipe) {
	t.Helper()
	addr := pythonAddr(t)
	l, err := mp.Listen(addr)
	require.NoError(t, err)
	defer l.Close()
	peer := startPython(t, role, addr)
	p, cred, err := l.Accept(ctx)
	peer.check(t, err, "accept")
	assert.Equal(t, peer.cmd.Process.Pid, cred.PID)
	t.Cleanup(func() { _ = p.Close() })
	return peer, p
}

// sharedDTypes are the dtypes torch and NumPy both take, and bfloat16
// (torch only).
var sharedDTypes = []tensor.DType{
	tensor.Bool, tensor.Uint8, tensor.Int8, tensor.Int16, tensor.Int32, tensor.Int64,
	tensor.Float16, tensor.BFloat16, tensor.Float32, tensor.Float64,
	tensor.Complex64, tensor.Complex128,
}

// elements returns t's elements in row-major order as complex numbers.
func elements(t *tensor.Tensor) ([]complex128, error) {
	switch t.DType() {
	case tensor.Bool:
		return convert(func(v bool) complex128 {
			if v {
				return 1
			}
			return 0
		})(tensor.Values[bool](t))
	case tensor.Uint8:
		return convert(func(v uint8) complex128 { return complex(float64(v), 0) })(tensor.Values[uint8](t))
	case tensor.Int8:
		return convert(func(v int8) complex128 { return complex(float64(v), 0) })(tensor.Values[int8](t))
	case tensor.Int16:
		return convert(func(v int16) complex128 { return complex(float64(v), 0) })(tensor.Values[int16](t))
	case tensor.Int32:
		return convert(func(v int32) complex128 { return complex(float64(v), 0) })(tensor.Values[int32](t))
	case tensor.Int64:
		return convert(func(v int64) complex128 { return complex(float64(v), 0) })(tensor.Values[int64](t))
	case tensor.Float16:
		return convert(func(v tensor.Half) complex128 { return complex(float64(v.Float32()), 0) })(tensor.Values[tensor.Half](t))
	case tensor.BFloat16:
		return convert(func(v tensor.BHalf) complex128 { return complex(float64(v.Float32()), 0) })(tensor.Values[tensor.BHalf](t))
	case tensor.Float32:
		return convert(func(v float32) complex128 { return complex(float64(v), 0) })(tensor.Values[float32](t))
	case tensor.Float64:
		return convert(func(v float64) complex128 { return complex(v, 0) })(tensor.Values[float64](t))
	case tensor.Complex64:
		return convert(func(v complex64) complex128 { return complex128(v) })(tensor.Values[complex64](t))
	case tensor.Complex128:
		return tensor.Values[complex128](t)
	}
	return nil, fmt.Errorf("no elements for %v", t.DType())
}

// convert returns a function that converts what tensor.Values returns
// with f.
func convert[T any](f func(T) complex128) func([]T, error) ([]complex128, error) {
	return func(vs []T, err error) ([]complex128, error) {
		if err != nil {
			return nil, err
		}
		out := make([]complex128, len(vs))
		for i, v := range vs {
			out[i] = f(v)
		}
		return out, nil
	}
}

// pyElements turns the peer's [re, im] pairs and plain numbers into
// complex numbers.
func pyElements(vs []any) []complex128 {
	out := make([]complex128, len(vs))
	for i, v := range vs {
		switch x := v.(type) {
		case []any:
			out[i] = complex(toFloat(x[0]), toFloat(x[1]))
		default:
			out[i] = complex(toFloat(x), 0)
		}
	}
	return out
}

func toFloat(v any) float64 {
	switch x := v.(type) {
	case float64:
		return x
	case float32:
		return float64(x)
	case int64:
		return float64(x)
	case uint64:
		return float64(x)
	case int8, int16, int32, uint8, uint16, uint32:
		n, _ := strconv.ParseFloat(fmt.Sprint(x), 64)
		return n
	}
	return -1
}

func ints(vs []any) []int {
	out := make([]int, len(vs))
	for i, v := range vs {
		out[i] = int(toFloat(v))
	}
	return out
}

// Go tensors of every dtype, contiguous and not, reach a PyTorch and a
// NumPy consumer without a copy: they see the values and layout Go has,
// and their in-place writes show in Go's memory.
func TestPythonConsumerWritesInPlace(t *testing.T) {
	leakcheck.Check(t)
	pool := shm.DefaultPool()
	inUse := pool.InUse()
	consumeInPython(t, device.CPU(), func() bool { return pool.InUse() > inUse }, "torch", "numpy")
}

// The same for GPU tensors and a PyTorch consumer: it views Go's device
// memory on its device, through CUDA IPC and DLPack.
func TestPythonGPUConsumerWritesInPlace(t *testing.T) {
	rt := requireTorchGPU(t)
	leakcheck.Check(t)
	files := driverFiles(t)
	consumeInPython(t, device.GPU(0), gpuHeld(rt), "torch")
	assert.Equal(t, files, driverFiles(t), "the consumer left no driver files")
}

// consumeInPython sends a consumer Go tensors on place of every dtype,
// contiguous and not, once through each of libs, and checks what the
// consumer saw and wrote. held reports whether another process still
// holds memory of this one; once the consumer has dropped every tensor it
// was sent it must be false, with no exit and no collection needed.
func consumeInPython(t *testing.T, place device.Place, held func() bool, libs ...string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	peer, p := acceptPython(t, ctx, "consumer")
	for _, dt := range sharedDTypes {
		for _, lib := range libs {
			if lib == "numpy" && dt == tensor.BFloat16 {
				continue // NumPy has no bfloat16
			}
			base, err := tensor.On(place).Shared().Arange(dt, 24)
			require.NoError(t, err)
			base, err = base.Reshape(4, 6)
			require.NoError(t, err)
			transposed, err := base.Transpose(0, 1)
			require.NoError(t, err)
			narrowed, err := base.Narrow(1, 1, 3)
			require.NoError(t, err)
			for name, x := range map[string]*tensor.Tensor{"contiguous": base, "transposed": transposed, "narrowed": narrowed} {
				what := fmt.Sprintf("%v %s on %s through %s", dt, name, place, lib)
				want := hostElements(t, x)
				require.NoError(t, p.Send(ctx, map[string]any{"t": x, "lib": lib}), what)
				var got map[string]any
				peer.check(t, p.Recv(ctx, &got), "%s", what)
				assert.Equal(t, dt.String(), got["dtype"], what)
				assert.Equal(t, torchDevice(place), got["device"], what)
				assert.Equal(t, x.Shape(), ints(got["shape"].([]any)), what)
				assert.Equal(t, x.Strides(), ints(got["strides"].([]any)), "%s: the consumer views Go's layout", what)
				assert.Equal(t, want, pyElements(got["values"].([]any)), what)
				after := hostElements(t, x)
				wrote := complex(42, 0)
				if dt == tensor.Bool {
					wrote = 1
				}
				assert.Equal(t, wrote, after[0], "%s: the consumer's write shows in Go's memory", what)
				assert.Equal(t, want[1:], after[1:], what)
			}
			require.NoError(t, base.Release())
		}
	}
	deadline := time.Now().Add(gone)
	for held() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	assert.False(t, held(), "memory still held by the live consumer")
	require.NoError(t, p.Send(ctx, "bye"))
	peer.wait(t)
}

// hostElements returns x's elements, read through host memory when x is
// on a GPU.
func hostElements(t *testing.T, x *tensor.Tensor) []complex128 {
	t.Helper()
	if !x.Place().IsCPU() {
		h, err := x.To(device.CPU())
		require.NoError(t, err)
		defer h.Release()
		x = h
	}
	vs, err := elements(x)
	require.NoError(t, err)
	return vs
}

// torchDevice names place as torch does: "cpu", "cuda:N".
func torchDevice(place device.Place) string {
	return strings.Replace(place.String(), "gpu", "cuda", 1)
}

// gpuHeld returns a function that reports whether another process still
// holds GPU memory this one freed: blocks of its slabs still in use, or,
// by legacy CUDA IPC, allocations in rt's limbo once it is collected.
func gpuHeld(rt *cuda.Runtime) func() bool {
	return func() bool {
		rt.CollectLimbo()
		return rt.Limbo() > 0 || rt.InUse(0) > 0
	}
}

// Tensors a PyTorch and NumPy producer makes reach Go with their values,
// dtype and shape, views included: copied once into shared memory when
// torch or NumPy made them, shared in place when they were born in
// tensormp's memory (Go's write shows in Python).
func TestPythonProducerToGo(t *testing.T) {
	leakcheck.Check(t)
	produceInPython(t, device.CPU())
}

// The same for PyTorch's CUDA tensors: copied once on the GPU when torch
// made them, shared in place when born in tensormp's GPU memory.
func TestPythonGPUProducerToGo(t *testing.T) {
	rt := requireTorchGPU(t)
	leakcheck.Check(t)
	files := driverFiles(t)
	produceInPython(t, device.GPU(0))
	assert.Equal(t, files, driverFiles(t), "the producer's exit took its driver files, though torch held its context")
	rt.CollectLimbo()
	assert.Equal(t, 0, rt.Limbo(), "the producer is gone: nothing of its memory waits here")
}

func produceInPython(t *testing.T, place device.Place) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	peer, p := acceptPython(t, ctx, "producer")
	names := make([]string, len(sharedDTypes))
	for i, dt := range sharedDTypes {
		names[i] = dt.String()
	}
	onCPU := place.IsCPU()
	require.NoError(t, p.Send(ctx, map[string]any{"dtypes": names, "device": torchDevice(place)}))
	// The index into base, 4 x 6, of element (r, c) of each kind of view.
	views := map[string]struct {
		shape []int
		index func(r, c int) int
	}{
		"torch":            {[]int{4, 6}, func(r, c int) int { return r*6 + c }},
		"torch-view":       {[]int{4, 3}, func(r, c int) int { return r*6 + 1 + 2*c }},
		"torch-transposed": {[]int{6, 4}, func(r, c int) int { return c*6 + r }},
		"numpy":            {[]int{4, 6}, func(r, c int) int { return r*6 + c }},
		"numpy-view":       {[]int{2, 2}, func(r, c int) int { return 2*r*6 + 3*c }},
		"born":             {[]int{3, 4}, func(r, c int) int { return (r+1)*6 + c + 2 }},
	}
	seen := map[string]int{}
	for {
		var msg any
		peer.check(t, p.Recv(ctx, &msg), "recv")
		if msg == "end" {
			break
		}
		m := msg.(map[string]any)
		kind, name := m["kind"].(string), m["dtype"].(string)
		x := m["t"].(*tensor.Tensor)
		what := name + " " + kind + " on " + place.String()
		seen[kind]++
		assert.Equal(t, name, x.DType().String(), what)
		assert.Equal(t, place, x.Place(), what)
		v := views[kind]
		require.Equal(t, v.shape, x.Shape(), what)
		got := hostElements(t, x)
		want := make([]complex128, 0, len(got))
		for r := range v.shape[0] {
			for c := range v.shape[1] {
				i := v.index(r, c)
				if x.DType() == tensor.Bool {
					i %= 2
				}
				want = append(want, complex(float64(i), 0))
			}
		}
		assert.Equal(t, want, got, what)
		if onCPU {
			assert.True(t, x.IsShared(), what)
		}
		if kind == "born" {
			assert.Equal(t, []int{6, 1}, x.Strides(), "%s: shared as the view it is, not copied", what)
			assert.Equal(t, int64(x.DType().Size())*8, x.Offset(), what)
			wantSeen := complex(7, 0)
			if x.DType() == tensor.Bool {
				wantSeen = 0
			}
			writeFirst(t, x, real(wantSeen))
			require.NoError(t, p.Send(ctx, "wrote"))
			var reply map[string]any
			peer.check(t, p.Recv(ctx, &reply), "recv")
			assert.Equal(t, []complex128{wantSeen}, pyElements(reply["seen"].([]any)), "%s: Go's write shows in Python", what)
		}
		require.NoError(t, x.Release())
	}
	want := map[string]int{"torch": len(names), "torch-view": len(names), "torch-transposed": len(names), "born": len(names)}
	if onCPU {
		want["numpy"], want["numpy-view"] = len(names)-1, len(names)-1 // NumPy has no bfloat16
	}
	assert.Equal(t, want, seen)
	peer.wait(t)
}

// writeFirst sets x's first element to v and returns once the write is
// done, for another process to see.
func writeFirst(t *testing.T, x *tensor.Tensor, v float64) {
	t.Helper()
	one := must(tensor.Full(x.DType(), v, 1))
	if x.Place().IsCPU() {
		first := must(x.Narrow(0, 0, 1))
		first = must(first.Narrow(1, 0, 1))
		require.NoError(t, tensor.Copy(first, must(one.Reshape(1, 1))))
		return
	}
	b := x.Storage().Backing().(*cuda.Buffer)
	require.NoError(t, b.Write(one.Storage().Bytes(), x.Offset()))
	require.NoError(t, b.Sync())
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// A Python process SIGKILLed while it holds Go's tensors and tensors of
// its own gives Go's memory back, leaves nothing in /dev/shm, and what
// it sent stays readable in Go.
func TestPythonKilledWhileHolding(t *testing.T) {
	leakcheck.Check(t)
	shmBefore := tensormpEntries(t)
	pool := shm.DefaultPool()
	inUse := pool.InUse()
	own, _ := killWhileHolding(t, device.CPU(), func() bool { return pool.InUse() > inUse })
	vs, err := tensor.Values[uint8](own)
	require.NoError(t, err)
	assert.Equal(t, 1<<20, len(vs))
	assert.Equal(t, -1, slices.IndexFunc(vs, func(v uint8) bool { return v != 1 }), "the dead process's tensor is still whole here")
	require.NoError(t, own.Release())
	assert.Empty(t, leftByTheDead(t, shmBefore), "nothing left in /dev/shm")
}

// The same with GPU tensors: the GPU memory Go sent is freed once its
// holder is dead, and the GPU memory it sent stays readable here. The
// CUDA driver's file for the dead process's interprocess events, which
// only that process could remove, is removed by this one.
func TestPythonGPUKilledWhileHolding(t *testing.T) {
	rt := requireTorchGPU(t)
	leakcheck.Check(t)
	shmBefore := tensormpEntries(t)
	files := driverFiles(t)
	own, _ := killWhileHolding(t, device.GPU(0), gpuHeld(rt))
	host := must(own.To(device.CPU()))
	vs := must(tensor.Values[uint8](host))
	assert.Equal(t, 1<<20, len(vs))
	assert.Equal(t, -1, slices.IndexFunc(vs, func(v uint8) bool { return v != 1 }), "the dead process's GPU tensor is still whole here")
	require.NoError(t, own.Release())
	assert.Empty(t, leftByTheDead(t, shmBefore), "nothing of tensormp's left in /dev/shm")
	for _, f := range driverFiles(t) {
		assert.True(t, slices.Contains(files, f), "driver file %s is new", f)
	}
}

// A GPU tensor written on one of torch's side streams and sent before
// the write is done, as the Tensor or as a torch view, arrives with the
// write: the receiver waits for the work torch had queued.
func TestPythonGPUSideStreamWriteArrives(t *testing.T) {
	requireTorchGPU(t)
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	peer, p := acceptPython(t, ctx, "side-stream")
	for range 2 {
		var m map[string]any
		peer.check(t, p.Recv(ctx, &m), "recv")
		x := m["t"].(*tensor.Tensor)
		vs := hostElements(t, x)
		stale := slices.IndexFunc(vs, func(v complex128) bool { return v != 7 })
		assert.Equal(t, -1, stale, "sent as %s: element %d is not written", m["how"], stale)
		require.NoError(t, x.Release())
		require.NoError(t, p.Send(ctx, "seen"))
	}
	peer.wait(t)
}

// killWhileHolding sends a Python process tensors on place, takes one of
// its own, SIGKILLs it while it holds both, and returns its tensor and
// its process id. held reports whether another process still holds
// memory of this one.
func killWhileHolding(t *testing.T, place device.Place, held func() bool) (*tensor.Tensor, int) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	peer, p := acceptPython(t, ctx, "hold")
	sent := make([]*tensor.Tensor, 16)
	for i := range sent {
		sent[i] = must(tensor.On(place).Shared().Full(tensor.Float32, float64(i), 1024))
	}
	require.NoError(t, p.Send(ctx, map[string]any{"t": sent, "device": torchDevice(place)}))
	var report map[string]any
	peer.check(t, p.Recv(ctx, &report), "recv")
	assert.Equal(t, float64(len(sent)), toFloat(report["holding"]))
	var own *tensor.Tensor
	require.NoError(t, p.Recv(ctx, &own))
	assert.Equal(t, place, own.Place())
	for _, x := range sent {
		require.NoError(t, x.Release())
	}
	require.True(t, held(), "the Python process holds Go's memory")
	// A file named as the CUDA driver names one of the peer's, as a peer
	// that sent GPU memory has: the process at the other end of its
	// connection removes it once the peer is dead.
	pid := peer.cmd.Process.Pid
	require.NoError(t, os.WriteFile(cudashm.Name(pid, 1<<19), nil, 0o600))
	t.Cleanup(func() { _ = os.Remove(cudashm.Name(pid, 1<<19)) })

	require.NoError(t, peer.cmd.Process.Signal(syscall.SIGKILL))
	err := <-peer.done
	peer.done <- err
	var xe *exec.ExitError
	require.True(t, errors.As(err, &xe), "killed: %v", err)
	deadline := time.Now().Add(gone)
	for held() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	assert.False(t, held(), "Go's memory came back when the holder died")
	assert.Eventually(t, func() bool { return len(cudashm.Of(pid)) == 0 }, gone, 5*time.Millisecond,
		"the dead peer's driver files are removed")
	err = p.Recv(ctx, new(any))
	assert.ErrorIs(t, err, mp.ErrClosed, "the dead peer's pipe is closed")
	return own, pid
}

// leftByTheDead lists the tensormp_ entries of the shared-memory
// directory that were not there before and belong to a session with no
// live member. Sessions of other programs that run meanwhile (go test runs
// packages side by side) come and go; they are not the dead peer's.
func leftByTheDead(t *testing.T, before []string) []string {
	t.Helper()
	dead, err := mp.Clean(shm.Dir(), true)
	require.NoError(t, err)
	return slices.DeleteFunc(dead, func(name string) bool { return slices.Contains(before, name) })
}

// tensormpEntries lists the tensormp_ entries of the shared-memory
// directory.
func tensormpEntries(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(shm.Dir())
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "tensormp_") {
			names = append(names, e.Name())
		}
	}
	return names
}

// The library answers bad input from Python with errors that say what was
// wrong, and goes on working.
func TestPythonMalformedInput(t *testing.T) {
	leakcheck.Check(t)
	badInputFromPython(t, "malformed", device.CPU(), map[string]string{
		"not-json":              "Error: value is not JSON",
		"text-after":            "Error: value is not JSON: text after the value",
		"unknown-handle":        "Error: no object has handle 987654",
		"handle-not-number":     "Error: tensor object without a numeric handle",
		"wrong-kind-handle":     "is a pipe, not a tensor",
		"unknown-kind":          "Error: unknown $tensormp object kind bomb",
		"bad-base64":            "Error: bytes object: illegal base64",
		"bad-float":             "Error: float object with value big",
		"too-deep":              "nested deeper than 100",
		"closed-handle":         "Closed: Tensor is closed",
		"bad-dtype":             "float8",
		"negative-shape":        "negative size -1",
		"overflow-shape":        "overflows",
		"too-many-dims":         "65 dimensions",
		"recv-on-tensor":        "is neither a queue nor a pipe",
		"close-unknown":         "Error: no object has handle 123456789",
		"dlpack-unknown-handle": "Error: no object has handle 999999",
		"dlpack-bad-as":         "Error: dtype int8 cannot stand for float32",
		"null-dlpack":           "Error: DLManagedTensor is NULL",
		"dial-nowhere":          "Error: mp: dial /nonexistent/tensormp.sock",
		"not-a-tensor":          "InvalidValue: tensormp: cannot send a object",
		"dict-key":              "InvalidValue: tensormp: dict key 1 is not a string",
		"own-key":               "InvalidValue: tensormp: dict key '$tensormp' is tensormp's own",
		"deleter-twice":         "no error",
		"recv-timeout":          "Timeout: ",
		"peer-closed":           "Closed: ",
		"invalid-value-is":      "InvalidValue,Error,TypeError,ValueError",
		"decode-not-json":       "InvalidValue: tensormp: malformed value from the library: JSONDecodeError",
		"decode-no-handle":      "InvalidValue: tensormp: malformed value from the library: KeyError: 'h'",
		"decode-bool-handle":    "InvalidValue: tensormp: malformed value from the library: TypeError: queue object's handle True is not a number",
		"decode-bad-bytes":      "InvalidValue: tensormp: bytes object: ",
		"decode-bad-float":      "InvalidValue: tensormp: float object with value 'big'",
		"decode-unknown-kind":   "InvalidValue: tensormp: unknown object kind 'bomb'",
		"decode-gives-back":     "Error: no object has handle",
	})
}

// DLPack CUDA tensors that lie about their memory, and other bad GPU
// input from Python, get errors that say what was wrong; the library
// goes on working, on the GPU too.
func TestPythonGPUMalformedInput(t *testing.T) {
	requireTorchGPU(t)
	leakcheck.Check(t)
	badInputFromPython(t, "malformed-gpu", device.GPU(0), map[string]string{
		"bogus-pointer":     "Error: cuda: copying from 0x1000 on gpu:0",
		"host-pointer":      "Error: cuda: copying from 0x",
		"past-allocation":   "the memory there ends at",
		"no-such-gpu":       "Error: cuda: device 7 does not exist",
		"negative-gpu":      "Error: DLPack CUDA device -1",
		"managed":           "Error: DLPack device type 13: only CPU and CUDA memory is taken",
		"numpy-of-gpu":      "InvalidValue: tensormp: a tensor on cuda:0 has no NumPy view",
		"empty-no-such-gpu": "cuda: device 7 does not exist",
		"empty-bad-device":  "unknown device type",
	})
}

// badInputFromPython runs a Python peer in role, which feeds the library
// bad input and reports the error each raised: each must contain want's
// text. Then the peer increments a tensor on place in place, to show the
// library still works.
func badInputFromPython(t *testing.T, role string, place device.Place, want map[string]string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	peer, p := acceptPython(t, ctx, role)
	var report map[string]string
	peer.check(t, p.Recv(ctx, &report), "recv")
	for name, text := range want {
		assert.Contains(t, report[name], text, name)
	}
	x := must(tensor.On(place).Shared().Full(tensor.Int32, 41, 8))
	require.NoError(t, p.Send(ctx, x))
	var done string
	peer.check(t, p.Recv(ctx, &done), "recv")
	assert.Equal(t, "incremented", done)
	assert.Equal(t, slices.Repeat([]complex128{42}, 8), hostElements(t, x), "the library still works after bad input")
	require.NoError(t, x.Release())
	peer.wait(t)
}

// A Python process that speaks to an endpoint without the library, with
// messages that are not tensormp's and a descriptor, gets the Go side an
// error, not a crash, and leaves no descriptor behind.
func TestPythonRawSocketIsRefused(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	peer, p := acceptPython(t, ctx, "raw")
	for i, want := range []string{"frame says 0+0 descriptors, 1 arrived", "mp: decoding", "malformed"} {
		var v any
		err := p.Recv(ctx, &v)
		require.Error(t, err, "message %d", i)
		assert.Contains(t, err.Error(), want, "message %d", i)
		assert.Nil(t, v, "message %d", i)
	}
	require.NoError(t, p.Close())
	peer.wait(t)
}

// A Python process that receives, from a hostile Go peer, messages that
// are not well formed (frames that lie, payloads that are not values,
// tensor metadata that names descriptors the message does not carry)
// raises InvalidValue for each, and its library goes on working.
func TestPythonHostilePeer(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	peer, c := acceptPythonConn(t, ctx, "hostile")
	devNull, err := os.Open(os.DevNull)
	require.NoError(t, err)
	defer devNull.Close()
	null := int(devNull.Fd())
	x := must(tensor.On(device.CPU()).Shared().Full(tensor.Int32, 41, 8))

	cases := []struct {
		name   string
		send   func() error
		raises string // the exception's class
		says   string // in its message
	}{
		{"frame-more-descriptors", func() error {
			return sendUnframed(c, append(frameHeader(0, 0, 0, 0), 1), null)
		}, "InvalidValue", "malformed message: frame says 0+0 descriptors, 1 arrived"},
		{"frame-fewer-descriptors", func() error {
			return sendUnframed(c, append(frameHeader(0, 2, 0, 0), 1), null)
		}, "InvalidValue", "malformed message: frame says 0+2 descriptors, 1 arrived"},
		{"frame-unknown-flag", func() error {
			return sendUnframed(c, append(frameHeader(0x80, 0, 0, 0), 1))
		}, "InvalidValue", "malformed message: frame says 0+0 descriptors"},
		{"frame-small-spill", func() error {
			return sendUnframed(c, frameHeader(1, 0, 0, 100), null)
		}, "InvalidValue", "malformed message: a spill of 100 bytes"},
		{"frame-short", func() error {
			return sendUnframed(c, []byte{1, 2, 3})
		}, "InvalidValue", "malformed message: 3 bytes, shorter than a header"},
		{"frame-empty", func() error {
			return sendUnframed(c, nil)
		}, "InvalidValue", "malformed message: an empty message"},
		// The rest are framed well, and what is inside the frame is not:
		// reduction's errors for it wrap ErrMalformed too.
		{"payload-garbage", func() error {
			return c.Send(ctx, []byte{0xc1}, nil)
		}, "InvalidValue", "invalid code 0xc1"},
		{"payload-truncated", func() error {
			return c.Send(ctx, []byte{0x92, 0x01}, nil)
		}, "InvalidValue", "a container of 2 items runs past the message"},
		{"payload-after-value", func() error {
			return c.Send(ctx, []byte{0x01, 0x02}, nil)
		}, "InvalidValue", "1 bytes after the value"},
		{"queue-without-descriptors", func() error {
			return c.Send(ctx, []byte("\xc7\x03\x51abc"), nil)
		}, "InvalidValue", "mp: a queue of 3 bytes"},
		{"tensor-descriptor-out-of-range", func() error {
			return sendMisdescribed(ctx, c, x)
		}, "InvalidValue", "descriptor index 0 out of range: the message has 0"},
		{"tensor-descriptor-not-its-segment", func() error {
			return sendMisdescribed(ctx, c, x, null)
		}, "InvalidValue", "not a regular file"},
		{"descriptor-unused", func() error {
			return sendMisdescribed(ctx, c, "no tensor", null)
		}, "InvalidValue", "the message carried 1 descriptors, 1 of them not used by any tensor"},
	}
	var names []string
	for _, tc := range cases {
		names = append(names, tc.name)
	}
	peer.check(t, sendValue(ctx, c, names), "send the names")
	for _, tc := range cases {
		peer.check(t, tc.send(), "send %s", tc.name)
	}
	var report map[string]string
	peer.check(t, recvValue(ctx, c, &report), "recv the report")
	for _, tc := range cases {
		assert.True(t, strings.HasPrefix(report[tc.name], tc.raises+": "), "%s raised %s, not %s", tc.name, report[tc.name], tc.raises)
		assert.Contains(t, report[tc.name], tc.says, tc.name)
	}
	require.NoError(t, sendValue(ctx, c, x))
	var done string
	peer.check(t, recvValue(ctx, c, &done), "recv")
	assert.Equal(t, "incremented", done)
	assert.Equal(t, slices.Repeat([]complex128{42}, 8), hostElements(t, x), "the library still works after hostile messages")
	require.NoError(t, x.Release())
	require.NoError(t, c.Close())
	peer.wait(t)
}

// acceptPythonConn is acceptPython for a test that speaks the transport
// itself: it returns the peer and the connection, on which the test
// frames, or does not frame, what it sends.
func acceptPythonConn(t *testing.T, ctx context.Context, role string) (*pythonPeer, *sock.Conn) {
	t.Helper()
	addr := pythonAddr(t)
	l, err := sock.Listen(addr, 0o600)
	require.NoError(t, err)
	defer l.Close()
	peer := startPython(t, role, addr)
	s, cred, err := l.Accept(ctx)
	peer.check(t, err, "accept")
	assert.Equal(t, peer.cmd.Process.Pid, cred.PID)
	c, err := sock.New(s, "endpoint")
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return peer, c
}

// sendValue sends v on c as a Pipe sends it.
func sendValue(ctx context.Context, c *sock.Conn, v any) error {
	enc := reduction.NewEncoder()
	data, fds, err := enc.Encode(v)
	if err != nil {
		return err
	}
	if err := c.Send(ctx, data, fds); err != nil {
		enc.Discard()
		return err
	}
	enc.Done()
	return nil
}

// recvValue receives a value on c into v as a Pipe receives it.
func recvValue(ctx context.Context, c *sock.Conn, v any) error {
	m, err := c.Recv(ctx)
	if err != nil {
		return err
	}
	defer m.Done()
	return carry.Decode(m.Data, m.FDs, v)
}

// sendMisdescribed sends v's encoding on c with fds, which stay the
// caller's, in place of the descriptors the encoding made for it.
func sendMisdescribed(ctx context.Context, c *sock.Conn, v any, fds ...int) error {
	enc := reduction.NewEncoder()
	data, _, err := enc.Encode(v)
	if err != nil {
		return err
	}
	defer enc.Discard()
	return c.Send(ctx, data, fds)
}

// frameHeader returns the header of a frame of internal/sock (frame.go):
// flags, direct descriptors, carried descriptors and spilled bytes,
// little-endian, saying whatever the caller wants it to.
func frameHeader(flags byte, direct, carried uint32, spilled uint64) []byte {
	b := binary.LittleEndian.AppendUint32([]byte{flags}, direct)
	b = binary.LittleEndian.AppendUint32(b, carried)
	return binary.LittleEndian.AppendUint64(b, spilled)
}

// sendUnframed sends msg and fds, which stay the caller's, on c's socket
// as one message that c does not frame.
func sendUnframed(c *sock.Conn, msg []byte, fds ...int) error {
	s, err := c.Dup()
	if err != nil {
		return err
	}
	defer s.Close()
	var rights []byte
	if len(fds) > 0 {
		rights = unix.UnixRights(fds...)
	}
	return unix.Sendmsg(s.Num(), msg, rights, nil, unix.MSG_NOSIGNAL)
}

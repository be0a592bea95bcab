package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/pytorch"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/testmain"
)

func TestMain(m *testing.M) {
	// GPUs are the stand-in driver's here, in this process and in the
	// workers, which inherit it: bench -device gpu:0 runs through the
	// real binding on memory the processes share as a GPU's.
	testmain.Run(m, testmain.WithSession(), testmain.WithStandInGPU(cudastub.Config{Devices: 1}))
}

func TestDemo(t *testing.T) {
	leakcheck.Check(t)
	var out, errOut bytes.Buffer
	code := run([]string{"demo", "-workers", "2", "-rounds", "1"}, &out, &errOut)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out.String(), errOut.String())
	assert.Regexp(t, `file_descriptor\s+8\s`, out.String())
	assert.Regexp(t, `file_system\s+8\s`, out.String())
	assert.Contains(t, out.String(), "residue:")
	assert.Contains(t, out.String(), "ok: every value checked")
}

// TestWorkerDeathEndsTheRun: a worker killed in the middle of demo or
// bench makes the command exit non-zero with the worker's error at once,
// not at its own timeout.
func TestWorkerDeathEndsTheRun(t *testing.T) {
	for _, args := range [][]string{
		{"demo", "-workers", "2", "-rounds", "1000000", "-strategy", "file_descriptor"},
		{"bench", "-trips", "100000000", "-strategy", "file_descriptor"},
	} {
		t.Run(args[0], func(t *testing.T) {
			leakcheck.Check(t)
			var out, errOut bytes.Buffer
			done := make(chan int, 1)
			go func() { done <- run(args, &out, &errOut) }()
			var victim int
			require.Eventually(t, func() bool {
				victim = childRunning("mp.worker." + args[0])
				return victim > 0
			}, 30*time.Second, 10*time.Millisecond, "no %s worker started", args[0])
			time.Sleep(200 * time.Millisecond) // well into the exchange
			require.NoError(t, unix.Kill(victim, unix.SIGKILL))
			killed := time.Now()
			select {
			case code := <-done:
				took := time.Since(killed)
				t.Logf("%s exited %d, %v after the kill", args[0], code, took)
				assert.NotEqual(t, 0, code)
				assert.Less(t, took, time.Second)
				assert.Contains(t, errOut.String(), "killed by signal")
			case <-time.After(10 * time.Second):
				t.Fatalf("%s still running 10 s after its worker was killed", args[0])
			}
		})
	}
}

// childRunning returns the pid of a live child of this process that runs
// the reexec function name, or 0.
func childRunning(name string) int {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	me := strconv.Itoa(os.Getpid())
	for _, d := range dirs {
		stat, err := os.ReadFile(d + "/stat")
		if err != nil {
			continue
		}
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(fields) < 2 || fields[1] != me || fields[0] == "Z" {
			continue
		}
		env, _ := os.ReadFile(d + "/environ")
		if bytes.Contains(env, []byte("TENSORMP_REEXEC="+name+"\x00")) {
			pid, _ := strconv.Atoi(filepath.Base(d))
			return pid
		}
	}
	return 0
}

func TestHelp(t *testing.T) {
	for _, args := range [][]string{{"help"}, {"-h"}} {
		var out, errOut bytes.Buffer
		assert.Equal(t, 0, run(args, &out, &errOut))
		assert.Contains(t, out.String(), "demo")
		assert.Contains(t, out.String(), "clean")
	}
	var out, errOut bytes.Buffer
	assert.Equal(t, 0, run([]string{"help", "demo"}, &out, &errOut))
	assert.Contains(t, errOut.String(), "-workers")
	errOut.Reset()
	for _, args := range [][]string{{"help", "help"}, {"help", "-h"}} {
		assert.Equal(t, 0, run(args, &out, &errOut), "%q", args)
		assert.Contains(t, errOut.String(), "usage: spawn help [command]")
		errOut.Reset()
	}
	assert.Equal(t, 0, run([]string{"clean", "-h"}, &out, &errOut))
	assert.Contains(t, errOut.String(), "dry run")
	errOut.Reset()
	assert.Equal(t, 2, run([]string{"frobnicate"}, &out, &errOut))
	assert.Contains(t, errOut.String(), `unknown command "frobnicate"`)
	errOut.Reset()
	assert.Equal(t, 2, run([]string{"demo", "-strategy", "bogus"}, &out, &errOut))
	assert.Contains(t, errOut.String(), `unknown sharing strategy "bogus" (valid: file_descriptor, file_system)`)
	errOut.Reset()
	assert.Equal(t, 2, run([]string{"bench", "-strategy", "file_system,bogus"}, &out, &errOut))
	assert.Contains(t, errOut.String(), `unknown sharing strategy "bogus"`)
	assert.Equal(t, 2, run([]string{"demo", "-workers", "0"}, &out, &errOut))
}

func TestClean(t *testing.T) {
	dir := t.TempDir()
	dead := shm.NamePrefix + "deadbeef_999999999_0123456789abcdef" // no such pid
	live := shm.NamePrefix + "cafe_" + strconv.Itoa(os.Getpid()) + "_0123456789abcdef"
	other := "not_ours"
	// A session whose lock nobody holds is dead, whatever its pids say;
	// one whose lock is held is live.
	unheld := shm.NamePrefix + "f00d_lock"
	unheldSeg := shm.NamePrefix + "f00d_" + strconv.Itoa(os.Getpid()) + "_0123456789abcdef"
	held := shm.NamePrefix + "beef_lock"
	heldSeg := shm.NamePrefix + "beef_999999999_0123456789abcdef"
	for _, n := range []string{dead, live, other, unheld, unheldSeg, held, heldSeg} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, n), nil, 0o600))
	}
	lock, err := os.Open(filepath.Join(dir, held))
	require.NoError(t, err)
	defer lock.Close()
	require.NoError(t, unix.Flock(int(lock.Fd()), unix.LOCK_SH))
	var out, errOut bytes.Buffer
	require.Equal(t, 0, run([]string{"clean", "-n", "-dir", dir}, &out, &errOut), errOut.String())
	assert.Contains(t, out.String(), "would remove "+dead)
	assert.NotContains(t, out.String(), live)
	assert.FileExists(t, filepath.Join(dir, dead), "a dry run removes nothing")

	out.Reset()
	require.Equal(t, 0, run([]string{"clean", "-dir", dir}, &out, &errOut), errOut.String())
	assert.Contains(t, out.String(), "removed "+dead)
	assert.NoFileExists(t, filepath.Join(dir, dead))
	assert.FileExists(t, filepath.Join(dir, live), "a live process's segment stays")
	assert.FileExists(t, filepath.Join(dir, other), "what tensormp did not make stays")
	assert.NoFileExists(t, filepath.Join(dir, unheld))
	assert.NoFileExists(t, filepath.Join(dir, unheldSeg), "an unheld lock means no live member")
	assert.FileExists(t, filepath.Join(dir, held))
	assert.FileExists(t, filepath.Join(dir, heldSeg), "a held lock keeps the session")
}

// TestCleanRemovesOnlyWhatItNamed: in a dead session, only regular files
// whose whole name is one tensormp gives are removed.
func TestCleanRemovesOnlyWhatItNamed(t *testing.T) {
	dir, elsewhere := t.TempDir(), t.TempDir()
	prefix := shm.NamePrefix + "deadbeef_"
	seg := prefix + "999999999_0123456789abcdef"
	target := filepath.Join(elsewhere, "precious")
	require.NoError(t, os.WriteFile(target, []byte("keep"), 0o600))
	for _, n := range []string{seg, prefix + "notes.txt", prefix + "999999999_0123456789ABCDEF", prefix + "999999999_0123456789abcdef.bak"} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, n), nil, 0o600))
	}
	subdir := prefix + "999999998_0123456789abcdef"
	link := prefix + "999999997_0123456789abcdef"
	require.NoError(t, os.Mkdir(filepath.Join(dir, subdir), 0o700))
	require.NoError(t, os.Symlink(target, filepath.Join(dir, link)))
	// A session whose lock others may write is not judged at all.
	foreign := shm.NamePrefix + "f0e1_999999999_0123456789abcdef"
	require.NoError(t, os.WriteFile(filepath.Join(dir, foreign), nil, 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, shm.LockName("f0e1")), nil, 0o600))
	require.NoError(t, os.Chmod(filepath.Join(dir, shm.LockName("f0e1")), 0o666))

	var out, errOut bytes.Buffer
	require.Equal(t, 0, run([]string{"clean", "-dir", dir}, &out, &errOut), errOut.String())
	assert.Equal(t, "removed "+seg+"\nremoved 1 entries from "+dir+"\n", out.String(), "the dead session's one segment, nothing else")
	for _, n := range []string{prefix + "notes.txt", prefix + "999999999_0123456789ABCDEF", prefix + "999999999_0123456789abcdef.bak", subdir, link, foreign} {
		_, err := os.Lstat(filepath.Join(dir, n))
		assert.NoError(t, err, "%s stays", n)
	}
	got, err := os.ReadFile(target)
	require.NoError(t, err)
	assert.Equal(t, "keep", string(got), "a link's target is never touched")
}

func TestBenchLoaderJSON(t *testing.T) {
	leakcheck.Check(t)
	var out, errOut bytes.Buffer
	code := run([]string{"bench", "-loader", "-json", "-batches", "3"}, &out, &errOut)
	require.Equal(t, 0, code, errOut.String())
	rows := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var r loaderResult
		require.NoError(t, json.Unmarshal([]byte(line), &r), line)
		rows[fmt.Sprintf("%s/%s/%d", r.Case, r.Dataset, r.Workers)]++
		assert.Positive(t, r.PerS, line)
		assert.Equal(t, int64(64*(3*224*224*4+8)), r.Bytes)
	}
	want := map[string]int{}
	for _, d := range []string{"transport", "compute"} {
		for w := range 3 {
			want[fmt.Sprintf("loader/%s/%d", d, w)] = 1
			if w > 0 {
				want[fmt.Sprintf("loader_pipe/%s/%d", d, w)] = 1
			}
		}
	}
	assert.Equal(t, want, rows)
}

func TestBenchJSON(t *testing.T) {
	leakcheck.Check(t)
	code, out, errOut := runBench(t, "-json", "-trips", "20", "-stream", "200", "-hold", "100", "-max", "1048576")
	require.Equal(t, 0, code, errOut)
	cases := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var r benchResult
		require.NoError(t, json.Unmarshal([]byte(line), &r), line)
		assert.Contains(t, []string{"file_descriptor", "file_system"}, r.Strategy)
		cases[r.Case]++
		switch r.Case {
		case "roundtrip", "first_share", "floor_roundtrip", "floor_futex_roundtrip", "floor_spin_roundtrip", "lane_roundtrip", "pipe_roundtrip", "pipe_tensor_roundtrip":
			assert.Positive(t, r.P50us)
			assert.GreaterOrEqual(t, r.P99us, r.P50us)
			assert.Contains(t, []int64{4 << 10, 1 << 20}, r.Bytes)
		case "stream", "floor_stream", "lane_stream", "pipe_stream", "pipe_tensor_stream":
			assert.Positive(t, r.PerS)
			assert.Zero(t, r.Batch)
		case "stream_batch", "floor_stream_batch", "lane_stream_batch", "pipe_tensor_stream_batch":
			assert.Positive(t, r.PerS)
			assert.Equal(t, 16, r.Batch)
		case "fds":
			assert.Positive(t, r.FDs)
			assert.Contains(t, []int{100, 1000}, r.Held)
			assert.Contains(t, []int64{4 << 10, 80 << 10}, r.Bytes)
		default:
			t.Errorf("unknown case %q", r.Case)
		}
	}
	want := map[string]int{
		"floor_roundtrip": 4, "floor_futex_roundtrip": 4, "roundtrip": 4, "first_share": 4,
		"floor_stream": 2, "stream": 2, "floor_stream_batch": 2, "stream_batch": 2,
		"fds": 6,
		// The lane's round trip is measured at the first size only.
		"lane_roundtrip": 2, "lane_stream": 2, "lane_stream_batch": 2, "pipe_roundtrip": 2, "pipe_stream": 2,
		"pipe_tensor_roundtrip": 2, "pipe_tensor_stream": 2, "pipe_tensor_stream_batch": 2,
	}
	if manyCPUs(t) {
		want["floor_spin_roundtrip"] = 4
	}
	assert.Equal(t, want, cases)
}

// manyCPUs reports whether this process may run on more than one CPU,
// where bench measures the spin floor unless told -cpus 1.
func manyCPUs(t *testing.T) bool {
	allowed, err := allowedCPUs()
	require.NoError(t, err)
	return len(allowed) > 1
}

// runBench runs spawn bench with args, and fails t if it is still running
// after two minutes.
func runBench(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	done := make(chan int, 1)
	go func() { done <- run(append([]string{"bench"}, args...), &out, &errOut) }()
	select {
	case code = <-done:
		return code, out.String(), errOut.String()
	case <-time.After(2 * time.Minute):
		t.Fatalf("spawn bench %q still running after 2 minutes", args)
		return 0, "", ""
	}
}

func TestBenchPythonJSON(t *testing.T) {
	python, err := pytorch.Find(pytorch.Candidates(os.Getenv(pytorch.EnvVar))...)
	if err != nil {
		if os.Getenv("TENSORMP_REQUIRE_PYTHON") != "" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	leakcheck.Check(t)
	lib := os.Getenv("TENSORMP_LIB") // a library built elsewhere, for a machine without Go
	if lib == "" {
		lib = filepath.Join(t.TempDir(), "libtensormp.so")
		build := exec.Command("go", "build", "-buildmode=c-shared", "-o", lib, "../libtensormp")
		out, err := build.CombinedOutput()
		require.NoError(t, err, "%s", out)
	}
	var stdout, stderr bytes.Buffer
	code := run([]string{"bench", "-python", "-json", "-trips", "20", "-python3", python, "-pylib", lib, "-pypath", "../../python"}, &stdout, &stderr)
	require.Equal(t, 0, code, stderr.String())
	rows := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		var r benchResult
		require.NoError(t, json.Unmarshal([]byte(line), &r), line)
		rows[fmt.Sprintf("%s/%d", r.Case, r.Bytes)]++
		assert.Positive(t, r.P50us, line)
		assert.GreaterOrEqual(t, r.P99us, r.P50us, line)
	}
	assert.Equal(t, map[string]int{
		"python_roundtrip/4096": 1, "python_roundtrip/67108864": 1,
		"torch_roundtrip/4096": 1, "torch_roundtrip/67108864": 1,
	}, rows)
}

// spawn bench -python with a Python that has no torch fails at once and
// says what to install, instead of waiting for a peer that never comes.
func TestBenchPythonWithoutTorch(t *testing.T) {
	fake := filepath.Join(t.TempDir(), "python3")
	script := "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n"
	require.NoError(t, os.WriteFile(fake, []byte(script), 0o700))
	var stdout, stderr bytes.Buffer
	code := run([]string{"bench", "-python", "-python3", fake}, &stdout, &stderr)
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr.String(), fake+": ModuleNotFoundError: No module named 'torch'")
	assert.Contains(t, stderr.String(), pytorch.Hint)
	assert.Empty(t, stdout.String())
}

// spawn bench -device gpu:0 measures GPU round trips beside the CPU's,
// GPU streams and the descriptors held for received GPU tensors; without
// a Python that has torch, torch's cases are left out.
func TestBenchDeviceJSON(t *testing.T) {
	leakcheck.Check(t)
	noTorch := filepath.Join(t.TempDir(), "python3")
	require.NoError(t, os.WriteFile(noTorch, []byte("#!/bin/sh\nexit 1\n"), 0o700))
	var out, errOut bytes.Buffer
	code := run([]string{"bench", "-device", "gpu:0", "-json", "-trips", "20", "-stream", "200", "-batch", "4",
		"-hold", "1000", "-max", "65536", "-python3", noTorch}, &out, &errOut)
	require.Equal(t, 0, code, errOut.String())
	assert.Contains(t, errOut.String(), "torch's cases left out", "said where run's output goes")
	rows := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var r benchResult
		require.NoError(t, json.Unmarshal([]byte(line), &r), line)
		assert.Equal(t, "file_descriptor", r.Strategy)
		assert.Equal(t, int64(4<<10), r.Bytes, line)
		rows[r.Case+"@"+r.Device]++
		switch r.Case {
		case "roundtrip", "floor_roundtrip", "floor_futex_roundtrip", "floor_spin_roundtrip", "lane_roundtrip", "pipe_roundtrip", "pipe_tensor_roundtrip":
			assert.Positive(t, r.P50us, line)
		case "stream", "stream_batch", "floor_stream", "floor_stream_batch", "lane_stream", "lane_stream_batch", "pipe_stream":
			assert.Positive(t, r.PerS, line)
		case "fds":
			assert.Equal(t, 1000, r.Held)
			assert.Positive(t, r.FDs)
			assert.Less(t, r.FDs, 64, "descriptors for 1000 received GPU tensors")
		}
	}
	want := map[string]int{
		"floor_roundtrip@": 2, "floor_futex_roundtrip@": 2, "roundtrip@": 1, "roundtrip@gpu:0": 1,
		"floor_stream@": 1, "stream@gpu:0": 1, "floor_stream_batch@": 1, "stream_batch@gpu:0": 1,
		"fds@gpu:0":       1,
		"lane_roundtrip@": 2, "lane_stream@": 1, "lane_stream_batch@": 1, "pipe_roundtrip@": 2, "pipe_stream@": 1,
		"pipe_tensor_roundtrip@": 1,
	}
	if manyCPUs(t) {
		want["floor_spin_roundtrip@"] = 2
	}
	assert.Equal(t, want, rows)
}

// BenchmarkDeviceOnStandIn runs spawn bench -device gpu:0 on the stand-in
// driver of this test binary, whose work runs a fixed delay after it is
// queued (cudastub.DefaultDelay, as a GPU's launch latency), and reports each
// GPU round trip over the CPU's of its size, measured in the same run,
// and the descriptors a receiver holds for 10,000 GPU tensors:
//
//	go test -run '^$' -bench DeviceOnStandIn -benchtime 1x ./cmd/spawn
func BenchmarkDeviceOnStandIn(b *testing.B) {
	noTorch := filepath.Join(b.TempDir(), "python3")
	require.NoError(b, os.WriteFile(noTorch, []byte("#!/bin/sh\nexit 1\n"), 0o700))
	// This process's device work lands 10 µs after it is queued, about
	// a GPU's launch latency, not the tests' 500 µs.
	cudastub.SetDelay(10 * time.Microsecond)
	defer cudastub.SetDelay(cudastub.DefaultDelay)
	for range b.N {
		var out, errOut bytes.Buffer
		code := run([]string{"bench", "-device", "gpu:0", "-json", "-trips", "2000", "-stream", "20000", "-hold", "10000", "-python3", noTorch}, &out, &errOut)
		require.Equal(b, 0, code, errOut.String())
		p50 := map[string]float64{}
		for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
			var r benchResult
			require.NoError(b, json.Unmarshal([]byte(line), &r), line)
			switch r.Case {
			case "roundtrip":
				p50[fmt.Sprint(r.Bytes, r.Device)] = r.P50us
			case "fds":
				b.ReportMetric(float64(r.FDs), "fds/10k-held")
			}
		}
		for _, size := range deviceSizes {
			cpu, gpu := p50[fmt.Sprint(size, "")], p50[fmt.Sprint(size, "gpu:0")]
			require.Positive(b, cpu, "the CPU round trip of %d bytes", size)
			b.ReportMetric(gpu/cpu, fmt.Sprintf("gpu/cpu-%dKiB", size>>10))
		}
	}
}

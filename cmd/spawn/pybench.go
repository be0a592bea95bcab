package main

import (
	"bufio"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/pytorch"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

const pythonHelp = `With -python, measures tensormp between Go and PyTorch instead: the round
trip of a shared float32 tensor of 4 KiB and 64 MiB from Go to a PyTorch
process, which views it with torch.from_dlpack and puts that torch tensor
back, to Go (python_roundtrip), beside torch.multiprocessing's own round
trip of the same tensor between two Python processes over two Queues
(torch_roundtrip), in the same run. With -pydevice cuda:N the tensors are
on that GPU and travel by CUDA IPC; torch's child then answers with a
word instead of the tensor (torch will not send a CUDA tensor back to
the process it came from), so torch's round trip does less than
tensormp's. Run it from the repository's root: it loads python/ and
builds libtensormp.so unless -pylib names one.`

//go:embed pybench.py
var pybenchScript []byte

type pythonOpts struct {
	python, lib, pkg string
	device           string       // where the tensors are, as torch names it
	place            device.Place // the same, parsed
	trips, stream    int
}

// pythonSizes are the sizes -python measures, with the share of -trips
// each gets.
var pythonSizes = []struct {
	bytes int64
	div   int
}{{4 << 10, 1}, {64 << 20, 10}}

func runPythonBench(o pythonOpts, asJSON bool, stdout, stderr io.Writer, progress func(string)) int {
	place, err := device.Parse(o.device)
	if err != nil || !place.IsCPU() && !place.IsGPU() {
		fmt.Fprintf(stderr, "spawn bench: -pydevice %q: want cpu or cuda:N\n", o.device)
		return 2
	}
	o.place, o.device = place, strings.Replace(place.String(), "gpu", "cuda", 1)
	candidates := pytorch.Candidates(os.Getenv(pytorch.EnvVar))
	if o.python != "" {
		candidates = []string{o.python}
	}
	if o.python, err = pytorch.Find(candidates...); err != nil {
		fmt.Fprintln(stderr, "spawn bench:", err)
		return 2
	}
	// A Python process takes no file_system segments: they belong to a
	// session of Go processes.
	if err := strategy.Set(strategy.FileDescriptor); err != nil {
		fmt.Fprintln(stderr, "spawn bench:", err)
		return 1
	}
	dir, err := os.MkdirTemp("", "tensormp-pybench")
	if err != nil {
		fmt.Fprintln(stderr, "spawn bench:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	if o.lib == "" {
		o.lib = filepath.Join(dir, "libtensormp.so")
		progress("building libtensormp.so")
		build := exec.Command("go", "build", "-buildmode=c-shared", "-o", o.lib, "./cmd/libtensormp")
		if out, err := build.CombinedOutput(); err != nil {
			fmt.Fprintf(stderr, "spawn bench: building libtensormp.so (run from the repository's root, or give -pylib): %v\n%s", err, out)
			return 1
		}
	}
	script := filepath.Join(dir, "pybench.py")
	if err := os.WriteFile(script, pybenchScript, 0o600); err != nil {
		fmt.Fprintln(stderr, "spawn bench:", err)
		return 1
	}
	results := &resultLog{json: asJSON, w: stdout}
	emit := func(r benchResult) {
		if o.device != "cpu" {
			r.Device = o.device
		}
		results.emit(r)
	}
	for _, run := range []func(pythonOpts, string, func(string), func(benchResult)) error{benchGoPython, benchTorch} {
		if err := run(o, script, progress, emit); err != nil {
			fmt.Fprintln(stderr, "spawn bench:", err)
			return 1
		}
	}
	if !asJSON {
		printPythonTable(stdout, results.rs)
	}
	return 0
}

// pythonCmd returns the command that runs the bench script in args.
func pythonCmd(ctx context.Context, o pythonOpts, script string, args ...string) (*exec.Cmd, error) {
	pkg, err := filepath.Abs(o.pkg)
	if err != nil {
		return nil, err
	}
	lib, err := filepath.Abs(o.lib)
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, o.python, append([]string{script}, args...)...)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+pkg, "TENSORMP_LIB="+lib)
	cmd.Stderr = &tailWriter{}
	return cmd, nil
}

// tailWriter keeps the last 4 KiB written to it: a Python traceback.
type tailWriter struct {
	mu  sync.Mutex
	buf []byte
}

func (w *tailWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, b...)
	if over := len(w.buf) - 4096; over > 0 {
		w.buf = w.buf[over:]
	}
	return len(b), nil
}

// pythonErr adds what the Python process printed to err.
func pythonErr(cmd *exec.Cmd, err error) error {
	if w, ok := cmd.Stderr.(*tailWriter); ok && err != nil {
		w.mu.Lock()
		defer w.mu.Unlock()
		if len(w.buf) > 0 {
			return fmt.Errorf("%w; python says:\n%s", err, w.buf)
		}
	}
	return err
}

// benchGoPython measures python_roundtrip.
func benchGoPython(o pythonOpts, script string, progress func(string), emit func(benchResult)) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	addr := "@tensormp-pybench-" + strconv.Itoa(os.Getpid())
	l, err := mp.Listen(addr)
	if err != nil {
		return err
	}
	defer l.Close()
	cmd, err := pythonCmd(ctx, o, script, "echo")
	if err != nil {
		return err
	}
	cmd.Env = append(cmd.Env, "ENDPOINT="+addr)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", o.python, err)
	}
	accepted, acceptCancel := context.WithTimeout(ctx, time.Minute)
	p, _, err := l.Accept(accepted)
	acceptCancel()
	if err != nil {
		return pythonErr(cmd, errors.Join(fmt.Errorf("waiting for the python process: %w", err), waitOrKill(cmd)))
	}
	defer p.Close()
	if err := goPythonTrips(ctx, o, p, progress, emit); err != nil {
		return pythonErr(cmd, errors.Join(err, waitOrKill(cmd)))
	}
	return pythonErr(cmd, cmd.Wait())
}

// waitOrKill gives a failed process a few seconds to finish its last
// words and exit, then kills it.
func waitOrKill(cmd *exec.Cmd) error {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(5 * time.Second):
		_ = cmd.Process.Kill()
		return <-done
	}
}

// goPythonTrips sends each size's tensor to the Python process over p and
// times its return.
func goPythonTrips(ctx context.Context, o pythonOpts, p *mp.Pipe, progress func(string), emit func(benchResult)) error {
	for _, sz := range pythonSizes {
		n := max(o.trips/sz.div, 10)
		progress(fmt.Sprintf("python_roundtrip %s x %d", formatBytes(sz.bytes), n))
		x, err := tensor.On(o.place).Shared().Zeros(tensor.Float32, int(sz.bytes/4))
		if err != nil {
			return err
		}
		ds := make([]time.Duration, 0, n)
		for i := range n + min(n, 20) {
			start := time.Now()
			var back *tensor.Tensor
			if err := p.Send(ctx, x); err != nil {
				return err
			}
			if err := p.Recv(ctx, &back); err != nil {
				return fmt.Errorf("python_roundtrip: %w", err)
			}
			if i >= min(n, 20) {
				ds = append(ds, time.Since(start))
			}
			if back.Storage() != x.Storage() {
				return errors.New("python_roundtrip: the tensor came back on other memory than it left on")
			}
		}
		slices.Sort(ds)
		emit(benchResult{Strategy: "file_descriptor", Case: "python_roundtrip", Bytes: sz.bytes, P50us: pct(ds, 50), P99us: pct(ds, 99)})
		if err := x.Release(); err != nil {
			return err
		}
	}
	return p.Send(ctx, "stop")
}

// benchTorch measures torch_roundtrip: the script reports it.
func benchTorch(o pythonOpts, script string, progress func(string), emit func(benchResult)) error {
	var sizes, counts []string
	for _, sz := range pythonSizes {
		sizes = append(sizes, strconv.FormatInt(sz.bytes, 10))
		counts = append(counts, strconv.Itoa(max(o.trips/sz.div, 10)))
	}
	progress("torch_roundtrip")
	return runPyBench(o, script, func(r benchResult) {
		r.Strategy, r.Case = "file_descriptor", "torch_roundtrip"
		emit(r)
	}, "torch", strings.Join(sizes, ","), strings.Join(counts, ","), o.device)
}

// runPyBench runs the bench script with args and emits each result it
// prints, one JSON object a line.
func runPyBench(o pythonOpts, script string, emit func(benchResult), args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd, err := pythonCmd(ctx, o, script, args...)
	if err != nil {
		return err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", o.python, err)
	}
	lines := bufio.NewScanner(out)
	for lines.Scan() {
		var r benchResult
		if err := json.Unmarshal(lines.Bytes(), &r); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			return fmt.Errorf("pybench.py %s: %q: %w", args[0], lines.Text(), err)
		}
		emit(r)
	}
	if err := cmd.Wait(); err != nil {
		return pythonErr(cmd, fmt.Errorf("pybench.py %s: %w", args[0], err))
	}
	return nil
}

// printPythonTable prints the -python results, each python_roundtrip
// beside torch's time for its size.
func printPythonTable(w io.Writer, rs []benchResult) {
	t := newTable(w, "case", "bytes", "device", "p50", "p99", "x torch")
	defer t.flush()
	for _, r := range rs {
		ratio := "-"
		for _, t := range rs {
			if r.Case == "python_roundtrip" && t.Case == "torch_roundtrip" && t.Bytes == r.Bytes && t.P50us > 0 {
				ratio = fmt.Sprintf("%.2f", r.P50us/t.P50us)
			}
		}
		us := func(v float64) string { return formatDuration(time.Duration(v * 1000)) }
		t.row(r.Case, formatBytes(r.Bytes), deviceOf(r), us(r.P50us), us(r.P99us), ratio)
	}
}

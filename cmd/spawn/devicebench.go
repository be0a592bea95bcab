package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/pytorch"
	"github.com/tensormp/tensormp/strategy"
)

const deviceHelp = `With -device gpu:N, measures GPU tensors on device N instead, beside
the CPU's in the same run, under file_descriptor:
  roundtrip           parent -> worker -> parent of a GPU tensor already
                      shared, 4 KiB and 64 MiB (device gpu:N), and of a
                      CPU tensor of the same sizes (no device)
  stream              new 4 KiB GPU tensors sent one way, one per message,
  stream_batch        and -batch to a message, per second
  fds                 descriptors a receiver holds for -hold received
                      4 KiB GPU tensors
and, with a Python that has torch (see -python3), torch.multiprocessing
doing the same on device N: torch_roundtrip, the hand-off of a shared
CUDA tensor to a child that answers with a word, and torch_stream, new
4 KiB CUDA tensors through a torch.multiprocessing.Queue. The summary
after the table gives each GPU round trip over the CPU's of its size, and
the GPU stream's rate over torch's.`

// deviceSizes are the round trip sizes -device measures.
var deviceSizes = []int64{4 << 10, 64 << 20}

func runDeviceBench(place device.Place, o benchOpts, po pythonOpts, asJSON bool, stdout, stderr io.Writer, progress func(string)) int {
	results := &resultLog{json: asJSON, w: stdout}
	err := withBenchWorker(strategy.FileDescriptor, o, progress, results.emit, func(b *bencher) error {
		stop, err := b.startFloor()
		if err != nil {
			return err
		}
		defer stop()
		for _, size := range deviceSizes {
			if size > b.o.maxSize {
				break
			}
			for _, p := range []device.Place{device.CPU(), place} {
				b.place = p
				if err := b.roundTrips(size); err != nil {
					return fmt.Errorf("%s: %w", p, err)
				}
			}
		}
		b.place = place
		if err := b.streams(); err != nil {
			return fmt.Errorf("%s: %w", place, err)
		}
		return b.fds(4<<10, b.o.hold)
	})
	if err != nil {
		fmt.Fprintf(stderr, "spawn bench: -device %s: %v\n", place, err)
		return 1
	}
	if err := benchTorchDevice(place, po, stderr, progress, results.emit); err != nil {
		fmt.Fprintf(stderr, "spawn bench: -device %s: torch: %v\n", place, err)
		return 1
	}
	if !asJSON {
		printBenchTable(stdout, results.rs)
		printDeviceSummary(stdout, place, results.rs)
	}
	return 0
}

// benchTorchDevice measures torch_roundtrip and torch_stream on place,
// with the Python -python3 names or the first that has torch; without
// one, it says so on stderr and measures nothing.
func benchTorchDevice(place device.Place, po pythonOpts, stderr io.Writer, progress func(string), emit func(benchResult)) error {
	candidates := pytorch.Candidates(os.Getenv(pytorch.EnvVar))
	if po.python != "" {
		candidates = []string{po.python}
	}
	python, err := pytorch.Find(candidates...)
	if err != nil {
		fmt.Fprintf(stderr, "spawn bench: torch's cases left out: %v\n", err)
		return nil
	}
	dir, err := os.MkdirTemp("", "tensormp-devicebench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	script := filepath.Join(dir, "pybench.py")
	if err := os.WriteFile(script, pybenchScript, 0o600); err != nil {
		return err
	}
	po.python, po.place = python, place
	po.device = strings.Replace(place.String(), "gpu", "cuda", 1)
	var counts []string
	var sizes []string
	for _, size := range deviceSizes {
		sizes = append(sizes, strconv.FormatInt(size, 10))
		counts = append(counts, strconv.Itoa(max(po.trips/10, 10)))
	}
	label := func(c string) func(benchResult) {
		return func(r benchResult) {
			r.Strategy, r.Case, r.Device = "file_descriptor", c, place.String()
			emit(r)
		}
	}
	progress("torch_roundtrip")
	if err := runPyBench(po, script, label("torch_roundtrip"), "torch", strings.Join(sizes, ","), strings.Join(counts, ","), po.device); err != nil {
		return err
	}
	progress("torch_stream")
	n := max(po.stream/rounds, 100)
	return runPyBench(po, script, label("torch_stream"), "torchstream", strconv.Itoa(n), po.device)
}

// printDeviceSummary says how the GPU cases compare: each round trip to
// the CPU's of its size, the stream to torch's.
func printDeviceSummary(w io.Writer, place device.Place, rs []benchResult) {
	find := func(c, dev string, size int64) *benchResult {
		for i, r := range rs {
			if r.Case == c && r.Device == dev && r.Bytes == size {
				return &rs[i]
			}
		}
		return nil
	}
	fmt.Fprintln(w)
	for _, size := range deviceSizes {
		gpu, cpu := find("roundtrip", place.String(), size), find("roundtrip", "", size)
		if gpu != nil && cpu != nil && cpu.P50us > 0 {
			fmt.Fprintf(w, "%s round trip of %s: %.2fx the CPU's\n", place, formatBytes(size), gpu.P50us/cpu.P50us)
		}
		if torch := find("torch_roundtrip", place.String(), size); gpu != nil && torch != nil && torch.P50us > 0 {
			fmt.Fprintf(w, "%s round trip of %s: %.2fx torch's hand-off\n", place, formatBytes(size), gpu.P50us/torch.P50us)
		}
	}
	stream, torch := find("stream", place.String(), 4<<10), find("torch_stream", place.String(), 4<<10)
	if stream != nil && torch != nil && torch.PerS > 0 {
		fmt.Fprintf(w, "%s stream of new 4 KiB tensors: %.1fx torch's rate\n", place, stream.PerS/torch.PerS)
	}
}

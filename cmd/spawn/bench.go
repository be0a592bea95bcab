package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

const benchHelp = `Measures tensor hand-off between processes, for each sharing strategy:
  roundtrip    parent -> worker -> parent over two queues, a tensor already
               shared (p50, p99)
  first_share  the same round trip for a tensor not yet in shared memory
  stream       4 KiB tensors sent one way, per second (made in shared
               memory with tensor.On(cpu).Shared(), as a producer would)
  fds          descriptors a receiver holds while it keeps 10,000 received
               4 KiB tensors alive
Prints a table, or with -json one JSON object per line.`

// benchMsg is what the bench worker receives: a command and a tensor.
type benchMsg struct {
	Op     string // "echo", "count", "hold", "stop"
	N      int
	Tensor *tensor.Tensor
}

type benchArgs struct {
	In, Out *mp.Queue
}

func init() {
	mp.Register("bench", benchWorker)
}

// benchWorker echoes tensors, counts streamed ones, or holds them and
// reports its descriptor count.
func benchWorker(ctx context.Context, w *mp.Worker) error {
	var a benchArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	var last *tensor.Tensor // keeps the echoed storage mapped between trips
	for {
		var m benchMsg
		if err := a.In.Get(ctx, &m); err != nil {
			return err
		}
		switch m.Op {
		case "echo":
			last = m.Tensor
			if err := a.Out.Put(ctx, last); err != nil {
				return err
			}
		case "count":
			for range m.N {
				var x *tensor.Tensor
				if err := a.In.Get(ctx, &x); err != nil {
					return err
				}
				if err := x.Release(); err != nil {
					return err
				}
			}
			if err := a.Out.Put(ctx, m.N); err != nil {
				return err
			}
		case "hold":
			held := make([]*tensor.Tensor, 0, m.N)
			for range m.N {
				var x *tensor.Tensor
				if err := a.In.Get(ctx, &x); err != nil {
					return err
				}
				held = append(held, x)
			}
			if err := a.Out.Put(ctx, countFDs()); err != nil {
				return err
			}
			for _, x := range held {
				_ = x.Release()
			}
		case "release":
			if last != nil {
				_ = last.Release()
				last = nil
			}
			if err := a.Out.Put(ctx, 0); err != nil {
				return err
			}
		case "stop":
			return nil
		}
	}
}

func countFDs() int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	return len(entries) - 1 // the directory's own descriptor
}

// benchResult is one line of -json output.
type benchResult struct {
	Strategy string  `json:"strategy"`
	Case     string  `json:"case"`
	Bytes    int64   `json:"bytes"`
	P50us    float64 `json:"p50_us,omitempty"`
	P99us    float64 `json:"p99_us,omitempty"`
	PerS     float64 `json:"per_s,omitempty"`
	FDs      int     `json:"fds,omitempty"`
}

var benchSizes = []int64{4 << 10, 1 << 20, 64 << 20, 256 << 20}

func runBench(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	asJSON := fs.Bool("json", false, "print one JSON object per line instead of a table")
	strategies := fs.String("strategy", "file_descriptor,file_system", "comma-separated sharing strategies to measure")
	trips := fs.Int("trips", 5000, "round trips per size (fewer for large first shares)")
	streamN := fs.Int("stream", 50000, "tensors sent in the stream case")
	holdN := fs.Int("hold", 10000, "tensors held in the fds case")
	maxSize := fs.Int64("max", 256<<20, "largest tensor size to measure, in bytes")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: spawn bench [flags]\n\n%s\n\nflags:\n", benchHelp)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	var sts []strategy.Strategy
	for _, name := range strings.Split(*strategies, ",") {
		st, err := strategy.Parse(strings.TrimSpace(name))
		if err != nil {
			fmt.Fprintln(stderr, "spawn bench:", err)
			return 2
		}
		sts = append(sts, st)
	}
	progress := func(string) {}
	if f, ok := stderr.(*os.File); ok && isTerminal(f) {
		progress = func(s string) { fmt.Fprintf(stderr, "\r\033[K%s", s) }
		defer fmt.Fprint(stderr, "\r\033[K")
	}
	var results []benchResult
	emit := func(r benchResult) {
		results = append(results, r)
		if *asJSON {
			b, _ := json.Marshal(r)
			fmt.Fprintln(stdout, string(b))
		}
	}
	for _, st := range sts {
		if err := benchStrategy(st, *trips, *streamN, *holdN, *maxSize, progress, emit); err != nil {
			fmt.Fprintf(stderr, "spawn bench: %s: %v\n", st, err)
			return 1
		}
	}
	if !*asJSON {
		printBenchTable(stdout, results)
	}
	return 0
}

// isTerminal reports whether f is a character device, as a terminal is.
func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func benchStrategy(st strategy.Strategy, trips, streamN, holdN int, maxSize int64, progress func(string), emit func(benchResult)) error {
	if err := strategy.Set(st); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	in, err := mp.NewQueue()
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := mp.NewQueue()
	if err != nil {
		return err
	}
	defer out.Close()
	g, err := mp.Spawn(ctx, "bench", 1, mp.WithArgs(benchArgs{In: in, Out: out}))
	if err != nil {
		return err
	}
	ctx = g.Context() // a dead worker ends the wait for its reply
	runErr := benchCases(ctx, st, in, out, trips, streamN, holdN, maxSize, progress, emit)
	_ = in.Put(ctx, benchMsg{Op: "stop"})
	if err := g.Join(); err != nil {
		return err // a worker's failure explains whatever else went wrong
	}
	return runErr
}

func benchCases(ctx context.Context, st strategy.Strategy, in, out *mp.Queue, trips, streamN, holdN int, maxSize int64, progress func(string), emit func(benchResult)) error {
	cpu := tensor.On(device.CPU())
	roundTrip := func(x *tensor.Tensor) (time.Duration, error) {
		start := time.Now()
		if err := in.Put(ctx, benchMsg{Op: "echo", Tensor: x}); err != nil {
			return 0, err
		}
		var back *tensor.Tensor
		if err := out.Get(ctx, &back); err != nil {
			return 0, err
		}
		d := time.Since(start)
		if back.Storage() != x.Storage() {
			return 0, errors.New("the tensor came back on other memory")
		}
		return d, nil
	}
	release := func() error {
		if err := in.Put(ctx, benchMsg{Op: "release"}); err != nil {
			return err
		}
		var ok int
		return out.Get(ctx, &ok)
	}
	for _, size := range benchSizes {
		if size > maxSize {
			break
		}
		progress(fmt.Sprintf("%s: round trip of %s", st, formatBytes(size)))
		x, err := cpu.Zeros(tensor.Uint8, int(size))
		if err != nil {
			return err
		}
		if err := x.ShareMemory(); err != nil {
			return err
		}
		runtime.GC() // start each measurement without the last one's garbage
		var ds []time.Duration
		for i := range trips + 1000 {
			d, err := roundTrip(x)
			if err != nil {
				return err
			}
			if i >= 1000 { // warm-up
				ds = append(ds, d)
			}
		}
		if err := release(); err != nil {
			return err
		}
		_ = x.Release()
		emit(benchResult{Strategy: st.String(), Case: "roundtrip", Bytes: size, P50us: pct(ds, 50), P99us: pct(ds, 99)})

		progress(fmt.Sprintf("%s: first share of %s", st, formatBytes(size)))
		n := max(3, min(trips, int((2<<30)/size)))
		ds = ds[:0]
		for range n {
			// A new batch, written by its producer: its pages are there.
			y, err := cpu.Full(tensor.Uint8, 1, int(size))
			if err != nil {
				return err
			}
			d, err := roundTrip(y)
			if err != nil {
				return err
			}
			ds = append(ds, d)
			if err := release(); err != nil {
				return err
			}
			_ = y.Release()
		}
		emit(benchResult{Strategy: st.String(), Case: "first_share", Bytes: size, P50us: pct(ds, 50), P99us: pct(ds, 99)})
	}

	progress(fmt.Sprintf("%s: stream of 4 KiB tensors", st))
	// The sender keeps the last streamWindow tensors alive (under
	// file_system a receiver opens them by name after Put returns) and
	// releases older ones, as a real producer would.
	const streamWindow = 4096
	window := make([]*tensor.Tensor, streamWindow)
	start := time.Now()
	if err := in.Put(ctx, benchMsg{Op: "count", N: streamN}); err != nil {
		return err
	}
	born := cpu.Shared() // a producer streaming tensors makes them in shared memory
	for i := range streamN {
		x, err := born.Zeros(tensor.Uint8, 4<<10)
		if err != nil {
			return err
		}
		if err := in.Put(ctx, x); err != nil {
			return err
		}
		if old := window[i%streamWindow]; old != nil {
			_ = old.Release()
		}
		window[i%streamWindow] = x
	}
	var got int
	if err := out.Get(ctx, &got); err != nil {
		return err
	}
	elapsed := time.Since(start)
	for _, x := range window {
		if x != nil {
			_ = x.Release()
		}
	}
	emit(benchResult{Strategy: st.String(), Case: "stream", Bytes: 4 << 10, PerS: float64(streamN) / elapsed.Seconds()})

	progress(fmt.Sprintf("%s: descriptors for %d held tensors", st, holdN))
	if err := in.Put(ctx, benchMsg{Op: "hold", N: holdN}); err != nil {
		return err
	}
	held := make([]*tensor.Tensor, 0, holdN)
	for range holdN {
		x, err := cpu.Zeros(tensor.Uint8, 4<<10)
		if err != nil {
			return err
		}
		if err := in.Put(ctx, x); err != nil {
			return fmt.Errorf("holding %d tensors: %w", holdN, err)
		}
		held = append(held, x)
	}
	var fds int
	if err := out.Get(ctx, &fds); err != nil {
		return fmt.Errorf("holding %d tensors: %w", holdN, err)
	}
	for _, x := range held {
		_ = x.Release()
	}
	emit(benchResult{Strategy: st.String(), Case: "fds", Bytes: 4 << 10, FDs: fds})
	return nil
}

func pct(ds []time.Duration, p int) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := min(len(s)-1, len(s)*p/100)
	return float64(s[i].Nanoseconds()) / 1000
}

func printBenchTable(w io.Writer, rs []benchResult) {
	fmt.Fprintf(w, "%-16s %-12s %10s %12s %12s %12s %8s\n", "strategy", "case", "bytes", "p50", "p99", "per second", "fds")
	for _, r := range rs {
		col := func(v float64, f func(float64) string) string {
			if v == 0 {
				return "-"
			}
			return f(v)
		}
		us := func(v float64) string { return formatDuration(time.Duration(v * 1000)) }
		fds := "-"
		if r.Case == "fds" {
			fds = fmt.Sprint(r.FDs)
		}
		fmt.Fprintf(w, "%-16s %-12s %10s %12s %12s %12s %8s\n", r.Strategy, r.Case, formatBytes(r.Bytes),
			col(r.P50us, us), col(r.P99us, us), col(r.PerS, func(v float64) string { return fmt.Sprintf("%.0f", v) }), fds)
	}
}

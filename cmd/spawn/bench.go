package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"golang.org/x/term"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
)

const benchHelp = `Measures tensor hand-off between processes, for each sharing strategy,
beside floors between the same two processes, measured in turns with the
cases they bound: the same socket type with nothing but the kernel's work
(one descriptor in each message, no encoding, no mapping), and, with no
message at all, a word stored in a page both map, there and back.
  floor_roundtrip     a message and a descriptor there and back (p50, p99)
  floor_futex_roundtrip
                      a word there and back, each side asleep in
                      FUTEX_WAIT until the other's FUTEX_WAKE
  floor_spin_roundtrip
                      a word there and back, each side spinning on it;
                      not with -cpus 1, nor on one CPU
  roundtrip           parent -> worker -> parent over two queues, a tensor
                      already shared
  first_share         the same round trip for a tensor not yet in shared
                      memory
  floor_stream        messages of one record and one descriptor sent one
                      way, per second
  stream              4 KiB tensors sent one way, one per message, per
                      second (made in shared memory with
                      tensor.On(cpu).Shared(), as a producer would)
  floor_stream_batch  records sent one way, -batch to a message with one
                      descriptor, per second
  stream_batch        4 KiB tensors sent one way, -batch to a message
                      (mp.PutMany), per second
  lane_roundtrip      the floor's record there and back through two
                      shared-memory lanes (package mp's internal Lane,
                      as a Pipe's lanes are), each side spinning, then
                      asleep on a futex
  lane_stream, lane_stream_batch
                      the floor streams' records through a lane
  pipe_roundtrip      an int there and back through an mp.Pipe, whose
                      lanes carry it (encoded and decoded as any value)
  pipe_stream         ints sent one way through an mp.Pipe, per second
  pipe_tensor_roundtrip
                      a shared 4 KiB tensor of the parent's to the worker
                      through an mp.Pipe, and one of the worker's back
                      (each taken and released by its receiver); the
                      lanes carry them once each side maps the other's
                      segment
  pipe_tensor_stream, pipe_tensor_stream_batch
                      new 4 KiB tensors sent one way through an mp.Pipe,
                      one or -batch to a message, each released once sent
  fds                 descriptors a receiver holds while it keeps "held"
                      received tensors alive: -hold and 10 x -hold of 4 KiB,
                      -hold of 80 KiB
The table's last columns divide each case by its floors: the round trips
by the three round trip floors (x socket, x futex, x spin), the streams
by the socket's (a rate over a floor's: below 1 is faster). Prints a table, or with -json one JSON object per line.

-cpus 1 pins the parent and the worker to one CPU, the first this process
may run on, where each hand-off waits for the other process to be
scheduled; -cpus 2 pins them to one CPU each, the first two; 0, the
default, pins nothing. A pinned process runs with GOMAXPROCS 1. It pins
the CPU cases only: not with -loader, -python or -device.`

// benchOpts are spawn bench's flags.
type benchOpts struct {
	trips, stream, batch, hold int
	maxSize                    int64
	profile                    string
	place                      placement
}

// placement is where -cpus puts the parent and the bench worker.
type placement struct {
	cpus           int   // -cpus
	parent, worker []int // the CPUs each is pinned to; none, unpinned
	apart          bool  // whether the two can run at once, on CPUs of their own
}

// placeBench returns the placement of -cpus n: 0, unpinned; 1, both on
// the first CPU this process may run on; 2, one each on the first two.
func placeBench(n int) (placement, error) {
	if n < 0 || n > 2 {
		return placement{}, fmt.Errorf("-cpus %d: want 0 (no pinning), 1 (one CPU for both processes) or 2 (one each)", n)
	}
	allowed, err := allowedCPUs()
	if n == 0 {
		// Without the CPUs' list, measure the spin floor where it has a
		// floor page at all: on Linux.
		return placement{apart: err != nil || len(allowed) > 1}, nil
	}
	if err != nil {
		return placement{}, fmt.Errorf("-cpus %d: %w", n, err)
	}
	if len(allowed) < n {
		return placement{}, fmt.Errorf("-cpus %d: this process may run on %d CPU (%v)", n, len(allowed), allowed)
	}
	return placement{cpus: n, parent: allowed[:1], worker: allowed[n-1 : n], apart: n == 2}, nil
}

// benchFlags defines bench's flags on fs and returns what runs it once
// they are parsed.
func benchFlags(fs *flag.FlagSet) func(stdout, stderr io.Writer) int {
	asJSON := fs.Bool("json", false, "print one JSON object per line instead of a table")
	sts := strategyList(strategy.All())
	fs.Var(&sts, "strategy", "comma-separated sharing strategies to measure")
	var o benchOpts
	fs.IntVar(&o.trips, "trips", 5000, "round trips per size (fewer for large first shares)")
	fs.IntVar(&o.stream, "stream", 300000, "tensors sent in each stream case, over five rounds")
	fs.IntVar(&o.batch, "batch", 16, "tensors per message in the batched stream")
	fs.IntVar(&o.hold, "hold", 10000, "tensors held in the fds cases (and ten times as many 4 KiB ones)")
	fs.Int64Var(&o.maxSize, "max", 256<<20, "largest tensor size to measure, in bytes")
	fs.StringVar(&o.profile, "cpuprofile", "", "write CPU profiles of the parent and the worker to `prefix`.parent and prefix.worker")
	cpus := fs.Int("cpus", 0, "pin the parent and the worker to one CPU (1) or to one each (2); 0 pins neither")
	loaderMode := fs.Bool("loader", false, "measure package loader instead (see below)")
	batches := fs.Int("batches", 200, "batches read in each -loader case, after a warm-up")
	pythonMode := fs.Bool("python", false, "measure Go <-> PyTorch instead (see below)")
	onDevice := fs.String("device", "cpu", "with gpu:N, measure GPU tensors on device N instead (see below)")
	var po pythonOpts
	fs.StringVar(&po.python, "python3", "", "the Python with torch and NumPy that -python runs (default: the first that has them of $TENSORMP_PYTHON, /usr/bin/python3, python3)")
	fs.StringVar(&po.lib, "pylib", os.Getenv("TENSORMP_LIB"), "libtensormp.so for -python (default: $TENSORMP_LIB, else built from ./cmd/libtensormp)")
	fs.StringVar(&po.pkg, "pypath", "python", "the directory holding the tensormp Python package, for -python")
	fs.StringVar(&po.device, "pydevice", "cpu", "where -python's tensors are: cpu, or cuda:N")
	return func(stdout, stderr io.Writer) int {
		if o.trips < 1 || o.stream < 1 || o.batch < 1 || o.hold < 1 {
			fmt.Fprintln(stderr, "spawn bench: -trips, -stream, -batch and -hold must be positive")
			return 2
		}
		progress := func(string) {}
		if f, ok := stderr.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
			progress = func(s string) { fmt.Fprintf(stderr, "\r\033[K%s", s) }
			defer fmt.Fprint(stderr, "\r\033[K")
		}
		if *cpus != 0 && (*loaderMode || *pythonMode || *onDevice != "cpu") {
			fmt.Fprintln(stderr, "spawn bench: -cpus pins the CPU cases' two processes: not with -loader, -python or -device")
			return 2
		}
		var err error
		if o.place, err = placeBench(*cpus); err != nil {
			fmt.Fprintf(stderr, "spawn bench: %v\n", err)
			return 2
		}
		if *loaderMode {
			if *batches < 1 {
				fmt.Fprintln(stderr, "spawn bench: -batches must be positive")
				return 2
			}
			return runLoaderBench(*batches, *asJSON, stdout, stderr, progress)
		}
		if *pythonMode {
			po.trips = o.trips
			return runPythonBench(po, *asJSON, stdout, stderr, progress)
		}
		if place, err := device.Parse(*onDevice); err != nil || !place.IsCPU() && !place.IsGPU() {
			fmt.Fprintf(stderr, "spawn bench: -device %q: want cpu or gpu:N\n", *onDevice)
			return 2
		} else if place.IsGPU() {
			po.trips, po.stream = o.trips, o.stream
			return runDeviceBench(place, o, po, *asJSON, stdout, stderr, progress)
		}
		results := &resultLog{json: *asJSON, w: stdout, cpus: o.place.cpus}
		if err := benchStrategies(sts, o, progress, results.emit); err != nil {
			fmt.Fprintf(stderr, "spawn bench: %v\n", err)
			return 1
		}
		if !*asJSON {
			printBenchTable(stdout, results.rs)
		}
		return 0
	}
}

// benchStrategies measures each strategy of sts in turn, the parent
// pinned meanwhile as o.place says.
func benchStrategies(sts []strategy.Strategy, o benchOpts, progress func(string), emit func(benchResult)) (err error) {
	if len(o.place.parent) > 0 {
		restore, perr := pinProcess(o.place.parent)
		if perr != nil {
			return fmt.Errorf("-cpus %d: %w", o.place.cpus, perr)
		}
		defer func() {
			if rerr := restore(); rerr != nil {
				err = errors.Join(err, fmt.Errorf("-cpus %d: restoring the CPUs: %w", o.place.cpus, rerr))
			}
		}()
	}
	for _, st := range sts {
		if err := benchStrategy(st, o, progress, emit); err != nil {
			return fmt.Errorf("%s: %w", st, err)
		}
	}
	return nil
}

func benchStrategy(st strategy.Strategy, o benchOpts, progress func(string), emit func(benchResult)) error {
	return withBenchWorker(st, o, progress, emit, (*bencher).run)
}

// withBenchWorker spawns a bench worker under strategy st and runs cases
// against it.
func withBenchWorker(st strategy.Strategy, o benchOpts, progress func(string), emit func(benchResult), cases func(*bencher) error) error {
	if err := strategy.Set(st); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
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
	var profile string
	if o.profile != "" {
		profile = o.profile + "." + st.String() + ".worker"
		stop, err := startProfile(o.profile + "." + st.String() + ".parent")
		if err != nil {
			return err
		}
		defer stop()
	}
	pipe, theirs, err := mp.NewPipe()
	if err != nil {
		return err
	}
	defer pipe.Close()
	g, err := mp.Spawn(ctx, "bench", 1, mp.WithArgs(benchArgs{In: in, Out: out, Pipe: theirs, Profile: profile, Pin: o.place.worker}))
	_ = theirs.Close() // the worker's now
	if err != nil {
		return err
	}
	b := &bencher{ctx: g.Context(), st: st, in: in, out: out, pipe: pipe, o: o, progress: progress, emit: emit, place: device.CPU()}
	runErr := cases(b)
	_ = in.Put(b.ctx, benchMsg{Op: "stop"}) // a dead worker ends the wait for its reply
	// Either failure may explain the other: a worker that died ends the
	// parent's wait, and a parent that gave up midway leaves the worker
	// reading a message it did not expect.
	return errors.Join(runErr, g.Join())
}

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
	"runtime/pprof"
	"slices"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/term"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

const benchHelp = `Measures tensor hand-off between processes, for each sharing strategy,
beside the floor: the same socket type between the same two processes
with nothing but the kernel's work (one descriptor in each message, no
encoding, no mapping), measured in turns with the case it bounds.
  floor_roundtrip     a message and a descriptor there and back (p50, p99)
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
  fds                 descriptors a receiver holds while it keeps "held"
                      received tensors alive: -hold and 10 x -hold of 4 KiB,
                      -hold of 80 KiB
The table's last column divides each case by its floor. Prints a table,
or with -json one JSON object per line.`

// benchMsg is what the bench worker receives: a command and a tensor.
type benchMsg struct {
	Op    string // "echo", "count", "hold", "release", "floor", "stop"
	N     int
	Batch int         // tensors per message for "count"
	Floor floorSocket // for "floor"
}

type benchArgs struct {
	In, Out *mp.Queue
	Profile string // where the worker writes its CPU profile, if anywhere
}

// floorSocket carries the worker's end of the floor's socket pair.
type floorSocket struct{ f *fd.FD }

func (s floorSocket) encode(enc *msgpack.Encoder) ([]byte, error) {
	if s.f == nil {
		return nil, nil
	}
	i, err := carry.AddFD(enc, s.f)
	if err != nil {
		return nil, err
	}
	return []byte{byte(i)}, nil
}

func decodeFloorSocket(dec *msgpack.Decoder, n int) (floorSocket, error) {
	payload, err := carry.ReadExt(dec, n)
	if err != nil || len(payload) == 0 {
		return floorSocket{}, err
	}
	f, err := carry.TakeFD(dec, int(payload[0]))
	return floorSocket{f}, err
}

// Close closes the socket, if any.
func (s floorSocket) Close() error {
	if s.f == nil {
		return nil
	}
	return s.f.Close()
}

const floorExt int8 = 0x62 // 'b'

func init() {
	mp.Register("bench", benchWorker)
	carry.Register(floorExt, floorSocket.encode, decodeFloorSocket)
}

// benchWorker echoes tensors, counts streamed ones, or holds them and
// reports its descriptor count; it serves the floor's socket beside.
func benchWorker(ctx context.Context, w *mp.Worker) error {
	var a benchArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	if a.Profile != "" {
		stop, err := startProfile(a.Profile)
		if err != nil {
			return err
		}
		defer stop()
	}
	var last *tensor.Tensor // keeps the echoed storage mapped between trips
	var batch []*tensor.Tensor
	for {
		var m benchMsg
		if err := a.In.Get(ctx, &m); err != nil {
			return err
		}
		switch m.Op {
		case "echo":
			// N round trips of a bare tensor, as the floor's carry a bare
			// record: what is measured is the hand-off, not this loop's
			// commands.
			for range m.N {
				var x *tensor.Tensor
				if err := a.In.Get(ctx, &x); err != nil {
					return err
				}
				last = x
				if err := a.Out.Put(ctx, x); err != nil {
					return err
				}
			}
		case "count":
			for got := 0; got < m.N; {
				var err error
				if batch, err = mp.GetMany(ctx, a.In, batch[:0]); err != nil {
					return err
				}
				for i, x := range batch {
					if err := x.Release(); err != nil {
						return err
					}
					batch[i] = nil
				}
				got += len(batch)
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
		case "floor":
			// Served until the parent closes its end; a failure closes
			// this end, which the parent's next floor call reports.
			go func() { _ = serveFloor(m.Floor.f) }()
		case "stop":
			return nil
		}
	}
}

// startProfile starts a CPU profile written to path; stop ends it.
func startProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}, nil
}

func countFDs() int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	return len(entries) - 1 // the directory's own descriptor
}

// resultLog keeps a bench's results, and prints each as it comes, a JSON
// object a line, with json.
type resultLog struct {
	rs   []benchResult
	json bool
	w    io.Writer
}

func (l *resultLog) emit(r benchResult) {
	l.rs = append(l.rs, r)
	if l.json {
		b, _ := json.Marshal(r)
		fmt.Fprintln(l.w, string(b))
	}
}

// benchResult is one line of -json output.
type benchResult struct {
	Strategy string  `json:"strategy"`
	Case     string  `json:"case"`
	Bytes    int64   `json:"bytes"`
	P50us    float64 `json:"p50_us,omitempty"`
	P99us    float64 `json:"p99_us,omitempty"`
	PerS     float64 `json:"per_s,omitempty"`
	Batch    int     `json:"batch,omitempty"` // tensors per message
	Held     int     `json:"held,omitempty"`  // tensors the receiver holds
	FDs      int     `json:"fds,omitempty"`
	Device   string  `json:"device,omitempty"` // where -python's tensors are, when not the CPU
}

var benchSizes = []int64{4 << 10, 1 << 20, 64 << 20, 256 << 20}

func runBench(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
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
	loaderMode := fs.Bool("loader", false, "measure package loader instead (see below)")
	batches := fs.Int("batches", 200, "batches read in each -loader case, after a warm-up")
	pythonMode := fs.Bool("python", false, "measure Go <-> PyTorch instead (see below)")
	onDevice := fs.String("device", "cpu", "with gpu:N, measure GPU tensors on device N instead (see below)")
	var po pythonOpts
	fs.StringVar(&po.python, "python3", "", "the Python with torch and NumPy that -python runs (default: the first that has them of $TENSORMP_PYTHON, /usr/bin/python3, python3)")
	fs.StringVar(&po.lib, "pylib", os.Getenv("TENSORMP_LIB"), "libtensormp.so for -python (default: $TENSORMP_LIB, else built from ./cmd/libtensormp)")
	fs.StringVar(&po.pkg, "pypath", "python", "the directory holding the tensormp Python package, for -python")
	fs.StringVar(&po.device, "pydevice", "cpu", "where -python's tensors are: cpu, or cuda:N")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: spawn bench [flags]\n\n%s\n\n%s\n\n%s\n\n%s\n\nflags:\n", benchHelp, deviceHelp, loaderHelp, pythonHelp)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if o.trips < 1 || o.stream < 1 || o.batch < 1 || o.hold < 1 {
		fmt.Fprintln(stderr, "spawn bench: -trips, -stream, -batch and -hold must be positive")
		return 2
	}
	progress := func(string) {}
	if f, ok := stderr.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		progress = func(s string) { fmt.Fprintf(stderr, "\r\033[K%s", s) }
		defer fmt.Fprint(stderr, "\r\033[K")
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
	results := &resultLog{json: *asJSON, w: stdout}
	for _, st := range sts {
		if err := benchStrategy(st, o, progress, results.emit); err != nil {
			fmt.Fprintf(stderr, "spawn bench: %s: %v\n", st, err)
			return 1
		}
	}
	if !*asJSON {
		printBenchTable(stdout, results.rs)
	}
	return 0
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
	g, err := mp.Spawn(ctx, "bench", 1, mp.WithArgs(benchArgs{In: in, Out: out, Profile: profile}))
	if err != nil {
		return err
	}
	b := &bencher{ctx: g.Context(), st: st, in: in, out: out, o: o, progress: progress, emit: emit, place: device.CPU()}
	runErr := cases(b)
	_ = in.Put(b.ctx, benchMsg{Op: "stop"}) // a dead worker ends the wait for its reply
	// Either failure may explain the other: a worker that died ends the
	// parent's wait, and a parent that gave up midway leaves the worker
	// reading a message it did not expect.
	return errors.Join(runErr, g.Join())
}

// benchOpts are spawn bench's flags.
type benchOpts struct {
	trips, stream, batch, hold int
	maxSize                    int64
	profile                    string
}

// bencher runs the cases of one strategy against one bench worker.
type bencher struct {
	ctx      context.Context
	st       strategy.Strategy
	in, out  *mp.Queue
	o        benchOpts
	progress func(string)
	emit     func(benchResult)
	floor    *floor       // nil where the floor is not measured
	place    device.Place // where the tensors the cases send are
}

// result is a result of b's strategy, labelled with its place when that
// is not the CPU.
func (b *bencher) result(r benchResult) benchResult {
	r.Strategy = b.st.String()
	if !b.place.IsCPU() {
		r.Device = b.place.String()
	}
	return r
}

// rounds is how many times the floor and the case it bounds take turns,
// so that both see the same machine.
const rounds = 5

// startFloor starts the floor beside the worker, where it can be measured.
// The returned stop ends it.
func (b *bencher) startFloor() (stop func(), err error) {
	f, peer, err := newFloor()
	switch {
	case errors.Is(err, errors.ErrUnsupported):
		return func() {}, nil
	case err != nil:
		return nil, err
	}
	if err := b.in.Put(b.ctx, benchMsg{Op: "floor", Floor: floorSocket{peer}}); err != nil {
		f.close()
		return nil, err
	}
	b.floor = f
	return f.close, nil
}

func (b *bencher) run() error {
	stop, err := b.startFloor()
	if err != nil {
		return err
	}
	defer stop()
	for _, size := range benchSizes {
		if size > b.o.maxSize {
			break
		}
		if err := b.roundTrips(size); err != nil {
			return err
		}
		if err := b.firstShares(size); err != nil {
			return err
		}
	}
	if err := b.streams(); err != nil {
		return err
	}
	for _, c := range []struct {
		size int64
		n    int
	}{{4 << 10, b.o.hold}, {4 << 10, 10 * b.o.hold}, {80 << 10, b.o.hold}} {
		if err := b.fds(c.size, c.n); err != nil {
			return err
		}
	}
	return nil
}

// echo has the worker send back the next n tensors it gets.
func (b *bencher) echo(n int) error {
	return b.in.Put(b.ctx, benchMsg{Op: "echo", N: n})
}

// roundTrip sends x to the worker, which echo has made send it back.
func (b *bencher) roundTrip(x *tensor.Tensor) (time.Duration, error) {
	start := time.Now()
	if err := b.in.Put(b.ctx, x); err != nil {
		return 0, err
	}
	var back *tensor.Tensor
	if err := b.out.Get(b.ctx, &back); err != nil {
		return 0, err
	}
	d := time.Since(start)
	if back.Storage() != x.Storage() {
		return 0, errors.New("the tensor came back on other memory")
	}
	return d, nil
}

// release has the worker let go of the last tensor it echoed.
func (b *bencher) release() error {
	if err := b.in.Put(b.ctx, benchMsg{Op: "release"}); err != nil {
		return err
	}
	var ok int
	return b.out.Get(b.ctx, &ok)
}

// roundTrips measures round trips of a shared tensor of size bytes, taking
// turns with the floor's.
func (b *bencher) roundTrips(size int64) error {
	b.progress(fmt.Sprintf("%s: round trip of %s on %s", b.st, formatBytes(size), b.place))
	x, err := tensor.On(b.place).Shared().Zeros(tensor.Uint8, int(size))
	if err != nil {
		return err
	}
	defer x.Release()
	runtime.GC() // start each measurement without the last one's garbage
	var ds, fs []time.Duration
	per := max(1, b.o.trips/rounds)
	for r := range rounds {
		warm := 0
		if r == 0 {
			warm = 1000
		}
		if err := b.echo(warm + per); err != nil {
			return err
		}
		if ds, err = sample(ds, per, warm, func() (time.Duration, error) { return b.roundTrip(x) }); err != nil {
			return err
		}
		if b.floor == nil {
			continue
		}
		if fs, err = sample(fs, per, warm, b.floor.roundTrip); err != nil {
			return err
		}
	}
	if err := b.release(); err != nil {
		return err
	}
	if b.floor != nil {
		b.emit(benchResult{Strategy: b.st.String(), Case: "floor_roundtrip", Bytes: size, P50us: pct(fs, 50), P99us: pct(fs, 99)})
	}
	b.emit(b.result(benchResult{Case: "roundtrip", Bytes: size, P50us: pct(ds, 50), P99us: pct(ds, 99)}))
	return nil
}

// sample appends to ds the times of n calls of trip, made after warm
// calls that are not measured.
func sample(ds []time.Duration, n, warm int, trip func() (time.Duration, error)) ([]time.Duration, error) {
	for i := range warm + n {
		d, err := trip()
		if err != nil {
			return ds, err
		}
		if i >= warm {
			ds = append(ds, d)
		}
	}
	return ds, nil
}

// firstShares measures round trips of tensors not yet in shared memory.
func (b *bencher) firstShares(size int64) error {
	b.progress(fmt.Sprintf("%s: first share of %s", b.st, formatBytes(size)))
	cpu := tensor.On(device.CPU())
	n := max(3, min(b.o.trips, int((2<<30)/size)))
	var ds []time.Duration
	for range n {
		// A new batch, written by its producer: its pages are there.
		y, err := cpu.Full(tensor.Uint8, 1, int(size))
		if err != nil {
			return err
		}
		if err := b.echo(1); err != nil {
			return err
		}
		d, err := b.roundTrip(y)
		if err != nil {
			return err
		}
		ds = append(ds, d)
		if err := b.release(); err != nil {
			return err
		}
		_ = y.Release()
	}
	b.emit(benchResult{Strategy: b.st.String(), Case: "first_share", Bytes: size, P50us: pct(ds, 50), P99us: pct(ds, 99)})
	return nil
}

// streams measures 4 KiB tensors sent one way, one per message and a
// batch per message, taking turns with the floor's streams of as many
// messages.
func (b *bencher) streams() error {
	const size = 4 << 10
	n := max(b.o.batch, b.o.stream/rounds/b.o.batch*b.o.batch)
	var one, many, floorOne, floorMany time.Duration
	for range rounds {
		b.progress(fmt.Sprintf("%s: stream of 4 KiB tensors", b.st))
		d, err := b.stream(n, 1)
		if err != nil {
			return err
		}
		one += d
		if d, err = b.stream(n, b.o.batch); err != nil {
			return err
		}
		many += d
		if b.floor == nil {
			continue
		}
		if d, err = b.floor.stream(n, 1); err != nil {
			return err
		}
		floorOne += d
		if d, err = b.floor.stream(n, b.o.batch); err != nil {
			return err
		}
		floorMany += d
	}
	rate := func(d time.Duration) float64 { return float64(n*rounds) / d.Seconds() }
	st := b.st.String()
	if b.floor != nil {
		b.emit(benchResult{Strategy: st, Case: "floor_stream", Bytes: size, PerS: rate(floorOne)})
	}
	b.emit(b.result(benchResult{Case: "stream", Bytes: size, PerS: rate(one)}))
	if b.floor != nil {
		b.emit(benchResult{Strategy: st, Case: "floor_stream_batch", Bytes: size, Batch: b.o.batch, PerS: rate(floorMany)})
	}
	b.emit(b.result(benchResult{Case: "stream_batch", Bytes: size, Batch: b.o.batch, PerS: rate(many)}))
	return nil
}

// stream sends n 4 KiB tensors, batch to a message, and returns the time
// until the worker has received and released them all.
func (b *bencher) stream(n, batch int) (time.Duration, error) {
	// The sender keeps the last streamWindow tensors alive (under
	// file_system a receiver opens them by name after Put returns) and
	// releases older ones, as a real producer would.
	const streamWindow = 4096
	var window ring
	defer window.releaseAll()
	runtime.GC()
	start := time.Now()
	if err := b.in.Put(b.ctx, benchMsg{Op: "count", N: n, Batch: batch}); err != nil {
		return 0, err
	}
	born := tensor.On(b.place).Shared() // a producer streaming tensors makes them in shared memory
	xs := make([]*tensor.Tensor, batch)
	for sent := 0; sent < n; sent += batch {
		xs = xs[:min(batch, n-sent)]
		for i := range xs {
			x, err := born.Zeros(tensor.Uint8, 4<<10)
			if err != nil {
				return 0, err
			}
			xs[i] = x
			window.push(x, streamWindow)
		}
		var err error
		if batch == 1 {
			err = b.in.Put(b.ctx, xs[0])
		} else {
			err = mp.PutMany(b.ctx, b.in, xs)
		}
		if err != nil {
			return 0, err
		}
	}
	var got int
	if err := b.out.Get(b.ctx, &got); err != nil {
		return 0, err
	}
	if got != n {
		return 0, fmt.Errorf("stream: the worker counted %d tensors, not %d", got, n)
	}
	return time.Since(start), nil
}

// ring keeps the last tensors pushed into it alive, releasing older ones.
type ring struct {
	xs   []*tensor.Tensor
	next int // where the next push goes, once xs is full
}

// push adds x, releasing the oldest tensor once the ring holds n.
func (r *ring) push(x *tensor.Tensor, n int) {
	if len(r.xs) < n {
		r.xs = append(r.xs, x)
		return
	}
	_ = r.xs[r.next].Release()
	r.xs[r.next] = x
	r.next = (r.next + 1) % n
}

func (r *ring) releaseAll() {
	for _, x := range r.xs {
		_ = x.Release()
	}
}

// fds has the worker hold n received tensors of size bytes and report the
// descriptors it holds.
func (b *bencher) fds(size int64, n int) error {
	b.progress(fmt.Sprintf("%s: descriptors for %d held tensors of %s", b.st, n, formatBytes(size)))
	if err := b.in.Put(b.ctx, benchMsg{Op: "hold", N: n}); err != nil {
		return err
	}
	made := tensor.On(b.place)
	held := make([]*tensor.Tensor, 0, n)
	defer func() {
		for _, x := range held {
			_ = x.Release()
		}
	}()
	for range n {
		x, err := made.Zeros(tensor.Uint8, int(size))
		if err != nil {
			return err
		}
		held = append(held, x)
		if err := b.in.Put(b.ctx, x); err != nil {
			return fmt.Errorf("holding %d tensors: %w", n, err)
		}
	}
	var fds int
	if err := b.out.Get(b.ctx, &fds); err != nil {
		return fmt.Errorf("holding %d tensors: %w", n, err)
	}
	b.emit(b.result(benchResult{Case: "fds", Bytes: size, Held: n, FDs: fds}))
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

// floorOf names the floor case that bounds a case.
var floorOf = map[string]string{
	"roundtrip":    "floor_roundtrip",
	"first_share":  "floor_roundtrip",
	"stream":       "floor_stream",
	"stream_batch": "floor_stream_batch",
}

// vsFloor returns how many times its floor r costs: a time over the
// floor's, or the floor's rate over r's. It is 0 without a floor.
func vsFloor(r benchResult, rs []benchResult) float64 {
	name, ok := floorOf[r.Case]
	if !ok {
		return 0
	}
	for _, f := range rs {
		if f.Strategy != r.Strategy || f.Case != name || f.Bytes != r.Bytes {
			continue
		}
		switch {
		case r.P50us > 0 && f.P50us > 0:
			return r.P50us / f.P50us
		case r.PerS > 0 && f.PerS > 0:
			return f.PerS / r.PerS
		}
	}
	return 0
}

func printBenchTable(w io.Writer, rs []benchResult) {
	t := newTable(w, "strategy", "case", "device", "bytes", "p50", "p99", "per second", "held", "fds", "x floor")
	defer t.flush()
	for _, r := range rs {
		col := func(v float64, f func(float64) string) string {
			if v == 0 {
				return "-"
			}
			return f(v)
		}
		us := func(v float64) string { return formatDuration(time.Duration(v * 1000)) }
		n := func(v float64) string { return fmt.Sprintf("%.0f", v) }
		fds := "-"
		if r.Case == "fds" {
			fds = fmt.Sprint(r.FDs)
		}
		t.row(r.Strategy, r.Case, deviceOf(r), formatBytes(r.Bytes), col(r.P50us, us), col(r.P99us, us),
			col(r.PerS, n), col(float64(r.Held), n), fds, col(vsFloor(r, rs), func(v float64) string { return fmt.Sprintf("%.2f", v) }))
	}
}

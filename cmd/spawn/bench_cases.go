package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"time"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

var benchSizes = []int64{4 << 10, 1 << 20, 64 << 20, 256 << 20}

// bencher runs the cases of one strategy against one bench worker.
type bencher struct {
	ctx      context.Context
	st       strategy.Strategy
	in, out  *mp.Queue
	pipe     *mp.Pipe // to the worker, for pipe_roundtrip
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
	f, peer, page, err := newFloor()
	switch {
	case errors.Is(err, errors.ErrUnsupported):
		return func() {}, nil
	case err != nil:
		return nil, err
	}
	to, from, err := f.startLanes()
	if err != nil {
		_, _ = peer.Close(), page.Close()
		f.close()
		return nil, err
	}
	m := benchMsg{Op: "floor", Floor: floorSocket{peer}, Page: floorSocket{page}, LaneTo: floorSocket{to}, LaneFrom: floorSocket{from}}
	if err := b.in.Put(b.ctx, m); err != nil {
		// The message closes what it took; Close closes the rest.
		_, _, _, _ = peer.Close(), page.Close(), to.Close(), from.Close()
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

// pipeTrips has the worker send back the next n ints it gets on its
// pipe.
func (b *bencher) pipeTrips(n int) error {
	return b.in.Put(b.ctx, benchMsg{Op: "pipe", N: n})
}

// pipeRoundTrip sends an int to the worker on the pipe, which pipeTrips
// has made send it back.
func (b *bencher) pipeRoundTrip() (time.Duration, error) {
	start := time.Now()
	if err := b.pipe.Send(b.ctx, 7); err != nil {
		return 0, err
	}
	var back int
	if err := b.pipe.Recv(b.ctx, &back); err != nil {
		return 0, err
	}
	d := time.Since(start)
	if back != 7 {
		return 0, fmt.Errorf("the pipe gave back %d for 7", back)
	}
	return d, nil
}

// pipeStream sends n ints one way through the pipe, and returns how long
// it took until the worker said it had them all.
func (b *bencher) pipeStream(n int) (time.Duration, error) {
	if err := b.in.Put(b.ctx, benchMsg{Op: "pipecount", N: n}); err != nil {
		return 0, err
	}
	start := time.Now()
	for i := range n {
		if err := b.pipe.Send(b.ctx, i); err != nil {
			return 0, err
		}
	}
	return b.pipeCounted(start, n, "ints")
}

// pipeCounted waits for the worker's count of the n values of what it was
// sent on the pipe since start, and returns the time since start.
func (b *bencher) pipeCounted(start time.Time, n int, what string) (time.Duration, error) {
	var got int
	if err := b.pipe.Recv(b.ctx, &got); err != nil {
		return 0, err
	}
	d := time.Since(start)
	if got != n {
		return 0, fmt.Errorf("the worker counted %d %s of %d", got, what, n)
	}
	return d, nil
}

// pipeTensorTrips appends to ds the times of n hand-offs of a shared 4 KiB
// tensor to the worker through the pipe and of one of the worker's back,
// after warm that are not measured: each side sends a tensor of its own,
// which the other takes and releases (see the worker's "pipetrip").
func (b *bencher) pipeTensorTrips(ds []time.Duration, n, warm int) ([]time.Duration, error) {
	x, err := tensor.On(b.place).Shared().Zeros(tensor.Uint8, 4<<10)
	if err != nil {
		return ds, err
	}
	defer x.Release()
	if err := b.in.Put(b.ctx, benchMsg{Op: "pipetrip", N: warm + n}); err != nil {
		return ds, err
	}
	return sample(ds, n, warm, func() (time.Duration, error) {
		start := time.Now()
		if err := b.pipe.Send(b.ctx, x); err != nil {
			return 0, err
		}
		var back *tensor.Tensor
		if err := b.pipe.Recv(b.ctx, &back); err != nil {
			return 0, err
		}
		d := time.Since(start)
		if back.Numel() != 4<<10 {
			return 0, fmt.Errorf("the worker sent back %d bytes", back.Numel())
		}
		return d, back.Release()
	})
}

// pipeTensorStream sends n new 4 KiB tensors one way through the pipe,
// batch to a message, each released once sent, and returns how long it
// took until the worker said it had them all.
func (b *bencher) pipeTensorStream(n, batch int) (time.Duration, error) {
	runtime.GC()
	if err := b.in.Put(b.ctx, benchMsg{Op: "pipetensors", N: n, Batch: batch}); err != nil {
		return 0, err
	}
	born := tensor.On(b.place).Shared()
	xs := make([]*tensor.Tensor, batch)
	start := time.Now()
	for sent := 0; sent < n; sent += batch {
		xs = xs[:min(batch, n-sent)]
		for i := range xs {
			x, err := born.Zeros(tensor.Uint8, 4<<10)
			if err != nil {
				return 0, err
			}
			xs[i] = x
		}
		var err error
		if batch == 1 {
			err = b.pipe.Send(b.ctx, xs[0])
		} else {
			err = b.pipe.Send(b.ctx, xs)
		}
		for _, x := range xs {
			_ = x.Release()
		}
		if err != nil {
			return 0, err
		}
	}
	return b.pipeCounted(start, n, "tensors")
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
// turns with the floors'.
func (b *bencher) roundTrips(size int64) error {
	b.progress(fmt.Sprintf("%s: round trip of %s on %s", b.st, formatBytes(size), b.place))
	x, err := tensor.On(b.place).Shared().Zeros(tensor.Uint8, int(size))
	if err != nil {
		return err
	}
	defer x.Release()
	runtime.GC() // start each measurement without the last one's garbage
	var ds, fs, futex, spin, lane, pipe, pipeTensor []time.Duration
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
		if futex, err = sample(futex, per, warm, b.floor.futexRoundTrip); err != nil {
			return err
		}
		if size == benchSizes[0] {
			if lane, err = sample(lane, per, warm, b.floor.laneRoundTrip); err != nil {
				return err
			}
			if err := b.pipeTrips(warm + per); err != nil {
				return err
			}
			if pipe, err = sample(pipe, per, warm, b.pipeRoundTrip); err != nil {
				return err
			}
			if b.place.IsCPU() {
				if pipeTensor, err = b.pipeTensorTrips(pipeTensor, per, warm); err != nil {
					return err
				}
			}
		}
		if !b.o.place.apart {
			continue
		}
		if spin, err = sample(spin, per, warm, b.floor.spinRoundTrip); err != nil {
			return err
		}
		// One more, that leaves the worker asleep: spinning, it would
		// take a CPU from the next case.
		if _, err := b.floor.futexRoundTrip(); err != nil {
			return err
		}
	}
	if err := b.release(); err != nil {
		return err
	}
	if b.floor != nil {
		for _, f := range []struct {
			name string
			ds   []time.Duration
		}{{"floor_roundtrip", fs}, {"floor_futex_roundtrip", futex}, {"floor_spin_roundtrip", spin}, {"lane_roundtrip", lane}, {"pipe_roundtrip", pipe}, {"pipe_tensor_roundtrip", pipeTensor}} {
			if len(f.ds) > 0 {
				b.emit(benchResult{Strategy: b.st.String(), Case: f.name, Bytes: size, P50us: pct(f.ds, 50), P99us: pct(f.ds, 99)})
			}
		}
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
	var one, many, floorOne, floorMany, laneOne, laneMany, pipeOne, pipeTensors, pipeBatches time.Duration
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
		if d, err = b.floor.laneStream(n, 1); err != nil {
			return err
		}
		laneOne += d
		if d, err = b.floor.laneStream(n, b.o.batch); err != nil {
			return err
		}
		laneMany += d
		if d, err = b.pipeStream(n); err != nil {
			return err
		}
		pipeOne += d
		if !b.place.IsCPU() {
			continue
		}
		if d, err = b.pipeTensorStream(n, 1); err != nil {
			return err
		}
		pipeTensors += d
		if d, err = b.pipeTensorStream(n, b.o.batch); err != nil {
			return err
		}
		pipeBatches += d
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
	if b.floor != nil {
		b.emit(benchResult{Strategy: st, Case: "lane_stream", Bytes: size, PerS: rate(laneOne)})
		b.emit(benchResult{Strategy: st, Case: "lane_stream_batch", Bytes: size, Batch: b.o.batch, PerS: rate(laneMany)})
		b.emit(benchResult{Strategy: st, Case: "pipe_stream", Bytes: size, PerS: rate(pipeOne)})
		if b.place.IsCPU() {
			b.emit(benchResult{Strategy: st, Case: "pipe_tensor_stream", Bytes: size, PerS: rate(pipeTensors)})
			b.emit(benchResult{Strategy: st, Case: "pipe_tensor_stream_batch", Bytes: size, Batch: b.o.batch, PerS: rate(pipeBatches)})
		}
	}
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

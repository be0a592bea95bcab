package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

const demoHelp = `Spawns worker processes, sends them tensors of several dtypes and sizes
through a queue under each sharing strategy, has every worker check the
values and overwrite them in place, and checks in the parent that each
tensor came back on the same shared memory with the workers' writes.
Prints the number of tensors, bytes and the median round trip per
strategy, and how many tensormp_ segments /dev/shm held before and after.
Exits non-zero on any mismatch or leftover segment.`

// demoCase is one kind of tensor the demo sends.
type demoCase struct {
	dtype tensor.DType
	shape []int
}

var demoCases = []demoCase{
	{tensor.Float32, []int{32, 32}},
	{tensor.Float64, []int{256, 512}},
	{tensor.Int32, []int{16384}},
	{tensor.Int64, []int{64, 64}},
	{tensor.Uint8, []int{1 << 20}},
	{tensor.BFloat16, []int{3, 224, 224}},
	{tensor.Complex64, []int{8192}},
	{tensor.Bool, []int{4096}},
}

// task goes to a worker: a tensor to check and modify. A nil Tensor asks
// the worker to stop.
type task struct {
	ID     int
	DType  string
	Tensor *tensor.Tensor
}

// reply comes back: the same tensor, written in place.
type reply struct {
	ID     int
	Rank   int
	Err    string
	Tensor *tensor.Tensor
}

type demoArgs struct {
	Tasks, Replies *mp.Queue
}

func init() {
	mp.Register("demo", demoWorker)
}

// demoWorker checks each tensor holds 0, 1, 2, ... (as its dtype), writes
// rank+1 into every element in place, and sends it back.
func demoWorker(ctx context.Context, w *mp.Worker) error {
	var a demoArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	for {
		var t task
		if err := a.Tasks.Get(ctx, &t); err != nil {
			return err
		}
		if t.Tensor == nil {
			return nil
		}
		r := reply{ID: t.ID, Rank: w.Rank(), Tensor: t.Tensor}
		if err := checkAndWrite(t.Tensor, w.Rank()); err != nil {
			r.Err = err.Error()
		}
		if err := a.Replies.Put(ctx, r); err != nil {
			return err
		}
		// This process's mapping is no longer needed; the parent holds
		// the tensor.
		if err := t.Tensor.Release(); err != nil {
			return err
		}
	}
}

func checkAndWrite(x *tensor.Tensor, rank int) error {
	flat, err := tensor.Arange(x.DType(), x.Numel())
	if err != nil {
		return err
	}
	want, err := flat.Reshape(x.Shape()...)
	if err != nil {
		return err
	}
	if !x.IsShared() {
		return errors.New("received tensor is not in shared memory")
	}
	if !tensor.Equal(x, want) {
		return fmt.Errorf("%v: values differ from 0..%d", x, x.Numel()-1)
	}
	fill, err := tensor.Full(x.DType(), float64(rank+1), x.Shape()...)
	if err != nil {
		return err
	}
	return tensor.Copy(x, fill)
}

type demoRow struct {
	strategy strategy.Strategy
	tensors  int
	bytes    int64
	p50      time.Duration
}

// demoFlags defines demo's flags on fs and returns what runs it once they
// are parsed.
func demoFlags(fs *flag.FlagSet) func(stdout, stderr io.Writer) int {
	workers := fs.Int("workers", 4, "number of worker processes")
	rounds := fs.Int("rounds", 4, "times each kind of tensor is sent per strategy")
	sts := strategyList(strategy.All())
	fs.Var(&sts, "strategy", "comma-separated sharing strategies to run")
	return func(stdout, stderr io.Writer) int {
		if *workers < 1 || *rounds < 1 {
			fmt.Fprintln(stderr, "spawn demo: -workers and -rounds must be at least 1")
			return 2
		}

		before, _, err := segments(mmapalloc.Dir())
		if err != nil {
			fmt.Fprintln(stderr, "spawn demo:", err)
			return 1
		}
		fmt.Fprintf(stdout, "spawn demo: %d workers, %d tensors per strategy, shared memory in %s\n\n", *workers, *rounds*len(demoCases), mmapalloc.Dir())
		var rows []demoRow
		failed := false
		for _, st := range sts {
			row, err := demoStrategy(st, *workers, *rounds)
			if err != nil {
				fmt.Fprintf(stderr, "spawn demo: %s: %v\n", st, err)
				failed = true
				continue
			}
			rows = append(rows, row)
		}
		t := newTable(stdout, "strategy", "tensors", "bytes", "hand-off p50")
		for _, r := range rows {
			t.row(r.strategy.String(), fmt.Sprint(r.tensors), formatBytes(r.bytes), formatDuration(r.p50))
		}
		t.flush()
		mmapalloc.Trim() // what the pools keep for reuse is not residue
		after, mine, err := segments(mmapalloc.Dir())
		if err != nil {
			fmt.Fprintln(stderr, "spawn demo:", err)
			return 1
		}
		fmt.Fprintf(stdout, "\nresidue: %d tensormp_ segments in %s before, %d after; %d of this run\n", before, mmapalloc.Dir(), after, len(mine))
		if len(mine) > 0 {
			fmt.Fprintf(stderr, "spawn demo: segments left behind: %s\n", strings.Join(mine, " "))
			failed = true
		}
		if failed {
			fmt.Fprintln(stdout, "FAIL")
			return 1
		}
		fmt.Fprintln(stdout, "ok: every value checked, every in-place write seen by the parent")
		return 0
	}
}

// demoStrategy runs one strategy: sends every tensor, checks every reply.
func demoStrategy(st strategy.Strategy, workers, rounds int) (demoRow, error) {
	if err := strategy.Set(st); err != nil {
		return demoRow{}, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tasks, err := mp.NewQueue()
	if err != nil {
		return demoRow{}, err
	}
	defer tasks.Close()
	replies, err := mp.NewQueue()
	if err != nil {
		return demoRow{}, err
	}
	defer replies.Close()
	g, err := mp.Spawn(ctx, "demo", workers, mp.WithArgs(demoArgs{Tasks: tasks, Replies: replies}))
	if err != nil {
		return demoRow{}, err
	}
	ctx = g.Context() // a dead worker ends the wait for its reply
	row, runErr := exchange(ctx, st, tasks, replies, rounds)
	for range workers {
		if err := tasks.Put(ctx, task{}); err != nil {
			break
		}
	}
	if err := g.Join(); err != nil {
		return row, err // a worker's failure explains whatever else went wrong
	}
	return row, runErr
}

// exchange sends each tensor and waits for it to come back, one at a
// time, timing the round trip.
func exchange(ctx context.Context, st strategy.Strategy, tasks, replies *mp.Queue, rounds int) (demoRow, error) {
	row := demoRow{strategy: st}
	var trips []time.Duration
	for round := range rounds {
		for i, c := range demoCases {
			id := round*len(demoCases) + i
			flat, err := tensor.On(device.CPU()).Arange(c.dtype, tensor.Numel(c.shape...))
			if err != nil {
				return row, err
			}
			x, err := flat.Reshape(c.shape...)
			if err != nil {
				return row, err
			}
			if err := x.ShareMemory(); err != nil {
				return row, err
			}
			start := time.Now()
			if err := tasks.Put(ctx, task{ID: id, DType: c.dtype.String(), Tensor: x}); err != nil {
				return row, err
			}
			var r reply
			if err := replies.Get(ctx, &r); err != nil {
				return row, err
			}
			trips = append(trips, time.Since(start))
			if err := verifyReply(x, r, id); err != nil {
				return row, err
			}
			row.tensors++
			row.bytes += x.Nbytes()
			if err := x.Release(); err != nil {
				return row, err
			}
		}
	}
	slices.Sort(trips)
	row.p50 = trips[len(trips)/2]
	return row, nil
}

func verifyReply(x *tensor.Tensor, r reply, id int) error {
	switch {
	case r.Err != "":
		return fmt.Errorf("worker %d on tensor %d: %s", r.Rank, id, r.Err)
	case r.ID != id:
		return fmt.Errorf("reply for tensor %d, want %d", r.ID, id)
	case r.Tensor == nil || r.Tensor.Storage() != x.Storage():
		return fmt.Errorf("tensor %d came back on other memory: it was copied, not shared", id)
	}
	want, err := tensor.On(device.CPU()).Full(x.DType(), float64(r.Rank+1), x.Shape()...)
	if err != nil {
		return err
	}
	if !tensor.Equal(x, want) {
		return fmt.Errorf("tensor %d: the worker's in-place write is not visible to the parent", id)
	}
	return nil
}

// segments counts the tensormp_ segments in dir, leaving out session
// locks, which belong to live programs, and lists those of this run.
func segments(dir string) (count int, mine []string, err error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, nil, err
	}
	for _, e := range entries {
		if !mmapalloc.ValidName(e.Name()) {
			continue
		}
		count++
		if strings.HasPrefix(e.Name(), mmapalloc.SessionPrefix()) {
			mine = append(mine, e.Name())
		}
	}
	return count, mine, nil
}

func formatBytes(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func formatDuration(d time.Duration) string {
	if d < time.Microsecond {
		return fmt.Sprintf("%d ns", d.Nanoseconds())
	}
	if d < time.Millisecond {
		return fmt.Sprintf("%d µs", d.Microseconds())
	}
	return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
}

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/loader"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

const loaderHelp = `With -loader, measures package loader instead: batches of 64 x 3 x 224 x
224 float32 images and int64 labels per second, read from two datasets:
  transport  Get touches one value per page of its sample (the batch's
             hand-off is what is measured)
  compute    Get computes every element, a few integer operations each
             (the workers' parallelism is)
with 0 (in the caller), 1 and 2 worker processes, beside the same batches
from the same number of workers written to a plain os.Pipe and read by
the caller (loader_pipe, the copying baseline). rss_growth and
shm_growth are the caller's resident memory and the machine's shared
memory after the last batch less after the warm-up: flat when released
batches are reused.`

// The loader bench's datasets: images made in their batch with
// loader.Zeros, one value per page or every value.
type imageArgs struct {
	Compute bool
	N       int
}

type imageSample struct {
	Image *tensor.Tensor
	Label int64
}

type imageBatch struct{ Image, Label *tensor.Tensor }

type imageSet struct{ imageArgs }

var images = loader.Register("bench.images", func(_ context.Context, a imageArgs) (loader.Dataset[imageSample], error) {
	return imageSet{a}, nil
})

func (s imageSet) Len() int { return s.N }

func (s imageSet) Get(ctx context.Context, i int) (imageSample, error) {
	x, err := loader.Zeros(ctx, tensor.Float32, 3, 224, 224)
	if err != nil {
		return imageSample{}, err
	}
	vals, err := tensor.Data[float32](x)
	if err != nil {
		return imageSample{}, err
	}
	if s.Compute {
		// A few operations an element, as a decoder or an augmentation
		// spends: bound by the CPU, not by memory.
		for j := range vals {
			x := uint32(i)*2654435761 + uint32(j)
			x ^= x >> 13
			x *= 0x5bd1e995
			x ^= x >> 15
			vals[j] = float32(x) * (1.0 / (1 << 32))
		}
	} else {
		for j := 0; j < len(vals); j += 1024 {
			vals[j] = float32(i)
		}
	}
	return imageSample{Image: x, Label: int64(i)}, nil
}

const (
	loaderBatch = 64
	loaderWarm  = 5 // batches before the clock starts
)

// loaderResult is one line of -loader -json output.
type loaderResult struct {
	Strategy  string  `json:"strategy"`
	Case      string  `json:"case"`
	Dataset   string  `json:"dataset"`
	Workers   int     `json:"workers"`
	Bytes     int64   `json:"bytes"`
	PerS      float64 `json:"per_s"`
	RSSGrowth int64   `json:"rss_growth"`
	ShmGrowth int64   `json:"shm_growth"`
}

// pipeArgs is what a loader_pipe worker is spawned with.
type pipeArgs struct {
	Images imageArgs
	Out    floorSocket // the pipe's writing end
}

func init() { mp.Register("bench.pipe", pipeWorker) }

// pipeWorker reads batches in its own process, as a NumWorkers 0 loader,
// and writes each batch's bytes to its pipe until the parent closes it.
func pipeWorker(ctx context.Context, w *mp.Worker) error {
	var a pipeArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	if a.Out.f == nil {
		return errors.New("no pipe to write to")
	}
	raw, err := a.Out.f.Disown()
	if err != nil {
		return err
	}
	out := os.NewFile(uintptr(raw), "loader_pipe")
	defer out.Close()
	l, err := loader.New[imageBatch](images, a.Images, loader.Options{BatchSize: loaderBatch})
	if err != nil {
		return err
	}
	defer l.Close()
	for b, err := range l.Epoch(ctx) {
		if err != nil {
			return err
		}
		for _, t := range []*tensor.Tensor{b.Image, b.Label} {
			if _, err := out.Write(t.Storage().Bytes()[t.Offset() : t.Offset()+t.Nbytes()]); err != nil {
				_ = loader.Release(b)
				if errors.Is(err, unix.EPIPE) {
					return nil // the parent has what it wanted
				}
				return err
			}
		}
		_ = loader.Release(b)
	}
	return nil
}

// runLoaderBench measures package loader and prints its rows.
func runLoaderBench(batches int, asJSON bool, stdout, stderr io.Writer, progress func(string)) int {
	var rs []loaderResult
	emit := func(r loaderResult) {
		r.Strategy = strategy.Get().String()
		rs = append(rs, r)
		if asJSON {
			b, _ := json.Marshal(r)
			fmt.Fprintln(stdout, string(b))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	for _, dataset := range []string{"transport", "compute"} {
		for _, workers := range []int{0, 1, 2} {
			progress(fmt.Sprintf("loader %s, %d workers", dataset, workers))
			r, err := benchLoader(ctx, dataset, workers, batches)
			if err != nil {
				fmt.Fprintf(stderr, "spawn bench: loader %s, %d workers: %v\n", dataset, workers, err)
				return 1
			}
			emit(r)
			if workers == 0 {
				continue
			}
			progress(fmt.Sprintf("loader_pipe %s, %d workers", dataset, workers))
			if r, err = benchPipe(ctx, dataset, workers, batches); err != nil {
				fmt.Fprintf(stderr, "spawn bench: loader_pipe %s, %d workers: %v\n", dataset, workers, err)
				return 1
			}
			emit(r)
		}
	}
	if !asJSON {
		printLoaderTable(stdout, rs)
	}
	return 0
}

func imageBytes() int64 { return loaderBatch * (3*224*224*4 + 8) }

// benchLoader reads batches (after a warm-up) from a loader with workers
// worker processes, releasing each at once.
func benchLoader(ctx context.Context, dataset string, workers, batches int) (loaderResult, error) {
	r := loaderResult{Case: "loader", Dataset: dataset, Workers: workers, Bytes: imageBytes()}
	args := imageArgs{Compute: dataset == "compute", N: (batches + loaderWarm) * loaderBatch}
	l, err := loader.New[imageBatch](images, args, loader.Options{BatchSize: loaderBatch, NumWorkers: workers})
	if err != nil {
		return r, err
	}
	defer l.Close()
	var start time.Time
	var rss, shm int64
	n := 0
	for b, err := range l.Epoch(ctx) {
		if err != nil {
			return r, err
		}
		if err := loader.Release(b); err != nil {
			return r, err
		}
		if n++; n == loaderWarm {
			rss, shm = memNow()
			start = time.Now()
		}
	}
	elapsed := time.Since(start)
	rss2, shm2 := memNow()
	r.PerS = float64(n-loaderWarm) / elapsed.Seconds()
	r.RSSGrowth, r.ShmGrowth = rss2-rss, shm2-shm
	return r, nil
}

// benchPipe reads the same batches, made by workers worker processes,
// through a pipe from each, in turn.
func benchPipe(ctx context.Context, dataset string, workers, batches int) (loaderResult, error) {
	r := loaderResult{Case: "loader_pipe", Dataset: dataset, Workers: workers, Bytes: imageBytes()}
	per := (batches+loaderWarm)/workers + 1
	var ins []*os.File
	defer func() {
		for _, f := range ins {
			_ = f.Close()
		}
	}()
	var outs []*fd.FD
	defer func() {
		for _, f := range outs {
			_ = f.Close()
		}
	}()
	for range workers {
		rd, wr, err := os.Pipe()
		if err != nil {
			return r, err
		}
		ins = append(ins, rd)
		// The writing end as a descriptor of its own, for the worker.
		raw, err := unix.Dup(int(wr.Fd()))
		_ = wr.Close()
		if err != nil {
			return r, err
		}
		unix.CloseOnExec(raw)
		outs = append(outs, fd.New(raw))
	}
	g, err := mp.Spawn(ctx, "bench.pipe", workers, mp.WithRankArgs(func(rank int) any {
		return pipeArgs{Images: imageArgs{Compute: dataset == "compute", N: per * loaderBatch}, Out: floorSocket{outs[rank]}}
	}))
	for _, f := range outs {
		_ = f.Close() // the workers have theirs
	}
	outs = nil
	if err != nil {
		return r, err
	}
	buf := make([]byte, imageBytes())
	var start time.Time
	var rss, shm int64
	for n := range batches + loaderWarm {
		if n == loaderWarm {
			rss, shm = memNow()
			start = time.Now()
		}
		if _, err := io.ReadFull(ins[n%workers], buf); err != nil {
			g.Stop(err)
			return r, errors.Join(fmt.Errorf("reading batch %d: %w", n, err), g.Join())
		}
	}
	elapsed := time.Since(start)
	rss2, shm2 := memNow()
	for _, f := range ins {
		_ = f.Close() // the workers' next write ends them
	}
	ins = nil
	r.PerS = float64(batches) / elapsed.Seconds()
	r.RSSGrowth, r.ShmGrowth = rss2-rss, shm2-shm
	return r, g.Join()
}

// memNow returns this process's resident memory and the machine's shared
// memory (tmpfs and memfd pages), in bytes.
func memNow() (rss, shm int64) {
	return procKB("/proc/self/status", "VmRSS:"), procKB("/proc/meminfo", "Shmem:")
}

func procKB(path, key string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return -1
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, key); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb << 10
		}
	}
	return -1
}

func printLoaderTable(w io.Writer, rs []loaderResult) {
	t := newTable(w, "case", "dataset", "workers", "batches/s", "MB/s", "x pipe", "rss growth", "shm growth")
	defer t.flush()
	for _, r := range rs {
		vs := ""
		for _, p := range rs {
			if r.Case == "loader" && p.Case == "loader_pipe" && p.Dataset == r.Dataset && p.Workers == r.Workers {
				vs = fmt.Sprintf("%.1f", r.PerS/p.PerS)
			}
		}
		t.row(r.Case, r.Dataset, fmt.Sprint(r.Workers), fmt.Sprintf("%.1f", r.PerS),
			fmt.Sprintf("%.0f", r.PerS*float64(r.Bytes)/1e6), vs, mib(r.RSSGrowth), mib(r.ShmGrowth))
	}
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

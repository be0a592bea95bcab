package loader

import (
	"context"
	"fmt"

	"github.com/tensormp/tensormp/mp"
)

// workerArgs is what a loader worker is spawned with.
type workerArgs[A any] struct {
	Info      WorkerInfo
	Args      A
	Collate   string
	Init      string
	BatchSize int
	DropLast  bool
	Tasks     *mp.Queue // this worker's own
	Results   *mp.Queue // every worker's, read by the loader
}

// task asks a worker for batch Seq of Epoch: the samples at Indices of a
// map-style dataset, or an iterable's next batch. Stop ends the worker.
type task struct {
	Epoch, Seq int
	Indices    []int
	Stop       bool
}

// result is a worker's answer to a task.
type result[V any] struct {
	Epoch, Seq, Worker int
	Failed             bool
	Index              int // with Failed, the failing sample, or -1
	Err                string
	Done               bool // an iterable's pass has ended
	Batch              V
}

// runWorker is a loader worker process's main: it opens the dataset and
// answers tasks until told to stop.
func runWorker[A, T any](ctx context.Context, w *mp.Worker, s *Source[A, T]) error {
	var a workerArgs[A]
	if err := w.Args(&a); err != nil {
		return err
	}
	defer a.Tasks.Close()
	defer a.Results.Close()
	ctx = context.WithValue(ctx, infoKey{}, a.Info)
	if a.Init != "" {
		fn, ok := lookupWorkerInit(a.Init)
		if !ok {
			return fmt.Errorf("loader: no worker init is registered as %q (RegisterWorkerInit before mp.Init)", a.Init)
		}
		if err := fn(ctx, a.Info); err != nil {
			return fmt.Errorf("loader: worker init %q: %w", a.Init, err)
		}
	}
	ds, err := s.open(ctx, a.Args)
	if err != nil {
		return fmt.Errorf("loader: opening dataset %q: %w", s.name, err)
	}
	f, err := newFetcher(ds, a.Collate)
	if err != nil {
		return err
	}
	defer f.close()
	for {
		var t task
		if err := a.Tasks.Get(ctx, &t); err != nil {
			if ctx.Err() != nil {
				return nil // stopped
			}
			return fmt.Errorf("loader: taking a task: %w", err)
		}
		if t.Stop {
			return nil
		}
		r := result[any]{Epoch: t.Epoch, Seq: t.Seq, Worker: a.Info.ID, Index: -1}
		var err error
		if s.iterable {
			r.Batch, r.Done, r.Index, err = f.batchOf(ctx, t.Epoch, a.BatchSize, a.DropLast)
		} else {
			r.Batch, r.Index, err = f.batch(ctx, t.Indices)
		}
		if err != nil {
			r.Failed, r.Err = true, err.Error()
			_ = Release(r.Batch)
			r.Batch = nil
		}
		err = a.Results.Put(ctx, &r)
		// The message holds what it carries: this process lets go of
		// the batch, which comes back to its pool once the trainer has.
		_ = Release(r.Batch)
		f.arena.release()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("loader: sending batch %d: %w", t.Seq, err)
		}
	}
}

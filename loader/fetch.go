package loader

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"reflect"
)

// fetcher reads a dataset's samples and collates them into batches, in a
// worker or, with NumWorkers 0, in the caller. It is used by one
// goroutine at a time.
type fetcher[T any] struct {
	ds      dataset[T]
	collate func(ctx context.Context, samples []T) (any, error)
	arena   arena

	// An iterable's pass: its epoch, and the samples read so far.
	epoch int
	next  func() (T, error, bool)
	stop  func()
	read  int
}

// newFetcher returns a fetcher of ds that collates with the collate
// registered as name, or the default for "".
func newFetcher[T any](ds dataset[T], name string) (*fetcher[T], error) {
	f := &fetcher[T]{ds: ds, epoch: -1}
	if name == "" {
		f.collate = func(_ context.Context, samples []T) (any, error) {
			vs := make([]reflect.Value, len(samples))
			all := reflect.ValueOf(samples)
			for i := range vs {
				vs[i] = all.Index(i)
			}
			return collate(vs)
		}
		return f, nil
	}
	c, ok := lookupCollate(name)
	if !ok {
		return nil, fmt.Errorf("loader: no collate is registered as %q (RegisterCollate before mp.Init)", name)
	}
	if want := reflect.TypeFor[T](); c.sample != want {
		return nil, fmt.Errorf("loader: collate %q takes %v samples, the dataset makes %v", name, c.sample, want)
	}
	f.collate = func(ctx context.Context, samples []T) (any, error) { return c.fn(ctx, samples) }
	return f, nil
}

// batch reads the samples at indices and collates them. On error, index
// is the failing sample's (-1 for the collate).
func (f *fetcher[T]) batch(ctx context.Context, indices []int) (b any, index int, err error) {
	f.arena.reset(len(indices))
	ctx = context.WithValue(ctx, arenaKey{}, &f.arena)
	samples := make([]T, len(indices))
	for k, i := range indices {
		f.arena.next(k)
		if samples[k], err = f.ds.m.Get(ctx, i); err != nil {
			return nil, i, err
		}
	}
	b, err = f.collate(ctx, samples)
	return b, -1, err
}

// batchOf reads the next size samples of epoch's pass over an iterable
// and collates them; done when the pass has ended (with dropLast, when it
// has fewer than size left). On error, index is the failing sample's
// position in this process's pass.
func (f *fetcher[T]) batchOf(ctx context.Context, epoch, size int, dropLast bool) (b any, done bool, index int, err error) {
	if f.epoch != epoch {
		f.close()
		f.epoch, f.read = epoch, 0
		// The pass reaches the arena through its ctx.
		f.next, f.stop = iter.Pull2(f.ds.it.All(context.WithValue(ctx, arenaKey{}, &f.arena)))
	}
	f.arena.reset(size)
	samples := make([]T, 0, size)
	for len(samples) < size {
		f.arena.next(len(samples))
		v, err, ok := f.next()
		if !ok {
			break
		}
		if err != nil {
			return nil, false, f.read, err
		}
		f.read++
		samples = append(samples, v)
	}
	if len(samples) == 0 || (dropLast && len(samples) < size) {
		return nil, true, -1, nil
	}
	b, err = f.collate(ctx, samples)
	return b, false, -1, err
}

// len returns a map-style dataset's number of samples.
func (f *fetcher[T]) len() int { return f.ds.m.Len() }

// close ends an iterable's pass.
func (f *fetcher[T]) close() {
	if f.stop != nil {
		f.stop()
		f.next, f.stop = nil, nil
	}
}

// errNoSamples is a map-style dataset's Len below one.
var errNoSamples = errors.New("loader: the dataset has no samples")

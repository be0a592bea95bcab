package loader

import (
	"context"
	"fmt"
	"iter"
	"reflect"
	"sync"

	"github.com/tensormp/tensormp/mp"
)

// Dataset is a map-style dataset (torch's Dataset): Len samples, read by
// index in any order.
type Dataset[T any] interface {
	Len() int
	Get(ctx context.Context, i int) (T, error)
}

// Iterable is a dataset read in one pass (torch's IterableDataset). With
// several workers each reads its own All: the dataset shards itself by
// the WorkerInfo in ctx, or every sample comes once per worker.
type Iterable[T any] interface {
	All(ctx context.Context) iter.Seq2[T, error]
}

// Source is a registered dataset constructor: New opens it with an A in
// each worker, or in the caller with NumWorkers 0, for samples of type T.
type Source[A, T any] struct {
	name     string
	iterable bool
	open     func(ctx context.Context, args A) (dataset[T], error)
}

// Name returns the name the source was registered under.
func (s *Source[A, T]) Name() string { return s.name }

// dataset is what a worker reads: a Dataset, or an Iterable with Len -1.
type dataset[T any] struct {
	m  Dataset[T]
	it Iterable[T]
}

// Register registers open under name as a map-style dataset and returns
// the Source New takes. Call it in every process, before mp.Init: a
// package-level variable is the natural place. Registering a name twice
// panics.
func Register[A, T any](name string, open func(ctx context.Context, args A) (Dataset[T], error)) *Source[A, T] {
	s := &Source[A, T]{name: name, open: func(ctx context.Context, args A) (dataset[T], error) {
		d, err := open(ctx, args)
		return dataset[T]{m: d}, err
	}}
	register(s)
	return s
}

// RegisterIterable is Register for an iterable dataset.
func RegisterIterable[A, T any](name string, open func(ctx context.Context, args A) (Iterable[T], error)) *Source[A, T] {
	s := &Source[A, T]{name: name, iterable: true, open: func(ctx context.Context, args A) (dataset[T], error) {
		d, err := open(ctx, args)
		return dataset[T]{it: d}, err
	}}
	register(s)
	return s
}

func register[A, T any](s *Source[A, T]) {
	mp.Register(workerPrefix+s.name, func(ctx context.Context, w *mp.Worker) error { return runWorker(ctx, w, s) })
}

const workerPrefix = "tensormp.loader."

// WorkerInfo is what a worker knows of itself (torch's get_worker_info):
// its id, the number of workers and the seed for its random numbers.
type WorkerInfo struct {
	ID         int
	NumWorkers int
	// Seed differs from worker to worker and is the same for the same
	// Options.Seed: seed a worker's random numbers with it.
	Seed int64
}

type infoKey struct{}

// Info returns the WorkerInfo of the worker whose dataset, collate or
// initializer ctx was given to; false outside a worker (NumWorkers 0).
func Info(ctx context.Context) (WorkerInfo, bool) {
	w, ok := ctx.Value(infoKey{}).(WorkerInfo)
	return w, ok
}

// Collate functions and worker initializers, by name.
var (
	registryMu  sync.Mutex
	collates    = map[string]collateFunc{}
	workerInits = map[string]func(context.Context, WorkerInfo) error{}
)

// collateFunc is a registered collate: fn takes a []T for the sample type.
type collateFunc struct {
	sample reflect.Type
	fn     func(ctx context.Context, samples any) (any, error)
}

// RegisterCollate registers fn under name for Options.Collate: it makes
// a batch of samples, in a worker (torch's collate_fn). Make the batch's
// tensors with tensor.On(device.CPU()).Shared() (or Stack) so that it
// travels without a copy. Register in every process, before mp.Init.
func RegisterCollate[T, B any](name string, fn func(ctx context.Context, samples []T) (B, error)) {
	registryMu.Lock()
	defer registryMu.Unlock()
	if _, dup := collates[name]; dup {
		panic(fmt.Sprintf("loader: RegisterCollate: %q registered twice", name))
	}
	collates[name] = collateFunc{sample: reflect.TypeFor[T](), fn: func(ctx context.Context, samples any) (any, error) {
		return fn(ctx, samples.([]T))
	}}
}

// RegisterWorkerInit registers fn under name for Options.WorkerInit: each
// worker runs it first (torch's worker_init_fn). Register in every
// process, before mp.Init.
func RegisterWorkerInit(name string, fn func(ctx context.Context, info WorkerInfo) error) {
	registryMu.Lock()
	defer registryMu.Unlock()
	if _, dup := workerInits[name]; dup {
		panic(fmt.Sprintf("loader: RegisterWorkerInit: %q registered twice", name))
	}
	workerInits[name] = fn
}

func lookupCollate(name string) (collateFunc, bool) {
	registryMu.Lock()
	defer registryMu.Unlock()
	c, ok := collates[name]
	return c, ok
}

func lookupWorkerInit(name string) (func(context.Context, WorkerInfo) error, bool) {
	registryMu.Lock()
	defer registryMu.Unlock()
	f, ok := workerInits[name]
	return f, ok
}

// Package loader is torch's DataLoader for Go: worker processes read a
// dataset's samples, collate them into batches born in shared memory, and
// hand the batches to the trainer without copying, in order.
//
// A dataset is opened in every process that reads it, from a constructor
// registered under a name (Register for a map-style Dataset, with Len and
// Get; RegisterIterable for an Iterable), like mp.Register's workers:
// register in every process of the program, before mp.Init. The
// constructor's argument travels to the workers as an mp.Queue value does,
// so a dataset can hold tensors that every worker maps, uncopied.
//
//	var squares = loader.Register("squares", openSquares)
//
//	l, err := loader.New[Batch](squares, 10_000, loader.Options{BatchSize: 64, NumWorkers: 2, Shuffle: true})
//	defer l.Close()
//	for batch, err := range l.Epoch(ctx) {
//		...
//		loader.Release(batch) // back to its worker's pool
//	}
//
// Ownership: a batch the iteration yields is the caller's; Release (or
// the garbage collector) gives its memory back to the worker that made it,
// which reuses it for a later batch. The Loader owns its worker processes
// and queues until Close. A worker's error or death ends the epoch with a
// *SampleError naming the worker and the sample; cancelling the epoch's
// context stops every worker.
package loader

package loader

import (
	"fmt"
	"iter"
	"math/rand/v2"
	"slices"
)

// Sampler orders a map-style dataset's indices for each epoch (torch's
// Sampler).
type Sampler interface {
	// Len is the number of indices an epoch yields.
	Len() int
	// Indices yields epoch's indices (epochs count from 0).
	Indices(epoch int) iter.Seq[int]
}

// Sequential returns the sampler of 0 to n-1 in order.
func Sequential(n int) Sampler { return sequential(n) }

type sequential int

func (s sequential) Len() int { return int(s) }

func (s sequential) Indices(int) iter.Seq[int] {
	return func(yield func(int) bool) {
		for i := range int(s) {
			if !yield(i) {
				return
			}
		}
	}
}

// Random returns a sampler of 0 to n-1 in a new order each epoch: the
// same orders, epoch by epoch, for the same seed, in every run.
func Random(n int, seed int64) Sampler { return random{n: n, seed: seed} }

type random struct {
	n    int
	seed int64
}

func (r random) Len() int { return r.n }

func (r random) Indices(epoch int) iter.Seq[int] {
	return slices.Values(permutation(r.n, r.seed, epoch))
}

// permutation is a permutation of 0 to n-1 that depends only on seed and
// epoch.
func permutation(n int, seed int64, epoch int) []int {
	rng := rand.New(rand.NewPCG(uint64(seed), uint64(epoch)))
	return rng.Perm(n)
}

// Distributed returns the sampler of rank's share of n indices among
// world processes (torch's DistributedSampler): the ranks' shares are
// disjoint, each of the same length, and, with shuffle, drawn from one
// permutation per epoch that every rank computes alike from seed. Unless
// dropLast, the share is padded with indices from the start, as torch
// does, so that every rank takes the same number of steps; with dropLast
// the tail that does not divide evenly is left out.
func Distributed(n, rank, world int, shuffle bool, seed int64, dropLast bool) (Sampler, error) {
	if world < 1 || rank < 0 || rank >= world || n < 0 {
		return nil, fmt.Errorf("loader: distributed sampler of rank %d among %d over %d samples", rank, world, n)
	}
	per := (n + world - 1) / world
	if dropLast {
		per = n / world
	}
	return distributed{n: n, rank: rank, world: world, per: per, shuffle: shuffle, seed: seed}, nil
}

type distributed struct {
	n, rank, world, per int
	shuffle             bool
	seed                int64
}

func (d distributed) Len() int { return d.per }

func (d distributed) Indices(epoch int) iter.Seq[int] {
	return func(yield func(int) bool) {
		if d.per == 0 {
			return
		}
		var order []int
		if d.shuffle {
			order = permutation(d.n, d.seed, epoch)
		}
		at := func(i int) int {
			i %= d.n // padding wraps to the start
			if order != nil {
				return order[i]
			}
			return i
		}
		for k := range d.per {
			if !yield(at(d.rank + k*d.world)) {
				return
			}
		}
	}
}

// BatchSampler groups a sampler's indices into batches of Size (torch's
// BatchSampler); with DropLast a last, short batch is left out.
type BatchSampler struct {
	Sampler  Sampler
	Size     int
	DropLast bool
}

// Len returns the number of batches an epoch yields.
func (b BatchSampler) Len() int {
	n := b.Sampler.Len()
	if b.DropLast {
		return n / b.Size
	}
	return (n + b.Size - 1) / b.Size
}

// Batches yields epoch's batches of indices.
func (b BatchSampler) Batches(epoch int) iter.Seq[[]int] {
	return func(yield func([]int) bool) {
		batch := make([]int, 0, b.Size)
		for i := range b.Sampler.Indices(epoch) {
			batch = append(batch, i)
			if len(batch) == b.Size {
				if !yield(batch) {
					return
				}
				batch = make([]int, 0, b.Size)
			}
		}
		if len(batch) > 0 && !b.DropLast {
			yield(batch)
		}
	}
}

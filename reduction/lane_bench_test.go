//go:build linux

package reduction

import (
	"bytes"
	"errors"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// lendingLane is the writer's side of a lane whose reader maps every
// block of this process's pool: a message names them by identity.
type lendingLane struct{ pinnedLane }

func (lendingLane) Maps(*shm.Block) bool { return true }

// BenchmarkLaneHandOff measures, in one process, the two halves of a
// shared 4 KiB tensor's hand-off by a lane, without the lane itself:
// its encoding for a lane whose reader maps the block (the loan taken,
// and given back as the reader's ack would), and the decode of a lane's
// message that names a pinned block of another process's pool, the
// tensor released at once as a consumer would (so that each decode
// attaches the block afresh), and of one that returns a block of this
// process's, found on the storage that holds it.
func BenchmarkLaneHandOff(b *testing.B) {
	b.Run("encode", func(b *testing.B) {
		x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Uint8, 4<<10)
		if err != nil {
			b.Fatal(err)
		}
		defer x.Release()
		send := func(_ []byte, fds []int, lent []*shm.Block) error {
			if len(fds) != 0 || len(lent) != 1 {
				b.Fatalf("sent %d descriptors and %d loans, want 0 and 1", len(fds), len(lent))
			}
			lent[0].Return()
			return nil
		}
		b.ReportAllocs()
		for b.Loop() {
			if err := carry.EncodeLane(x, lendingLane{}, send); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode-pinned", func(b *testing.B) {
		m := laneBlocks(b, 1, 4<<10)[0]
		benchDecode(b, compactMessage(b, m), pinnedLane{m.segmentID(): true}, func(x *tensor.Tensor) error {
			return x.Release()
		})
	})
	b.Run("decode-batch-of-16", func(b *testing.B) {
		const n = 16
		ms := laneBlocks(b, n, 4<<10)
		var data bytes.Buffer
		if err := msgpack.NewEncoder(&data).EncodeArrayLen(n); err != nil {
			b.Fatal(err)
		}
		for _, m := range ms {
			data.Write(compactMessage(b, m))
		}
		lane := pinnedLane{ms[0].segmentID(): true}
		var fds fd.Set
		var xs []*tensor.Tensor
		b.ReportAllocs()
		for b.Loop() {
			if err := carry.DecodeFrom(data.Bytes(), &fds, &xs, lane, true); err != nil {
				b.Fatal(err)
			}
			if len(xs) != n {
				b.Fatalf("%d tensors of a batch of %d", len(xs), n)
			}
			for _, x := range xs {
				if err := x.Release(); err != nil {
					b.Fatal(err)
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/tensor")
	})
	b.Run("decode-returned", func(b *testing.B) {
		blk, err := shm.DefaultPool().Alloc(4 << 10)
		if err != nil {
			b.Fatal(err)
		}
		s, err := tensor.NewStorage(device.CPU(), blk)
		if err != nil {
			b.Fatal(err)
		}
		defer s.Release()
		registerBlock(s, blk)
		benchDecode(b, compactMessage(b, returnMeta(blk)), pinnedLane{}, func(x *tensor.Tensor) error {
			if x.Storage() != s {
				return errors.New("the return came back on other memory")
			}
			return nil
		})
	})
}

// benchDecode decodes data, a message of lane, into a tensor b.N times,
// each given to then.
func benchDecode(b *testing.B, data []byte, lane carry.Lane, then func(*tensor.Tensor) error) {
	var fds fd.Set
	b.ReportAllocs()
	for b.Loop() {
		var x *tensor.Tensor
		if err := carry.DecodeFrom(data, &fds, &x, lane, true); err != nil {
			b.Fatal(err)
		}
		if err := then(x); err != nil {
			b.Fatal(err)
		}
	}
}

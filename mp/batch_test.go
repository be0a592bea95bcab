package mp_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/tensor"
)

func init() {
	mp.Register("batch-echo", workerBatchEcho)
}

type batchArgs struct {
	In, Out *mp.Queue
	Batches int
}

// workerBatchEcho takes batches with GetMany into one reused slice, adds
// the batch's index to every element in place, and sends each batch back
// with PutMany: TestBatchAcrossProcesses.
func workerBatchEcho(ctx context.Context, w *mp.Worker) error {
	var a batchArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	var b []*tensor.Tensor
	for i := range a.Batches {
		var err error
		if b, err = mp.GetMany(ctx, a.In, b[:0]); err != nil {
			return err
		}
		for _, x := range b {
			d, err := tensor.Data[int32](x)
			if err != nil {
				return err
			}
			for k := range d {
				d[k] += int32(i)
			}
		}
		if err := mp.PutMany(ctx, a.Out, b); err != nil {
			return err
		}
		for _, x := range b {
			_ = x.Release()
		}
	}
	return nil
}

func TestBatchAcrossProcesses(t *testing.T) {
	leakcheck.Check(t)
	// A worker that cannot take its arguments fails the test, not hangs it.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	in, err := mp.NewQueue(mp.WithCapacity(2))
	require.NoError(t, err)
	defer in.Close()
	out, err := mp.NewQueue()
	require.NoError(t, err)
	defer out.Close()
	const batches, size = 5, 16
	g, err := mp.Spawn(ctx, "batch-echo", 1, mp.WithArgs(batchArgs{In: in, Out: out, Batches: batches}))
	require.NoError(t, err)

	born := tensor.On(device.CPU()).Shared()
	var sent [][]*tensor.Tensor
	defer func() {
		for _, b := range sent {
			for _, x := range b {
				_ = x.Release()
			}
		}
	}()
	for i := range batches {
		b := make([]*tensor.Tensor, size)
		for j := range b {
			b[j], err = born.Full(tensor.Int32, float64(j), 8)
			require.NoError(t, err)
		}
		sent = append(sent, b)
		require.NoError(t, mp.PutMany(ctx, in, b), "batch %d", i)
	}
	got := make([]*tensor.Tensor, 1, 4) // GetMany appends after what is there
	for i := range batches {
		got, err = mp.GetMany(ctx, out, got[:1])
		require.NoError(t, err)
		require.Len(t, got, 1+size)
		for j, x := range got[1:] {
			assert.Same(t, sent[i][j].Storage(), x.Storage(), "batch %d element %d came back on its own memory", i, j)
			v, err := tensor.Values[int32](x)
			require.NoError(t, err)
			assert.Equal(t, int32(j+i), v[7], "the worker wrote into batch %d element %d in place", i, j)
			_ = x.Release()
		}
	}
	require.NoError(t, g.Join())
}

func TestGetManyTakesSingleValuesAndKeepsBatchOnError(t *testing.T) {
	leakcheck.Check(t)
	ctx := context.Background()
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()

	require.NoError(t, q.Put(ctx, 7))
	require.NoError(t, mp.PutMany(ctx, q, []int{8, 9}))
	require.NoError(t, mp.PutMany(ctx, q, []int{}))
	require.NoError(t, q.Put(ctx, "ten"))
	require.NoError(t, mp.PutMany(ctx, q, []string{"eleven"}))

	b := []int{1}
	b, err = mp.GetMany(ctx, q, b)
	require.NoError(t, err)
	assert.Equal(t, []int{1, 7}, b, "a single Put is a batch of one")
	b, err = mp.GetMany(ctx, q, b)
	require.NoError(t, err)
	assert.Equal(t, []int{1, 7, 8, 9}, b)
	b, err = mp.GetMany(ctx, q, b)
	require.NoError(t, err)
	assert.Equal(t, []int{1, 7, 8, 9}, b, "an empty batch adds nothing")
	b, err = mp.GetMany(ctx, q, b)
	require.Error(t, err)
	assert.Equal(t, []int{1, 7, 8, 9}, b, "a value of another type leaves the batch as it was")
	require.Greater(t, cap(b), len(b))
	assert.Zero(t, b[:len(b)+1][len(b)], "and nothing of it in the slice's room")
	b2 := make([]int, 0, 8)
	b2, err = mp.GetMany(ctx, q, b2)
	require.Error(t, err, "a batch of another type is refused")
	assert.Empty(t, b2)
	assert.Equal(t, []int{0, 0, 0, 0, 0, 0, 0, 0}, b2[:8], "no half-decoded value is left in the slice's room")
}

func TestPutManyCarriesOneDescriptorPerSegment(t *testing.T) {
	leakcheck.Check(t)
	born := tensor.On(device.CPU()).Shared()
	b := make([]*tensor.Tensor, 64)
	for i := range b {
		var err error
		b[i], err = born.Zeros(tensor.Uint8, 4<<10)
		require.NoError(t, err)
	}
	defer func() {
		for _, x := range b {
			_ = x.Release()
		}
	}()
	_, fds, err := reduction.Marshal(b)
	require.NoError(t, err)
	defer func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}()
	assert.Len(t, fds, 1, "64 tensors of one slab travel with one descriptor")
}

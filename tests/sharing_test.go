package tests

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// The behaviours of torch's test_multiprocessing.py, under both
// strategies: a worker echoes what it receives after checking it and
// writing into it.

type item struct {
	Tensor *tensor.Tensor
	View   *tensor.Tensor
	Empty  *tensor.Tensor
	Write  float64
}

type echoArgs struct {
	In, Out *mp.Queue
}

func init() {
	mp.Register("share.echo", shareEcho)
}

// shareEcho takes items from In until an empty one, checks that each
// arrived shared, with its tensor and view on one storage and its empty
// tensor empty, writes Write into the view, and puts the item on Out:
// TestSharingAcrossProcesses' worker.
func shareEcho(ctx context.Context, w *mp.Worker) error {
	var a echoArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	for {
		var it item
		if err := a.In.Get(ctx, &it); err != nil {
			return err
		}
		if it.Tensor == nil {
			return nil
		}
		if !it.Tensor.IsShared() || !it.View.IsShared() || !it.Empty.IsShared() {
			return errors.New("received tensors are not shared")
		}
		if it.Tensor.Storage() != it.View.Storage() {
			return errors.New("a tensor and its view came back on different storages")
		}
		if it.Empty.Numel() != 0 {
			return fmt.Errorf("empty tensor arrived as %v", it.Empty)
		}
		fill, err := tensor.Full(it.View.DType(), it.Write, it.View.Shape()...)
		if err != nil {
			return err
		}
		if err := tensor.Copy(it.View, fill); err != nil { // into a non-contiguous view
			return err
		}
		if err := a.Out.Put(ctx, it); err != nil {
			return err
		}
		if err := it.Tensor.Release(); err != nil {
			return err
		}
	}
}

func TestSharingAcrossProcesses(t *testing.T) {
	for _, st := range strategy.All() {
		t.Run(st.String(), func(t *testing.T) {
			useStrategy(t, st)
			leakcheck.Check(t)

			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			in, out := testQueues(t)
			g, err := mp.Spawn(ctx, "share.echo", 2, mp.WithArgs(echoArgs{In: in, Out: out}))
			require.NoError(t, err)

			for i, dt := range []tensor.DType{tensor.Float32, tensor.Float64, tensor.Int32, tensor.Int64} {
				flat, err := tensor.Arange(dt, 60)
				require.NoError(t, err)
				x, err := flat.Reshape(6, 10)
				require.NoError(t, err)
				assert.False(t, x.IsShared())
				cols, err := x.Slice(1, 2, 5)
				require.NoError(t, err)
				view, err := cols.Transpose(0, 1)
				require.NoError(t, err)
				empty, err := tensor.Zeros(dt, 0)
				require.NoError(t, err)

				require.NoError(t, in.Put(ctx, item{Tensor: x, View: view, Empty: empty, Write: float64(-1 - i)}))
				assert.True(t, x.IsShared(), "sending shares the tensor in place")
				var back item
				require.NoError(t, out.Get(ctx, &back))
				assert.Same(t, x.Storage(), back.Tensor.Storage(), "preserve sharing: out and back is the same storage")
				assert.Same(t, x.Storage(), back.View.Storage())
				assert.Equal(t, []int{0}, back.Empty.Shape())

				// The worker's write through the view is in the parent's tensor.
				want, err := tensor.Arange(dt, 60)
				require.NoError(t, err)
				wantM, err := want.Reshape(6, 10)
				require.NoError(t, err)
				wc, err := wantM.Slice(1, 2, 5)
				require.NoError(t, err)
				fill, err := tensor.Full(dt, float64(-1-i), 6, 3)
				require.NoError(t, err)
				require.NoError(t, tensor.Copy(wc, fill))
				assert.True(t, tensor.Equal(x, wantM), "%v: in-place writes seen across processes", dt)
				require.NoError(t, x.Release())
			}
			for range 2 {
				require.NoError(t, in.Put(ctx, item{}))
			}
			require.NoError(t, g.Join())
		})
	}
}

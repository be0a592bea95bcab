//go:build linux

package reduction_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/reduction"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// sample is one dtype's part of a batch: a 6x8 matrix of 0..47, a
// non-contiguous view of it (rows 1..4, transposed), the matrix again, and
// an empty tensor.
type sample struct {
	DType string
	Base  *tensor.Tensor
	View  *tensor.Tensor
	Again *tensor.Tensor
	Empty *tensor.Tensor
}

type batch struct {
	Label   string
	Samples []sample
	ByName  map[string]any
}

// Values the helper writes: every element of Base, then every element of
// View, and every element of a "big" tensor, which it receives holding
// 0, 1, 2, ...
const (
	baseWrite = 0
	viewWrite = 5
	bigWrite  = 7
)

func viewOf(t *tensor.Tensor) (*tensor.Tensor, error) {
	rows, err := t.Narrow(0, 1, 4)
	if err != nil {
		return nil, err
	}
	return rows.Transpose(0, 1)
}

func matrix(dt tensor.DType) (*tensor.Tensor, error) {
	a, err := tensor.Arange(dt, 48)
	if err != nil {
		return nil, err
	}
	return a.Reshape(6, 8)
}

func newSample(dt tensor.DType) (sample, error) {
	base, err := matrix(dt)
	if err != nil {
		return sample{}, err
	}
	view, err := viewOf(base)
	if err != nil {
		return sample{}, err
	}
	empty, err := tensor.Zeros(dt, 0, 3)
	if err != nil {
		return sample{}, err
	}
	return sample{DType: dt.String(), Base: base, View: view, Again: base, Empty: empty}, nil
}

// expectedAfterWrites is what Base holds once the helper has written.
func expectedAfterWrites(dt tensor.DType) (*tensor.Tensor, error) {
	want, err := tensor.Full(dt, baseWrite, 6, 8)
	if err != nil {
		return nil, err
	}
	view, err := viewOf(want)
	if err != nil {
		return nil, err
	}
	fill, err := tensor.Full(dt, viewWrite, 8, 4)
	if err != nil {
		return nil, err
	}
	return want, tensor.Copy(view, fill)
}

// helperRebuildCheck reads a batch from stdin and descriptors from fd 3
// on, checks every value, checks that tensors on one storage came back on
// one storage, writes through Base and View, and releases everything.
func helperRebuildCheck() int {
	if err := rebuildCheck(); err != nil {
		fmt.Fprintln(os.Stderr, "rebuild-check:", err)
		return 1
	}
	return 0
}

// helperInput returns the message a helper process was given: its bytes
// on standard input, its descriptors from 3 on, as many as its first
// argument says.
func helperInput() ([]byte, []int, error) {
	nfds, err := strconv.Atoi(os.Args[1])
	if err != nil {
		return nil, nil, err
	}
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		return nil, nil, err
	}
	fds := make([]int, nfds)
	for i := range fds {
		fds[i] = 3 + i
	}
	return data, fds, nil
}

func rebuildCheck() error {
	data, fds, err := helperInput()
	if err != nil {
		return err
	}
	var b batch
	if err := reduction.Unmarshal(data, fds, &b); err != nil {
		return err
	}
	if b.Label != "batch" || len(b.Samples) != len(tensor.DTypes()) {
		return fmt.Errorf("label %q with %d samples", b.Label, len(b.Samples))
	}
	for _, s := range b.Samples {
		dt, err := tensor.ParseDType(s.DType)
		if err != nil {
			return err
		}
		want, err := matrix(dt)
		if err != nil {
			return err
		}
		wantView, err := viewOf(want)
		if err != nil {
			return err
		}
		switch {
		case !tensor.Equal(s.Base, want):
			return fmt.Errorf("%v: base differs", dt)
		case !tensor.Equal(s.View, wantView):
			return fmt.Errorf("%v: view differs", dt)
		case !s.Base.IsShared():
			return fmt.Errorf("%v: received tensor not shared", dt)
		case s.Base.Storage() != s.View.Storage() || s.Base.Storage() != s.Again.Storage():
			return fmt.Errorf("%v: one storage came back as several", dt)
		case s.Empty.Numel() != 0 || s.Empty.Dim() != 2 || s.Empty.DType() != dt:
			return fmt.Errorf("%v: empty tensor came back as %v", dt, s.Empty)
		}
		full, err := tensor.Full(dt, baseWrite, 6, 8)
		if err != nil {
			return err
		}
		if err := tensor.Copy(s.Base, full); err != nil {
			return err
		}
		fill, err := tensor.Full(dt, viewWrite, 8, 4)
		if err != nil {
			return err
		}
		if err := tensor.Copy(s.View, fill); err != nil {
			return err
		}
	}
	if x, ok := b.ByName["f32"].(*tensor.Tensor); !ok || x.DType() != tensor.Float32 {
		return fmt.Errorf("tensor inside map[string]any came back as %T", b.ByName["f32"])
	}
	if big, ok := b.ByName["big"].(*tensor.Tensor); ok {
		want, err := tensor.Arange(big.DType(), big.Numel())
		if err != nil {
			return err
		}
		if !tensor.Equal(big, want) {
			return fmt.Errorf("%v: the big tensor differs", big.DType())
		}
		write, err := tensor.Full(big.DType(), bigWrite, big.Numel())
		if err != nil {
			return err
		}
		if err := tensor.Copy(big, write); err != nil {
			return err
		}
	}
	// Release what was received: under file_system a process that exits
	// holding a segment keeps its reference counted.
	for _, s := range b.Samples {
		if err := s.Base.Release(); err != nil {
			return err
		}
	}
	for _, v := range b.ByName {
		if err := v.(*tensor.Tensor).Release(); err != nil {
			return err
		}
	}
	return nil
}

// runHelper sends data and fds to a new rebuild-check process and waits
// for it.
func runHelper(t *testing.T, data []byte, fds []int) {
	t.Helper()
	runHelperAs(t, "rebuild-check", data, fds)
}

// runHelperAs sends data and fds to a new helper process of the given
// role and waits for it.
func runHelperAs(t *testing.T, role string, data []byte, fds []int) {
	t.Helper()
	for _, fd := range fds {
		f := os.NewFile(uintptr(fd), "segment") // runHelper owns fds
		defer f.Close()
	}
	cmd, err := reexec.Command(context.Background(), role, strconv.Itoa(len(fds)))
	require.NoError(t, err)
	// A worker belongs to its parent's session; segments of another
	// session are refused.
	cmd.Env = append(cmd.Env, shm.EnvSession+"="+shm.Session())
	for _, fd := range fds {
		cmd.ExtraFiles = append(cmd.ExtraFiles, os.NewFile(uintptr(fd), "segment"))
	}
	var stderr bytes.Buffer
	cmd.Stdin = bytes.NewReader(data)
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Run(), "helper: %s", stderr.String())
}

// TestCrossProcessAllDTypes sends every dtype under both strategies to a
// helper process, which checks the values and writes through the tensor
// and a non-contiguous view; the parent must see the writes.
func TestCrossProcessAllDTypes(t *testing.T) {
	withStrategy(t, func(t *testing.T, st strategy.Strategy) {
		b := batch{Label: "batch", ByName: map[string]any{}}
		for _, dt := range tensor.DTypes() {
			s, err := newSample(dt)
			require.NoError(t, err)
			b.Samples = append(b.Samples, s)
		}
		f32, err := tensor.Full(tensor.Float32, 1.5, 3)
		require.NoError(t, err)
		b.ByName["f32"] = f32
		defer func() {
			for _, s := range b.Samples {
				s.Base.Release()
			}
			f32.Release()
		}()

		data, fds, err := reduction.Marshal(&b)
		require.NoError(t, err)
		if st == strategy.FileDescriptor {
			assert.LessOrEqual(t, len(fds), 4, "one descriptor per pooled segment, however many storages it holds")
		} else {
			assert.Empty(t, fds)
		}
		runHelper(t, data, fds)
		checkWrites(t, b.Samples)
		for _, s := range b.Samples {
			if st == strategy.FileSystem {
				assert.Equal(t, int32(1), segmentOf(t, s.Base).Refs(), "the helper gave its reference back")
			}
		}
	})
}

// checkWrites checks that the helper's writes to the samples are seen
// here.
func checkWrites(t *testing.T, samples []sample) {
	t.Helper()
	for _, s := range samples {
		dt, err := tensor.ParseDType(s.DType)
		require.NoError(t, err)
		want, err := expectedAfterWrites(dt)
		require.NoError(t, err)
		assert.True(t, tensor.Equal(s.Base, want), "%v: the parent sees the helper's writes", dt)
	}
}

// TestCrossProcessLarge moves the four common dtypes at a size where a
// copy would be noticed, and checks the writes come back.
func TestCrossProcessLarge(t *testing.T) {
	withStrategy(t, func(t *testing.T, st strategy.Strategy) {
		for _, dt := range []tensor.DType{tensor.Float32, tensor.Float64, tensor.Int32, tensor.Int64} {
			t.Run(dt.String(), func(t *testing.T) {
				b := batch{Label: "batch", ByName: map[string]any{}}
				for _, d := range tensor.DTypes() {
					s, err := newSample(d)
					require.NoError(t, err)
					b.Samples = append(b.Samples, s)
				}
				big, err := tensor.Arange(dt, 1<<20)
				require.NoError(t, err)
				require.NoError(t, big.ShareMemory())
				b.ByName["f32"] = mustFull(t, tensor.Float32)
				b.ByName["big"] = big
				data, fds, err := reduction.Marshal(&b)
				require.NoError(t, err)
				assert.Less(t, len(data), 16<<10, "metadata only: the data stays in the segment")
				runHelper(t, data, fds)
				want, err := tensor.Full(dt, bigWrite, 1<<20)
				require.NoError(t, err)
				assert.True(t, tensor.Equal(big, want), "the parent sees the helper's writes to the big tensor")
				checkWrites(t, b.Samples)
				for _, s := range b.Samples {
					s.Base.Release()
				}
				b.ByName["f32"].(*tensor.Tensor).Release()
				big.Release()
			})
		}
	})
}

func mustFull(t *testing.T, dt tensor.DType) *tensor.Tensor {
	x, err := tensor.Full(dt, 1, 2)
	require.NoError(t, err)
	return x
}

//go:build cgo && linux

package tests

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"

	_ "github.com/tensormp/tensormp/cuda" // removes a dead worker's driver files
)

// driverFile is the name libcuda gives a file of process pid's
// interprocess events.
func driverFile(pid int, n int) string {
	return filepath.Join("/dev/shm", "cuda.shm.0."+strconv.FormatInt(int64(pid), 16)+"."+strconv.Itoa(n))
}

func init() {
	// Makes a file named as the driver names one of this process's,
	// reports, and waits to be killed.
	mp.Register("driverfile.plant", func(ctx context.Context, w *mp.Worker) error {
		var a gpuArgs
		if err := w.Args(&a); err != nil {
			return err
		}
		if err := os.WriteFile(driverFile(os.Getpid(), 1), nil, 0o600); err != nil {
			return err
		}
		if err := a.Status.Put(ctx, os.Getpid()); err != nil {
			return err
		}
		var ack string
		return a.Ack.Get(ctx, &ack)
	})
}

// killWorker SIGKILLs g's one worker once it has put its pid on status,
// and checks that Join reports the kill.
func killWorker(ctx context.Context, t *testing.T, g *mp.Group) {
	t.Helper()
	pids := g.Pids()
	require.Len(t, pids, 1)
	require.NoError(t, syscall.Kill(pids[0], syscall.SIGKILL))
	var xe *mp.ExitError
	require.ErrorAs(t, g.Join(), &xe)
	assert.Equal(t, syscall.SIGKILL, xe.Signal)
}

// A worker SIGKILLed with driver files of its own in /dev/shm leaves none:
// its parent removes them before it reaps the worker. Files of a live
// process (here the test's own) stay.
func TestKilledWorkerLeavesNoDriverFiles(t *testing.T) {
	leakcheck.Check(t)
	status, ack := testQueues(t)
	mine := driverFile(os.Getpid(), 1<<20)
	require.NoError(t, os.WriteFile(mine, nil, 0o600))
	t.Cleanup(func() { _ = os.Remove(mine) })

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g, err := mp.Spawn(ctx, "driverfile.plant", 1, mp.WithArgs(gpuArgs{Status: status, Ack: ack}))
	require.NoError(t, err)
	var pid int
	require.NoError(t, status.Get(ctx, &pid))
	require.FileExists(t, driverFile(pid, 1), "the worker planted its file")
	killWorker(ctx, t, g)
	_, err = os.Stat(driverFile(pid, 1))
	assert.True(t, errors.Is(err, os.ErrNotExist), "the dead worker's file is gone: %v", err)
	assert.FileExists(t, mine, "a live process's file stays")
}

// The same on the GPU: a worker killed while the memory it exported is
// held here leaves no driver file behind, and the memory it sent stays
// readable until it is released.
func TestGPUKilledWorkerLeavesNoDriverFiles(t *testing.T) {
	requireGPU(t)
	leakcheck.Check(t)
	before := driverFiles(t)
	status, ack := testQueues(t)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	g, err := mp.Spawn(ctx, "gpu.make", 1, mp.WithArgs(gpuArgs{Status: status, Ack: ack}))
	require.NoError(t, err)
	var x *tensor.Tensor
	require.NoError(t, status.Get(ctx, &x))
	dead := "." + strconv.FormatInt(int64(g.Pids()[0]), 16) + "."
	require.True(t, slices.ContainsFunc(driverFiles(t), func(f string) bool { return strings.Contains(filepath.Base(f), dead) }),
		"the worker's export made a driver file of its own")
	killWorker(ctx, t, g)
	host, err := x.To(device.CPU())
	require.NoError(t, err)
	last, err := tensor.At[int32](host, 1<<10-1)
	require.NoError(t, err)
	assert.Equal(t, int32(1<<10-1), last, "what the dead worker sent is still whole here")
	require.NoError(t, x.Release())
	assert.Equal(t, before, driverFiles(t), "the dead worker's driver file went with it")
}

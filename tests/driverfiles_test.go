//go:build cgo && linux

package tests

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mp"

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
	killWorker(t, g)
	_, err = os.Stat(driverFile(pid, 1))
	assert.True(t, errors.Is(err, os.ErrNotExist), "the dead worker's file is gone: %v", err)
	assert.FileExists(t, mine, "a live process's file stays")
}

//go:build cgo && linux

package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/cudashm"
	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/leftover"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// The CUDA driver's files in /dev/shm of processes that die without
// giving their context back: whoever learns of the death removes them.
// The stand-in driver makes its file as the real one does, when the
// process first exports GPU memory by legacy CUDA IPC.

func init() {
	mp.Register("driverfile.plant", driverfilePlant)
	mp.Register("driverfile.export", driverfileExport)
	reexec.Register("program.gpu-fatal", programGPUFatal)
	reexec.Register("program.gpu-peer", programGPUPeer)
}

// driverfilePlant makes a file named as the driver names one of this
// process's, reports, and waits to be killed:
// TestKilledWorkerLeavesNoDriverFiles' worker.
func driverfilePlant(ctx context.Context, w *mp.Worker) error {
	var a gpuArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	if err := os.WriteFile(cudashm.Name(os.Getpid(), 1), nil, 0o600); err != nil {
		return err
	}
	if err := a.Status.Put(ctx, os.Getpid()); err != nil {
		return err
	}
	var ack string
	return a.Ack.Get(ctx, &ack)
}

// driverfileExport exports GPU memory by legacy CUDA IPC, which makes
// the driver's file, reports, and waits for the end of its program:
// program.gpu-fatal's worker.
func driverfileExport(ctx context.Context, w *mp.Worker) error {
	var status *mp.Queue
	if err := w.Args(&status); err != nil {
		return err
	}
	if err := exportLegacy(); err != nil {
		return err
	}
	if err := status.Put(ctx, os.Getpid()); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

// exportLegacy makes this process export GPU memory by legacy CUDA IPC,
// as a process does that sends a GPU tensor from a device that cannot
// export descriptors: the driver makes its file. It must run before the
// process's first GPU tensor.
func exportLegacy() error {
	if err := os.Setenv(cuda.EnvLegacy, "1"); err != nil {
		return err
	}
	x, err := tensor.On(device.GPU(0)).Zeros(tensor.Uint8, 16)
	if err != nil {
		return err
	}
	gs, err := gpushare.Get()
	if err != nil {
		return err
	}
	h, err := gs.Export(x.Storage().Backing().(tensor.Buffer))
	if err != nil {
		return err
	}
	h.Ticket.Discard()
	if len(cudashm.Of(os.Getpid())) == 0 {
		return errors.New("the driver made no file")
	}
	return nil
}

// programGPUFatal exports GPU memory, as its worker does, prints both
// pids and ends as log.Fatal ends a program: no Join, no CloseBackends.
func programGPUFatal() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	status, err := mp.NewQueue()
	if err != nil {
		fmt.Println("error", err)
		return 2
	}
	if _, err := mp.Spawn(ctx, "driverfile.export", 1, mp.WithArgs(status)); err != nil {
		fmt.Println("error", err)
		return 2
	}
	var worker int
	if err := status.Get(ctx, &worker); err != nil {
		fmt.Println("error", err)
		return 2
	}
	if err := exportLegacy(); err != nil {
		fmt.Println("error", err)
		return 2
	}
	// Both files exist now: once this process has exited, which it does
	// the moment it has printed, the test could not tell "never made"
	// from "removed already".
	if len(cudashm.Of(worker)) == 0 {
		fmt.Println("error: the worker's driver file is missing")
		return 2
	}
	fmt.Printf("pids %d %d\n", os.Getpid(), worker)
	os.Exit(1)
	return 1
}

// programGPUPeer is an endpoint's peer: it dials ENDPOINT, or with
// LISTEN listens there and accepts one connection; then it exports GPU
// memory, sends its pid, and waits to be killed.
func programGPUPeer() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var p *mp.Pipe
	var err error
	if os.Getenv("LISTEN") != "" {
		var l *mp.Listener
		if l, err = mp.Listen(os.Getenv("ENDPOINT")); err == nil {
			defer l.Close()
			fmt.Println("listening")
			p, _, err = l.Accept(ctx)
		}
	} else {
		p, err = mp.Dial(ctx, os.Getenv("ENDPOINT"))
	}
	if err == nil {
		err = exportLegacy()
	}
	if err == nil {
		err = p.Send(ctx, os.Getpid())
	}
	if err == nil {
		err = p.Recv(ctx, new(string))
	}
	fmt.Println("error", err)
	return 1
}

// A worker SIGKILLed with driver files of its own in /dev/shm leaves none:
// its parent removes them before it reaps the worker. Files of a live
// process (here the test's own) stay.
func TestKilledWorkerLeavesNoDriverFiles(t *testing.T) {
	leakcheck.Check(t)
	status, ack := testQueues(t)
	mine := plantOwnDriverFile(t)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g, err := mp.Spawn(ctx, "driverfile.plant", 1, mp.WithArgs(gpuArgs{Status: status, Ack: ack}))
	require.NoError(t, err)
	var pid int
	require.NoError(t, status.Get(ctx, &pid))
	require.NotEmpty(t, cudashm.Of(pid), "the worker planted its file")
	killWorker(t, g)
	assert.Empty(t, cudashm.Of(pid), "the dead worker's file is gone")
	assert.FileExists(t, mine, "a live process's file stays")
}

// A program that exported GPU memory and ends as log.Fatal ends it, and
// its worker, which dies with it, leave no driver files: the session's
// keepers remove those of every member once the session has ended.
func TestFatalProgramLeavesNoDriverFiles(t *testing.T) {
	leakcheck.Check(t)
	mine := plantOwnDriverFile(t)
	p := startProgram(t, "program.gpu-fatal", strategy.FileDescriptor, false)
	// The program prints the pids once both have their files (it checks).
	pids := pidsFrom(t, p.waitLine(t, "pids"))
	require.Len(t, pids, 2)
	assert.Equal(t, 1, p.wait(t))
	p.expectGone(t)
	for _, pid := range pids {
		assert.Empty(t, cudashm.Of(pid), "the driver files of member %d", pid)
	}
	assert.FileExists(t, mine, "a live process's file stays")
}

// An endpoint whose peer is killed removes the peer's driver files,
// whichever side listened.
func TestKilledEndpointPeerLeavesNoDriverFiles(t *testing.T) {
	mine := plantOwnDriverFile(t)
	for _, listens := range []string{"peer", "this process"} {
		t.Run(listens+" listens", func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			addr := "@tensormp-driverfiles-" + strconv.Itoa(os.Getpid()) + "-" + strconv.Itoa(int(sessionCounter.Add(1)))
			env := []string{"ENDPOINT=" + addr}
			var pipe *mp.Pipe
			var p *program
			if listens == "peer" {
				p = startProgramIn(t, newSession(), "program.gpu-peer", strategy.FileDescriptor, false, append(env, "LISTEN=1")...)
				p.waitLine(t, "listening")
				var err error
				pipe, err = mp.Dial(ctx, addr)
				require.NoError(t, err)
			} else {
				l, err := mp.Listen(addr)
				require.NoError(t, err)
				defer l.Close()
				p = startProgramIn(t, newSession(), "program.gpu-peer", strategy.FileDescriptor, false, env...)
				var cred mp.Cred
				pipe, cred, err = l.Accept(ctx)
				require.NoError(t, err)
				require.Equal(t, p.cmd.Process.Pid, cred.PID)
			}
			defer pipe.Close()
			var pid int
			require.NoError(t, pipe.Recv(ctx, &pid))
			require.Equal(t, p.cmd.Process.Pid, pid)
			require.NotEmpty(t, cudashm.Of(pid), "the peer exported GPU memory")
			require.NoError(t, p.cmd.Process.Signal(syscall.SIGKILL))
			assert.Eventually(t, func() bool { return len(cudashm.Of(pid)) == 0 }, 5*time.Second, 10*time.Millisecond,
				"the dead peer's driver files are removed")
			p.wait(t)
		})
	}
	assert.FileExists(t, mine, "a live process's file stays")
}

// What a dead process left under its pid is removed only once no live
// process has that pid: not while it runs, and then as a zombie.
func TestLiveProcessKeepsItsDriverFiles(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	require.NoError(t, cmd.Start())
	pid := cmd.Process.Pid
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	require.NoError(t, os.WriteFile(cudashm.Name(pid, 1), nil, 0o600))
	t.Cleanup(func() { _ = os.Remove(cudashm.Name(pid, 1)) })

	leftover.Remove(pid)
	assert.FileExists(t, cudashm.Name(pid, 1), "a live process's file stays")
	require.NoError(t, cmd.Process.Kill())
	require.Eventually(t, func() bool { return leftover.Dead(pid) }, 5*time.Second, time.Millisecond)
	leftover.Remove(pid) // a zombie, not yet reaped: its pid is still its own
	assert.NoFileExists(t, cudashm.Name(pid, 1))
}

// plantOwnDriverFile makes a file named as the driver names one of this
// process's, removed when t ends: a live process's, which nothing may
// remove.
func plantOwnDriverFile(t *testing.T) string {
	t.Helper()
	mine := cudashm.Name(os.Getpid(), 1<<20)
	require.NoError(t, os.WriteFile(mine, nil, 0o600))
	t.Cleanup(func() { _ = os.Remove(mine) })
	return mine
}

//go:build linux

package cudastub

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"syscall"
)

// Enter makes the calling test binary run on the stand-in. Call it first
// in TestMain, before anything else runs.
//
// In a process not on it yet (TMSTUB_DIR unset), it builds the library
// (Dir), makes a fresh state directory, and runs os.Args again with the
// library first on LD_LIBRARY_PATH (which the dynamic loader reads only
// at start) and the configuration in the environment; stdin, stdout and
// stderr pass through, SIGINT, SIGTERM and SIGQUIT are forwarded, and the
// child is killed if this process dies. It then removes the state
// directory and exits with the child's exit code, 128+n for a child
// killed by signal n, or 1 with a message on stderr if something failed.
//
// In a process already on it (TMSTUB_DIR set, as every child of such a
// process inherits it), Enter returns at once. The re-executed process
// always has TMSTUB_DIR set, whatever cfg.Env says, so Enter never
// re-executes twice.
func Enter(cfg Config) {
	if _, on := os.LookupEnv(EnvDir); on {
		return
	}
	code, err := enter(cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "cudastub: %v\n", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func enter(cfg Config) (int, error) {
	lib, err := Dir()
	if err != nil {
		return 0, err
	}
	state, err := os.MkdirTemp("", "tmstub-")
	if err != nil {
		return 0, fmt.Errorf("making the state directory: %w", err)
	}
	defer os.RemoveAll(state)

	cmd := exec.Command(os.Args[0], os.Args[1:]...)
	cmd.Env = cfg.environ(lib, state)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}

	// The parent-death signal follows the thread that started the child:
	// keep this goroutine on it until the child is gone.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("re-executing %s: %w", os.Args[0], err)
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case s := <-sigs:
				_ = cmd.Process.Signal(s)
			case <-done:
				return
			}
		}
	}()
	err = cmd.Wait()
	close(done)
	if err != nil {
		var exit *exec.ExitError
		if !errors.As(err, &exit) {
			return 0, fmt.Errorf("waiting for %s: %w", os.Args[0], err)
		}
	}
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	switch {
	case !ok:
		return cmd.ProcessState.ExitCode(), nil
	case ws.Signaled():
		return 128 + int(ws.Signal()), nil
	default:
		return ws.ExitStatus(), nil
	}
}

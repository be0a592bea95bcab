// Package tests holds tensormp's end-to-end tests: real processes, real
// shared memory, real signals. Each test checks that it leaves nothing:
// no descriptor in the test process, no tensormp_ entry of its session in
// the shared-memory directory, no process of its session alive.
package tests

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/strategy"
)

func TestMain(m *testing.M) {
	// Without TENSORMP_REQUIRE_GPU (tests/gpu.sh sets it, on a GPU),
	// the GPU tests run on the stand-in driver, through the real binding.
	testmain.Run(m, testmain.WithSession(), testmain.WithStandInGPU(cudastub.Config{Devices: 1}),
		testmain.After(func() { pythonCleanup() }))
}

// gone is how long a test waits for its processes and segments to
// disappear.
const gone = 3 * time.Second

// program is a separate tensormp program run by a test: the test binary
// re-executed in one of the roles registered with reexec, in a session of
// its own.
type program struct {
	cmd     *exec.Cmd
	session string
	lines   *bufio.Scanner
	stdout  io.ReadCloser
}

var sessionCounter atomic.Int64

// newSession returns a session id no program has used.
func newSession() string {
	return fmt.Sprintf("e2e%dx%d", os.Getpid(), sessionCounter.Add(1))
}

// startProgram runs role as a new program under strategy st, in a
// session of its own. With ownGroup it leads a process group of its own.
func startProgram(t *testing.T, role string, st strategy.Strategy, ownGroup bool) *program {
	t.Helper()
	return startProgramIn(t, newSession(), role, st, ownGroup)
}

// startProgramIn is startProgram in the given session, with env added
// to the program's environment.
func startProgramIn(t *testing.T, session, role string, st strategy.Strategy, ownGroup bool, env ...string) *program {
	t.Helper()
	cmd, err := reexec.Command(context.Background(), role)
	require.NoError(t, err)
	cmd.Env = append(cmd.Env,
		shm.EnvSession+"="+session,
		strategy.EnvVar+"="+st.String(),
	)
	cmd.Env = append(cmd.Env, env...)
	if ownGroup {
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	}
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	p := &program{cmd: cmd, session: session, lines: bufio.NewScanner(stdout), stdout: stdout}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		p.expectGone(t)
	})
	return p
}

// waitLine reads the program's output up to a line starting with prefix
// and returns the rest of that line.
func (p *program) waitLine(t *testing.T, prefix string) string {
	t.Helper()
	var skipped []string
	for p.lines.Scan() {
		if rest, ok := strings.CutPrefix(p.lines.Text(), prefix); ok {
			return strings.TrimSpace(rest)
		}
		skipped = append(skipped, p.lines.Text())
	}
	t.Fatalf("program ended without printing %q (%v); it printed %q", prefix, p.lines.Err(), skipped)
	return ""
}

// wait waits for the program and returns its exit code.
func (p *program) wait(t *testing.T) int {
	t.Helper()
	_, _ = io.Copy(io.Discard, p.stdout)
	err := p.cmd.Wait()
	if err == nil {
		return 0
	}
	xe, ok := err.(*exec.ExitError)
	require.True(t, ok, "waiting for the program: %v", err)
	return xe.ExitCode()
}

// expectGone fails t unless, within a few seconds, no process of the
// program's session is alive and no entry of the session is left.
func (p *program) expectGone(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(gone)
	for {
		procs := sessionProcs(p.session)
		entries := sessionEntries(p.session)
		if len(procs) == 0 && len(entries) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("session %s after %v: processes alive %v, entries left %v", p.session, gone, procs, entries)
			for _, pid := range procs {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// sessionProcs lists the live processes whose environment names session.
func sessionProcs(session string) []int {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	want := []byte(shm.EnvSession + "=" + session + "\x00")
	var pids []int
	for _, d := range dirs {
		env, err := os.ReadFile(d + "/environ")
		if err != nil || !bytesContains(append(env, 0), want) {
			continue
		}
		if stat, err := os.ReadFile(d + "/stat"); err == nil && isZombie(stat) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(d))
		pids = append(pids, pid)
	}
	return pids
}

func isZombie(stat []byte) bool {
	s := string(stat)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] == 'Z'
}

func bytesContains(b, sub []byte) bool { return strings.Contains(string(b), string(sub)) }

// useStrategy sets the sharing strategy for the rest of t.
func useStrategy(t *testing.T, st strategy.Strategy) {
	t.Helper()
	old := strategy.Get()
	require.NoError(t, strategy.Set(st))
	t.Cleanup(func() { require.NoError(t, strategy.Set(old)) })
}

// sessionEntries lists the session's entries in the shared-memory
// directory.
func sessionEntries(session string) []string {
	matches, _ := filepath.Glob(filepath.Join(shm.Dir(), shm.NamePrefix+session+"_*"))
	return matches
}

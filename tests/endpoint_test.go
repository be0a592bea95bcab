package tests

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

func init() {
	reexec.Register("program.dial", programDial)
}

// programDial dials ENDPOINT, adds one to the first element of the
// tensor it receives, in place, says "done", and holds the tensor until
// told "bye". With DIAL_ANYONE it accepts a listener of any user.
func programDial() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var opts []mp.EndpointOption
	if os.Getenv("DIAL_ANYONE") != "" {
		opts = append(opts, mp.WithPeerCheck(nil))
	}
	p, err := mp.Dial(ctx, os.Getenv("ENDPOINT"), opts...)
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	defer p.Close()
	var x *tensor.Tensor
	if err := p.Recv(ctx, &x); err != nil {
		if errors.Is(err, mp.ErrClosed) {
			fmt.Println("closed:", err)
			return 0
		}
		fmt.Println("recv:", err)
		return 1
	}
	v, err := tensor.At[int32](x, 0)
	if err == nil {
		err = tensor.Set(x, v+1, 0)
	}
	if err == nil {
		err = p.Send(ctx, "done")
	}
	var bye string
	if err == nil {
		err = p.Recv(ctx, &bye)
	}
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	_ = x.Release()
	return 0
}

// An unrelated process reaches a named endpoint, on a path or an
// abstract name, and shares tensors through it without a copy.
func TestEndpointSharesWithAnUnrelatedProcess(t *testing.T) {
	for _, addr := range []string{
		filepath.Join(t.TempDir(), "endpoint"),
		"@tensormp-test-" + strconv.Itoa(os.Getpid()),
	} {
		t.Run(addr, func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			l, err := mp.Listen(addr)
			require.NoError(t, err)
			defer l.Close()
			if addr[0] != '@' {
				st, err := os.Stat(addr)
				require.NoError(t, err)
				assert.Equal(t, os.ModeSocket|0o600, st.Mode(), "only this user may connect")
			}

			prog := startEndpointProgram(t, addr)
			p, cred, err := l.Accept(ctx)
			require.NoError(t, err)
			defer p.Close()
			assert.Equal(t, prog.cmd.Process.Pid, cred.PID, "the kernel names the peer")
			assert.Equal(t, os.Geteuid(), cred.UID)

			x, err := tensor.On(device.CPU()).Shared().Full(tensor.Int32, 41, 1024)
			require.NoError(t, err)
			require.NoError(t, p.Send(ctx, x))
			var done string
			require.NoError(t, p.Recv(ctx, &done))
			assert.Equal(t, "done", done)
			v, err := tensor.At[int32](x, 0)
			require.NoError(t, err)
			assert.Equal(t, int32(42), v, "the other process wrote into this one's memory")
			require.NoError(t, p.Send(ctx, "bye"))
			assert.Equal(t, 0, prog.wait(t))
			require.NoError(t, x.Release())

			require.NoError(t, l.Close())
			if addr[0] != '@' {
				_, err := os.Stat(addr)
				assert.ErrorIs(t, err, os.ErrNotExist, "Close removes the socket file")
			}
		})
	}
}

func startEndpointProgram(t *testing.T, addr string, env ...string) *program {
	t.Helper()
	t.Setenv("ENDPOINT", addr)
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	return startProgram(t, "program.dial", strategy.FileDescriptor, false)
}

// A listener refuses a process of another user unless told otherwise;
// Accept says who it refused and goes on listening.
func TestEndpointRefusesAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running a process as another user needs root")
	}
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	addr := "@tensormp-test-refuse-" + strconv.Itoa(os.Getpid())
	l, err := mp.Listen(addr)
	require.NoError(t, err)
	defer l.Close()

	// The test binary, where the other user can run it.
	dir, err := os.MkdirTemp("", "tensormp-endpoint")
	require.NoError(t, err)
	defer os.RemoveAll(dir)
	require.NoError(t, os.Chmod(dir, 0o755))
	self, err := os.Executable()
	require.NoError(t, err)
	bin := filepath.Join(dir, "tests.test")
	src, err := os.Open(self)
	require.NoError(t, err)
	dst, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
	require.NoError(t, err)
	_, err = io.Copy(dst, src)
	require.NoError(t, errors.Join(err, src.Close(), dst.Close()))

	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), reexec.Env("program.dial"), "ENDPOINT="+addr, "DIAL_ANYONE=1",
		shm.EnvSession+"="+newSession())
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()

	_, cred, err := l.Accept(ctx)
	require.ErrorIs(t, err, mp.ErrPeerRefused)
	assert.Equal(t, 65534, cred.UID)
	assert.Equal(t, cmd.Process.Pid, cred.PID)
	said, _ := io.ReadAll(out)
	require.NoError(t, cmd.Wait())
	assert.Contains(t, string(said), "closed:", "the refused process sees the connection closed")

	// Still listening: this user's process gets through.
	prog := startEndpointProgram(t, addr)
	p, _, err := l.Accept(ctx)
	require.NoError(t, err)
	defer p.Close()
	x, err := tensor.Zeros(tensor.Int32, 4)
	require.NoError(t, err)
	require.NoError(t, x.ShareMemory())
	require.NoError(t, p.Send(ctx, x))
	var done string
	require.NoError(t, p.Recv(ctx, &done))
	require.NoError(t, p.Send(ctx, "bye"))
	assert.Equal(t, 0, prog.wait(t))
	require.NoError(t, x.Release())
}

package dist_test

import (
	"bufio"
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

	"github.com/tensormp/tensormp/dist"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/tensor"
)

// Hosts as root: each fake host is a network namespace and a mount
// namespace with a private tmpfs on /dev/shm, the two joined by a veth
// pair whose addresses exist only inside the namespaces this test makes.

func init() {
	if namespacesUsable() == "" {
		reexec.Register("dist-host", hostMain)
	}
}

// namespacesUsable says why this machine cannot make namespaced hosts, or
// returns "" if it can.
func namespacesUsable() string {
	if os.Geteuid() != 0 {
		return "needs root: network and mount namespaces"
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return "needs iproute2's ip"
	}
	return ""
}

// hostMain is a rank on a namespaced host: it joins, moves one tensor
// through rank 0's queue so that both hosts hold shared memory, says
// "joined", then waits for the group to fail, says how, closes, and says
// how many entries its /dev/shm holds.
func hostMain() int {
	r, _ := strconv.Atoi(os.Getenv("TEST_RANK"))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	g, err := dist.Init(ctx, dist.WithRank(r, 2), dist.WithStore(os.Getenv("TEST_STORE")), dist.WithAddr(os.Getenv("TEST_ADDR")),
		dist.WithHeartbeat(heartbeat), dist.WithTimeout(30*time.Second))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	q, err := g.Queue(ctx, "warm")
	if err == nil && r == 1 {
		var x *tensor.Tensor
		if x, err = tensor.Arange(tensor.Float32, 1<<18); err == nil {
			err = q.Put(ctx, x)
		}
	}
	var got *tensor.Tensor
	if err == nil && r == 0 {
		err = q.Get(ctx, &got) // kept until the end: shared memory in use
	}
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("joined")
	err = g.Wait()
	var pe *dist.PeerError
	switch {
	case errors.As(err, &pe):
		fmt.Println("failed peer", pe.Rank)
	case errors.Is(err, dist.ErrStoreLost):
		fmt.Println("failed store")
	default:
		fmt.Println("failed other", err)
	}
	if got != nil {
		_ = got.Release()
	}
	_ = g.Close()
	entries, _ := os.ReadDir("/dev/shm")
	fmt.Println("shm-left", len(entries))
	return 0
}

type nsHost struct {
	name  string
	addr  string
	cmd   *exec.Cmd
	lines chan string
	done  chan error
}

func run(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	require.NoError(t, err, "%v: %s", args, out)
}

// makeHosts makes two namespaced hosts joined by a veth pair.
func makeHosts(t *testing.T) [2]*nsHost {
	if why := namespacesUsable(); why != "" {
		t.Skip(why)
	}
	id := strconv.Itoa(os.Getpid() % 100000)
	subnet := "10.213." + strconv.Itoa(os.Getpid()%250) + "."
	var hosts [2]*nsHost
	for i := range hosts {
		hosts[i] = &nsHost{name: fmt.Sprintf("tmpd%d-%s", i, id), addr: subnet + strconv.Itoa(i+1)}
		run(t, "ip", "netns", "add", hosts[i].name)
		name := hosts[i].name
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	}
	v0, v1 := "tv0-"+id, "tv1-"+id
	run(t, "ip", "link", "add", v0, "mtu", "65535", "type", "veth", "peer", "name", v1, "mtu", "65535")
	for i, v := range []string{v0, v1} {
		h := hosts[i]
		run(t, "ip", "link", "set", v, "netns", h.name)
		run(t, "ip", "-n", h.name, "addr", "add", h.addr+"/24", "dev", v)
		run(t, "ip", "-n", h.name, "link", "set", v, "up")
		run(t, "ip", "-n", h.name, "link", "set", "lo", "up")
	}
	return hosts
}

// start runs rank r on host h, in its own process group and mount
// namespace with a private tmpfs on /dev/shm.
func (h *nsHost) start(t *testing.T, r int, store string) {
	self, err := os.Executable()
	require.NoError(t, err)
	script := `mount -t tmpfs -o size=256m tensormp-test /dev/shm && exec "$0"`
	h.cmd = exec.Command("ip", "netns", "exec", h.name, "unshare", "--mount", "--propagation", "private", "sh", "-c", script, self)
	h.cmd.Env = append(os.Environ(), reexec.Env("dist-host"), "TEST_RANK="+strconv.Itoa(r), "TEST_STORE="+store,
		"TEST_ADDR="+h.addr, "TENSORMP_DIST_HOST="+h.name)
	h.cmd.Stderr = os.Stderr
	h.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	out, err := h.cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, h.cmd.Start())
	h.lines, h.done = make(chan string, 16), make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			h.lines <- sc.Text()
		}
		close(h.lines)
		h.done <- h.cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = syscall.Kill(-h.cmd.Process.Pid, syscall.SIGKILL)
		<-h.done
	})
}

// line returns the host's next line of output, within d.
func (h *nsHost) line(t *testing.T, d time.Duration) string {
	t.Helper()
	select {
	case l, ok := <-h.lines:
		if !ok {
			t.Fatalf("%s ended", h.name)
		}
		return l
	case <-time.After(d):
		t.Fatalf("%s said nothing within %v", h.name, d)
		return ""
	}
}

func startHosts(t *testing.T) [2]*nsHost {
	hosts := makeHosts(t)
	store := hosts[0].addr + ":29400"
	hosts[0].start(t, 0, store)
	hosts[1].start(t, 1, store)
	for _, h := range hosts {
		require.Equal(t, "joined", h.line(t, 30*time.Second))
	}
	return hosts
}

// Cutting the link between the hosts fails the group on both within the
// heartbeat bound (3 heartbeats), and each host is left with no segment.
func TestNamespacedHostsLinkDown(t *testing.T) {
	hosts := startHosts(t)
	run(t, "ip", "-n", hosts[0].name, "link", "set", "tv0-"+strconv.Itoa(os.Getpid()%100000), "down")
	cut := time.Now()
	assert.Equal(t, "failed peer 1", hosts[0].line(t, 10*time.Second))
	assert.Equal(t, "failed store", hosts[1].line(t, 10*time.Second))
	t.Logf("both hosts failed %v after the link went down (heartbeat %v)", time.Since(cut), heartbeat)
	assert.Less(t, time.Since(cut), 3*heartbeat+2*time.Second, "both noticed within the bound")
	for _, h := range hosts {
		assert.Equal(t, "shm-left 0", h.line(t, 10*time.Second), h.name)
	}
}

// SIGKILL of one host's process group fails the other within 3 s, and
// leaves no process of that group and no segment on the survivor.
func TestNamespacedHostKilled(t *testing.T) {
	hosts := startHosts(t)
	pgid := hosts[1].cmd.Process.Pid
	require.NoError(t, syscall.Kill(-pgid, syscall.SIGKILL))
	killed := time.Now()
	assert.Equal(t, "failed peer 1", hosts[0].line(t, 10*time.Second))
	t.Logf("the survivor failed %v after the kill", time.Since(killed))
	assert.Less(t, time.Since(killed), 3*time.Second)
	assert.Equal(t, "shm-left 0", hosts[0].line(t, 10*time.Second))
	select {
	case <-hosts[1].done:
		hosts[1].done <- nil
	case <-time.After(10 * time.Second):
		t.Fatal("the killed host's process was not reaped")
	}
	assert.ErrorIs(t, syscall.Kill(-pgid, 0), syscall.ESRCH, "no orphan of the killed host's group")
}

//go:build linux

package dist_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/dist"
	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/tensor"
)

// Each test pretends to run on several hosts: every rank binds its own
// loopback address (127.0.0.2, .3, ...), names its own host and, in a
// helper process, its own shared-memory directory, so nothing can take a
// same-host shortcut.

func TestMain(m *testing.M) {
	reexec.Register("dist-rank", rankMain)
	testmain.Run(m, testmain.WithStandInGPU(cudastub.Config{Devices: 1}))
}

const heartbeat = 200 * time.Millisecond

// freeStore returns an address for rank 0's store on fake host 0.
func freeStore(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.2:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

func hostAddr(h int) string { return "127.0.0." + strconv.Itoa(2+h) }

// join makes this test process rank r, on fake host r.
func join(t *testing.T, ctx context.Context, r, world int, store string, extra ...dist.Option) *dist.Group {
	t.Helper()
	opts := []dist.Option{dist.WithRank(r, world), dist.WithStore(store), dist.WithAddr(hostAddr(r)),
		dist.WithHeartbeat(heartbeat), dist.WithTimeout(30 * time.Second)}
	g, err := dist.Init(ctx, append(opts, extra...)...)
	require.NoError(t, err)
	return g
}

// rankProc is a rank in a helper process.
type rankProc struct {
	cmd  *exec.Cmd
	done chan error
	shm  string
}

// startRank starts rank r of world, running scenario, on fake host r,
// with env added to its environment.
func startRank(t *testing.T, scenario string, r, world int, store string, env ...string) *rankProc {
	t.Helper()
	cmd, err := reexec.Command(context.Background(), "dist-rank")
	require.NoError(t, err)
	shm := filepath.Join(t.TempDir(), "shm")
	require.NoError(t, os.Mkdir(shm, 0o700))
	cmd.Env = append(cmd.Env, "TEST_SCENARIO="+scenario, "TEST_RANK="+strconv.Itoa(r), "TEST_WORLD="+strconv.Itoa(world),
		"TEST_STORE="+store, "TENSORMP_DIST_HOST=h"+strconv.Itoa(r), "TENSORMP_SHM_DIR="+shm)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, cmd.Start())
	p := &rankProc{cmd: cmd, done: make(chan error, 1), shm: shm}
	go func() { p.done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
	})
	return p
}

// wait waits for the helper to exit and returns its exit code.
func (p *rankProc) wait(t *testing.T) int {
	t.Helper()
	select {
	case err := <-p.done:
		p.done <- err
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		require.NoError(t, err)
		return 0
	case <-time.After(60 * time.Second):
		t.Fatal("a rank did not exit within 60 s")
		return -1
	}
}

// rankMain runs a scenario as one rank in a helper process.
func rankMain() int {
	r, _ := strconv.Atoi(os.Getenv("TEST_RANK"))
	world, _ := strconv.Atoi(os.Getenv("TEST_WORLD"))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	opts := []dist.Option{dist.WithRank(r, world), dist.WithStore(os.Getenv("TEST_STORE")), dist.WithAddr(hostAddr(r)),
		dist.WithHeartbeat(heartbeat), dist.WithTimeout(30 * time.Second)}
	if v, err := strconv.ParseInt(os.Getenv("TEST_REF_ABOVE"), 10, 64); err == nil {
		opts = append(opts, dist.WithReferenceAbove(v))
	}
	g, err := dist.Init(ctx, opts...)
	if err != nil {
		fmt.Fprintf(os.Stderr, "rank %d: %v\n", r, err)
		return 3
	}
	if err := scenarios[os.Getenv("TEST_SCENARIO")](ctx, g); err != nil {
		fmt.Fprintf(os.Stderr, "rank %d: %v\n", r, err)
		_ = g.Close()
		return 1
	}
	if err := g.Close(); err != nil {
		fmt.Fprintf(os.Stderr, "rank %d closing: %v\n", r, err)
		return 1
	}
	return 0
}

// ownUntilTaken opens queue name, owned by rank owner, and serves it
// until the test sets name/taken in the store.
func ownUntilTaken(ctx context.Context, g *dist.Group, name string, owner int) error {
	if _, err := g.Queue(ctx, name, dist.WithOwner(owner)); err != nil {
		return err
	}
	_, err := g.Store().Get(ctx, name+"/taken", 0)
	return err
}

var scenarios = map[string]func(ctx context.Context, g *dist.Group) error{
	"put-samples": func(ctx context.Context, g *dist.Group) error {
		owner, _ := strconv.Atoi(os.Getenv("TEST_OWNER"))
		q, err := g.Queue(ctx, "samples", dist.WithOwner(owner))
		if err != nil {
			return err
		}
		return putSamples(ctx, q)
	},
	"own-samples": func(ctx context.Context, g *dist.Group) error { return ownUntilTaken(ctx, g, "samples", g.Rank()) },
	"pipe-echo": func(ctx context.Context, g *dist.Group) error {
		p, err := g.Pipe(ctx, 0)
		if err != nil {
			return err
		}
		defer p.Close()
		for {
			var x *tensor.Tensor
			if err := p.Recv(ctx, &x); err != nil {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return err
			}
			y, err := addOne(x)
			if err != nil {
				return err
			}
			_ = x.Release()
			if err := p.Send(ctx, y); err != nil {
				return err
			}
			_ = y.Release()
		}
	},
	"put-three": func(ctx context.Context, g *dist.Group) error {
		q, err := g.Queue(ctx, "small", dist.WithCapacity(1))
		if err != nil {
			return err
		}
		for i := range 3 {
			x, err := tensor.Full(tensor.Int32, float64(i), putThreeLen)
			if err != nil {
				return err
			}
			if err := q.Put(ctx, x); err != nil {
				return err
			}
		}
		return g.Store().Set(ctx, "put-three/done", []byte("yes"))
	},
	"wait-failure": func(ctx context.Context, g *dist.Group) error {
		// Stay in the group until it fails; report the cause as rank 0
		// would see it.
		err := g.Wait()
		var pe *dist.PeerError
		if !errors.As(err, &pe) || pe.Rank != 1 || !errors.Is(err, dist.ErrPeerLost) {
			return fmt.Errorf("the group ended with %v, want rank 1 lost", err)
		}
		return nil
	},
	"put-refs": func(ctx context.Context, g *dist.Group) error {
		q, err := g.Queue(ctx, "refs", dist.WithOwner(2))
		if err == nil {
			err = putSamples(ctx, q)
		}
		if err != nil {
			return err
		}
		// Close waits until every value was taken.
		return g.Store().Set(ctx, "refs/put", []byte("yes"))
	},
	"own-refs": func(ctx context.Context, g *dist.Group) error { return ownUntilTaken(ctx, g, "refs", 2) },
	"pipe-write": func(ctx context.Context, g *dist.Group) error {
		p, err := g.Pipe(ctx, 0)
		if err != nil {
			return err
		}
		defer p.Close()
		var x *tensor.Tensor
		if err := p.Recv(ctx, &x); err != nil {
			return err
		}
		defer x.Release()
		if err := tensor.Set(x, int32(99), 0); err != nil {
			return err
		}
		if err := p.Send(ctx, "written"); err != nil {
			return err
		}
		var bye string
		return p.Recv(ctx, &bye)
	},
	"queue-owner": func(ctx context.Context, g *dist.Group) error {
		// Serves its queues until told to stop on "end".
		q, err := g.Queue(ctx, "end")
		if err != nil {
			return err
		}
		var s string
		return q.Get(ctx, &s)
	},
	"queue-write": func(ctx context.Context, g *dist.Group) error {
		in, err := g.Queue(ctx, "q")
		if err != nil {
			return err
		}
		back, err := g.Queue(ctx, "back")
		if err != nil {
			return err
		}
		var x *tensor.Tensor
		if err := in.Get(ctx, &x); err != nil {
			return err
		}
		if err := tensor.Set(x, int32(99), 0); err != nil {
			return err
		}
		return back.Put(ctx, "written")
	},
	"idle": func(ctx context.Context, g *dist.Group) error {
		<-ctx.Done()
		return nil
	},
	"abort": func(ctx context.Context, g *dist.Group) error {
		g.Abort(errors.New("bad batch"))
		return nil
	},
}

// samples are the values the tests send: every dtype, views, empty
// tensors, nested values, and bodies at the chunk boundaries.
func samples() []string {
	var names []string
	for _, dt := range tensor.DTypes() {
		names = append(names, "dtype "+dt.String())
	}
	return append(names, "view", "empty", "nested", "chunk-1", "chunk", "chunk+1", "large")
}

type sampleValue struct {
	Name   string
	T      *tensor.Tensor
	Nested map[string][]*tensor.Tensor
	Meta   map[string]int
}

// sample builds sample i, the same in every process.
func sample(i int) (sampleValue, error) {
	names := samples()
	v := sampleValue{Name: names[i], Meta: map[string]int{"i": i}}
	dts := tensor.DTypes()
	var err error
	switch name := names[i]; {
	case i < len(dts):
		v.T, err = tensor.Arange(dts[i], 15)
		if err == nil {
			v.T, err = v.T.Reshape(3, 5)
		}
	case name == "view":
		var x *tensor.Tensor
		if x, err = tensor.Arange(tensor.Float32, 24); err == nil {
			if x, err = x.Reshape(4, 6); err == nil {
				if x, err = x.Transpose(0, 1); err == nil {
					v.T, err = x.Narrow(0, 1, 3)
				}
			}
		}
	case name == "empty":
		v.T, err = tensor.Zeros(tensor.Float64, 0, 4)
	case name == "nested":
		a, _ := tensor.Arange(tensor.Int64, 6)
		b, _ := a.Narrow(0, 2, 3)
		c, _ := tensor.Full(tensor.Float32, 2.5, 2, 2)
		v.T = c
		v.Nested = map[string][]*tensor.Tensor{"ab": {a, b}, "c": {c}}
	default:
		n := map[string]int{"chunk-1": dist.DefaultChunk - 1, "chunk": dist.DefaultChunk, "chunk+1": dist.DefaultChunk + 1, "large": 5*dist.DefaultChunk + 3}[name]
		data := make([]uint8, n)
		for j := range data {
			data[j] = uint8(j*31 + i)
		}
		v.T, err = tensor.FromSlice(data, n)
	}
	return v, err
}

// putSamples puts every sample on q, in order.
func putSamples(ctx context.Context, q *dist.Queue) error {
	for i := range samples() {
		v, err := sample(i)
		if err != nil {
			return err
		}
		if err := q.Put(ctx, v); err != nil {
			return fmt.Errorf("put %d: %w", i, err)
		}
		release(v)
	}
	return nil
}

func release(v sampleValue) {
	if v.T != nil {
		_ = v.T.Release()
	}
	for _, ts := range v.Nested {
		for _, t := range ts {
			_ = t.Release()
		}
	}
}

func addOne(x *tensor.Tensor) (*tensor.Tensor, error) {
	data, err := tensor.Values[float32](x)
	if err != nil {
		return nil, err
	}
	for i := range data {
		data[i]++
	}
	return tensor.FromSlice(data, x.Shape()...)
}

func TestQueueCarriesEveryKindOfValueAcrossHosts(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store := freeStore(t)
	peer := startRank(t, "put-samples", 1, 2, store)
	g := join(t, ctx, 0, 2, store)
	q, err := g.Queue(ctx, "samples")
	require.NoError(t, err)
	getSamples(t, ctx, q)
	assert.Equal(t, 0, peer.wait(t))
	require.NoError(t, g.Close())
	require.NoError(t, g.Wait())
	assertEmptyDir(t, peer.shm)
}

// TestQueueCarriesEveryKindOfValueThroughAnOwner gets every sample from a
// queue held by a third rank, with the three ranks on one, two or three
// hosts: values cross each same-host hop as shared memory and each hop
// between hosts as a copy, and arrive whole either way.
func TestQueueCarriesEveryKindOfValueThroughAnOwner(t *testing.T) {
	for _, tc := range []struct {
		name                string
		getter, putter, own string // the fake hosts of ranks 0, 1 and 2
		refAbove            string // the putter's WithReferenceAbove, if set
		ownRefAbove         string // the owner's: it lends values this large to getters
	}{
		{"three hosts", "h0", "h1", "h2", "", ""},
		{"three hosts, lent by the owner", "h0", "h1", "h2", "", "1"},
		{"owner with getter", "h0", "h1", "h0", "", ""},
		{"owner with getter, by reference", "h0", "h1", "h0", "1", ""},
		{"owner with putter", "h0", "h1", "h1", "", ""},
		{"one host", "h0", "h0", "h0", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			t.Setenv("TENSORMP_DIST_HOST", tc.getter)
			store := freeStore(t)
			putter := startRank(t, "put-samples", 1, 3, store, "TENSORMP_DIST_HOST="+tc.putter, "TEST_OWNER=2", "TEST_REF_ABOVE="+tc.refAbove)
			owner := startRank(t, "own-samples", 2, 3, store, "TENSORMP_DIST_HOST="+tc.own, "TEST_REF_ABOVE="+tc.ownRefAbove)
			g := join(t, ctx, 0, 3, store)
			q, err := g.Queue(ctx, "samples", dist.WithOwner(2))
			require.NoError(t, err)
			getSamples(t, ctx, q)
			require.NoError(t, g.Store().Set(ctx, "samples/taken", []byte("yes")))
			assert.Equal(t, 0, putter.wait(t))
			require.NoError(t, g.Close())
			assert.Equal(t, 0, owner.wait(t))
			assertEmptyDir(t, putter.shm)
			assertEmptyDir(t, owner.shm)
		})
	}
}

// getSamples gets every sample from q, in order, and checks it: values,
// dtypes, strides, nested tensors, and a view and its base on one
// storage, all in shared memory.
func getSamples(t *testing.T, ctx context.Context, q *dist.Queue) {
	t.Helper()
	for i, name := range samples() {
		want, err := sample(i)
		require.NoError(t, err)
		var got sampleValue
		require.NoError(t, q.Get(ctx, &got), name)
		assert.Equal(t, want.Name, got.Name)
		assert.Equal(t, want.Meta, got.Meta)
		assert.True(t, tensor.Equal(want.T, got.T), "%s: %v != %v", name, want.T, got.T)
		if got.T.Numel() > 0 {
			assert.Equal(t, want.T.Strides(), got.T.Strides(), "%s keeps its strides", name)
			assert.True(t, got.T.IsShared(), "%s arrives in shared memory", name)
		}
		for k, ts := range want.Nested {
			require.Len(t, got.Nested[k], len(ts))
			for j := range ts {
				assert.True(t, tensor.Equal(ts[j], got.Nested[k][j]), "%s[%s][%d]", name, k, j)
			}
		}
		if want.Nested != nil {
			assert.Same(t, got.Nested["ab"][0].Storage(), got.Nested["ab"][1].Storage(), "a view and its base arrive on one storage")
		}
		release(want)
		release(got)
	}
}

func assertEmptyDir(t *testing.T, dir string) {
	t.Helper()
	left, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Empty(t, left, "segments left in %s", dir)
}

func TestPipeBothWays(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store := freeStore(t)
	peer := startRank(t, "pipe-echo", 1, 2, store)
	g := join(t, ctx, 0, 2, store)
	p, err := g.Pipe(ctx, 1)
	require.NoError(t, err)
	// First a value gRPC holds rather than copies, before the peer ever
	// answered: the stream must not keep it for a retry.
	for _, n := range []int{1000, 1, dist.DefaultChunk/4 + 1} {
		x, err := tensor.Full(tensor.Float32, float64(n), n)
		require.NoError(t, err)
		require.NoError(t, p.Send(ctx, x))
		var y *tensor.Tensor
		require.NoError(t, p.Recv(ctx, &y))
		want, err := tensor.Full(tensor.Float32, float64(n+1), n)
		require.NoError(t, err)
		assert.True(t, tensor.Equal(want, y), "%d elements", n)
		_ = x.Release()
		_ = y.Release()
	}
	require.NoError(t, p.Close())
	assert.Equal(t, 0, peer.wait(t))
	require.NoError(t, g.Close())
}

// putThreeLen is the length of put-three's tensors: 4 KiB, which gRPC
// holds (lent, not copied) and would keep for a retry until its stream
// commits, unless dist commits it first.
const putThreeLen = 1024

func TestQueueBackpressureAndCancel(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store := freeStore(t)
	peer := startRank(t, "put-three", 1, 2, store)
	g := join(t, ctx, 0, 2, store)
	q, err := g.Queue(ctx, "small", dist.WithCapacity(1))
	require.NoError(t, err)

	// The putter fills the one place and then waits: it cannot be done.
	require.NoError(t, g.Store().Wait(ctx, 0, "tensormp/rank/1"))
	time.Sleep(5 * heartbeat)
	missing, err := g.Store().Missing(ctx, "put-three/done")
	require.NoError(t, err)
	assert.Equal(t, []string{"put-three/done"}, missing, "three puts went through a queue of one place nobody emptied")

	// A Put of this rank's own waits too, until its context ends.
	x, err := tensor.Full(tensor.Int32, 9, 4)
	require.NoError(t, err)
	short, stop := context.WithTimeout(ctx, 3*heartbeat)
	err = q.Put(short, x)
	stop()
	require.ErrorIs(t, err, context.DeadlineExceeded)

	for i := range 3 {
		var got *tensor.Tensor
		require.NoError(t, q.Get(ctx, &got))
		want, _ := tensor.Full(tensor.Int32, float64(i), putThreeLen)
		assert.True(t, tensor.Equal(want, got), "value %d in order", i)
		_ = got.Release()
	}
	_, err = g.Store().Get(ctx, "put-three/done", 10*time.Second)
	require.NoError(t, err)

	// A Get on an empty queue waits until its context ends.
	short, stop = context.WithTimeout(ctx, 3*heartbeat)
	var none *tensor.Tensor
	err = q.Get(short, &none)
	stop()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.NoError(t, g.Err(), "a cancelled call does not fail the group")

	assert.Equal(t, 0, peer.wait(t))
	require.NoError(t, g.Close())
}

// A rank killed mid-run fails the group on every other rank, as a
// PeerError naming it, within the heartbeat bound.
func TestKilledRankFailsTheGroup(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store := freeStore(t)
	victim := startRank(t, "idle", 1, 3, store)
	other := startRank(t, "wait-failure", 2, 3, store)
	g := join(t, ctx, 0, 3, store)

	require.NoError(t, victim.cmd.Process.Kill())
	killed := time.Now()
	err := g.Wait()
	took := time.Since(killed)
	var pe *dist.PeerError
	require.ErrorAs(t, err, &pe)
	assert.Equal(t, 1, pe.Rank)
	assert.ErrorIs(t, err, dist.ErrPeerLost)
	assert.Less(t, took, 3*heartbeat+time.Second, "a killed rank is noticed when its connection closes")
	assert.ErrorIs(t, context.Cause(g.Context()), dist.ErrPeerLost, "the group's context is cancelled with the cause")
	assert.Equal(t, 0, other.wait(t), "the third rank saw rank 1 lost too")
	require.NoError(t, g.Close())
}

// When rank 0 dies, every other rank fails with ErrStoreLost.
func TestKilledRankZero(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store := freeStore(t)
	zero := startRank(t, "idle", 0, 2, store)
	g := join(t, ctx, 1, 2, store)
	require.NoError(t, zero.cmd.Process.Kill())
	err := g.Wait()
	require.ErrorIs(t, err, dist.ErrStoreLost)
	q, qerr := g.Queue(ctx, "after")
	require.NoError(t, qerr)
	var x *tensor.Tensor
	require.ErrorIs(t, q.Get(ctx, &x), dist.ErrStoreLost, "calls after the failure return it")
	require.NoError(t, g.Close())
}

// A rank's Abort reaches every rank as a RankError.
func TestAbortReachesEveryRank(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store := freeStore(t)
	startRank(t, "abort", 1, 2, store)
	g := join(t, ctx, 0, 2, store)
	err := g.Wait()
	var re *dist.RankError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, 1, re.Rank)
	assert.Contains(t, err.Error(), "bad batch")
	require.NoError(t, g.Close())
}

// A group whose ranks never come fails with an error naming them.
func TestFormationNamesMissingRanks(t *testing.T) {
	leakcheck.Check(t)
	ctx := context.Background()
	store := freeStore(t)
	_, err := dist.Init(ctx, dist.WithRank(0, 3), dist.WithStore(store), dist.WithAddr(hostAddr(0)), dist.WithTimeout(time.Second))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "ranks [1 2] never registered")
}

// fileSystem makes a helper's shared memory named files in its shm
// directory, where a test can see it.
const fileSystem = "TENSORMP_SHARING_STRATEGY=file_system"

// Values by reference travel from the putter to the getter: the owner,
// on a third host, holds only their tickets, and the putter's copies go
// once they were taken.
// The getter pulls each value from its putter over one connection, or
// striped over several (the default, and more).
func TestLargeValuesGoByReference(t *testing.T) {
	for _, conns := range []int{1, dist.DefaultPullConns, 3} {
		t.Run(fmt.Sprintf("conns=%d", conns), func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			store := freeStore(t)
			putter := startRank(t, "put-refs", 1, 3, store, "TEST_REF_ABOVE=1", fileSystem)
			owner := startRank(t, "own-refs", 2, 3, store, "TEST_REF_ABOVE=1", fileSystem)
			g := join(t, ctx, 0, 3, store, dist.WithPullConns(conns))
			_, err := g.Store().Get(ctx, "refs/put", 0)
			require.NoError(t, err)
			assertEmptyDir(t, owner.shm) // every value waits in the queue, none of it here

			q, err := g.Queue(ctx, "refs", dist.WithOwner(2))
			require.NoError(t, err)
			getSamples(t, ctx, q)
			assert.Equal(t, 0, putter.wait(t), "the putter's Close returns once everything was taken")
			require.NoError(t, g.Store().Set(ctx, "refs/taken", []byte("yes")))
			assert.Equal(t, 0, owner.wait(t))
			require.NoError(t, g.Close())
			assertEmptyDir(t, putter.shm)
			assertEmptyDir(t, owner.shm)
		})
	}
}

func TestPullConnsAreBounded(t *testing.T) {
	for _, n := range []int{0, -1, dist.MaxPullConns + 1} {
		_, err := dist.Init(context.Background(), dist.WithRank(0, 1), dist.WithStore("127.0.0.1:1"), dist.WithPullConns(n))
		require.Error(t, err, "%d connections", n)
		assert.Contains(t, err.Error(), "connections per pull")
	}
}

// Two ranks of one host talk over an mp.Pipe: a tensor is shared, so the
// receiver's write reaches the sender, which it never does across hosts.
func TestSameHostPipeSharesMemory(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	t.Setenv("TENSORMP_DIST_HOST", "h0")
	store := freeStore(t)
	peer := startRank(t, "pipe-write", 1, 2, store, "TENSORMP_DIST_HOST=h0")
	g := join(t, ctx, 0, 2, store)
	p, err := g.Pipe(ctx, 1)
	require.NoError(t, err)
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Int32, 256)
	require.NoError(t, err)
	require.NoError(t, p.Send(ctx, x))
	var said string
	require.NoError(t, p.Recv(ctx, &said))
	require.Equal(t, "written", said)
	v, err := tensor.At[int32](x, 0)
	require.NoError(t, err)
	assert.Equal(t, int32(99), v, "the other rank wrote into this rank's memory")
	require.NoError(t, p.Send(ctx, "bye"))
	var end string
	assert.ErrorIs(t, p.Recv(ctx, &end), io.EOF, "the peer closed its end")
	require.NoError(t, p.Close())
	require.NoError(t, x.Release())
	assert.Equal(t, 0, peer.wait(t))
	require.NoError(t, g.Close())
}

func TestSameHostQueueSharesMemory(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	t.Setenv("TENSORMP_DIST_HOST", "h0")
	store := freeStore(t)
	owner := startRank(t, "queue-owner", 0, 3, store, "TENSORMP_DIST_HOST=h0")
	writer := startRank(t, "queue-write", 1, 3, store, "TENSORMP_DIST_HOST=h0")
	g := join(t, ctx, 2, 3, store)
	q, err := g.Queue(ctx, "q")
	require.NoError(t, err)
	back, err := g.Queue(ctx, "back")
	require.NoError(t, err)

	// A Get that gives up takes nothing with it.
	short, stop := context.WithTimeout(ctx, 300*time.Millisecond)
	var early string
	assert.ErrorIs(t, back.Get(short, &early), context.DeadlineExceeded)
	stop()

	// This rank puts, the owner (rank 0) queues, rank 1 gets and writes:
	// all three on one host, so the write lands in this rank's memory.
	x, err := tensor.On(device.CPU()).Shared().Zeros(tensor.Int32, 256)
	require.NoError(t, err)
	require.NoError(t, q.Put(ctx, x))
	var said string
	require.NoError(t, back.Get(ctx, &said))
	require.Equal(t, "written", said)
	v, err := tensor.At[int32](x, 0)
	require.NoError(t, err)
	assert.Equal(t, int32(99), v, "rank 1 wrote into the memory this rank put")
	require.NoError(t, x.Release())

	end, err := g.Queue(ctx, "end")
	require.NoError(t, err)
	require.NoError(t, end.Put(ctx, "bye"))
	assert.Equal(t, 0, writer.wait(t))
	require.NoError(t, g.Close())
	assert.Equal(t, 0, owner.wait(t))
}

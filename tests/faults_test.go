package tests

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
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

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// Faults: processes killed with SIGKILL at bad moments. Each test runs a
// separate program (a session of its own), kills part or all of it, and
// then checks that within a few seconds nothing of the session is left.

func init() {
	mp.Register("fault.hold", faultHold)
	mp.Register("fault.put-and-die", faultPutAndDie)
	mp.Register("fault.double-row", faultDoubleRow)
	reexec.Register("program.kill-worker", programKillWorker)
	reexec.Register("program.stream", programStream)
	reexec.Register("program.hold-forever", programHoldForever)
	reexec.Register("program.short", programShort)
}

// holdArgs are fault.hold's and fault.put-and-die's queues: tensors go
// on Tasks, the worker's reports come back on Status.
type holdArgs struct {
	Tasks, Status *mp.Queue
}

// faultHold receives tensors on Tasks and keeps them, reporting each
// with its rank on Status, until a nil tensor: the worker that
// startHolders spawns for the faults' programs, and program.kill-holder.
func faultHold(ctx context.Context, w *mp.Worker) error {
	var a holdArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	var held []*tensor.Tensor
	for {
		var x *tensor.Tensor
		if err := a.Tasks.Get(ctx, &x); err != nil {
			return err
		}
		if x == nil {
			for _, h := range held {
				_ = h.Release()
			}
			return nil
		}
		held = append(held, x)
		if err := a.Status.Put(ctx, w.Rank()); err != nil {
			return err
		}
	}
}

// faultPutAndDie puts tensors on Tasks that nobody will read, says its
// pid on Status, and kills itself with SIGKILL:
// TestKilledProducersUnreadTensorsLeaveNothing's worker.
func faultPutAndDie(ctx context.Context, w *mp.Worker) error {
	var a holdArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	for range 4 {
		x, err := tensor.Arange(tensor.Float32, 256)
		if err != nil {
			return err
		}
		if err := a.Tasks.Put(ctx, x); err != nil {
			return err
		}
	}
	if err := a.Status.Put(ctx, os.Getpid()); err != nil {
		return err
	}
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

// startHolders spawns n fault.hold workers and gives each k tensors, which
// the program itself shares and releases again.
func startHolders(ctx context.Context, n, k int) (*mp.Group, *mp.Queue, error) {
	tasks, err := mp.NewQueue()
	if err != nil {
		return nil, nil, err
	}
	status, err := mp.NewQueue()
	if err != nil {
		return nil, nil, err
	}
	g, err := mp.Spawn(ctx, "fault.hold", n, mp.WithArgs(holdArgs{Tasks: tasks, Status: status}), mp.WithGrace(time.Second))
	if err != nil {
		return nil, nil, err
	}
	for range n * k {
		x, err := tensor.Full(tensor.Float32, 1, 1<<16)
		if err != nil {
			return nil, nil, err
		}
		if err := tasks.Put(ctx, x); err != nil {
			return nil, nil, err
		}
		var rank int
		if err := status.Get(ctx, &rank); err != nil {
			return nil, nil, err
		}
		if err := x.Release(); err != nil {
			return nil, nil, err
		}
	}
	return g, tasks, nil
}

func printPids(g *mp.Group) {
	pids := make([]string, 0)
	for _, p := range g.Pids() {
		pids = append(pids, strconv.Itoa(p))
	}
	fmt.Printf("pids %s\n", strings.Join(pids, " "))
}

// programKillWorker: workers hold tensors; worker 0 is killed; Join must
// report it; the program then exits normally.
func programKillWorker() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g, _, err := startHolders(ctx, 2, 3)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	printPids(g)
	_ = syscall.Kill(g.Pids()[0], syscall.SIGKILL)
	err = g.Join()
	var xe *mp.ExitError
	if !errors.As(err, &xe) || xe.Signal != syscall.SIGKILL || xe.Rank != 0 {
		fmt.Println("error unexpected join result:", err)
		return 1
	}
	fmt.Println("joined", err)
	return 0
}

// programStream: a worker is killed while tensors stream to it.
func programStream() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g, tasks, err := startHolders(ctx, 1, 5)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	printPids(g)
	// Under file_system a sender keeps what it sent alive until the
	// receiver has opened it, as with torch.
	var sent []*tensor.Tensor
	defer func() {
		for _, x := range sent {
			_ = x.Release()
		}
	}()
	for i := range 200 {
		if i == 50 {
			_ = syscall.Kill(g.Pids()[0], syscall.SIGKILL)
		}
		x, err := tensor.Full(tensor.Int64, float64(i), 1024)
		if err != nil {
			return 1
		}
		pctx, pcancel := context.WithTimeout(ctx, 100*time.Millisecond)
		err = tasks.Put(pctx, x) // messages to a dead reader wait in the socket
		pcancel()
		sent = append(sent, x)
		if err != nil {
			break
		}
	}
	err = g.Join()
	var xe *mp.ExitError
	if !errors.As(err, &xe) {
		fmt.Println("error unexpected join result:", err)
		return 1
	}
	fmt.Println("joined", err)
	return 0
}

// programHoldForever: workers hold tensors and the program waits to be
// killed.
func programHoldForever() int {
	ctx := context.Background()
	g, _, err := startHolders(ctx, 2, 2)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	printPids(g)
	fmt.Println("ready")
	time.Sleep(time.Minute)
	return 1
}

func pidsFrom(t *testing.T, line string) []int {
	var pids []int
	for _, f := range strings.Fields(line) {
		pid, err := strconv.Atoi(f)
		require.NoError(t, err)
		pids = append(pids, pid)
	}
	return pids
}

// TestKillWorker kills a worker while it holds tensors, and while
// tensors stream to it; the program's Join must report the kill.
func TestKillWorker(t *testing.T) {
	for _, program := range []string{"program.kill-worker", "program.stream"} {
		for _, st := range strategy.All() {
			t.Run(program+"/"+st.String(), func(t *testing.T) {
				leakcheck.Check(t)
				p := startProgram(t, program, st, false)
				assert.NotEmpty(t, pidsFrom(t, p.waitLine(t, "pids")))
				assert.Contains(t, p.waitLine(t, "joined"), "killed by signal killed")
				assert.Equal(t, 0, p.wait(t))
				p.expectGone(t)
			})
		}
	}
}

func TestKillParent(t *testing.T) {
	for _, st := range strategy.All() {
		t.Run(st.String(), func(t *testing.T) {
			leakcheck.Check(t)
			p := startProgram(t, "program.hold-forever", st, false)
			workers := pidsFrom(t, p.waitLine(t, "pids"))
			p.waitLine(t, "ready")
			started := make([]procStart, len(workers))
			for i, pid := range workers {
				started[i] = startOf(pid)
				require.NotZero(t, started[i], "worker %d runs", pid)
			}
			if st == strategy.FileSystem {
				assert.NotEmpty(t, sessionEntries(p.session), "the workers hold named segments")
			}
			require.NoError(t, p.cmd.Process.Signal(syscall.SIGKILL))
			p.wait(t)
			p.expectGone(t)
			for i, pid := range workers {
				// The pid may name another process by now: the worker is
				// the one that started when it did.
				assert.False(t, alive(pid) && startOf(pid) == started[i], "worker %d died with its parent", pid)
			}
		})
	}
}

func TestKillProcessGroupFileSystem(t *testing.T) {
	leakcheck.Check(t)
	p := startProgram(t, "program.hold-forever", strategy.FileSystem, true)
	p.waitLine(t, "pids")
	p.waitLine(t, "ready")
	assert.NotEmpty(t, sessionEntries(p.session))
	require.NoError(t, syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL))
	p.wait(t)
	p.expectGone(t) // the keeper, in its own session, survived the kill and cleaned up
}

// alive reports whether pid runs; a zombie waiting for a reaper that
// never comes (PID 1 in some containers) counts as dead.
func alive(pid int) bool {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	return err == nil && !isZombie(stat)
}

// procStart is when a process started, in clock ticks after boot: with
// its pid, what names one process, since a pid names another once its
// process is reaped.
type procStart uint64

// startOf returns when process pid started, or 0 if there is none.
func startOf(pid int) procStart {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// The fields after the command name, which ends at the last ')':
	// state is the first, starttime the twentieth.
	s := string(stat)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 20 {
		return 0
	}
	n, _ := strconv.ParseUint(f[19], 10, 64)
	return procStart(n)
}

// TestKilledKeeperIsReplaced: a keeper is SIGKILLed first, then the
// whole program; a new keeper takes the killed one's place, and the
// session still ends with nothing left.
func TestKilledKeeperIsReplaced(t *testing.T) {
	leakcheck.Check(t)
	p := startProgram(t, "program.hold-forever", strategy.FileSystem, true)
	p.waitLine(t, "pids")
	p.waitLine(t, "ready")
	require.NotEmpty(t, sessionEntries(p.session), "the workers hold named segments")
	keepers := keepersOf(p.session)
	require.Len(t, keepers, 2, "the session's keepers")
	require.NoError(t, syscall.Kill(keepers[0], syscall.SIGKILL))
	var now []int
	require.Eventually(t, func() bool {
		now = keepersOf(p.session)
		return len(now) == 2 && !slices.Contains(now, keepers[0])
	}, 5*time.Second, 10*time.Millisecond, "no keeper replaced the killed one")
	t.Logf("keeper %d killed; keepers now %v", keepers[0], now)
	require.NoError(t, syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL))
	p.wait(t)
	p.expectGone(t)
}

// keepersOf returns the pids of the live keepers of session.
func keepersOf(session string) []int {
	var keepers []int
	for _, pid := range sessionProcs(session) {
		env, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
		if err == nil && strings.Contains(string(env), "\x00"+reexec.EnvVar+"=mp.keeper\x00") {
			keepers = append(keepers, pid)
		}
	}
	return keepers
}

// faultDoubleRow takes a tensor from its queue and doubles it in place:
// program.short's worker.
func faultDoubleRow(ctx context.Context, w *mp.Worker) error {
	var q *mp.Queue
	if err := w.Args(&q); err != nil {
		return err
	}
	var x *tensor.Tensor
	if err := q.Get(ctx, &x); err != nil {
		return err
	}
	defer x.Release()
	vals, err := tensor.Data[float32](x)
	if err != nil {
		return err
	}
	for i := range vals {
		vals[i] *= 2
	}
	return nil
}

// programShort is a short run: two workers each take a tensor, double it
// in place and exit, and the program checks what they wrote.
func programShort() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tasks, err := mp.NewQueue()
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer tasks.Close()
	x, err := tensor.Full(tensor.Float32, 1, 2, 1024)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer x.Release()
	g, err := mp.Spawn(ctx, "fault.double-row", 2, mp.WithArgs(tasks))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	for i := range 2 {
		row, err := x.Narrow(0, i, 1)
		if err == nil {
			err = tasks.Put(ctx, row)
		}
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
	}
	if err := g.Join(); err != nil {
		fmt.Println("error", err)
		return 1
	}
	vals, err := tensor.Values[float32](x)
	if err != nil || slices.ContainsFunc(vals, func(v float32) bool { return v != 2 }) {
		fmt.Println("error the workers' writes are missing", err)
		return 1
	}
	fmt.Println("done")
	return 0
}

// TestSessionEndsWhoeverDies kills the session's first member or one of
// its keepers at a random moment of a short run (before the keepers say
// they run, while the workers work, as the last member exits, after), a
// hundred times per strategy: each time, the session ends with nothing
// of it in the shared-memory directory and none of its processes alive
// within a few seconds of its last member's exit.
func TestSessionEndsWhoeverDies(t *testing.T) {
	const runs = 100
	leakcheck.Check(t)
	for _, victim := range []string{"parent", "keeper"} {
		for _, st := range strategy.All() {
			t.Run(victim+"/"+st.String(), func(t *testing.T) {
				t.Parallel()
				// One run undisturbed, which says how long a run takes.
				start := time.Now()
				p := startProgram(t, "program.short", st, false)
				require.Equal(t, "", p.waitLine(t, "done"))
				require.Equal(t, 0, p.wait(t))
				span := time.Since(start)
				p.expectGone(t)
				rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 0))
				for i := range runs {
					at := time.Duration(rng.Int64N(int64(span + span/4)))
					p := startProgram(t, "program.short", st, false)
					which := rng.IntN(2)
					killed := make(chan int, 1)
					go func() { killed <- killAt(p, victim, at, which) }()
					code := p.wait(t)
					pid := <-killed
					if t.Failed() {
						return
					}
					p.expectGone(t)
					if t.Failed() {
						t.Logf("run %d: %s %d killed %v in (a run takes %v); the program exited %d", i, victim, pid, at, span, code)
						return
					}
				}
			})
		}
	}
}

// killAt SIGKILLs p's victim ("parent", or keeper which of the session's
// keepers) at, after the program started; a keeper not started by then
// is killed as soon as it is. It returns the pid killed, or 0 if the
// victim was gone first.
func killAt(p *program, victim string, at time.Duration, which int) int {
	time.Sleep(at)
	if victim == "parent" {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		return p.cmd.Process.Pid
	}
	for {
		if keepers := keepersOf(p.session); len(keepers) > 0 {
			pid := keepers[which%len(keepers)]
			_ = syscall.Kill(pid, syscall.SIGKILL)
			return pid
		}
		if len(sessionProcs(p.session)) == 0 {
			return 0
		}
		time.Sleep(time.Millisecond)
	}
}

// TestKilledProducersUnreadTensorsLeaveNothing: a worker is killed after
// putting tensors that nobody reads, so no process ever maps its named
// segment. Once the queue that holds them is closed, the segment goes,
// while the session lives on.
func TestKilledProducersUnreadTensorsLeaveNothing(t *testing.T) {
	useStrategy(t, strategy.FileSystem)
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	unread, status := testQueues(t)
	g, err := mp.Spawn(ctx, "fault.put-and-die", 1, mp.WithArgs(holdArgs{Tasks: unread, Status: status}))
	require.NoError(t, err)
	var pid int
	require.NoError(t, status.Get(ctx, &pid))
	var ee *mp.ExitError
	require.ErrorAs(t, g.Join(), &ee)
	made := func() []string {
		m, _ := filepath.Glob(filepath.Join(shm.Dir(), shm.SessionPrefix()+strconv.Itoa(pid)+"_*"))
		return m
	}
	require.NotEmpty(t, made(), "the unread tensors hold the worker's segment")
	require.NoError(t, unread.Close()) // drops them
	assert.Eventually(t, func() bool { return len(made()) == 0 }, 5*time.Second, 10*time.Millisecond,
		"the killed worker's segment goes once nothing holds it")
}

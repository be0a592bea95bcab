package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/mmapalloc"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// Ownership: what a process holds in shared memory is given back when it
// dies or fails to take it, and what nobody holds leaves the directory.

func init() {
	mp.Register("own.starve", workerStarve)
	mp.Register("own.send", workerSend)
	reexec.Register("program.kill-holder", programKillHolder)
	reexec.Register("program.starve", programStarve)
	reexec.Register("program.generations", programGenerations)
	reexec.Register("program.start-session", programStartSession)
	mp.Register("own.low-limit", workerLowLimit)
	reexec.Register("program.low-limit", programLowLimit)
}

// poolFor returns the pool shared tensors come from under st in a
// program that spawned workers.
func poolFor(st strategy.Strategy) *shm.Pool {
	if st == strategy.FileSystem {
		return shm.NamedPool()
	}
	return shm.DefaultPool()
}

// waitFree polls the pool until none of its blocks is held and prints
// how many still are and after how long, in milliseconds.
func waitFree(pool *shm.Pool, limit time.Duration) {
	start := time.Now()
	for pool.InUse() > 0 && time.Since(start) < limit {
		time.Sleep(5 * time.Millisecond)
	}
	fmt.Printf("returned %d %d\n", pool.InUse(), time.Since(start).Milliseconds())
}

// programKillHolder: a worker holds 64 tensors of 1 MiB that the program
// made and released; the worker is killed; the program's pool must get
// every block back.
func programKillHolder() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tasks, status, err := queues()
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	g, err := mp.Spawn(ctx, "fault.hold", 1, mp.WithArgs(holdArgs{Tasks: tasks, Status: status}), mp.WithGrace(time.Second))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	for range 64 {
		x, err := tensor.Full(tensor.Float32, 1, 1<<18)
		if err == nil {
			err = tasks.Put(ctx, x)
		}
		var rank int
		if err == nil {
			err = status.Get(ctx, &rank)
		}
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		_ = x.Release()
	}
	pool := poolFor(strategy.Get())
	fmt.Println("held", pool.InUse())
	_ = syscall.Kill(g.Pids()[0], syscall.SIGKILL)
	waitFree(pool, 5*time.Second)
	var xe *mp.ExitError
	if err := g.Join(); !errors.As(err, &xe) {
		fmt.Println("error unexpected join result:", err)
		return 1
	}
	return 0
}

// testQueues returns two new queues that t closes at its end.
func testQueues(t *testing.T) (*mp.Queue, *mp.Queue) {
	a, b, err := queues()
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = a.Close(), b.Close() })
	return a, b
}

func queues() (*mp.Queue, *mp.Queue, error) {
	a, err := mp.NewQueue()
	if err != nil {
		return nil, nil, err
	}
	b, err := mp.NewQueue()
	if err != nil {
		_ = a.Close()
		return nil, nil, err
	}
	return a, b, nil
}

// TestKilledReceiverGivesBlocksBack: references held by a process die
// with it, SIGKILL included, and the producer has the blocks back within
// a second.
func TestKilledReceiverGivesBlocksBack(t *testing.T) {
	for _, st := range strategy.All() {
		t.Run(st.String(), func(t *testing.T) {
			leakcheck.Check(t)
			p := startProgram(t, "program.kill-holder", st, false)
			assert.Equal(t, "64", p.waitLine(t, "held"), "the worker holds every block")
			expectReturned(t, p, "the kill")
			assert.Equal(t, 0, p.wait(t))
		})
	}
}

// expectReturned reads the program's "returned" line (see waitFree): no
// block may be held any more, within a second of event.
func expectReturned(t *testing.T, p *program, event string) {
	t.Helper()
	line := p.waitLine(t, "returned")
	var left, ms int
	_, err := fmt.Sscan(line, &left, &ms)
	require.NoError(t, err, "line %q", line)
	t.Logf("%d blocks held %d ms after %s", left, ms, event)
	assert.Zero(t, left, "blocks still held after %s", event)
	assert.Less(t, ms, 1000, "milliseconds after %s until the producer had its blocks back", event)
}

type starveArgs struct {
	Tasks, Status *mp.Queue
	N             int
}

// workerStarve runs out of descriptors, then tries to take N messages,
// each of which carries one: every receive fails. It reports how many
// did, with its descriptors back.
func workerStarve(ctx context.Context, w *mp.Worker) error {
	var a starveArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	var fillers []int
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			break
		}
		fillers = append(fillers, fd)
	}
	failed := takeAll(ctx, a, w)
	for _, fd := range fillers {
		_ = unix.Close(fd)
	}
	return a.Status.Put(ctx, failed)
}

// takeAll receives a.N tensors, releasing each at once, and returns how
// many receives failed.
func takeAll(ctx context.Context, a starveArgs, w *mp.Worker) int {
	failed := 0
	for range a.N {
		var x *tensor.Tensor
		if err := a.Tasks.Get(ctx, &x); err != nil {
			w.Logger().Debug("receive failed", "error", err)
			failed++
			continue
		}
		_ = x.Release()
	}
	return failed
}

// feedTaker spawns worker, a taker of starveArgs, sends it n tensors of
// size bytes (keeping them alive when keep is set: each is then in a
// segment of its own), and returns how many of its receives failed once
// it has reported and exited. The caller releases kept and closes the
// queues.
func feedTaker(ctx context.Context, worker string, n, size int, keep bool) (failed int, kept []*tensor.Tensor, tasks, status *mp.Queue, err error) {
	if tasks, status, err = queues(); err != nil {
		return 0, nil, nil, nil, err
	}
	g, err := mp.Spawn(ctx, worker, 1, mp.WithArgs(starveArgs{Tasks: tasks, Status: status, N: n}))
	if err != nil {
		return 0, nil, tasks, status, err
	}
	for range n {
		x, err := tensor.Full(tensor.Uint8, 1, size)
		if err == nil {
			err = tasks.Put(ctx, x)
		}
		if err != nil {
			return 0, kept, tasks, status, err
		}
		if keep {
			kept = append(kept, x)
		} else {
			_ = x.Release()
		}
	}
	if err := status.Get(ctx, &failed); err != nil {
		return 0, kept, tasks, status, err
	}
	return failed, kept, tasks, status, g.Join()
}

// programStarve: a worker out of descriptors fails to take 200 tensors;
// once it and the queue are gone, none of them may stay held.
func programStarve() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	failed, _, tasks, status, err := feedTaker(ctx, "own.starve", 200, 4<<10, false)
	if err != nil {
		fmt.Println("error", err)
		return 1 // the program's exit closes the rest
	}
	fmt.Println("failed", failed)
	_ = tasks.Close() // nothing can take what might be left in it
	_ = status.Close()
	waitFree(poolFor(strategy.Get()), 5*time.Second)
	return 0
}

// TestFailedReceiveDropsItsHolds: a receive that fails (here: the
// receiver is out of descriptors, the kernel drops them) keeps nothing of
// what its message brought.
func TestFailedReceiveDropsItsHolds(t *testing.T) {
	for _, st := range strategy.All() {
		t.Run(st.String(), func(t *testing.T) {
			leakcheck.Check(t)
			p := startProgram(t, "program.starve", st, false)
			assert.Equal(t, "200", p.waitLine(t, "failed"), "every receive failed")
			expectReturned(t, p, "the queue closed")
			assert.Equal(t, 0, p.wait(t))
		})
	}
}

type sendArgs struct {
	Out  *mp.Queue
	N    int
	Size int
}

// workerSend makes N tensors of Size bytes, sends them and exits.
func workerSend(ctx context.Context, w *mp.Worker) error {
	var a sendArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	for i := range a.N {
		x, err := tensor.Full(tensor.Uint8, float64(i), a.Size)
		if err != nil {
			return err
		}
		if err := a.Out.Put(ctx, x); err != nil {
			return err
		}
		_ = x.Release()
	}
	return nil
}

// segmentsOfSession lists this program's segments in the directory, the
// session lock left out, and the bytes of memory they take.
func segmentsOfSession() (names []string, bytes int64) {
	entries, _ := os.ReadDir(shm.Dir())
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), shm.SessionPrefix()) || !mmapalloc.ValidName(e.Name()) {
			continue
		}
		names = append(names, e.Name())
		// The memory a segment takes: a pool's slabs are sized ahead
		// and given their pages as their slots are used.
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(shm.Dir(), e.Name()), &st); err == nil {
			bytes += st.Blocks * 512
		}
	}
	return names, bytes
}

// programGenerations: 100 worker generations, in 25 rounds of 4 workers
// at once (starting processes is what takes time), each of which sends 20
// tensors of 1 MiB and exits; the program releases them. After each round
// the directory must be back to empty within a second.
func programGenerations() int {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	q, err := mp.NewQueue()
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	var worst time.Duration
	var most int64
	const rounds, workers = 25, 4
	for round := range rounds {
		g, err := mp.Spawn(ctx, "own.send", workers, mp.WithArgs(sendArgs{Out: q, N: 20, Size: 1 << 20}))
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		var got []*tensor.Tensor
		for range workers * 20 {
			var x *tensor.Tensor
			if err := q.Get(ctx, &x); err != nil {
				fmt.Println("error", err)
				return 1
			}
			got = append(got, x)
		}
		if err := g.Join(); err != nil {
			fmt.Println("error", err)
			return 1
		}
		_, bytes := segmentsOfSession()
		most = max(most, bytes)
		for _, x := range got {
			_ = x.Release()
		}
		start := time.Now()
		for {
			names, _ := segmentsOfSession()
			if len(names) == 0 {
				break
			}
			if time.Since(start) > 2*time.Second {
				fmt.Printf("left round %d %v\n", round, names)
				return 1
			}
			time.Sleep(2 * time.Millisecond)
		}
		worst = max(worst, time.Since(start))
	}
	fmt.Printf("flat %d %d\n", most>>20, worst.Milliseconds())
	return 0
}

// TestWorkerGenerationsLeaveNothing: under file_system the last process
// to let go of a segment removes it, whoever made it and whether or not
// its maker lives: a trainer that restarts its workers does not fill the
// directory.
func TestWorkerGenerationsLeaveNothing(t *testing.T) {
	leakcheck.Check(t)
	p := startProgram(t, "program.generations", strategy.FileSystem, false)
	line := p.waitLine(t, "flat")
	var mib, ms int
	_, err := fmt.Sscan(line, &mib, &ms)
	require.NoError(t, err, line)
	t.Logf("100 worker generations: at most %d MiB in the directory, empty at most %d ms after the last release", mib, ms)
	assert.LessOrEqual(t, mib, 100, "MiB of segments in the directory while a round's 80 MiB are held")
	assert.Less(t, ms, 1000, "milliseconds from the last release to an empty directory, worst round")
	assert.Equal(t, 0, p.wait(t))
}

// programStartSession starts its session and says how that went.
func programStartSession() int {
	if err := mp.StartSession(); err != nil {
		fmt.Println("refused", err)
		return 1
	}
	fmt.Println("started")
	return 0
}

// TestPlantedSessionLockIsRefused: a session lock that another user
// owns, or that others may write, is not adopted: its owner could hold it
// and block the keeper forever.
func TestPlantedSessionLockIsRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("planting a lock owned by another user needs root")
	}
	for _, c := range []struct {
		name     string
		uid      int
		mode     os.FileMode
		accepted bool
	}{
		{"another user's", 65534, 0o600, false},
		{"writable by all", 0, 0o666, false},
		{"our own", 0, 0o600, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			session := newSession()
			lock := filepath.Join(shm.Dir(), shm.LockName(session))
			require.NoError(t, os.WriteFile(lock, nil, 0o600))
			require.NoError(t, os.Chown(lock, c.uid, -1))
			require.NoError(t, os.Chmod(lock, c.mode))
			t.Cleanup(func() { _ = os.Remove(lock) })
			p := startProgramIn(t, session, "program.start-session", strategy.FileSystem, false)
			if c.accepted {
				p.waitLine(t, "started")
				assert.Equal(t, 0, p.wait(t))
				return
			}
			assert.Contains(t, p.waitLine(t, "refused"), "not this user's own")
			assert.Equal(t, 1, p.wait(t))
			_ = os.Remove(lock) // the test planted it; the program must not have used it
		})
	}
}

// workerLowLimit receives N tensors at RLIMIT_NOFILE 64, releasing each
// at once, and reports how many receives failed.
func workerLowLimit(ctx context.Context, w *mp.Worker) error {
	var a starveArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: 64, Max: 64}); err != nil {
		return err
	}
	return a.Status.Put(ctx, takeAll(ctx, a, w))
}

// programLowLimit sends 200 tensors of 1 MiB, each in a segment of its
// own (the program keeps them all), to a worker at a descriptor limit of
// 64 that releases each as it comes.
func programLowLimit() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	failed, kept, tasks, status, err := feedTaker(ctx, "own.low-limit", 200, 1<<20, true)
	defer func() {
		for _, x := range kept {
			_ = x.Release()
		}
		if tasks != nil {
			_ = tasks.Close()
			_ = status.Close()
		}
	}()
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("failed", failed)
	return 0
}

// TestReceiverAtALowDescriptorLimit: a receiver's idle mappings, one
// descriptor each, never crowd out the descriptors of new messages.
func TestReceiverAtALowDescriptorLimit(t *testing.T) {
	leakcheck.Check(t)
	p := startProgram(t, "program.low-limit", strategy.FileDescriptor, false)
	assert.Equal(t, "0", p.waitLine(t, "failed"), "receives failed for want of descriptors")
	assert.Equal(t, 0, p.wait(t))
}

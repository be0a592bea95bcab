package mp_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/tensor"
)

// Tensors returned to their producer by a pipe's lane: the worker's
// answer is the tensor it was given, which goes back named by identity
// and held by its producer while it waits (see package sock's Way).

func init() { mp.Register("return-keep", workerReturnKeep) }

type returnArgs struct {
	Pipe  *mp.Pipe
	Notes *mp.Queue
}

// workerReturnKeep sends each tensor it gets on its pipe back on it,
// keeping it, and then puts on Notes whether the answer went by the lane;
// a nil tensor ends it. It is killed holding what it kept.
func workerReturnKeep(ctx context.Context, w *mp.Worker) error {
	var a returnArgs
	if err := w.Args(&a); err != nil {
		return err
	}
	var kept []*tensor.Tensor
	defer func() {
		for _, x := range kept {
			_ = x.Release()
		}
	}()
	for {
		var x *tensor.Tensor
		if err := a.Pipe.Recv(ctx, &x); err != nil || x == nil {
			return err
		}
		kept = append(kept, x)
		before := sock.ReturnsSent()
		if err := a.Pipe.Send(ctx, x); err != nil {
			return err
		}
		if err := a.Notes.Put(ctx, sock.ReturnsSent() > before); err != nil {
			return err
		}
	}
}

// slotOf returns where x's block lies: its segment and offset.
func slotOf(t *testing.T, x *tensor.Tensor) (shm.ID, int64) {
	t.Helper()
	b, ok := x.Storage().Backing().(*shm.Block)
	require.True(t, ok, "a pooled block")
	return b.Segment().ID(), b.Offset()
}

// returnedThenKilled has a return-keep worker send back, by the lane, a
// tensor this process released once it was sent, and kills the worker
// before this process takes the answer; it returns once the answer's
// block is the only one of the default pool held. It returns this
// process's end of the pipe the answer waits on, and the value and place
// of the tensor.
func returnedThenKilled(t *testing.T, ctx context.Context) (p *mp.Pipe, v int, id shm.ID, off int64) {
	t.Helper()
	pool := shm.DefaultPool()
	p, theirs, err := mp.NewPipe()
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	notes := newQueue(t)
	g, err := mp.Spawn(ctx, "return-keep", 1, mp.WithArgs(returnArgs{Pipe: theirs, Notes: notes}))
	require.NoError(t, theirs.Close())
	require.NoError(t, err)
	// The first answer goes by the socket: this process takes the
	// lane's reader's role, and lists its segments, at its first receive.
	for v = 1; v <= 10; v++ {
		x := newInts(t, v)
		id, off = slotOf(t, x)
		err := p.Send(ctx, x)
		require.NoError(t, x.Release()) // the worker's hold, then the lane's, are all it has
		require.NoError(t, err)
		var laned bool
		require.NoError(t, notes.Get(ctx, &laned))
		if laned {
			kill(t, g) // its hold on the block dies with it; the answer waits in the lane
			// This process's ticket descriptions, which hold every slot
			// of a segment it sent from, go (Trim), and the killed
			// worker's loans come back: then the kernel says nobody
			// holds the answer's block, and only the lane's scanner
			// keeps it.
			require.Eventually(t, func() bool { pool.Trim(1 << 30); return pool.InUse() == 1 }, 5*time.Second, 5*time.Millisecond,
				"the answer's block is kept, and nothing else")
			return p, v, id, off
		}
		var y *tensor.Tensor
		require.NoError(t, p.Recv(ctx, &y))
		checkInts(t, y, v)
		require.NoError(t, y.Release())
	}
	t.Fatal("no answer went by the lane")
	return nil, 0, id, off
}

// A tensor returned by the lane outlives its sender: killed before its
// answer is taken, the sender's hold on the block is gone, yet the
// producer's pool does not hand the block out again, however many it
// hands out meanwhile, and the answer, taken, is the tensor whole.
func TestPipeReturnOutlivesItsSender(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := shm.DefaultPool()
	p, v, id, off := returnedThenKilled(t, ctx)
	taken := sock.ReturnsTaken()

	var made []*tensor.Tensor
	defer func() {
		for _, x := range made {
			_ = x.Release()
		}
	}()
	for range 1500 { // three slabs of the class and more: each empty free list is a reclaim
		x := newInts(t, 0)
		made = append(made, x)
		xid, xoff := slotOf(t, x)
		require.False(t, xid == id && xoff == off, "the returned block was handed out while its answer waited")
	}
	var y *tensor.Tensor
	require.NoError(t, p.Recv(ctx, &y))
	assert.Equal(t, taken+1, sock.ReturnsTaken(), "the answer came by the lane")
	yid, yoff := slotOf(t, y)
	assert.True(t, yid == id && yoff == off, "on its own block")
	checkInts(t, y, v)
	require.NoError(t, y.Release())
	for _, x := range made {
		require.NoError(t, x.Release())
	}
	made = nil
	require.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"every block comes back")
}

// An answer returned by the lane and never taken gives its block back to
// its producer once the producer's end of the pipe is closed.
func TestPipeReturnNeverTaken(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := shm.DefaultPool()
	p, _, _, _ := returnedThenKilled(t, ctx)
	time.Sleep(20 * time.Millisecond) // reclaims meanwhile keep it still
	assert.Equal(t, 1, pool.InUse())
	scanners := shm.ReturnScanners()
	require.NoError(t, p.Close())
	assert.Equal(t, scanners-1, shm.ReturnScanners(), "the closed end's reader no longer scans its lane")
	require.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"the block comes back once no lane of this process holds the answer")
}

// A process that gets its own tensor back by descriptor (the first answer
// of a pipe goes by the socket), having released it once sent, maps its
// own segment a second time to take it, and pins that mapping for the
// lane; the answers that return its blocks by the lane after that are
// taken back from its pool with no lock call all the same, not as a
// peer's blocks of the pin, each locked as it is taken.
func TestPipeReturnsOfReleasedTensorsTakeNoLock(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, theirs, err := mp.NewPipe()
	require.NoError(t, err)
	defer p.Close()
	notes := newQueue(t)
	g, err := mp.Spawn(ctx, "return-keep", 1, mp.WithArgs(returnArgs{Pipe: theirs, Notes: notes}))
	require.NoError(t, theirs.Close())
	require.NoError(t, err)
	var laned, locks uint64
	for v := 1; v <= 40; v++ {
		x := newInts(t, v)
		err := p.Send(ctx, x)
		require.NoError(t, x.Release()) // the worker keeps its own hold
		require.NoError(t, err)
		var byLane bool
		require.NoError(t, notes.Get(ctx, &byLane))
		before := shm.AttachLocks()
		var y *tensor.Tensor
		require.NoError(t, p.Recv(ctx, &y))
		if byLane {
			laned++
			locks += shm.AttachLocks() - before
		}
		checkInts(t, y, v)
		require.NoError(t, y.Release())
	}
	require.NoError(t, p.Send(ctx, (*tensor.Tensor)(nil)))
	require.NoError(t, g.Join())
	require.NotZero(t, laned, "answers went by the lane")
	assert.Zero(t, locks, "lock calls to take %d answers returned by the lane", laned)
}

//go:build cgo && linux

package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/tensormp/tensormp/device"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
	"github.com/tensormp/tensormp/tensor"
)

// GPU tensors in device slabs by a pipe's lane: once the reader has been
// sent one block of a slab by descriptor (and imported the slab), the
// writer names the slab's other blocks by identity, lending each to its
// message, as it does CPU blocks (see mp.Pipe).

type laneGPUArgs struct {
	Pipe *mp.Pipe
	Ack  *mp.Queue
	N    int // tensors it takes after the first, each of the value its place in the stream
	Hold bool
	// Go, if set: it waits for a word on it before it takes the N,
	// which the writer sends meanwhile, so that they wait in the lane
	// together.
	Go *mp.Queue
}

func init() {
	mp.Register("gpulane.take", func(ctx context.Context, w *mp.Worker) error {
		var a laneGPUArgs
		if err := w.Args(&a); err != nil {
			return err
		}
		return gpulaneTake(ctx, a)
	})
	mp.Register("gpulane.give", func(ctx context.Context, w *mp.Worker) error {
		var a laneGPUArgs
		if err := w.Args(&a); err != nil {
			return err
		}
		return gpulaneGive(ctx, a)
	})
}

// gpulaneTake takes a GPU tensor of zeros from Pipe and says so on Ack,
// then takes N more, the i-th all i, checking each, and says how many
// lock calls it made to hold them (shm.AttachLocks). With Hold it keeps
// them and waits to be killed; else it releases each once checked and
// returns.
func gpulaneTake(ctx context.Context, a laneGPUArgs) error {
	var held []*tensor.Tensor
	var locks uint64
	defer func() {
		for _, x := range held {
			_ = x.Release()
		}
	}()
	for i := 0; i <= a.N; i++ {
		var x *tensor.Tensor
		if err := a.Pipe.Recv(ctx, &x); err != nil {
			return err
		}
		if err := checkAll(x, float32(i)); err != nil {
			return fmt.Errorf("tensor %d: %w", i, err)
		}
		if a.Hold {
			held = append(held, x)
		} else if err := x.Release(); err != nil {
			return err
		}
		if i > 0 {
			continue
		}
		if err := a.Ack.Put(ctx, 0); err != nil {
			return err
		}
		if a.Go != nil {
			if err := a.Go.Get(ctx, new(int)); err != nil {
				return err
			}
		}
		locks = shm.AttachLocks()
	}
	if err := a.Ack.Put(ctx, shm.AttachLocks()-locks); err != nil {
		return err
	}
	if a.Hold {
		// Killed first. Not a Get on Ack: the count just put there
		// is the first thing such a Get would take, if the writer
		// has not come to its own Get yet.
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}

// sendFull sends a GPU tensor of n elements, all v, on p and releases it
// once sent: its block goes back to the pool once the message has done
// with it.
func sendFull(ctx context.Context, p *mp.Pipe, v float64, n int) error {
	x, err := tensor.On(device.GPU(0)).Full(tensor.Float32, v, n)
	if err != nil {
		return err
	}
	err = p.Send(ctx, x)
	return errors.Join(err, x.Release())
}

// startLaneTaker spawns gpulane.take with a and sends it its first
// tensor, by descriptor, which it acknowledges: its slab is the
// reader's, pinned for the lane, from then on.
func startLaneTaker(ctx context.Context, a laneGPUArgs) (*mp.Pipe, *mp.Queue, *mp.Group, error) {
	mine, theirs, err := mp.NewPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	ack, err := mp.NewQueue()
	if err != nil {
		return nil, nil, nil, err
	}
	a.Pipe, a.Ack = theirs, ack
	g, err := mp.Spawn(ctx, "gpulane.take", 1, mp.WithArgs(a))
	if err != nil {
		return nil, nil, nil, err
	}
	if err := theirs.Close(); err != nil {
		return nil, nil, nil, err
	}
	if err := sendFull(ctx, mine, 0, 1024); err != nil {
		return nil, nil, nil, err
	}
	if err := ack.Get(ctx, new(int)); err != nil {
		return nil, nil, nil, err
	}
	return mine, ack, g, nil
}

// A stream of GPU tensors, each released once sent, with a reclaim of
// the pool after each: every tensor after the first goes by the lane,
// its block lent to the entry until the reader holds it, and each
// arrives with its own values. The reader, taking them once they all
// wait in the lane, locks their slots in a few calls, not one each.
func gpulaneStream(ctx context.Context) error {
	const n = 64
	goOn, err := mp.NewQueue()
	if err != nil {
		return err
	}
	defer goOn.Close()
	a := laneGPUArgs{N: n, Go: goOn}
	p, ack, g, err := startLaneTaker(ctx, a)
	if err != nil {
		return err
	}
	before := sock.LentSent()
	for i := 1; i <= n; i++ {
		if err := sendFull(ctx, p, float64(i), 1024); err != nil {
			return err
		}
		shm.Trim() // a reclaim: the loan keeps the block the entry names
	}
	if err := goOn.Put(ctx, 1); err != nil {
		return err
	}
	var locks int
	if err := ack.Get(ctx, &locks); err != nil {
		return err
	}
	if err := g.Join(); err != nil {
		return err
	}
	if lent := sock.LentSent() - before; lent != n {
		return fmt.Errorf("%d of %d tensors went by the lane", lent, n)
	}
	if locks > n/8 {
		return fmt.Errorf("the reader made %d lock calls for %d tensors that waited in the lane together", locks, n)
	}
	if err := p.Close(); err != nil {
		return err
	}
	return noDeviceMemory()
}

// A reader killed while it holds GPU tensors it took by the lane, with
// more in the lane it never took, gives back every block: the writer's
// loans come back, its own holds go with it.
func gpulaneKilledReader(ctx context.Context) error {
	const taken, untaken = 8, 8
	a := laneGPUArgs{N: taken, Hold: true}
	p, ack, g, err := startLaneTaker(ctx, a)
	if err != nil {
		return err
	}
	before := sock.LentSent()
	for i := 1; i <= taken+untaken; i++ {
		if err := sendFull(ctx, p, float64(i), 1024); err != nil {
			return err
		}
	}
	if lent := sock.LentSent() - before; lent != taken+untaken {
		return fmt.Errorf("%d of %d tensors went by the lane", lent, taken+untaken)
	}
	if err := ack.Get(ctx, new(int)); err != nil { // it holds what it took
		return err
	}
	shm.Trim() // keeps the slab only for the blocks held
	if held := heldDeviceMemory(os.Getpid()); held == 0 {
		return errors.New("the tensors the reader holds and those in the lane hold no device memory")
	}
	if err := syscall.Kill(g.Pids()[0], syscall.SIGKILL); err != nil {
		return err
	}
	_ = g.Join()
	return errors.Join(noDeviceMemory(), p.Close())
}

// TestGPUSlabBlocksByLane runs each case in a program of its own.
func TestGPUSlabBlocksByLane(t *testing.T) {
	if legacyIPC() {
		t.Skip("on the legacy IPC path GPU tensors are in no slab")
	}
	for _, c := range []string{"lane-stream", "lane-killed-reader", "lane-killed-writer"} {
		t.Run(c, func(t *testing.T) {
			leakcheck.Check(t)
			p := startProgramIn(t, newSession(), "program.gpufd", strategy.FileDescriptor, false, "GPUFD_CASE="+c)
			assert.Equal(t, "", p.waitLine(t, "ok"))
			assert.Equal(t, 0, p.wait(t))
			p.expectGone(t)
		})
	}
}

// gpulaneGive is the writer of the case lane-killed-writer: it sends a
// GPU tensor of zeros on Pipe, waits for a word on Go, sends N more, the
// i-th all i, says so on Ack, and waits to be killed.
func gpulaneGive(ctx context.Context, a laneGPUArgs) error {
	if err := sendFull(ctx, a.Pipe, 0, 1024); err != nil {
		return err
	}
	if err := a.Go.Get(ctx, new(int)); err != nil {
		return err
	}
	before := sock.LentSent()
	for i := 1; i <= a.N; i++ {
		if err := sendFull(ctx, a.Pipe, float64(i), 1024); err != nil {
			return err
		}
	}
	if err := a.Ack.Put(ctx, int(sock.LentSent()-before)); err != nil {
		return err
	}
	return a.Go.Get(ctx, new(int)) // killed first
}

// A writer killed with GPU tensors it sent by the lane still untaken:
// the reader takes each, whole, from the slab it imported, and lets go
// of everything once it is done.
func gpulaneKilledWriter(ctx context.Context) error {
	const n = 16
	qs, err := newQueues(2)
	if err != nil {
		return err
	}
	mine, theirs, err := mp.NewPipe()
	if err != nil {
		return err
	}
	g, err := mp.Spawn(ctx, "gpulane.give", 1, mp.WithArgs(laneGPUArgs{Pipe: theirs, Ack: qs[0], Go: qs[1], N: n}))
	if err != nil {
		return err
	}
	if err := theirs.Close(); err != nil {
		return err
	}
	var first *tensor.Tensor
	if err := mine.Recv(ctx, &first); err != nil {
		return err
	}
	if err := errors.Join(checkAll(first, 0), first.Release()); err != nil {
		return err
	}
	if err := qs[1].Put(ctx, 1); err != nil {
		return err
	}
	var lent int
	if err := qs[0].Get(ctx, &lent); err != nil {
		return err
	}
	if lent != n {
		return fmt.Errorf("%d of %d tensors went by the lane", lent, n)
	}
	if err := syscall.Kill(g.Pids()[0], syscall.SIGKILL); err != nil {
		return err
	}
	_ = g.Join()
	for i := 1; i <= n; i++ {
		var x *tensor.Tensor
		if err := mine.Recv(ctx, &x); err != nil {
			return fmt.Errorf("tensor %d: %w", i, err)
		}
		if err := errors.Join(checkAll(x, float32(i)), x.Release()); err != nil {
			return fmt.Errorf("tensor %d: %w", i, err)
		}
	}
	return errors.Join(mine.Close(), noDeviceMemory())
}

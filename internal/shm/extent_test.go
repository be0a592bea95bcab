//go:build linux

package shm_test

import (
	"io"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
)

// extents records the extents an extent pool made and which are closed.
type extents struct {
	mu    sync.Mutex
	sizes []int64
	open  int
}

type extent struct {
	e    *extents
	once sync.Once
}

func (x *extent) Close() error {
	x.once.Do(func() {
		x.e.mu.Lock()
		x.e.open--
		x.e.mu.Unlock()
	})
	return nil
}

func (e *extents) make(n int64) (io.Closer, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.sizes = append(e.sizes, n)
	e.open++
	return &extent{e: e}, nil
}

func (e *extents) counts() (made, open int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.sizes), e.open
}

// An extent pool packs blocks into slabs as any pool does, but their data
// lies in an extent per slab, at the block's Offset; the segment is the
// slot table alone. A receiver attaches the segment's extent once and
// finds it with each block; its mapping closes it, as the pool's trim
// closes the pool's.
func TestExtentPool(t *testing.T) {
	leakcheck.Check(t)
	var made extents
	p := shm.NewExtentPool(1<<30, made.make)
	var blocks []*shm.Block
	for range 3 {
		b := mustAlloc(t, p, 4<<10)
		assert.True(t, b.InExtent())
		assert.Nil(t, b.Bytes(), "no data in the segment")
		blocks = append(blocks, b)
	}
	n, open := made.counts()
	require.Equal(t, 1, n, "three blocks of 4 KiB share a slab")
	assert.Equal(t, 1, open)
	assert.Equal(t, int64(2<<20), made.sizes[0], "the first slab holds 2 MiB of data")
	assert.Equal(t, []int64{0, 4 << 10, 8 << 10}, []int64{blocks[0].Offset(), blocks[1].Offset(), blocks[2].Offset()})
	seg := blocks[0].Segment()
	assert.Less(t, seg.Size(), int64(64<<10), "the segment is a slot table")
	x := blocks[0].Extent()
	assert.Same(t, x, blocks[2].Extent())

	// A receiver: the extent is its own to attach, once.
	msg := send(t, blocks[1])
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, msg).ID, Size: seg.Size()}, Offset: blocks[1].Offset(), Size: 4 << 10, Gen: blocks[1].Gen(), Ticket: msg})
	require.NoError(t, err)
	require.NoError(t, unix.Close(msg)) // the message is taken: the receiver holds the block itself
	assert.True(t, r.InExtent())
	assert.Nil(t, r.Extent(), "nothing attached yet")
	mine, _ := made.make(2 << 20)
	got, err := r.SetExtent(mine)
	require.NoError(t, err)
	assert.Same(t, mine, got)
	other, _ := made.make(2 << 20)
	got, err = r.SetExtent(other)
	require.NoError(t, err)
	assert.Same(t, mine, got, "the first attached stays")
	require.NoError(t, other.Close())
	_, err = blocks[0].SetExtent(other)
	assert.ErrorIs(t, err, shm.ErrNoExtent, "the producer's extent is its pool's")
	require.NoError(t, r.Release())
	require.NoError(t, shm.DropIdle())
	_, open = made.counts()
	assert.Equal(t, 1, open, "the receiver's mapping closed its extent")

	for _, b := range blocks {
		require.NoError(t, b.Release())
	}
	p.Trim(0)
	_, open = made.counts()
	assert.Zero(t, open, "the pool closed its slab's extent")

	// A block of an ordinary pool has no extent to attach.
	plain := testPool(t)
	b := mustAlloc(t, plain, 4<<10)
	defer b.Release()
	assert.False(t, b.InExtent())
	m := send(t, b)
	defer unix.Close(m)
	rb, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: statOf(t, m).ID, Size: b.Segment().Size()}, Offset: b.Offset(), Size: 4 << 10, Gen: b.Gen(), Ticket: m})
	require.NoError(t, err)
	defer rb.Release()
	_, err = rb.SetExtent(other)
	assert.ErrorIs(t, err, shm.ErrNoExtent)
}

// A slab's extent is made outside the pool's lock: while one allocation
// waits for a new slab's extent, another of a slab with room goes on.
func TestExtentMadeOutsideTheLock(t *testing.T) {
	leakcheck.Check(t)
	var made extents
	slow := make(chan struct{})
	entered := make(chan struct{}, 1)
	first := true
	var mu sync.Mutex
	p := shm.NewExtentPool(1<<30, func(n int64) (io.Closer, error) {
		mu.Lock()
		wait := !first
		first = false
		mu.Unlock()
		if wait {
			entered <- struct{}{}
			<-slow
		}
		return made.make(n)
	})
	defer p.Trim(0)
	small := mustAlloc(t, p, 64) // a slab with room, made at once
	defer small.Release()
	big := make(chan error, 1)
	go func() {
		b, err := p.Alloc(32 << 20) // a slab of its own, made slowly
		if err == nil {
			err = b.Release()
		}
		big <- err
	}()
	<-entered
	other := make(chan error, 1)
	go func() { // while the big one's extent is being made
		b, err := p.Alloc(64)
		if err == nil {
			err = b.Release()
		}
		other <- err
	}()
	select {
	case err := <-other:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		close(slow)
		t.Fatal("an allocation from a slab with room waited for another slab's extent")
	}
	close(slow)
	require.NoError(t, <-big)
}

// Allocations that find a class empty at once wait for one new slab,
// not one each: a slab's extent is made with the pool's lock let go.
func TestConcurrentGrowMakesOneSlab(t *testing.T) {
	var made extents
	p := shm.NewExtentPool(1<<30, func(n int64) (io.Closer, error) {
		time.Sleep(20 * time.Millisecond) // a device allocation
		return made.make(n)
	})
	defer p.Trim(0)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var bs []*shm.Block
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b, err := p.Alloc(64)
			require.NoError(t, err)
			mu.Lock()
			bs = append(bs, b)
			mu.Unlock()
		}()
	}
	wg.Wait()
	n, _ := made.counts()
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
	require.Equal(t, 1, n, "one slab would hold all 8")
}

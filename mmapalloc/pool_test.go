package mmapalloc_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mmapalloc"
)

func TestPoolPacksSmallBlocks(t *testing.T) {
	leakcheck.Check(t)
	p := mmapalloc.NewPool(1 << 30)
	defer p.Trim(0)
	var blocks []*mmapalloc.Block
	for i := range 100 {
		b, err := p.Alloc(4 << 10)
		require.NoError(t, err)
		b.Bytes()[0] = byte(i)
		blocks = append(blocks, b)
	}
	segs, _, _ := p.Stats()
	assert.Equal(t, 1, segs, "100 blocks of 4 KiB share one slab")
	for i, b := range blocks {
		assert.Equal(t, byte(i), b.Bytes()[0], "blocks do not overlap")
		assert.Len(t, b.Bytes(), 4<<10)
		require.NoError(t, b.Release())
	}
	big, err := p.Alloc(100 << 10)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, int64(len(big.Bytes())), int64(100<<10))
	segs, _, _ = p.Stats()
	assert.Equal(t, 2, segs, "a large block gets a segment of its own")
	require.NoError(t, big.Release())
}

func TestPoolRecyclesOnlyWhenNobodyHolds(t *testing.T) {
	leakcheck.Check(t)
	p := mmapalloc.NewPool(1 << 30)
	defer p.Trim(0)
	a, err := p.Alloc(1 << 20)
	require.NoError(t, err)
	seg, off, gen := a.Segment(), a.Offset(), a.Gen()
	require.NoError(t, a.Retain()) // a message in flight
	assert.Equal(t, int32(2), a.Refs())
	require.NoError(t, a.Release())

	b, err := p.Alloc(1 << 20)
	require.NoError(t, err)
	assert.False(t, b.Segment() == seg && b.Offset() == off, "a block a message still refers to is not reused")

	// The receiver adopts the message's reference and releases it.
	r, err := mmapalloc.AttachBlock(seg.FD(), seg.Size(), off, 1<<20, gen)
	require.NoError(t, err)
	require.NoError(t, r.Release())

	c, err := p.Alloc(1 << 20)
	require.NoError(t, err)
	assert.True(t, c.Segment() == seg && c.Offset() == off, "once nobody holds it, the block is reused")
	assert.Greater(t, c.Gen(), gen, "with a new generation")
	_, err = mmapalloc.AttachBlock(seg.FD(), seg.Size(), off, 1<<20, gen)
	assert.ErrorIs(t, err, mmapalloc.ErrStaleBlock)
	require.NoError(t, b.Release())
	require.NoError(t, c.Release())
}

func TestAttachBlock(t *testing.T) {
	leakcheck.Check(t)
	p := mmapalloc.NewPool(1 << 30)
	defer p.Trim(0)
	a, err := p.Alloc(4 << 10)
	require.NoError(t, err)
	b, err := p.Alloc(4 << 10)
	require.NoError(t, err)
	copy(a.Bytes(), "first")
	copy(b.Bytes(), "second")
	require.NoError(t, a.Retain())
	require.NoError(t, b.Retain())
	seg := a.Segment()

	before, err := leakcheck.Mappings()
	require.NoError(t, err)
	ra, err := mmapalloc.AttachBlock(seg.FD(), seg.Size(), a.Offset(), 4<<10, a.Gen())
	require.NoError(t, err)
	rb, err := mmapalloc.AttachBlock(seg.FD(), seg.Size(), b.Offset(), 4<<10, b.Gen())
	require.NoError(t, err)
	after, err := leakcheck.Mappings()
	require.NoError(t, err)
	assert.Equal(t, before+1, after, "two blocks of one segment: one mapping")
	assert.Equal(t, "first", string(ra.Bytes()[:5]))
	assert.Equal(t, "second", string(rb.Bytes()[:6]))
	rb.Bytes()[0] = 'S'
	assert.Equal(t, byte('S'), b.Bytes()[0])
	assert.Equal(t, int32(2), ra.Refs(), "the receiver adopted the message's reference")

	for name, f := range map[string]func() error{
		"offset past the segment": func() error {
			_, err := mmapalloc.AttachBlock(seg.FD(), seg.Size(), seg.Size(), 1, a.Gen())
			return err
		},
		"size past the segment": func() error {
			_, err := mmapalloc.AttachBlock(seg.FD(), seg.Size(), a.Offset(), seg.Size(), a.Gen())
			return err
		},
		"not a header": func() error {
			_, err := mmapalloc.AttachBlock(seg.FD(), seg.Size(), a.Offset()+64, 16, a.Gen())
			return err
		},
		"larger than the block": func() error {
			_, err := mmapalloc.AttachBlock(seg.FD(), seg.Size(), a.Offset(), 8<<10, a.Gen())
			return err
		},
		"segment larger than the file": func() error {
			_, err := mmapalloc.AttachBlock(seg.FD(), seg.Size()*2, a.Offset(), 16, a.Gen())
			return err
		},
	} {
		assert.Error(t, f(), name)
	}
	require.NoError(t, ra.Release())
	require.NoError(t, rb.Release())
	require.NoError(t, a.Release())
	require.NoError(t, b.Release())
	_, err = mmapalloc.AttachBlock(seg.FD(), seg.Size(), a.Offset(), 16, a.Gen())
	assert.ErrorIs(t, err, mmapalloc.ErrReleased, "a block nobody holds cannot be attached")
}

func TestPoolTrimAndLimit(t *testing.T) {
	leakcheck.Check(t)
	p := mmapalloc.NewPool(3 << 20)
	var bs []*mmapalloc.Block
	for range 4 {
		b, err := p.Alloc(1 << 20)
		require.NoError(t, err)
		bs = append(bs, b)
	}
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
	_, bytes, _ := p.Stats()
	assert.LessOrEqual(t, bytes, int64(3<<20), "released segments beyond the limit are closed")
	p.Trim(0)
	segs, bytes, free := p.Stats()
	assert.Zero(t, segs)
	assert.Zero(t, bytes)
	assert.Zero(t, free)
}

func TestPoolConcurrent(t *testing.T) {
	leakcheck.Check(t)
	p := mmapalloc.NewPool(1 << 30)
	defer p.Trim(0)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				size := int64(512 << (i % 10))
				b, err := p.Alloc(size)
				if !assert.NoError(t, err) {
					return
				}
				b.Bytes()[0] = byte(g)
				b.Bytes()[size-1] = byte(g)
				if i%3 == 0 {
					assert.NoError(t, b.Retain())
					b.Drop()
				}
				assert.Equal(t, byte(g), b.Bytes()[0])
				assert.NoError(t, b.Release())
			}
		}()
	}
	wg.Wait()
}

func BenchmarkPoolAllocRelease(b *testing.B) {
	for _, size := range []int64{4 << 10, 64 << 20} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			p := mmapalloc.NewPool(1 << 30)
			defer p.Trim(0)
			warm, err := p.Alloc(size)
			require.NoError(b, err)
			require.NoError(b, warm.Release())
			b.ReportAllocs()
			for b.Loop() {
				blk, err := p.Alloc(size)
				if err != nil {
					b.Fatal(err)
				}
				if err := blk.Release(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func TestPoolHitAllocatesNothing(t *testing.T) {
	p := mmapalloc.NewPool(1 << 30)
	defer p.Trim(0)
	warm, err := p.Alloc(4 << 10)
	require.NoError(t, err)
	require.NoError(t, warm.Release())
	allocs := testing.AllocsPerRun(100, func() {
		b, err := p.Alloc(4 << 10)
		if err != nil {
			panic(err)
		}
		_ = b.Release()
	})
	assert.Zero(t, allocs, "taking a recycled block allocates nothing")
}

func TestNamedPool(t *testing.T) {
	leakcheck.Check(t)
	mmapalloc.EnableNamedPool()
	p := mmapalloc.NamedPool()
	require.NotNil(t, p)
	a, err := p.Alloc(4 << 10)
	require.NoError(t, err)
	seg := a.Segment()
	require.NotEmpty(t, seg.Name())
	assert.True(t, inDir(seg.Name()), "a named pool's segments keep their names")
	assert.Equal(t, -1, seg.FD(), "and travel by name, not by descriptor")
	copy(a.Bytes(), "named")
	require.NoError(t, a.Retain())

	r, err := mmapalloc.AttachNamedBlock(seg.Name(), seg.Size(), a.Offset(), 4<<10, a.Gen())
	require.NoError(t, err)
	assert.Equal(t, "named", string(r.Bytes()[:5]))
	_, err = mmapalloc.AttachNamedBlock("../"+seg.Name(), seg.Size(), a.Offset(), 4<<10, a.Gen())
	assert.ErrorIs(t, err, mmapalloc.ErrBadName)
	require.NoError(t, r.Release())
	require.NoError(t, a.Release())

	mmapalloc.Trim()
	assert.False(t, inDir(seg.Name()), "trimming a named segment removes its name")
}

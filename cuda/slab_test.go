//go:build cgo && linux

package cuda_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/cuda"
	"github.com/tensormp/tensormp/internal/cudastub"
	"github.com/tensormp/tensormp/internal/gpushare"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
)

// slabRuntime returns a Runtime of its own whose devices share their
// memory in slabs, closed when t ends.
func slabRuntime(t *testing.T) *cuda.Runtime { return cuda.NewTestRuntime(t, false) }

// closeAll closes a message's descriptors.
func closeAll(t *testing.T, fds ...int) {
	t.Helper()
	for _, fd := range fds {
		require.NoError(t, unix.Close(fd))
	}
}

// Small buffers share a slab, a device allocation made once; each is
// cleared, and what one writes the others do not see. Closing the
// Runtime gives the unused slabs back.
func TestSlabsPackBuffers(t *testing.T) {
	leakcheck.Check(t)
	rt := slabRuntime(t)
	handles, mappings := cudastub.Handles(), cudastub.Mappings()
	ok, err := rt.FDShared(0)
	require.NoError(t, err)
	require.True(t, ok)
	var bufs []*cuda.Buffer
	for i := range 100 {
		b, err := rt.Alloc(0, 4<<10)
		require.NoError(t, err)
		got := make([]byte, 4<<10)
		require.NoError(t, b.Read(got, 0))
		require.Equal(t, make([]byte, 4<<10), got, "buffer %d is cleared", i)
		require.NoError(t, b.Write([]byte{byte(i)}, 0))
		bufs = append(bufs, b)
	}
	assert.Equal(t, handles+1, cudastub.Handles(), "100 buffers of 4 KiB in one slab")
	for i, b := range bufs {
		got := []byte{0}
		require.NoError(t, b.Read(got, 0))
		assert.Equal(t, byte(i), got[0])
		require.NoError(t, b.Release())
	}
	rt.Close()
	assert.Equal(t, handles, cudastub.Handles(), "the unused slab is given back")
	assert.Equal(t, mappings, cudastub.Mappings())
}

// share sends b as a message would: it returns a ticket descriptor of its
// block, as the receiver gets it, and the message's copy of the slab's
// descriptor.
func share(t *testing.T, b *cuda.Buffer) (sh gpushare.Slab, ticket, memFD int) {
	t.Helper()
	sh, ok, err := b.Share()
	require.NoError(t, err)
	require.True(t, ok)
	tk, err := sh.Block.Ticket()
	require.NoError(t, err)
	ticket, err = unix.Dup(tk.FD())
	require.NoError(t, err)
	tk.Done()
	memFD, err = unix.Dup(sh.MemFD)
	require.NoError(t, err)
	return sh, ticket, memFD
}

// receive attaches the block a message named, as a receiver does.
func receive(t *testing.T, sh gpushare.Slab, ticket int) *shm.Block {
	t.Helper()
	st, err := shm.Stat(ticket)
	require.NoError(t, err)
	b := sh.Block
	blk, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: st.ID, Size: b.Segment().Size()}, Offset: b.Offset(), Size: b.Size(), Gen: b.Gen(), Ticket: ticket})
	require.NoError(t, err)
	return blk
}

// A receiver imports a slab once, from the message's descriptor, and
// sees and writes the producer's bytes; a second block of the slab costs
// no import. The slab's memory lives while the receiver maps it, after
// the producer has let go of it.
func TestImportBlock(t *testing.T) {
	leakcheck.Check(t)
	rt := slabRuntime(t)
	recv := slabRuntime(t) // another process's state, in this one
	handles, mappings := cudastub.Handles(), cudastub.Mappings()
	a, err := rt.Alloc(0, 64)
	require.NoError(t, err)
	b, err := rt.Alloc(0, 64)
	require.NoError(t, err)
	require.NoError(t, a.Write([]byte("alpha"), 0))
	require.NoError(t, b.Write([]byte("beta"), 0))

	sa, ta, fa := share(t, a)
	sb, tb, fb := share(t, b)
	ra, err := recv.ImportBlock(0, receive(t, sa, ta), 64, fa)
	require.NoError(t, err)
	rb, err := recv.ImportBlock(0, receive(t, sb, tb), 64, fb)
	require.NoError(t, err)
	for _, fd := range []int{ta, tb, fa, fb} {
		require.NoError(t, unix.Close(fd)) // the message is taken
	}
	assert.Equal(t, handles+2, cudastub.Handles(), "the producer's slab, and one import of it for two blocks")
	got := make([]byte, 5)
	require.NoError(t, ra.Read(got, 0))
	assert.Equal(t, "alpha", string(got))
	require.NoError(t, rb.Read(got[:4], 0))
	assert.Equal(t, "beta", string(got[:4]))
	require.NoError(t, rb.Write([]byte("BETA"), 0))
	require.NoError(t, b.Read(got[:4], 0))
	assert.Equal(t, "BETA", string(got[:4]), "the producer sees the receiver's write")

	// The producer lets go of its buffers: its slab, whose blocks the
	// receiver holds, stays the pool's until the receiver lets go too.
	require.NoError(t, a.Release())
	require.NoError(t, b.Release())
	shm.Trim()
	assert.Equal(t, handles+2, cudastub.Handles(), "a slab another process holds blocks of is kept")
	require.NoError(t, ra.Read(got, 0))
	assert.Equal(t, "alpha", string(got))
	require.NoError(t, ra.Release())
	require.NoError(t, rb.Release())
	require.Eventually(t, func() bool {
		shm.Trim()
		return cudastub.Handles() == handles
	}, 5*time.Second, time.Millisecond, "the slab goes once nobody holds a block of it")
	assert.Equal(t, mappings, cudastub.Mappings())
}

// What a message names as a block of a device slab is checked before
// anything is mapped: a descriptor that is no allocation, one of another
// device, one smaller than the slab, and a block of a CPU segment are
// errors, and the receiver holds nothing afterwards.
func TestImportBlockRefusesWhatIsNoSlab(t *testing.T) {
	leakcheck.Check(t)
	rt := slabRuntime(t)
	recv := slabRuntime(t)
	small, err := rt.Alloc(0, 64) // in a slab of 2 MiB
	require.NoError(t, err)
	defer small.Release()
	large, err := rt.Alloc(0, 17<<20) // in a slab of its own, over 16 MiB
	require.NoError(t, err)
	defer large.Release()
	other, err := rt.Alloc(1, 64)
	require.NoError(t, err)
	defer other.Release()
	_, smallTicket, smallFD := share(t, small)
	require.NoError(t, unix.Close(smallTicket)) // only the slab's descriptor is wanted
	defer unix.Close(smallFD)
	_, otherTicket, otherFD := share(t, other)
	require.NoError(t, unix.Close(otherTicket))
	defer unix.Close(otherFD)
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	handles, mappings := cudastub.Handles(), cudastub.Mappings()

	for _, c := range []struct {
		name  string
		buf   *cuda.Buffer
		memFD int
		want  string
	}{
		{"a pipe", small, p[0], "importing a slab of gpu:0"},
		{"another device's allocation", small, otherFD, "not of gpu:0"},
		{"an allocation smaller than the slab", large, smallFD, "mapping a slab"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sh, ticket, memFD := share(t, c.buf)
			defer unix.Close(ticket)
			require.NoError(t, unix.Close(memFD))
			blk := receive(t, sh, ticket)
			_, err := recv.ImportBlock(0, blk, sh.Block.Size(), c.memFD)
			require.ErrorContains(t, err, c.want)
			require.NoError(t, blk.Release())
			assert.Equal(t, handles, cudastub.Handles(), "nothing imported stays")
			assert.Equal(t, mappings, cudastub.Mappings(), "nothing mapped stays")
		})
	}

	cpu, err := shm.DefaultPool().Alloc(64)
	require.NoError(t, err)
	defer cpu.Release()
	tk, err := cpu.Ticket()
	require.NoError(t, err)
	defer tk.Done()
	st, err := shm.Stat(tk.FD())
	require.NoError(t, err)
	blk, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: st.ID, Size: cpu.Segment().Size()}, Offset: cpu.Offset(), Size: 64, Gen: cpu.Gen(), Ticket: tk.FD()})
	require.NoError(t, err)
	defer blk.Release()
	_, err = recv.ImportBlock(0, blk, 64, smallFD)
	assert.ErrorIs(t, err, shm.ErrNoExtent, "a block of a CPU segment")
	assert.Equal(t, handles, cudastub.Handles())
}

// Once a receiver maps a slab for a segment, a message that names a block
// of that segment with the descriptor of another allocation is refused,
// not read from or written to the mapped one: every honest message about
// a slab carries the producer's one export of it.
func TestImportBlockRefusesAnotherAllocationForAMappedSlab(t *testing.T) {
	leakcheck.Check(t)
	rt := slabRuntime(t)
	recv := slabRuntime(t)
	a, err := rt.Alloc(0, 64)
	require.NoError(t, err)
	defer a.Release()
	b, err := rt.Alloc(0, 64) // the same slab
	require.NoError(t, err)
	defer b.Release()
	large, err := rt.Alloc(0, 17<<20) // a slab of its own
	require.NoError(t, err)
	defer large.Release()
	_, largeTicket, largeFD := share(t, large)
	closeAll(t, largeTicket)
	defer closeAll(t, largeFD)

	sa, ta, fa := share(t, a)
	ra, err := recv.ImportBlock(0, receive(t, sa, ta), 64, fa)
	require.NoError(t, err)
	defer ra.Release()
	closeAll(t, ta, fa)

	sb, tb, fb := share(t, b)
	defer closeAll(t, tb, fb)
	blk := receive(t, sb, tb)
	_, err = recv.ImportBlock(0, blk, 64, largeFD)
	assert.ErrorContains(t, err, "not of the allocation this process maps for its segment")
	require.NoError(t, blk.Release())
	blk = receive(t, sb, tb)
	rb, err := recv.ImportBlock(0, blk, 64, fb)
	require.NoError(t, err, "the honest message still works")
	require.NoError(t, rb.Release())
}

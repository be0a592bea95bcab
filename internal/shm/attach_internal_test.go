//go:build linux

package shm

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A received segment dropped while slots it locked ahead keep their locks
// leaves no transfer behind: its locks went with its description, and a
// file given that descriptor's number afterwards keeps its own locks.
func TestDroppedSegmentLeavesNoTransfer(t *testing.T) {
	p := newPool(1 << 30)
	defer p.Trim(0)
	a, err := p.Alloc(4 << 10)
	require.NoError(t, err)
	defer a.Release()
	b, err := p.Alloc(4 << 10)
	require.NoError(t, err)
	defer b.Release()
	tk, err := a.Ticket()
	require.NoError(t, err)
	st, err := Stat(tk.FD())
	require.NoError(t, err)
	ref := func(x *Block) BlockRef {
		return BlockRef{Seg: SegmentRef{ID: st.ID, Size: x.seg.alloc.Size()}, Offset: x.Offset(), Size: x.size, Gen: x.Gen(), Ticket: -1}
	}
	ra := ref(a)
	ra.Ticket = tk.FD()
	got, err := Attach(ra) // this process maps the segment as a receiver
	tk.Done()
	require.NoError(t, err)
	LockAhead([]BlockRef{ref(b)})
	require.True(t, Locked(ref(b)))
	attached.mu.Lock()
	seg := attached.m[st.ID]
	num := seg.alloc.fd()
	attached.mu.Unlock()
	require.NoError(t, got.Release())
	require.NoError(t, DropIdle()) // unmaps the segment, b's lock kept ahead

	// Another file at the number the segment's description had, holding
	// a read lock at b's slot byte.
	f, err := os.CreateTemp(t.TempDir(), "other")
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(1<<20))
	if int(f.Fd()) != num { // else it has the number already
		require.NoError(t, unix.Dup3(int(f.Fd()), num, unix.O_CLOEXEC))
		defer unix.Close(num)
	}
	ok, err := lockRead(num, slotByte(b.slot), 1)
	require.NoError(t, err)
	require.True(t, ok)
	time.Sleep(aheadKeep + 5*transferDelay) // the transfers, were any left
	probe, err := os.OpenFile(f.Name(), os.O_RDWR, 0)
	require.NoError(t, err)
	defer probe.Close()
	ok, err = lockWrite(int(probe.Fd()), slotByte(b.slot), 1)
	require.NoError(t, err)
	assert.False(t, ok, "the other file's lock was dropped by a transfer of the dropped segment")
}

//go:build linux

package shm_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
)

func TestBlockShare(t *testing.T) {
	p := testPool(t)
	a := mustAlloc(t, p, 4<<10)
	b := mustAlloc(t, p, 4<<10)
	defer a.Release()
	defer b.Release()

	h, err := a.Share(nil)
	require.NoError(t, err)
	assert.Same(t, a, h.Block)
	assert.Equal(t, a.Segment().ID(), h.ID)
	assert.Empty(t, h.Name, "a memfd travels by descriptor")
	assert.Equal(t, a.Offset(), h.Offset)
	assert.Equal(t, a.Gen(), h.Gen)
	assert.Equal(t, a.Segment().Size(), h.Segment)
	tk, ok := h.Lease.(*shm.Ticket)
	require.True(t, ok, "a new ticket, which the message holds")
	assert.Equal(t, tk.FD(), h.FD)

	hb, err := b.Share(tk)
	require.NoError(t, err)
	assert.Nil(t, hb.Lease, "the message's ticket covers b")
	assert.Equal(t, h.FD, hb.FD)
	h.Lease.Done()
}

func TestAllocationShare(t *testing.T) {
	leakcheck.Check(t)
	named, err := shm.Create(64, shm.RefCount)
	require.NoError(t, err)
	defer named.Release()
	h, err := named.Share(nil)
	require.NoError(t, err)
	assert.Equal(t, named.Name(), h.Name)
	assert.Equal(t, -1, h.FD, "a named segment travels by name alone")
	assert.Nil(t, h.Lease)
	assert.Equal(t, int64(-1), h.Offset, "a whole segment")

	memfd, err := shm.Create(64, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	h, err = memfd.Share(nil)
	require.NoError(t, err)
	assert.Equal(t, memfd.FD(), h.FD)
	assert.Equal(t, memfd.ID(), h.ID)
	require.NotNil(t, h.Lease)
	require.NoError(t, memfd.Release())
	assert.True(t, isOpen(h.FD), "lent: open until the message is sent")
	h.Lease.Done()
	assert.False(t, isOpen(h.FD), "closed with the last loan")
}

func isOpen(fd int) bool {
	_, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	return err == nil
}

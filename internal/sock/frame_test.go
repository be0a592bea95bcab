//go:build linux

package sock

import (
	"context"
	"encoding/binary"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
)

// rawPair returns a connection and the raw other end of its socket, for
// writing what no tensormp sender writes.
func rawPair(t *testing.T) (*Conn, int) {
	t.Helper()
	pair, err := Pair()
	require.NoError(t, err)
	c, err := New(pair[0], "test")
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	raw, err := pair[1].Disown()
	require.NoError(t, err)
	return c, raw
}

func TestEmptyDatagramIsMalformedNotClosed(t *testing.T) {
	leakcheck.Check(t)
	c, peer := rawPair(t)
	require.NoError(t, unix.Sendmsg(peer, nil, nil, nil, 0))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := c.Recv(ctx)
	assert.ErrorIs(t, err, ErrMalformed, "an empty message while the peer is open")
	assert.NotErrorIs(t, err, ErrClosed)

	// The connection still works, and its peer's close is ErrClosed.
	var frame [headerLen]byte
	require.NoError(t, unix.Sendmsg(peer, frame[:], nil, nil, 0))
	m, err := c.Recv(ctx)
	require.NoError(t, err)
	assert.Empty(t, m.Data)
	assert.Zero(t, m.FDs.Len())
	m.Done()
	require.NoError(t, unix.Close(peer))
	_, err = c.Recv(ctx)
	assert.ErrorIs(t, err, ErrClosed)
}

// A 17-byte frame whose spill descriptor claims far more than it holds,
// or more than any message may be, is refused without copying.
func TestHostileSpills(t *testing.T) {
	leakcheck.Check(t)
	small, err := shm.Create(1<<20, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	defer small.Release()
	sealed, err := shm.SealedCopy(make([]byte, 1<<20))
	require.NoError(t, err)
	defer unix.Close(sealed)
	unsealed, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(unsealed)
	require.NoError(t, unix.Ftruncate(unsealed, 1<<20))

	for _, c := range []struct {
		name  string
		fd    int
		claim uint64
		want  string
	}{
		{"1 TiB", small.FD(), 1 << 40, "a spill of"},
		{"past the limit", small.FD(), maxSpill + 1, "a spill of"},
		{"more than the segment holds", sealed, 2 << 20, "not the 2097152 claimed"},
		{"writable segment", small.FD(), 1 << 20, "not sealed"},
		{"unsealed segment", unsealed, 1 << 20, "not sealed"},
		{"inline-sized", small.FD(), 16, "a spill of"},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, peer := rawPair(t)
			defer unix.Close(peer)
			var frame [headerLen]byte
			frame[0] = flagSpill
			binary.LittleEndian.PutUint64(frame[9:], c.claim)
			require.NoError(t, unix.Sendmsg(peer, frame[:], unix.UnixRights(c.fd), nil, 0))
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			m, err := conn.Recv(ctx)
			assert.ErrorContains(t, err, c.want)
			assert.Empty(t, m.FDs, "whatever arrived is closed")
		})
	}
}

// A peer that closes with our message unread makes the kernel report a
// reset once, ahead of what the peer sent before closing: that message is
// still delivered, and only then is the Conn closed.
func TestMessageBeforeResetIsDelivered(t *testing.T) {
	leakcheck.Check(t)
	c, peer := rawPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, c.Send(ctx, []byte("unread"), nil))
	frame := make([]byte, headerLen, headerLen+5)
	frame = append(frame, "last!"...)
	require.NoError(t, unix.Sendmsg(peer, frame, nil, nil, 0))
	require.NoError(t, unix.Close(peer))

	m, err := c.Recv(ctx)
	require.NoError(t, err, "the message sent before the close")
	assert.Equal(t, "last!", string(m.Data))
	assert.Zero(t, m.FDs.Len())
	m.Done()
	_, err = c.Recv(ctx)
	assert.ErrorIs(t, err, ErrClosed)
}

// TestParseRights reads the descriptors of every SCM_RIGHTS message in a
// control buffer, skips other kinds, and returns what it read before a
// malformed one, for the caller to close.
func TestParseRights(t *testing.T) {
	other := make([]byte, unix.CmsgSpace(4))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&other[0]))
	h.Level, h.Type = unix.SOL_SOCKET, unix.SCM_RIGHTS+0x40 // another kind
	h.SetLen(unix.CmsgLen(4))

	oob := append(unix.UnixRights(7, 8), other...)
	oob = append(oob, unix.UnixRights(9)...)
	fds, err := parseRights(nil, oob)
	require.NoError(t, err)
	assert.Equal(t, []int{7, 8, 9}, fds)

	bad := append(unix.UnixRights(7, 8), 1, 2, 3) // a header cut short
	fds, err = parseRights(nil, bad)
	assert.ErrorContains(t, err, "control message")
	assert.Equal(t, []int{7, 8}, fds)

	fds, err = parseRights(nil, nil)
	require.NoError(t, err)
	assert.Empty(t, fds)

	fds, err = parseRights([]int{5}, oob)
	require.NoError(t, err)
	assert.Equal(t, []int{5, 7, 8, 9}, fds, "appended after what the slice held")
}

// appendRights writes what unix.UnixRights makes, after what the buffer
// held, and parseRights reads it back.
func TestAppendRights(t *testing.T) {
	for _, n := range []int{1, 2, 3, maxFDs} {
		fds := make([]int, n)
		for i := range fds {
			fds[i] = 3 + 7*i
		}
		assert.Equal(t, unix.UnixRights(fds...), appendRights(nil, fds), "%d descriptors", n)

		reused := appendRights(make([]byte, 0, 8), []int{9, 9, 9, 9, 9})
		got := appendRights(reused[:0], fds)
		assert.Equal(t, unix.UnixRights(fds...), got, "a reused buffer holds only the new message")
		back, err := parseRights(nil, got)
		require.NoError(t, err)
		assert.Equal(t, fds, back)
	}
}

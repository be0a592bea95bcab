//go:build linux

package sock

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A writer whose lane is full as of its last look at the taken count
// looks again, and keeps what it read: it takes the room that look
// found without reading the count again, and looks again once that is
// used up.
func TestLaneWriterKeepsItsLook(t *testing.T) {
	f, err := CreateLane(8, 256)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	w, err := OpenLane(f)
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close() })
	r, err := OpenLane(f)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })

	for range 8 {
		require.NoError(t, w.TrySend([]byte{1}))
	}
	assert.Zero(t, w.seen, "room as of the lane's opening: no look")
	require.ErrorIs(t, w.TrySend([]byte{2}), ErrWouldBlock)
	for range 3 {
		_, _, err := r.TryRecv(nil)
		require.NoError(t, err)
	}
	require.NoError(t, w.TrySend([]byte{3}))
	assert.Equal(t, r.Taken(), w.seen, "the look's count, kept")
	require.NoError(t, w.TrySend([]byte{4}))
	require.NoError(t, w.TrySend([]byte{5}))
	_, _, err = r.TryRecv(nil)
	require.NoError(t, err)
	assert.Equal(t, r.Taken()-1, w.seen, "no look while the room it found lasts")
	require.NoError(t, w.TrySend([]byte{6}), "a look, once that room is used up")
	assert.Equal(t, r.Taken(), w.seen)
}

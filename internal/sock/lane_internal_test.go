//go:build linux

package sock

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// openLanes makes a lane of entries entries of 256 bytes and maps it n
// times, each Lane closed, and the lane's descriptor, as the test ends.
func openLanes(t *testing.T, entries, n int) []*Lane {
	t.Helper()
	f, err := CreateLane(entries, 256)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	ls := make([]*Lane, n)
	for i := range ls {
		l, err := OpenLane(f)
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Close() })
		ls[i] = l
	}
	return ls
}

// A writer whose lane is full as of its last look at the taken count
// looks again, and keeps what it read: it takes the room that look
// found without reading the count again, and looks again once that is
// used up.
func TestLaneWriterKeepsItsLook(t *testing.T) {
	l := openLanes(t, 8, 2)
	w, r := l[0], l[1]

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
	_, _, err := r.TryRecv(nil)
	require.NoError(t, err)
	assert.Equal(t, r.Taken()-1, w.seen, "no look while the room it found lasts")
	require.NoError(t, w.TrySend([]byte{6}), "a look, once that room is used up")
	assert.Equal(t, r.Taken(), w.seen)
}

// Tail is the writer's own count, read without the writer's lock: a
// Way's writer reads it at each message (and Maps as it encodes one),
// while another of its goroutines may hold the lock, waiting for room.
// It follows each message published, and a writer that resumes after
// another counts from what that one published.
func TestLaneTailWhileASendWaits(t *testing.T) {
	l := openLanes(t, 4, 3)
	w, r, other := l[0], l[1], l[2] // other: a writer after w, opened before it sends

	for i := range 4 {
		require.Equal(t, uint32(i), w.Tail())
		require.NoError(t, w.TrySend([]byte{byte(i)}))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sent := make(chan error, 1)
	alive := func() error { return nil }
	go func() { sent <- w.Send(ctx, []byte{4}, alive) }() // waits for room, holding wmu
	require.Eventually(t, func() bool {
		if !w.wmu.TryLock() {
			return true
		}
		w.wmu.Unlock()
		return false
	}, 5*time.Second, time.Millisecond, "the send never waited")
	done := make(chan uint32, 1)
	go func() { done <- w.Tail() }()
	select {
	case tail := <-done:
		assert.Equal(t, uint32(4), tail, "four published while the fifth waits")
	case <-time.After(5 * time.Second):
		t.Fatal("Tail waited for the send that waits for room")
	}
	_, _, err := r.TryRecv(nil)
	require.NoError(t, err)
	require.NoError(t, <-sent)
	assert.Equal(t, uint32(5), w.Tail())

	assert.Zero(t, other.Tail(), "as the lane was when it opened")
	other.Resume()
	assert.Equal(t, uint32(5), other.Tail(), "counts from what the last writer published")
}

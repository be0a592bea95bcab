//go:build linux

package sock

import (
	"context"
	"encoding/binary"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
)

// wayPair returns the two ends of one direction of a pipe in this
// process: w writes the lane, r reads it, each through its own socket end
// and lane descriptor. mem is another descriptor of the lane's memory,
// for tests that write it. The test's end closes them all.
func wayPair(t testing.TB) (w, r *Way, mem *fd.FD) {
	t.Helper()
	pair, err := Pair()
	require.NoError(t, err)
	a, err := New(pair[0], "pipe")
	require.NoError(t, err)
	b, err := New(pair[1], "pipe")
	require.NoError(t, err)
	lane, err := CreateWayLane()
	require.NoError(t, err)
	dup, err := lane.Dup()
	require.NoError(t, err)
	mem, err = lane.Dup()
	require.NoError(t, err)
	w, r = NewWay(a, lane, true), NewWay(b, dup, false)
	t.Cleanup(func() {
		_, _ = a.Close(), b.Close()
		_, _, _ = w.Close(), r.Close(), mem.Close()
	})
	return w, r, mem
}

// another returns a second Way of the end of w (its socket), with a
// descriptor of its own of the lane's memory mem: another process's, as
// far as roles go. The test's end closes it.
func another(t *testing.T, w *Way, mem *fd.FD, writes bool) *Way {
	t.Helper()
	dup, err := mem.Dup()
	require.NoError(t, err)
	w2 := NewWay(w.shared, dup, writes)
	t.Cleanup(func() { _ = w2.Close() })
	return w2
}

// holds reports whether w holds its role, as its calls see it.
func holds(w *Way) bool {
	w.sem.lock()
	defer w.sem.unlock()
	return w.held
}

// wayMsg is message i: its index, then n bytes.
func wayMsg(i, n int) []byte {
	b := binary.LittleEndian.AppendUint32(nil, uint32(i))
	for j := range n {
		b = append(b, byte(i+j))
	}
	return b
}

// recvIndex receives the next message on r and returns its index and its
// descriptors' count, checking its bytes.
func recvIndex(t *testing.T, ctx context.Context, r *Way) (int, int) {
	t.Helper()
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	defer m.Done()
	require.GreaterOrEqual(t, len(m.Data), 4)
	i := int(binary.LittleEndian.Uint32(m.Data))
	require.Equal(t, wayMsg(i, len(m.Data)-4), m.Data, "message %d's bytes", i)
	return i, m.FDs.Len()
}

// A writer's messages arrive in the order it sent them, whichever way
// each went: small ones by the lane, those with a descriptor or too large
// for an entry by the socket. The reader both keeps up and falls behind,
// and nothing is left open.
func TestWayKeepsOrder(t *testing.T) {
	leakcheck.Check(t)
	w, r, _ := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	defer func() { _, _ = unix.Close(p[0]), unix.Close(p[1]) }()
	const n = 5000
	withFD := func(i int) bool { return i%5 == 0 }
	size := func(i int) int {
		if i%7 == 0 {
			return 2 * WayEntry // too large for the lane
		}
		return i % 100
	}
	done := make(chan error, 1)
	go func() {
		for i := range n {
			var fds []int
			if withFD(i) {
				fds = []int{p[0]}
			}
			if i%300 == 0 {
				time.Sleep(time.Millisecond) // the reader sleeps
			}
			if err := w.Send(ctx, wayMsg(i, size(i)), fds); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	for i := range n {
		if i%1000 == 0 {
			time.Sleep(5 * time.Millisecond) // the lane fills
		}
		got, fds := recvIndex(t, ctx, r)
		require.Equal(t, i, got)
		assert.Equal(t, withFD(i), fds == 1, "message %d's descriptors", i)
	}
	require.NoError(t, <-done)
	assert.True(t, holds(w) && holds(r), "the two ends did not take the lane")
}

// A socket message whose marker found the lane full comes after the
// lane's entries, and before the writer's next message: its marker is
// written first.
func TestWayOwesAMarkerWhenFull(t *testing.T) {
	w, r, _ := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := range WayEntries {
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
	}
	big := WayEntries
	require.NoError(t, w.Send(ctx, wayMsg(big, 2*WayEntry), nil))
	assert.True(t, w.owed, "a marker is owed")
	for i := range WayEntries {
		got, _ := recvIndex(t, ctx, r)
		require.Equal(t, i, got)
	}
	got, _ := recvIndex(t, ctx, r)
	require.Equal(t, big, got)
	require.NoError(t, w.Send(ctx, wayMsg(big+1, 8), nil))
	assert.False(t, w.owed, "the marker went first")
	got, _ = recvIndex(t, ctx, r)
	require.Equal(t, big+1, got)
}

// A socket message that follows lane entries the reader has not taken is
// left on the socket until it has taken them, even when the reader looks
// at the socket first (woken by it, between the writer's entry and its
// marker).
func TestWayLeavesAnEarlySocketMessage(t *testing.T) {
	w, r, _ := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	l := w.lane.Load()
	require.NotNil(t, l)
	// Message 1 by the socket, tagged as following entry 0, and no
	// marker yet.
	require.NoError(t, w.shared.send(ctx, wayMsg(1, 8), nil, int64(l.Tail()), true))
	r.sem.lock() // as Recv holds it
	rl := r.taken()
	require.NotNil(t, rl)
	r.draining = true
	_, ok, err := r.fromSocket(ctx, rl)
	r.sem.unlock()
	require.NoError(t, err)
	require.False(t, ok, "the socket's message came before entry 0")
	assert.False(t, r.stashed || r.draining, "the message was received, or the drain goes on")
	got, _ := recvIndex(t, ctx, r)
	assert.Equal(t, 0, got)
	got, _ = recvIndex(t, ctx, r)
	assert.Equal(t, 1, got)
}

// A message that fills the socket's inline room, tag and all, arrives
// whole: the tag does not push it past the receive's buffer.
func TestWayTaggedMessageAtTheInlineLimit(t *testing.T) {
	w, r, _ := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil)) // w takes the lane
	for i, n := range []int{maxInline - 4, maxInline - 3, maxInline - 4 + tagLen, maxInline + 1} {
		require.NoError(t, w.Send(ctx, wayMsg(i+1, n-4), nil))
	}
	for i := range 5 {
		got, _ := recvIndex(t, ctx, r)
		require.Equal(t, i, got)
	}
}

// A writer that takes the role after another let go of it sends after
// what the lane holds, and what it sent by the socket before comes first:
// nothing is overwritten, and each writer's order is kept.
func TestWayWriterTakesOver(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w2 := another(t, w, mem, true)
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil)) // w takes the role
	got, _ := recvIndex(t, ctx, r)                     // and r
	require.Equal(t, 0, got)
	require.NoError(t, w2.Send(ctx, wayMsg(100, 8), nil)) // w2 by the socket
	for i := 1; i <= 3; i++ {
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
	}
	require.NoError(t, w.Close())
	time.Sleep(2 * roleRetry) // past w2's next try
	for i := 101; i <= 103; i++ {
		require.NoError(t, w2.Send(ctx, wayMsg(i, 8), nil))
	}
	require.True(t, holds(w2), "the second writer took the role")
	next := [2]int{1, 100}
	for range 7 {
		got, _ := recvIndex(t, ctx, r)
		k := got / 100
		require.Equal(t, next[k], got)
		next[k]++
	}
	assert.Equal(t, [2]int{4, 104}, next)
}

// A reader that takes the role over from one that closed mid-drain
// receives what is left on the socket before the lane's later entries.
func TestWayReaderTakesOverMidDrain(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := range WayEntries {
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
	}
	// Two by the socket under one owed marker, then one by the lane.
	require.NoError(t, w.Send(ctx, wayMsg(WayEntries, 2*WayEntry), nil))
	require.NoError(t, w.Send(ctx, wayMsg(WayEntries+1, 2*WayEntry), nil))
	for i := range WayEntries {
		got, _ := recvIndex(t, ctx, r)
		require.Equal(t, i, got)
	}
	// The owed marker goes in first, then this one.
	require.NoError(t, w.Send(ctx, wayMsg(WayEntries+2, 8), nil))
	got, _ := recvIndex(t, ctx, r) // at the marker: the first of the two
	require.Equal(t, WayEntries, got)
	require.True(t, r.draining)
	require.NoError(t, r.Close())
	r2 := another(t, r, mem, false)
	for i := WayEntries + 1; i <= WayEntries+2; i++ {
		got, _ := recvIndex(t, ctx, r2)
		require.Equal(t, i, got)
	}
}

// A reader that lets go of its role (its end sent on) leaves the lane to
// another process of the end, and takes it again if it is free.
func TestWayReaderLetsGo(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	got, _ := recvIndex(t, ctx, r)
	require.Equal(t, 0, got)
	r.LetGo()
	r2 := another(t, r, mem, false)
	for i := 1; i <= 3; i++ {
		require.NoError(t, w.Send(ctx, wayMsg(i, 8), nil))
		got, _ := recvIndex(t, ctx, r2)
		require.Equal(t, i, got)
	}
	require.True(t, holds(r2))
	require.NoError(t, r2.Close())
	require.NoError(t, w.Send(ctx, wayMsg(4, 8), nil))
	got, _ = recvIndex(t, ctx, r)
	assert.Equal(t, 4, got)
	assert.True(t, holds(r), "the first reader took the role again")
}

// Counts that no honest peer writes end the lane for the reader, which
// goes on with the socket: a writer without the role is still heard.
func TestWayBrokenCountsLeaveTheSocket(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	got, _ := recvIndex(t, ctx, r)
	require.Equal(t, 0, got)
	rogue, err := OpenLane(mem)
	require.NoError(t, err)
	defer rogue.Close()
	binary.LittleEndian.PutUint32(rogue.mem[sentBell:], rogue.Sent()+WayEntries+5)
	_, err = r.Recv(ctx)
	require.ErrorIs(t, err, ErrMalformed)
	require.NoError(t, w.shared.Send(ctx, wayMsg(1, 8), nil))
	got, _ = recvIndex(t, ctx, r)
	assert.Equal(t, 1, got)
	r.sem.lock()
	assert.True(t, r.broken)
	r.sem.unlock()
}

// What a peer writes into the lane or the socket that the Way did not is
// an error wrapping ErrMalformed for that receive alone: an entry of an
// unknown kind, an empty one, a socket message that says it follows
// entries never sent. What it brought is closed.
func TestWayRefusesWhatItDidNotWrite(t *testing.T) {
	leakcheck.Check(t)
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	got, _ := recvIndex(t, ctx, r)
	require.Equal(t, 0, got)
	base := leakcheck.Count()

	rogue, err := OpenLane(mem)
	require.NoError(t, err)
	defer rogue.Close()
	for _, bad := range [][]byte{{7, 1, 2}, {}} {
		require.NoError(t, rogue.Send(ctx, bad, nil))
		_, err := r.Recv(ctx)
		require.ErrorIs(t, err, ErrMalformed, "entry %v", bad)
	}
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	require.NoError(t, w.shared.send(ctx, wayMsg(1, 8), []int{p[0]}, int64(rogue.Tail()+100), true))
	_, _ = unix.Close(p[0]), unix.Close(p[1])
	require.NoError(t, rogue.Send(ctx, marker, nil))
	_, err = r.Recv(ctx)
	require.ErrorIs(t, err, ErrMalformed, "a tag ahead of the lane")
	assert.Equal(t, base, leakcheck.Count(), "descriptors left open")

	// The reader goes on: the next whole entry is a message.
	require.NoError(t, rogue.Send(ctx, append([]byte{kindValue}, wayMsg(2, 8)...), nil))
	got, _ = recvIndex(t, ctx, r)
	assert.Equal(t, 2, got)
}

// A process without the lane's role sends by the socket, nudging the
// reader asleep on the lane; each writer's messages arrive in its order.
func TestWayWriterWithoutTheRole(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w2 := another(t, w, mem, true)
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil)) // w takes the role
	const n = 200
	done := make(chan error, 1)
	go func() {
		for i := 1; i <= n; i++ {
			if err := w2.Send(ctx, wayMsg(1000+i, 8), nil); err != nil {
				done <- err
				return
			}
			if err := w.Send(ctx, wayMsg(i, 8), nil); err != nil {
				done <- err
				return
			}
			time.Sleep(100 * time.Microsecond)
		}
		done <- nil
	}()
	next := [2]int{0, 1001}
	for range 2*n + 1 {
		got, _ := recvIndex(t, ctx, r)
		k := 0
		if got >= 1000 {
			k = 1
		}
		require.Equal(t, next[k], got)
		next[k]++
	}
	require.NoError(t, <-done)
	assert.False(t, holds(w2), "a second writer took the role")
}

// Whatever a hostile writer puts in the lane's memory and sends on the
// socket (entries of any kind and length, tags ahead, behind or none,
// markers with nothing behind them, counts moved at will), a reader's
// receives return messages, errors wrapping ErrMalformed, or their
// context's end: never a crash, a hang, or a descriptor left open.
func FuzzWay(f *testing.F) {
	f.Add([]byte{0, 3, 1, 2, 3, 1, 0, 1, 2, 5, 2, 0, 3})
	f.Add([]byte{1, 0x7f, 1, 1, 0x80, 0, 3, 3, 0, 0, 7})
	f.Add([]byte{4, 0, 1, 9, 0, 0, 0, 3, 1, 1, 3})    // the sent count moved
	f.Add([]byte{4, 1, 1, 0, 0, 0, 1, 1, 2, 1, 3, 3}) // the taken count moved
	f.Add([]byte{0, 3, 2, 0, 9, 0, 4, 2, 5, 1, 1})    // entries that return blocks: none, and too many
	var pipe [2]int
	require.NoError(f, unix.Pipe2(pipe[:], unix.O_CLOEXEC))
	f.Cleanup(func() { _, _ = unix.Close(pipe[0]), unix.Close(pipe[1]) })
	// The package's waiting (its kernel wait slots and its poller) starts
	// at the first receive that waits in the kernel or parks, which not
	// every input reaches, and keeps its descriptors for the life of the
	// process: leakcheck.Count leaves them out.
	f.Fuzz(func(t *testing.T, ops []byte) {
		base := leakcheck.Count()
		fuzzWay(t, pipe[0], ops)
		assert.Equal(t, base, leakcheck.Count(), "descriptors left open")
	})
}

// fuzzWay is one run of FuzzWay: a pair of Ways, what ops says a hostile
// writer does to them (sending fd with the socket's messages), then
// receives until the reader waits. It closes all it made.
func fuzzWay(t testing.TB, fd int, ops []byte) {
	w, r, mem := wayPair(t)
	defer func() {
		_, _ = w.shared.Close(), r.shared.Close()
		_, _, _ = w.Close(), r.Close(), mem.Close()
	}()
	rogue, err := OpenLane(mem)
	require.NoError(t, err)
	defer rogue.Close()
	raw := rogue.mem
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	next := func() byte {
		if len(ops) == 0 {
			return 0
		}
		b := ops[0]
		ops = ops[1:]
		return b
	}
	for n := 0; len(ops) > 0 && n < 64; n++ {
		switch next() % 5 {
		case 0: // an entry: a length, then its bytes
			k := int(next() % 24)
			e := make([]byte, 0, k)
			for range k {
				e = append(e, next())
			}
			_ = rogue.TrySend(e)
		case 1: // a tagged socket message, around the lane's position
			tag := int64(uint32(int32(rogue.Tail()) + int32(int8(next()))))
			var fds []int
			if next()%2 == 0 {
				fds = []int{fd}
			}
			_ = w.shared.send(ctx, wayMsg(n, 4), fds, tag, false)
		case 2: // an untagged one
			_ = w.shared.send(ctx, wayMsg(n, 4), nil, -1, false)
		case 3:
			_ = rogue.TrySend(marker)
		case 4: // a count moved: the sent (0) or taken (1) one
			off := sentBell
			if next()%2 == 1 {
				off = takenBell
			}
			binary.LittleEndian.PutUint32(raw[off:], binary.LittleEndian.Uint32(raw[off:])+uint32(int8(next())))
		}
	}
	// Receive until the reader waits: each receive returns
	// within its 20 ms.
	for range 600 {
		rctx, rcancel := context.WithTimeout(ctx, 20*time.Millisecond)
		m, err := r.Recv(rctx)
		rcancel()
		if err == nil {
			m.Done()
			continue
		}
		if errors.Is(err, context.DeadlineExceeded) {
			return
		}
		require.ErrorIs(t, err, ErrMalformed)
	}
}

// A writer whose end closes with a message of the reader's unread leaves
// the reader's socket saying so (ECONNRESET) once, before what the writer
// sent: the reader's look at the socket asks again, so nothing is
// reordered or lost.
func TestWayWriterClosedWithUnread(t *testing.T) {
	for _, lane := range []bool{true, false} {
		w, r, _ := wayPair(t)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
		got, _ := recvIndex(t, ctx, r)
		require.Equal(t, 0, got)
		require.NoError(t, r.shared.Send(ctx, []byte("never read"), nil))
		if lane {
			require.NoError(t, w.Send(ctx, wayMsg(1, 2*WayEntry), nil)) // socket, then marker
			require.NoError(t, w.Send(ctx, wayMsg(2, 8), nil))          // lane
		} else {
			// As a writer without the role: no marker, heard by the
			// reader's look at the socket once the writers are gone.
			require.NoError(t, w.shared.Send(ctx, wayMsg(1, 8), nil))
		}
		require.NoError(t, w.shared.Close())
		got, _ = recvIndex(t, ctx, r)
		assert.Equal(t, 1, got, "lane %v", lane)
		if lane {
			got, _ = recvIndex(t, ctx, r)
			assert.Equal(t, 2, got)
		}
		_, err := r.Recv(ctx)
		assert.ErrorIs(t, err, ErrClosed)
		cancel()
	}
}

// An empty message at the socket's head, which no Conn sends, is refused
// (ErrMalformed), and what follows it comes next.
func TestWayRefusesAnEmptyMessage(t *testing.T) {
	w, r, _ := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	got, _ := recvIndex(t, ctx, r)
	require.Equal(t, 0, got)
	_, err := unix.Write(w.shared.sock.Num(), nil)
	require.NoError(t, err)
	require.NoError(t, w.Send(ctx, wayMsg(1, 2*WayEntry), nil)) // socket, then marker
	_, err = r.Recv(ctx)
	require.ErrorIs(t, err, ErrMalformed)
	got, _ = recvIndex(t, ctx, r)
	assert.Equal(t, 1, got)
}

// keepAhead has r keep message 2 ahead of its place: w sends 0 and 1 by
// the lane and 2 by the socket; r, receiving without the role as a
// process whose last try was just now, gets 2 first, which makes it take
// the role and keep 2 until entries 0 and 1 are taken; it receives 0.
func keepAhead(t *testing.T, ctx context.Context, w, r *Way) {
	t.Helper()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	l := w.lane.Load()
	require.NoError(t, w.shared.send(ctx, wayMsg(2, 8), nil, int64(l.Tail()), true))
	r.tried = time.Now()
	got, _ := recvIndex(t, ctx, r)
	require.Equal(t, 0, got)
	r.sem.lock()
	defer r.sem.unlock()
	require.True(t, r.held && r.stashed, "message 2 is kept")
}

// A message kept ahead of its place is the next one received once the
// lane's counts break: the receive does not wait on the socket behind it.
func TestWayBrokenLaneGivesTheKeptMessage(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	keepAhead(t, ctx, w, r)
	rogue, err := OpenLane(mem)
	require.NoError(t, err)
	defer rogue.Close()
	binary.LittleEndian.PutUint32(rogue.mem[sentBell:], rogue.Sent()+WayEntries+5)
	_, err = r.Recv(ctx)
	require.ErrorIs(t, err, ErrMalformed)
	got, _ := recvIndex(t, ctx, r) // entry 1 is lost with the lane
	assert.Equal(t, 2, got)
	require.NoError(t, w.shared.Send(ctx, wayMsg(3, 8), nil))
	got, _ = recvIndex(t, ctx, r)
	assert.Equal(t, 3, got)
}

// A reader that holds the role and stops receiving, its end still open,
// lets go of it within idleRole or two: another reader of the end then
// takes the lane, and the writer does not block on a full lane.
func TestWayIdleReaderLetsGo(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	got, _ := recvIndex(t, ctx, r) // r takes the role, then idles
	require.Equal(t, 0, got)
	r2 := another(t, r, mem, false)
	done := make(chan error, 1)
	go func() {
		for i := 1; i <= 2*WayEntries; i++ {
			if err := w.Send(ctx, wayMsg(i, 8), nil); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	for i := 1; i <= 2*WayEntries; i++ {
		got, _ := recvIndex(t, ctx, r2)
		require.Equal(t, i, got)
	}
	require.NoError(t, <-done)
	assert.False(t, holds(r), "the idle reader kept the role")
}

// A reader without the role that receives a message of the role's writer
// takes the role at once, however recently it last tried: the message
// keeps its place after the lane's entry.
func TestWayReaderTakesTheRoleAtOnce(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil)) // w takes the role
	r2 := another(t, r, mem, false)
	r.sem.lock()
	require.NotNil(t, r.taken()) // r holds the reader's role
	r.sem.unlock()
	require.NoError(t, w.Send(ctx, wayMsg(1, 2*WayEntry), nil)) // socket, then marker
	r2.sem.lock()
	require.Nil(t, r2.taken()) // r2's try fails, just now
	r2.sem.unlock()
	require.NoError(t, r.Close()) // the role is free
	got, _ := recvIndex(t, ctx, r2)
	assert.Equal(t, 0, got)
	got, _ = recvIndex(t, ctx, r2)
	assert.Equal(t, 1, got)
}

// A reader that keeps a message ahead of its place and stops receiving
// lets go of the role all the same: another reader takes the entries
// before it and what follows, and the kept message is the first reader's
// next.
func TestWayKeptMessageDoesNotKeepTheRole(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	keepAhead(t, ctx, w, r)
	r.LetGo()
	require.False(t, holds(r), "a reader with a kept message kept the role")
	r2 := another(t, r, mem, false)
	got, _ := recvIndex(t, ctx, r2)
	assert.Equal(t, 1, got)
	require.NoError(t, w.Send(ctx, wayMsg(3, 8), nil))
	got, _ = recvIndex(t, ctx, r2)
	assert.Equal(t, 3, got)
	got, _ = recvIndex(t, ctx, r)
	assert.Equal(t, 2, got)
}

// Ahead shows the role's reader, while it receives, the values the lane
// holds behind the message it took, oldest first, a marker passed over;
// the writer, and a reader without the role, see none.
func TestWayAhead(t *testing.T) {
	w, r, mem := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	defer func() { _, _ = unix.Close(p[0]), unix.Close(p[1]) }()
	require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), []int{p[0]})) // by the socket
	require.NoError(t, w.Send(ctx, wayMsg(2, 8), nil))
	require.NoError(t, w.Send(ctx, wayMsg(3, 16), nil))
	ahead := func(x *Way) (got []int) {
		x.Ahead(func(data []byte) bool {
			i := int(binary.LittleEndian.Uint32(data))
			assert.Equal(t, wayMsg(i, len(data)-4), data, "message %d's bytes", i)
			got = append(got, i)
			return true
		})
		return got
	}
	assert.Empty(t, ahead(w), "the writer's side")
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	require.Equal(t, wayMsg(0, 8), m.Data)
	assert.Equal(t, []int{2, 3}, ahead(r))
	var first []int
	r.Ahead(func(data []byte) bool {
		first = append(first, int(binary.LittleEndian.Uint32(data)))
		return false
	})
	assert.Equal(t, []int{2}, first, "until yield says stop")
	assert.Empty(t, ahead(another(t, r, mem, false)), "a reader without the role")
	m.Done()
	r.LetGo()
	assert.Empty(t, ahead(r), "a reader that let go of the role, its lane still mapped")
	for i := 1; i <= 3; i++ {
		got, _ := recvIndex(t, ctx, r)
		require.Equal(t, i, got)
	}
}

// watchedPair returns a wayPair whose reader has mapped the lane, with a
// message, and watches its peer as a wait's alive does (watchPeer).
func watchedPair(t *testing.T) (w, r *Way) {
	t.Helper()
	w, r, _ = wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	m.Done()
	require.NotNil(t, r.lane.Load(), "the reader maps the lane")
	r.watchPeer()
	return w, r
}

// A Way's Close ends its watch of its peer (watchPeer) before it unmaps
// the lane: the peer's close afterwards nudges nothing, where the poller's
// nudge of the unmapped lane would fault.
func TestWayClosedIsNudgedNoMore(t *testing.T) {
	w, r := watchedPair(t)
	require.NoError(t, r.Close())
	require.NoError(t, w.shared.Close()) // the poller sees the hang-up
	time.Sleep(100 * time.Millisecond)   // and would nudge meanwhile
}

// A Way's Close waits for a nudge of the poller's under way (see
// watchPeer) before it unmaps the lane: the poller, slowed here between
// its look at the watches and their run, nudges a lane still mapped.
func TestWayCloseWaitsForThePollersNudge(t *testing.T) {
	w, r := watchedPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	entered, release := make(chan struct{}), make(chan struct{})
	var once, released sync.Once
	letGo := func() { released.Do(func() { close(release) }) }
	t.Cleanup(letGo) // a failure lets the poller go before the pair closes
	hook := func(p *parking) {
		if p == &r.shared.park {
			once.Do(func() { close(entered); <-release })
		}
	}
	beforeGone.Store(&hook)
	defer beforeGone.Store(nil)
	require.NoError(t, w.shared.Close()) // the hang-up
	select {
	case <-entered:
	case <-ctx.Done():
		t.Fatal("the poller never ran the watch")
	}
	closed := make(chan error, 1)
	go func() { closed <- r.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while the poller was about to nudge the lane", err)
	case <-time.After(50 * time.Millisecond):
	}
	letGo() // the nudge runs: the lane must be mapped still
	require.NoError(t, <-closed)
	time.Sleep(100 * time.Millisecond) // a nudge run after the lock would come meanwhile
}

// recvGivingUp holds r's call, as a receive does, starts another
// receive, which waits for the call, and ends that receive's context
// once it is counted as waiting: the test's release of the call (r's
// unlock) then hands it to a receive that has given up. It returns what
// the receive returns.
func recvGivingUp(ctx context.Context, r *Way) <-chan error {
	r.sem.lock()
	waiting, stop := context.WithCancel(ctx)
	done := recvErr(waiting, r)
	for r.sem.waiters.Load() == 0 {
		time.Sleep(10 * time.Microsecond)
	}
	stop()
	return done
}

// recvErr receives one message on r in a goroutine, under ctx, and
// returns what the receive returns; a message received is done with at
// once.
func recvErr(ctx context.Context, r *Way) <-chan error {
	done := make(chan error, 1)
	go func() {
		m, err := r.Recv(ctx)
		if err == nil {
			m.Done()
		}
		done <- err
	}()
	return done
}

// A LetGo that comes as a receive ends, and hands the Way's call to
// another receive whose context ended meanwhile, lets the role go: that
// receive, which takes the call as it gives up, hands on as it ends,
// whichever it does first.
func TestLetGoAsAWaitingReceiveGivesUp(t *testing.T) {
	for i := range 50 {
		w, r, _ := wayPair(t)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
		recvIndex(t, ctx, r)
		require.True(t, holds(r))
		done := recvGivingUp(ctx, r)
		r.unlock() // the receive's end
		r.LetGo()
		gotWithin(t, done, "the receive did not return")
		assert.False(t, holds(r), "try %d: the role is held still", i)
		cancel()
	}
}

// A receive whose context ends as the Way's call is handed to it takes
// nothing and returns the context's error, as one whose context ended
// first does: the message is the next receive's.
func TestRecvEndedAsItIsHandedTheCall(t *testing.T) {
	w, r, _ := wayPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for range 20 {
		require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
		recvIndex(t, ctx, r)
		require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
		done := recvGivingUp(ctx, r)
		r.unlock()
		assert.ErrorIs(t, gotWithin(t, done, "the receive did not return"), context.Canceled)
		i, _ := recvIndex(t, ctx, r)
		assert.Equal(t, 1, i, "the message was left for the next receive")
	}
}

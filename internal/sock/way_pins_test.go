//go:build linux

package sock

import (
	"context"
	"encoding/binary"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
)

// receivedCopy returns a block of b's segment as a receiver holds it: mapped
// afresh from a ticket, as a message's would be.
func receivedCopy(t *testing.T, b *shm.Block) *shm.Block {
	t.Helper()
	tk, err := b.Ticket()
	require.NoError(t, err)
	defer tk.Done()
	st, err := shm.Stat(tk.FD())
	require.NoError(t, err)
	r, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: st.ID, Size: b.Segment().Size()}, Offset: b.Offset(), Size: b.Size(), Gen: b.Gen(), Ticket: tk.FD()})
	require.NoError(t, err)
	return r
}

// takeRoles has w send a message that r receives: both hold their roles.
// r's receive is left open for the caller's f, which runs as a decode of
// the message would.
func takeRoles(t *testing.T, ctx context.Context, w, r *Way, f func()) {
	t.Helper()
	require.NoError(t, w.Send(ctx, []byte{1}, nil))
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	if f != nil {
		f()
	}
	m.Done()
	require.True(t, holds(w) && holds(r))
}

// pinOne has r receive and pin a block of a new segment of this
// process's pool, w and r in their roles, with r looking at its pins
// each 10 ms once it waits or lets go of its role: it returns the block
// (the producer's) and r's copy of it.
func pinOne(t *testing.T, ctx context.Context, w, r *Way) (b, got *shm.Block) {
	t.Helper()
	r.sem.lock()
	r.pinLook = 10 * time.Millisecond
	r.sem.unlock()
	b, err := shm.DefaultPool().Alloc(4 << 10)
	require.NoError(t, err)
	got = receivedCopy(t, b)
	takeRoles(t, ctx, w, r, func() { r.Pin(b.Segment().ID()) })
	return b, got
}

// pinsNow reports whether r pins segment id, as its calls see it.
func pinsNow(r *Way, id shm.ID) bool {
	r.sem.lock()
	defer r.sem.unlock()
	return r.Pinned(id)
}

// pinnedIdle is pinOne, and then waits for r to let go of its role idle.
func pinnedIdle(t *testing.T, ctx context.Context, w, r *Way) (b, got *shm.Block) {
	t.Helper()
	b, got = pinOne(t, ctx, w, r)
	require.Eventually(t, func() bool { return !holds(r) }, 5*time.Second, 5*time.Millisecond, "r lets go of its role idle")
	return b, got
}

// endedWithin returns the error of the receive got reports within 5 s;
// else the test fails with why.
func endedWithin(t *testing.T, got <-chan gotMsg, why string) error {
	t.Helper()
	select {
	case g := <-got:
		return g.err
	case <-time.After(5 * time.Second):
		t.Fatal(why)
		return nil
	}
}

// producerLetsGo releases b, a block of this process's pool, and waits
// for the pool to let go of its segment (shm.Kept).
func producerLetsGo(t *testing.T, b *shm.Block) {
	t.Helper()
	id := b.Segment().ID()
	require.NoError(t, b.Release())
	require.Eventually(t, func() bool {
		shm.DefaultPool().Trim(0)
		return !shm.Kept(id)
	}, 5*time.Second, 5*time.Millisecond)
}

// pinOfAGoneProducer has r, with w, take their roles and pin the segment
// of a block of this process's pool that r received, which the pool then
// lets go of, and returns the segment's identity.
func pinOfAGoneProducer(t *testing.T, ctx context.Context, w, r *Way) shm.ID {
	t.Helper()
	b, err := shm.DefaultPool().Alloc(4 << 10)
	require.NoError(t, err)
	got := receivedCopy(t, b)
	id := b.Segment().ID()
	takeRoles(t, ctx, w, r, func() { r.Pin(id) })
	require.NoError(t, got.Release())
	producerLetsGo(t, b)
	return id
}

// pruneNow has r look at its pins now, as its receives and its idle
// timer do.
func pruneNow(r *Way) {
	r.sem.lock()
	defer r.sem.unlock()
	r.prunePins(r.lane.Load())
}

// A reader lists the segments it pins, while it holds its role; the
// writer names by identity only blocks of its own pool in them. Another
// reader that takes the role lists its own (none), and a reader that
// closes unlists its.
func TestWayListsPinnedSegments(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, mem := wayPair(t)
	pool := shm.DefaultPool()
	a, err := pool.Alloc(4 << 10)
	require.NoError(t, err)
	defer a.Release()
	other, err := pool.Alloc(32 << 20) // a segment of its own
	require.NoError(t, err)
	defer other.Release()
	got := receivedCopy(t, a)
	defer got.Release()
	assert.False(t, w.Maps(a), "nothing is pinned yet")

	takeRoles(t, ctx, w, r, func() { r.Pin(a.Segment().ID()) })
	assert.True(t, w.Maps(a), "a block of a pinned segment")
	assert.False(t, w.Maps(other), "a block of another segment")
	assert.False(t, w.Maps(got), "a block this process received, not produced")
	assert.False(t, r.Maps(a), "a reader's Way writes nothing")

	// Another reader of the end takes the role over: the list is its.
	r2 := another(t, r, mem, false)
	r.LetGo()
	require.NoError(t, w.Send(ctx, []byte{2}, nil))
	m, err := r2.Recv(ctx)
	require.NoError(t, err)
	m.Done()
	assert.False(t, w.Maps(a), "the new reader pins nothing")
	require.NoError(t, r2.Close())

	// The first takes it back, its pins listed again; closing, it
	// unlists them.
	require.NoError(t, w.Send(ctx, []byte{3}, nil))
	m, err = r.Recv(ctx)
	require.NoError(t, err)
	m.Done()
	assert.True(t, w.Maps(a), "the pins are the reader's, listed again with its role")
	r.LetGo()
	require.NoError(t, r.Close())
	assert.False(t, w.Maps(a), "a closed reader's pins are unlisted")
}

// The writer returns a block's loan once the reader has done with the
// entry that named it, not before, and every loan once no reader pins:
// no process that took the reader's role has its end open.
func TestWayLoansFollowAcks(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := wayPair(t)
	pool := shm.DefaultPool()
	takeRoles(t, ctx, w, r, nil)

	lend := func() {
		b, err := pool.Alloc(4 << 10)
		require.NoError(t, err)
		require.NoError(t, b.Lend())
		require.NoError(t, w.SendLent(ctx, []byte{9}, nil, []*shm.Block{b}))
		require.NoError(t, b.Release()) // parked: lent
	}
	small := func() { require.NoError(t, w.Send(ctx, []byte{1}, nil)) } // and settles
	lend()
	lend()
	assert.Equal(t, 2, pool.InUse(), "lent")
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	small()
	assert.Equal(t, 2, pool.InUse(), "the reader has not done with the first entry")
	m.Done()
	small()
	assert.Equal(t, 1, pool.InUse(), "the reader has done with the first entry, not the second")

	require.NoError(t, r.Close())
	time.Sleep(2 * peerCheck)
	small()
	assert.Equal(t, 0, pool.InUse(), "no reader pins: every loan is returned")
}

// Warm, which a writer calls as it begins a message, touches the lane's
// memory only while the Way holds the writer's role and its lane is
// mapped: on a reader, on a writer with no lane yet, while another
// goroutine closes the writer (the race detector watches the lane's
// mapping), and once it is closed, it asks for nothing and faults on
// nothing.
func TestWayWarmOnlyWhileTheLaneIsMapped(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, fair := range []bool{false, true} {
		var w, r *Way
		if fair {
			w, r, _ = fairPair(t)
		} else {
			w, r, _ = wayPair(t)
		}
		w.Warm() // no lane yet
		require.NoError(t, w.Send(ctx, wayMsg(0, 8), nil))
		recvWay(t, ctx, r)
		r.Warm() // a reader sends nothing
		w.Warm()
		require.NoError(t, w.Send(ctx, wayMsg(1, 8), nil))
		i, byLane := recvWay(t, ctx, r)
		require.Equal(t, 1, i)
		require.True(t, byLane || fair, "a pipe's lane carries it") // a queue's, to a waiting reader only
		assert.Equal(t, byLane, w.byLane.Load(), "the writer knows which way its last message went (fair %v)", fair)
		if fair {
			got := recvLater(ctx, r)
			waitsOnLane(t, r) // a waiting reader: the lane takes it
			require.NoError(t, w.Send(ctx, wayMsg(2, 8), nil))
			g := <-got
			require.NoError(t, g.err)
			require.True(t, g.byLane)
			assert.True(t, w.byLane.Load())
		}
		warming, closed, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
		go func() {
			defer close(done)
			close(warming)
			for {
				select {
				case <-closed:
					return
				default:
					w.Warm()
				}
			}
		}()
		<-warming
		require.NoError(t, w.Close())
		close(closed)
		<-done
		w.Warm()
		require.NoError(t, r.Close())
	}
}

// A writer's loans are settled without a Send, each time loans are out
// again, and by a closed writer.
func TestWayLoansSettleIdleAndClosed(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := shm.DefaultPool()
	for _, closed := range []bool{false, true} {
		w, r, mem := wayPair(t)
		takeRoles(t, ctx, w, r, nil)
		pinner, err := shm.ShareByte(mem, pinnerByte)
		require.NoError(t, err)
		for round := range 2 {
			b, err := pool.Alloc(4 << 10)
			require.NoError(t, err)
			require.NoError(t, b.Lend())
			require.NoError(t, w.SendLent(ctx, []byte{9}, nil, []*shm.Block{b}))
			require.NoError(t, b.Release())
			if closed {
				require.NoError(t, w.Close())
			}
			time.Sleep(3 * settleEvery) // the timer finds the loan out, and comes back
			assert.Equal(t, 1, pool.InUse(), "a writer keeps its loans until the reader is done (closed: %v)", closed)
			m, err := r.Recv(ctx)
			require.NoError(t, err)
			m.Done()
			require.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, time.Millisecond,
				"acked, the loan is returned (closed: %v, round %d)", closed, round)
			if closed {
				break
			}
		}
		require.NoError(t, pinner.Close())
	}
}

// The reader's page is the reader's to write, and the writer reads it as
// a hint: a list rewritten for ever, counts beyond the table, identities
// of other files, make Maps false or name a segment this process does not
// pin; an ack written ahead returns loans early, which only the reader's
// own messages pay for. Nothing faults, hangs or leaks.
func TestWayHostileReadersPage(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, mem := wayPair(t)
	pool := shm.DefaultPool()
	a, err := pool.Alloc(4 << 10)
	require.NoError(t, err)
	defer a.Release()
	takeRoles(t, ctx, w, r, nil)
	l, err := OpenLane(mem)
	require.NoError(t, err)
	defer l.Close()

	l.setReaderID(pinTable, a.Segment().ID())
	l.readerWord(pinCount).Store(1)
	l.readerWord(pinSeq).Store(7) // odd: being rewritten, for ever
	assert.False(t, w.Maps(a), "a list being rewritten names nothing")
	l.readerWord(pinSeq).Store(8)
	assert.True(t, w.Maps(a), "once rewritten")
	l.readerWord(pinSeq).Store(9)
	l.readerWord(pinCount).Store(^uint32(0))
	for i := range maxPins {
		l.setReaderID(pinTable+16*i, shm.ID{Dev: uint64(i), Ino: ^uint64(0)})
	}
	assert.False(t, w.Maps(a), "a count beyond the table reads the table")
	l.setReaderID(pinTable, a.Segment().ID())
	l.readerWord(pinSeq).Store(10)
	assert.True(t, w.Maps(a), "a listed segment, which the reader may not map: its loss")

	require.NoError(t, a.Lend())
	require.NoError(t, w.SendLent(ctx, []byte{9}, nil, []*shm.Block{a}))
	l.readerWord(pinAcked).Store(l.Sent() + 1000) // ahead of the lane
	pinner, err := shm.ShareByte(mem, pinnerByte)
	require.NoError(t, err)
	defer pinner.Close()
	require.NoError(t, w.Send(ctx, []byte{1}, nil))
	assert.Empty(t, w.ledger.out(), "acked ahead: returned")
	m, err := r.Recv(ctx)
	require.NoError(t, err)
	m.Done()
}

// The page's words sit in the lane's header, out of the way of the
// bells and of the entries.
func TestWayReadersPageLayout(t *testing.T) {
	assert.GreaterOrEqual(t, takenBell, sentBell+bellSize)
	assert.GreaterOrEqual(t, readerPage, takenBell+bellSize)
	assert.LessOrEqual(t, readerPage+pinTable+16*maxPins, laneHeader)
	assert.LessOrEqual(t, readerPage+laneMisses+4, laneHeader)
	assert.Zero(t, (readerPage+prodTable)%8, "identities load whole")
	assert.Zero(t, (readerPage+pinTable)%8, "identities load whole")
	seen := map[int]bool{}
	for _, w := range []struct{ off, size int }{{pinAcked, 4}, {readerWaits, 4}, {waitsAt, 4}, {sockSends, 4}, {readerAt, 8}} {
		at := readerPage + w.off
		assert.Zero(t, at%w.size, "the word at %d is aligned", at)
		assert.Equal(t, takenBell/64, (at+w.size-1)/64, "the word at %d ends on the taken count's line", at)
		for b := at; b < at+w.size; b++ {
			assert.False(t, seen[b], "byte %d of two words", b)
			seen[b] = true
		}
		assert.Equal(t, takenBell/64, at/64, "a reader's word at %d shares the taken count's line", at)
		assert.GreaterOrEqual(t, at, takenBell+bellOwn, "past the bell's own words")
	}
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	f := fd.New(p[0])
	defer f.Close()
	defer unix.Close(p[1])
	held, err := shm.ByteHeld(f, pinnerByte)
	assert.False(t, held && err == nil, "a pipe holds no lock")
}

// A reader holds a block it took by identity by its own lock, not by the
// writer's loan, which any holder of the lane could end by writing an ack
// ahead of the reader: the loan returned early, the block stays held.
func TestWayForgedAckLeavesReaderHeld(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, mem := wayPair(t)
	pool := shm.DefaultPool()
	b0, err := pool.Alloc(4 << 10)
	require.NoError(t, err)
	b, err := pool.Alloc(4 << 10)
	require.NoError(t, err)
	require.Equal(t, b0.Segment(), b.Segment())
	mapped := receivedCopy(t, b0) // this process maps the segment, as a reader that pins it
	defer mapped.Release()
	defer b0.Release()
	takeRoles(t, ctx, w, r, nil)
	require.NoError(t, b.Lend())
	require.NoError(t, w.SendLent(ctx, []byte{9}, nil, []*shm.Block{b}))
	require.NoError(t, w.Send(ctx, []byte{1}, nil))
	ref := shm.BlockRef{Seg: shm.SegmentRef{ID: b.Segment().ID(), Size: b.Segment().Size()}, Offset: b.Offset(), Size: b.Size(), Gen: b.Gen(), Ticket: -1}
	require.NoError(t, b.Release())

	m, err := r.Recv(ctx)
	require.NoError(t, err)
	taken, err := shm.Attach(ref) // as the decode of a lane's message does
	require.NoError(t, err)
	l, err := OpenLane(mem)
	require.NoError(t, err)
	defer l.Close()
	l.readerWord(pinAcked).Store(l.Sent() + 100) // another holder of the lane
	require.NoError(t, w.Send(ctx, []byte{1}, nil))
	assert.Empty(t, w.ledger.out(), "the forged ack returned the loan")
	time.Sleep(50 * time.Millisecond) // past the rotation of the ticket that mapped it
	assert.Equal(t, 2, pool.InUse(), "the reader's own locks hold both blocks")
	m.Done()
	for range 2 {
		m, err := r.Recv(ctx)
		require.NoError(t, err)
		m.Done()
	}
	require.NoError(t, taken.Release())
	assert.Eventually(t, func() bool { return pool.InUse() == 1 }, 5*time.Second, time.Millisecond)
}

// A process pins for a Way only while it holds the reader's role: another
// reader of the end lists nothing, and its receives name no block by
// identity.
func TestWayPinNeedsTheRole(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, mem := wayPair(t)
	a, err := shm.DefaultPool().Alloc(4 << 10)
	require.NoError(t, err)
	defer a.Release()
	got := receivedCopy(t, a)
	defer got.Release()
	takeRoles(t, ctx, w, r, nil)
	r2 := another(t, r, mem, false)
	// r2 takes the role once, and r takes it back.
	r.LetGo()
	require.NoError(t, w.Send(ctx, []byte{1}, nil))
	m, err := r2.Recv(ctx)
	require.NoError(t, err)
	m.Done()
	r2.LetGo()
	require.NoError(t, w.Send(ctx, []byte{1}, nil))
	m, err = r.Recv(ctx)
	require.NoError(t, err)
	m.Done()
	require.True(t, holds(r))
	r2.sem.lock() // as a receive of r2 would hold it
	r2.Pin(a.Segment().ID())
	pinned := r2.Pinned(a.Segment().ID())
	r2.sem.unlock()
	assert.False(t, pinned, "r2 does not hold the role")
	assert.False(t, w.Maps(a), "nor lists anything")
}

// The segments a reader pins are bounded, and one whose producer has let
// go of it is unpinned, and unlisted, at the reader's next pin or within
// its next idle look, the lane holding nothing untaken: its memory goes.
func TestWayPinsAreBoundedAndPruned(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := wayPair(t)
	r.pins.most = 2
	pool := shm.DefaultPool()
	var bs, got []*shm.Block
	for _, size := range []int64{4 << 10, 8 << 10, 16 << 10} { // a segment each
		b, err := pool.Alloc(size)
		require.NoError(t, err)
		bs = append(bs, b)
		got = append(got, receivedCopy(t, b))
	}
	takeRoles(t, ctx, w, r, func() {
		for _, b := range bs {
			r.Pin(b.Segment().ID())
		}
	})
	assert.True(t, w.Maps(bs[0]))
	assert.True(t, w.Maps(bs[1]))
	assert.False(t, w.Maps(bs[2]), "beyond the bound")

	// The producer lets go of the first segment.
	require.NoError(t, got[0].Release())
	require.NoError(t, bs[0].Release())
	require.Eventually(t, func() bool {
		pool.Trim(0)
		return !shm.Kept(bs[0].Segment().ID())
	}, 5*time.Second, 5*time.Millisecond)
	takeRoles(t, ctx, w, r, func() { r.Pin(bs[2].Segment().ID()) })
	assert.True(t, w.Maps(bs[1]))
	assert.True(t, w.Maps(bs[2]), "pinned in the room the first left")
	r.sem.lock()
	assert.False(t, r.Pinned(bs[0].Segment().ID()), "unpinned once its producer let go of it")
	r.sem.unlock()

	require.NoError(t, got[1].Release())
	require.NoError(t, bs[1].Release())
	require.Eventually(t, func() bool {
		pool.Trim(0)
		return !shm.Kept(bs[1].Segment().ID())
	}, 5*time.Second, 5*time.Millisecond)
	require.NoError(t, w.Send(ctx, []byte{1}, nil))
	m, err := r.Recv(ctx) // a receive within idleRole: the idle look prunes
	require.NoError(t, err)
	m.Done()
	assert.Eventually(t, func() bool {
		r.sem.lock()
		defer r.sem.unlock()
		return !r.Pinned(bs[1].Segment().ID())
	}, 5*time.Second, 10*time.Millisecond, "unpinned at an idle look")
	require.NoError(t, got[2].Release())
	require.NoError(t, bs[2].Release())
}

// A reader that lets go of its role idle keeps looking at its pins: one
// whose producer lets go of the segment afterwards, the lane holding
// nothing untaken, is unpinned though the reader receives nothing more;
// and the list in the lane's page, another reader's by then, stays as
// that reader wrote it.
func TestWayIdleReaderUnpinsWhatItsProducerLetGo(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, mem := wayPair(t)
	b, got := pinnedIdle(t, ctx, w, r)
	id := b.Segment().ID()
	time.Sleep(5 * r.pinLook) // looks that find the producer keeping it
	assert.True(t, pinsNow(r, id), "kept while its producer keeps it")

	// Another reader takes the role, and lists a segment of its own.
	r2 := another(t, r, mem, false)
	b2, err := shm.DefaultPool().Alloc(8 << 10) // a segment apart
	require.NoError(t, err)
	defer b2.Release()
	got2 := receivedCopy(t, b2)
	defer got2.Release()
	takeRoles(t, ctx, w, r2, func() { r2.Pin(b2.Segment().ID()) })
	l := r.lane.Load()
	r2.sem.lock()
	owner := r2.pins.owner
	r2.sem.unlock()

	require.NoError(t, got.Release())
	producerLetsGo(t, b)
	assert.Eventually(t, func() bool { return !pinsNow(r, id) }, 5*time.Second, 5*time.Millisecond,
		"unpinned with no receive, once its producer let go of it")
	assert.Equal(t, owner, l.readerWord(pinOwner).Load(), "the page is r2's")
	assert.Equal(t, uint32(1), l.readerWord(pinCount).Load(), "listing r2's pin")
}

// An idle reader without the role keeps a pin while entries sent before
// it saw the producer let go are untaken, whoever takes them; it unpins
// once another reader has taken them.
func TestWayIdleReaderKeepsPinForUntakenEntries(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, mem := wayPair(t)
	b, got := pinnedIdle(t, ctx, w, r)
	id := b.Segment().ID()
	for range 2 {
		require.NoError(t, w.Send(ctx, []byte{1}, nil)) // into the lane, for no reader now
	}
	require.NoError(t, got.Release())
	producerLetsGo(t, b)
	time.Sleep(10 * r.pinLook) // looks that see the entries untaken
	assert.True(t, pinsNow(r, id), "two entries sent before the producer let go are untaken")
	r2 := another(t, r, mem, false)
	for range 2 {
		m, err := r2.Recv(ctx)
		require.NoError(t, err)
		m.Done()
	}
	assert.Eventually(t, func() bool { return !pinsNow(r, id) }, 5*time.Second, 5*time.Millisecond, "unpinned once another reader took them")
}

// A Pipe's reader that let go of its role idle leaves its list in the
// lane's page, which its writer still names blocks for; LetGo, as the end
// is handed on, unlists it.
func TestWayLetGoAfterIdleUnlists(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := wayPair(t)
	b, got := pinnedIdle(t, ctx, w, r)
	defer b.Release()
	defer got.Release()
	require.True(t, w.Maps(b), "the list stays in the page")
	r.LetGo()
	assert.False(t, w.Maps(b), "unlisted as the end is handed on")
	assert.Equal(t, uint32(0), r.lane.Load().readerWord(pinCount).Load())
}

// LetGo on a reader that never took its role (its lane not mapped), and
// on a closed one, does nothing.
func TestWayLetGoBeforeTheRoleAndAfterClose(t *testing.T) {
	leakcheck.Check(t)
	_, r, _ := wayPair(t)
	r.LetGo()
	assert.False(t, holds(r))
	require.NoError(t, r.Close())
	r.LetGo()
}

// A reader that waits in a receive looks at its pins as it waits: a
// segment whose producer lets go of it is unpinned, and its mapping gone,
// before the receive ends; a queue's reader parked on the socket, a
// Pipe's parked reader, and a queue's reader without the role.
func TestWayWaitingReaderUnpinsWhatItsProducerLetGo(t *testing.T) {
	for _, c := range []string{"pipe", "queue", "queue-without-the-role"} {
		t.Run(c, func(t *testing.T) {
			leakcheck.Check(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			var w, r, mem = wayPair(t)
			if c != "pipe" {
				w, r, mem = fairPair(t)
			}
			b, got := pinOne(t, ctx, w, r)
			id := b.Segment().ID()
			require.NoError(t, got.Release()) // the pin alone maps it now
			if c == "queue-without-the-role" {
				// Another reader takes the role, and keeps it, waiting.
				r.LetGo()
				r2 := anotherFair(t, r, mem, false)
				require.NoError(t, w.Send(ctx, []byte{1}, nil))
				m, err := r2.Recv(ctx)
				require.NoError(t, err)
				m.Done()
				require.True(t, holds(r2))
				recvLater(ctx, r2)
				require.Eventually(t, func() bool { return r2.Waiting() > 0 }, 5*time.Second, time.Millisecond)
			}
			done := recvLater(ctx, r)
			require.Eventually(t, func() bool { return r.Waiting() > 0 }, 5*time.Second, time.Millisecond, "r waits")
			require.True(t, mapsInode(t, id.Ino), "mapped, as /proc/self/maps says")
			producerLetsGo(t, b)
			assert.Eventually(t, func() bool {
				shm.Trim()
				return !mapsInode(t, id.Ino)
			}, 5*time.Second, 5*time.Millisecond, "unpinned, and unmapped, while the receive waits")
			select {
			case g := <-done:
				t.Fatalf("the receive ended: %v", g.err)
			default:
			}
			if c == "queue-without-the-role" {
				require.NoError(t, w.Send(ctx, wayMsg(1, 0), nil)) // r2's
			}
			require.NoError(t, w.Send(ctx, wayMsg(2, 0), nil))
			within(t, done, "the receive took no message")
		})
	}
}

// LetGo from two goroutines at once hands on, and leaves nothing asked
// of the Way's next call: a receive after it keeps the role it takes.
func TestWayLetGoTwiceAtOnce(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := wayPair(t)
	takeRoles(t, ctx, w, r, nil)
	for i := range 200 {
		var wg sync.WaitGroup
		for range 2 {
			wg.Go(r.LetGo)
		}
		wg.Wait()
		require.False(t, holds(r), "round %d: handed on", i)
		r.handMu.Lock()
		asked := r.handOn
		r.handMu.Unlock()
		require.False(t, asked, "round %d: a hand-on left for nobody", i)
	}
	takeRoles(t, ctx, w, r, nil) // holds(r) after the receive's Done
}

// parkingWithPins returns a fair pair in their roles, its reader pinning
// a segment and parking on its socket after a millisecond on the lane,
// and a context for the test, after a look at what the test leaves.
func parkingWithPins(t *testing.T) (w, r *Way, ctx context.Context) {
	t.Helper()
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	w, r, _ = fairPair(t)
	b, got := pinOne(t, ctx, w, r)
	t.Cleanup(func() { _, _ = got.Release(), b.Release() })
	r.sem.lock()
	r.sleep = time.Millisecond
	r.sem.unlock()
	return w, r, ctx
}

// A queue's reader parked on its socket with pins, which waits in
// slices, ends its receive as its caller's context says: context.Canceled
// for a cancel, however it falls among the slices, and
// context.DeadlineExceeded at its deadline.
func TestWayParkedReceiveEndsAsItsCallerSays(t *testing.T) {
	w, r, ctx := parkingWithPins(t)
	r.sem.lock()
	r.pinLook = 20 * time.Microsecond // slices end all the time
	r.sem.unlock()
	const outlived = "the receive outlived its caller's context by seconds"
	for i := range 200 {
		c, stop := context.WithCancel(ctx)
		done := recvLater(c, r)
		time.Sleep(2*time.Millisecond + time.Duration(i%20)*10*time.Microsecond)
		stop()
		require.ErrorIs(t, endedWithin(t, done, outlived), context.Canceled, "cancel %d", i)
	}
	c, stop := context.WithTimeout(ctx, 50*time.Millisecond)
	defer stop()
	assert.ErrorIs(t, endedWithin(t, recvLater(c, r), outlived), context.DeadlineExceeded)
	require.NoError(t, w.Send(ctx, wayMsg(0, 0), nil)) // for a receive left waiting
}

// A parked receive whose caller cancels as a message comes either
// returns the message or leaves it for the next receive: each message is
// received once, however the cancel and the send fall.
func TestWayParkedCancelLosesNothing(t *testing.T) {
	w, r, ctx := parkingWithPins(t)
	seen := map[int]int{}
	recv := func(c context.Context) error {
		m, err := r.Recv(c)
		if err == nil {
			seen[int(binary.LittleEndian.Uint32(m.Data))]++
			m.Done()
		}
		return err
	}
	const n = 600
	for i := range n {
		c, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- recv(c) }()
		time.Sleep(2 * time.Millisecond)
		send := func() { assert.NoError(t, w.Send(ctx, wayMsg(i, 0), nil)) }
		spin := time.Duration(i%40) * 5 * time.Microsecond
		if i%2 == 0 {
			go send()
			for end := time.Now().Add(spin); time.Now().Before(end); {
			}
			stop()
		} else {
			stop()
			for end := time.Now().Add(spin); time.Now().Before(end); {
			}
			go send()
		}
		if err := <-done; err != nil {
			require.ErrorIs(t, err, context.Canceled)
		}
	}
	for {
		c, stop := context.WithTimeout(ctx, 300*time.Millisecond)
		err := recv(c)
		stop()
		if err != nil {
			break
		}
	}
	for i := range n {
		require.Equal(t, 1, seen[i], "message %d", i)
	}
}

// LetGo while a receive waits hands the end on as the receive ends: the
// reader lets go of its role and unlists its pins.
func TestWayLetGoDuringARecv(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := wayPair(t)
	b, got := pinOne(t, ctx, w, r)
	defer b.Release()
	defer got.Release()
	done := recvLater(ctx, r)
	require.Eventually(t, func() bool { return r.Waiting() > 0 }, 5*time.Second, time.Millisecond)
	r.LetGo() // the end is handed on
	require.True(t, w.Maps(b), "listed while the receive is under way")
	require.NoError(t, w.Send(ctx, wayMsg(1, 0), nil))
	within(t, done, "the receive took no message")
	assert.False(t, holds(r), "let go of its role as the receive ended")
	assert.False(t, w.Maps(b), "unlisted as the receive ended")
}

// mapsInode reports whether this process maps a file of inode ino.
func mapsInode(t *testing.T, ino uint64) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	want := strconv.FormatUint(ino, 10)
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) >= 5 && f[4] == want {
			return true
		}
	}
	return false
}

// The bytes a reader pins are bounded too, by the segments' mapped sizes.
func TestWayPinBytesAreBounded(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := wayPair(t)
	pool := shm.DefaultPool()
	var bs []*shm.Block
	for _, size := range []int64{4 << 10, 8 << 10} { // a segment each
		b, err := pool.Alloc(size)
		require.NoError(t, err)
		defer b.Release()
		got := receivedCopy(t, b)
		defer got.Release()
		bs = append(bs, b)
	}
	r.pins.mostBytes = bs[0].Segment().Size()
	takeRoles(t, ctx, w, r, func() {
		for _, b := range bs {
			r.Pin(b.Segment().ID())
		}
	})
	assert.True(t, w.Maps(bs[0]))
	assert.False(t, w.Maps(bs[1]), "beyond the bound of bytes")
}

// Maps, which a writer's encoding calls without the Way's receive or
// send, never reads a lane that Close has unmapped.
func TestWayMapsRacesClose(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a, err := shm.DefaultPool().Alloc(4 << 10)
	require.NoError(t, err)
	defer a.Release()
	for range 100 {
		w, r, _ := wayPair(t)
		takeRoles(t, ctx, w, r, nil)
		done := make(chan struct{})
		for range 2 {
			go func() {
				defer func() { done <- struct{}{} }()
				for range 200 {
					w.Maps(a)
				}
			}()
		}
		require.NoError(t, w.Close())
		<-done
		<-done
	}
}

// A writer blocked on a full lane settles its loans while it waits: the
// loans of a reader that closed come back though the writer never
// returns from its Send.
func TestWayBlockedWriterSettles(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := wayPair(t)
	pool := shm.DefaultPool()
	takeRoles(t, ctx, w, r, nil)
	b, err := pool.Alloc(4 << 10)
	require.NoError(t, err)
	require.NoError(t, b.Lend())
	require.NoError(t, w.SendLent(ctx, []byte{9}, nil, []*shm.Block{b}))
	require.NoError(t, b.Release())
	for range WayEntries - 1 {
		require.NoError(t, w.Send(ctx, []byte{1}, nil))
	}
	blocked, unblock := context.WithCancel(ctx)
	sent := make(chan error, 1)
	go func() { sent <- w.Send(blocked, []byte{1}, nil) }() // the lane is full
	time.Sleep(20 * time.Millisecond)
	require.Equal(t, 1, pool.InUse(), "lent")
	require.NoError(t, r.Close()) // no reader pins; its socket end stays open
	assert.Eventually(t, func() bool { return pool.InUse() == 0 }, 5*time.Second, 5*time.Millisecond,
		"the blocked writer returned the loan")
	unblock()
	assert.ErrorIs(t, <-sent, context.Canceled)
}

// A pin whose producer let go of its segment stays while the lane holds
// entries sent before the reader saw so (a killed producer's messages
// name it), and goes once the reader has taken them, later entries
// waiting or not.
func TestWayPinOutlivesEarlierEntries(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := wayPair(t)
	id := pinOfAGoneProducer(t, ctx, w, r)
	pinned := func() bool { return pinsNow(r, id) }
	take := func() {
		m, err := r.Recv(ctx)
		require.NoError(t, err)
		m.Done()
	}
	for range 2 {
		require.NoError(t, w.Send(ctx, []byte{1}, nil)) // sent before the reader looks
	}
	pruneNow(r) // sees the producer gone: marks the segment
	assert.True(t, pinned(), "two entries before the mark are untaken")
	take()
	require.NoError(t, w.Send(ctx, []byte{1}, nil)) // after the mark
	pruneNow(r)
	assert.True(t, pinned(), "one entry before the mark is untaken")
	take()
	pruneNow(r)
	assert.False(t, pinned(), "every entry before the mark is taken, one after it waiting")
	take()
}

// A writer's ledger returns the loans of the entries its reader has done
// with, in their order and each once, however many are out, and keeps the
// others out: those returned make room only once they are half of it, and
// not before (which would copy the loans out at every Send). Once no
// reader pins, the rest come back, whatever was returned before.
func TestLedgerReturnsEachLoanOnce(t *testing.T) {
	leakcheck.Check(t)
	mem, err := CreateWayLane()
	require.NoError(t, err)
	defer mem.Close()
	l, err := OpenLane(mem)
	require.NoError(t, err)
	defer l.Close()
	pinner, err := shm.ShareByte(mem, pinnerByte) // a reader pins: no loan comes back unacked
	require.NoError(t, err)
	defer pinner.Close()
	pool := shm.DefaultPool()
	before := pool.InUse()
	var g ledger
	const n = 100
	lend := func(from, to int) {
		for pos := from; pos < to; pos++ {
			b, err := pool.Alloc(4 << 10)
			require.NoError(t, err)
			require.NoError(t, b.Lend())
			require.NoError(t, b.Release()) // parked until its loan is returned
			require.True(t, g.lend(uint32(pos), []*shm.Block{b}))
		}
	}
	lend(0, n)
	require.Equal(t, before+n, pool.InUse())
	acked := l.readerWord(pinAcked)
	for _, upTo := range []uint32{10, 30, 31, 70, 71, 99, 100} {
		acked.Store(upTo)
		g.settle(l, mem, false, monoNow())
		out := g.out()
		require.Len(t, out, n-int(upTo))
		for i, o := range out {
			require.Equal(t, upTo+uint32(i), o.pos, "the loans out, in their entries' order")
		}
		assert.Equal(t, before+n-int(upTo), pool.InUse(), "acked up to %d: each of those returned", upTo)
		assert.True(t, 2*g.returned < len(g.loans) || len(g.loans) == 0, "%d of %d returned: not moved out of the way", g.returned, len(g.loans))
		if upTo == 10 {
			assert.Equal(t, 10, g.returned, "fewer than half returned: left in place")
		}
	}

	// Some returned, then no reader pins: the rest come back.
	lend(n, n+20)
	acked.Store(n + 5)
	g.settle(l, mem, false, monoNow())
	require.Equal(t, 5, g.returned)
	require.NoError(t, pinner.Close())
	g.settle(l, mem, true, monoNow())
	assert.Empty(t, g.out())
	assert.Equal(t, before, pool.InUse(), "every loan returned")
	lend(n+20, n+21)
	assert.Len(t, g.out(), 1, "the ledger lends again")
	g.returnAll()
	assert.Equal(t, before, pool.InUse())
}

// A pin whose producer let go of its segment stays while the lane is
// full of entries sent before the reader saw so: a mark a whole lane's
// length ahead of what was taken is a mark an honest writer makes, not
// one to give up on. The pin goes once they are taken.
func TestWayPinOutlivesAFullLane(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, r, _ := wayPair(t)
	id := pinOfAGoneProducer(t, ctx, w, r)
	l := r.lane.Load()
	for range l.entries {
		require.NoError(t, w.Send(ctx, []byte{1}, nil)) // sent before the reader looks
	}
	require.Equal(t, l.entries, l.Sent()-l.Taken(), "the lane is full")
	pruneNow(r) // sees the producer gone: marks the segment a lane ahead
	assert.True(t, pinsNow(r, id), "a whole lane of entries before the mark is untaken")
	for range l.entries {
		m, err := r.Recv(ctx)
		require.NoError(t, err)
		m.Done()
	}
	pruneNow(r)
	assert.False(t, pinsNow(r, id), "every entry before the mark is taken")
}

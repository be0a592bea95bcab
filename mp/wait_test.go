package mp_test

import (
	"bufio"
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/mp"
)

// threads is the number of threads of this process.
func threads(t *testing.T) int {
	t.Helper()
	f, err := os.Open("/proc/self/status")
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "Threads:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			require.NoError(t, err)
			return n
		}
	}
	t.Fatal("no Threads line in /proc/self/status")
	return 0
}

// raiseFDLimit lifts the soft descriptor limit to at least n for the
// test, skipping it where the hard limit is lower.
func raiseFDLimit(t *testing.T, n uint64) {
	t.Helper()
	var old unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &old))
	if old.Cur >= n {
		return
	}
	if old.Max < n {
		t.Skipf("needs %d descriptors; the hard limit is %d", n, old.Max)
	}
	raised := old
	raised.Cur = n
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &raised))
	t.Cleanup(func() { _ = unix.Setrlimit(unix.RLIMIT_NOFILE, &old) })
}

// A thousand goroutines blocked in Get on a thousand queues are parked
// goroutines, not threads; each wakes when its queue gets a message, or at
// once when its context is cancelled.
func TestThousandBlockedGetsHoldFewThreads(t *testing.T) {
	const n = 1000
	raiseFDLimit(t, 6*n) // a queue's two socket ends and two of its lane, and room
	leakcheck.Check(t)
	queues := make([]*mp.Queue, n)
	for i := range queues {
		q, err := mp.NewQueue()
		require.NoError(t, err)
		queues[i] = q
		defer q.Close()
	}
	before := threads(t)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errs := make([]error, n)
	got := make([]int, n)
	done := make([]chan struct{}, n)
	for i, q := range queues {
		done[i] = make(chan struct{})
		go func() {
			defer close(done[i])
			errs[i] = q.Get(ctx, &got[i])
		}()
	}
	waitFor(t, "every Get waits", func() bool {
		waiting := 0
		for _, q := range queues {
			gets, _ := mp.Waiting(q)
			waiting += gets
		}
		return waiting == n
	})
	blocked := threads(t)
	assert.Less(t, blocked-before, 50, "threads while %d Gets wait (%d before)", n, before)

	// The even ones get a message, and then the odd ones a cancellation.
	deadline := time.After(5 * time.Second)
	for i := 0; i < n; i += 2 {
		require.NoError(t, queues[i].Put(context.Background(), i+1))
	}
	for i := 0; i < n; i += 2 {
		select {
		case <-done[i]:
		case <-deadline:
			t.Fatalf("Get %d still blocked 5 s after its message", i)
		}
	}
	for i := 1; i < n; i += 2 {
		select {
		case <-done[i]:
			t.Fatalf("Get %d returned without a message or a cancellation: %v", i, errs[i])
		default:
		}
	}
	cancel()
	for i := 1; i < n; i += 2 {
		select {
		case <-done[i]:
		case <-deadline:
			t.Fatalf("Get %d still blocked after its cancellation", i)
		}
	}
	for i := range n {
		if i%2 == 0 {
			if assert.NoError(t, errs[i], "Get %d", i) {
				assert.Equal(t, i+1, got[i], "Get %d", i)
			}
		} else {
			assert.ErrorIs(t, errs[i], context.Canceled, "Get %d", i)
		}
	}
}

// waitFor waits until cond holds: the state a test goes on from, which
// it confirms instead of sleeping for it.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	require.Eventually(t, cond, 10*time.Second, time.Millisecond, "never: %s", what)
}

// A Put blocked on a full queue goes on when Gets make room, and returns at
// once when its context is cancelled or the queue closed. (A socket says it
// has room once three quarters of its buffer are free, so the Gets take
// every message queued.)
func TestPutBlockedOnAFullQueue(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	blob := make([]byte, 32<<10)
	fill := func() int {
		for n := range 10000 {
			if err := q.TryPut(context.Background(), blob); err != nil {
				require.ErrorIs(t, err, mp.ErrFull)
				return n
			}
		}
		t.Fatal("the queue never filled")
		return 0
	}
	full := fill()
	require.Greater(t, full, 0)

	putBlocks := func() {
		t.Helper()
		waitFor(t, "the Put waits for room", func() bool {
			_, puts := mp.Waiting(q)
			return puts == 1
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- q.Put(ctx, blob) }()
	putBlocks()
	cancel()
	select {
	case err := <-errc:
		assert.ErrorIs(t, err, context.Canceled)
	case <-time.After(5 * time.Second):
		t.Fatal("a cancelled Put is still blocked")
	}

	go func() { errc <- q.Put(context.Background(), blob) }()
	putBlocks()
	var b []byte
	for range full {
		require.NoError(t, q.Get(context.Background(), &b))
	}
	select {
	case err := <-errc:
		assert.NoError(t, err, "Gets made room")
	case <-time.After(5 * time.Second):
		t.Fatal("a Put is still blocked after Gets made room")
	}

	fill()

	go func() { errc <- q.Put(context.Background(), blob) }()
	putBlocks()
	require.NoError(t, q.Close())
	select {
	case err := <-errc:
		assert.ErrorIs(t, err, mp.ErrClosed)
	case <-time.After(5 * time.Second):
		t.Fatal("a Put is still blocked after Close")
	}
}

// A message and a cancellation racing a Get that waits in the kernel lose
// nothing: the Get returns the message, or the cancellation, and then the
// message is still queued for the next Get.
func TestGetRacingCancelLosesNothing(t *testing.T) {
	leakcheck.Check(t)
	q, err := mp.NewQueue()
	require.NoError(t, err)
	defer q.Close()
	cancelled := 0
	for i := range 300 {
		ctx, cancel := context.WithCancel(context.Background())
		var got int
		errc := make(chan error, 1)
		go func() { errc <- q.Get(ctx, &got) }()
		time.Sleep(time.Duration(i%8) * 100 * time.Microsecond) // before, in and after the receive call
		go cancel()
		require.NoError(t, q.Put(context.Background(), i+1))
		select {
		case err = <-errc:
		case <-time.After(10 * time.Second):
			t.Fatalf("Get %d still blocked after a message and a cancellation", i)
		}
		if err != nil {
			require.ErrorIs(t, err, context.Canceled, "Get %d", i)
			cancelled++
			require.NoError(t, q.Get(context.Background(), &got), "the message of Get %d", i)
		}
		require.Equal(t, i+1, got, "Get %d", i)
		cancel()
	}
	t.Logf("%d of 300 Gets were cancelled first", cancelled)
}

//go:build linux

package sock

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leakcheck"
)

// inBlockingReceive waits until a receive on c is blocked in the receive
// call itself, its thread published for signals.
func inBlockingReceive(t *testing.T, c *Conn) {
	t.Helper()
	require.Eventually(t, func() bool {
		sl := c.rwait.Load()
		return sl != nil && sl.current() != 0
	}, 5*time.Second, 100*time.Microsecond, "the receive never blocked in the kernel")
	time.Sleep(time.Millisecond) // from published to inside the call
}

// A receive blocked in the receive call wakes for a message, and for close
// and cancellation by a signal to its thread: the socket's receive timeout
// is an hour here, so only the signal can end those waits in time.
func TestBlockingReceiveIsInterrupted(t *testing.T) {
	leakcheck.Check(t)
	blocked := func(t *testing.T) (*Conn, int) {
		c, raw := rawPair(t)
		t.Cleanup(func() { _ = unix.Close(raw) })
		require.True(t, c.recvBlock, "a socket pair's end receives in the receive call")
		hour := unix.NsecToTimeval(int64(time.Hour))
		require.NoError(t, unix.SetsockoptTimeval(c.sock.Num(), unix.SOL_SOCKET, unix.SO_RCVTIMEO, &hour))
		return c, raw
	}
	recv := func(ctx context.Context, c *Conn) <-chan error {
		errc := make(chan error, 1)
		go func() {
			m, err := c.Recv(ctx)
			if err == nil {
				assert.Equal(t, []byte("hello"), m.Data)
				assert.Zero(t, m.FDs.Len())
				m.Done()
			}
			errc <- err
		}()
		return errc
	}
	hello := append(make([]byte, headerLen), "hello"...) // a frame with no descriptors
	returns := func(t *testing.T, errc <-chan error, raw int) error {
		t.Helper()
		select {
		case err := <-errc:
			return err
		case <-time.After(10 * time.Second):
			_ = unix.Sendmsg(raw, hello, nil, nil, 0) // so that the test can end
			t.Fatal("the receive is still blocked")
			return nil
		}
	}

	t.Run("message", func(t *testing.T) {
		c, raw := blocked(t)
		errc := recv(context.Background(), c)
		inBlockingReceive(t, c)
		assert.Equal(t, 1, c.Waiting(), "a receive blocked in the call waits")
		require.NoError(t, unix.Sendmsg(raw, hello, nil, nil, 0))
		assert.NoError(t, returns(t, errc, raw))
		assert.Zero(t, c.Waiting())
	})
	t.Run("close", func(t *testing.T) {
		c, raw := blocked(t)
		errc := recv(context.Background(), c)
		inBlockingReceive(t, c)
		closed := make(chan error, 1)
		go func() { closed <- c.Close() }() // waits for the receive to return
		assert.ErrorIs(t, returns(t, errc, raw), ErrClosed)
		assert.NoError(t, <-closed)
	})
	t.Run("cancel", func(t *testing.T) {
		c, raw := blocked(t)
		ctx, cancel := context.WithCancel(context.Background())
		errc := recv(ctx, c)
		inBlockingReceive(t, c)
		cancel()
		assert.ErrorIs(t, returns(t, errc, raw), context.Canceled)

		// The connection goes on: the next receive gets the next message.
		require.NoError(t, unix.Sendmsg(raw, hello, nil, nil, 0))
		assert.NoError(t, returns(t, recv(context.Background(), c), raw))
	})
	t.Run("cancel after receives on the same context", func(t *testing.T) {
		// The context is watched once, from the first receive that waits
		// with it, and still interrupts the last.
		c, raw := blocked(t)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		for range 3 {
			errc := recv(ctx, c)
			inBlockingReceive(t, c)
			require.NoError(t, unix.Sendmsg(raw, hello, nil, nil, 0))
			require.NoError(t, returns(t, errc, raw))
		}
		errc := recv(ctx, c)
		inBlockingReceive(t, c)
		cancel()
		assert.ErrorIs(t, returns(t, errc, raw), context.Canceled)
	})
	t.Run("a context cancelled after its receive leaves the next alone", func(t *testing.T) {
		// The cancel comes as the next receive begins (as a caller's
		// deferred cancel does), or while it waits.
		c, raw := blocked(t)
		for _, next := range []context.Context{context.Background(), t.Context()} {
			for _, early := range []bool{true, false} {
				ctx, cancel := context.WithCancel(context.Background())
				errc := recv(ctx, c)
				inBlockingReceive(t, c)
				require.NoError(t, unix.Sendmsg(raw, hello, nil, nil, 0))
				require.NoError(t, returns(t, errc, raw))

				if early {
					cancel()
				}
				errc = recv(next, c)
				inBlockingReceive(t, c)
				cancel()
				time.Sleep(50 * time.Millisecond) // for the context's callbacks
				sl := c.rwait.Load()
				assert.True(t, sl != nil && sl.current() != 0, "the next receive was interrupted by the last one's context")
				require.NoError(t, unix.Sendmsg(raw, hello, nil, nil, 0))
				require.NoError(t, returns(t, errc, raw))
			}
		}
	})
}

// A watch of the other end's close (watchGone) runs at the next event of
// the socket, which a parked caller's readiness may be, after which it is
// armed again by the next watchGone, and then runs at the close.
func TestConnWatchGoneAgainAfterAnotherEvent(t *testing.T) {
	pair, err := Pair()
	require.NoError(t, err)
	a, err := New(pair[0], "pipe")
	require.NoError(t, err)
	defer a.Close()
	b, err := New(pair[1], "pipe")
	require.NoError(t, err)
	defer b.Close()
	ran := make(chan struct{}, 8)
	f := func() { ran <- struct{}{} }
	key := new(int)
	require.NoError(t, b.watchGone(key, f))

	// A caller parked for a message, which comes: the one event of
	// the registration, which the watch runs at too.
	ready, err := b.park.arm(b.sock.Num(), unix.POLLIN)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, a.Send(ctx, []byte("x"), nil))
	select {
	case <-ready:
	case <-ctx.Done():
		t.Fatal("the parked caller was not told")
	}
	select {
	case <-ran:
	case <-ctx.Done():
		t.Fatal("the watch did not run at the event")
	}

	// Watched again, it runs at the other end's close.
	require.NoError(t, b.watchGone(key, f))
	require.NoError(t, a.Close())
	select {
	case <-ran:
	case <-ctx.Done():
		t.Fatal("the watch did not run at the close")
	}
	b.unwatchGone(key)
}

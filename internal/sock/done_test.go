//go:build linux

package sock

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Done closes the descriptors of a message that nobody took, direct and
// carried, of a spilled message too.
func TestDoneClosesWhatNobodyTook(t *testing.T) {
	for _, n := range []int{1, maxFDs + 5} {
		a, err := Pair()
		require.NoError(t, err)
		send, err := New(a[0], "s")
		require.NoError(t, err)
		recv, err := New(a[1], "r")
		require.NoError(t, err)
		var ps []int
		for range n {
			var p [2]int
			require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
			ps = append(ps, p[0])
			defer unix.Close(p[1])
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		require.NoError(t, send.Send(ctx, make([]byte, 100<<10), ps)) // spilled, maybe carried
		for _, p := range ps {
			unix.Close(p)
		}
		m, err := recv.Recv(ctx)
		cancel()
		require.NoError(t, err)
		require.Equal(t, n, m.FDs.Len())
		var got []int
		for i := range n {
			raw, err := m.FDs.Borrow(i)
			require.NoError(t, err)
			got = append(got, raw)
		}
		m.Done()
		for _, raw := range got {
			assert.ErrorIs(t, unix.FcntlFlock(uintptr(raw), unix.F_GETLK, &unix.Flock_t{Type: unix.F_RDLCK}), unix.EBADF, "fd %d still open after Done", raw)
		}
		_ = send.Close()
		_ = recv.Close()
	}
}

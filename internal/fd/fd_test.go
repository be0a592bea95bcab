//go:build linux

package fd_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

func TestCloseWaitsForLoans(t *testing.T) {
	raw := open(t)
	f := fd.New(raw)
	n, err := f.Lend()
	require.NoError(t, err)
	assert.Equal(t, raw, n)
	require.NoError(t, f.Close())
	assert.True(t, isOpen(raw), "a lent descriptor stays open through Close")
	_, err = f.Lend()
	assert.ErrorIs(t, err, fd.ErrClosed, "nothing is lent once Close was called")
	require.NoError(t, f.Return())
	assert.False(t, isOpen(raw), "the last Return closes it")
	assert.NoError(t, f.Close(), "closing twice is harmless")
}

func TestDisownAndDup(t *testing.T) {
	f := fd.New(open(t))
	d, err := f.Dup()
	require.NoError(t, err)
	n, _ := f.Lend()
	_, err = f.Disown()
	assert.Error(t, err, "a lent descriptor cannot be disowned")
	require.NoError(t, f.Return())
	raw, err := f.Disown()
	require.NoError(t, err)
	assert.Equal(t, n, raw)
	require.NoError(t, f.Close())
	assert.True(t, isOpen(raw), "Close after Disown leaves the descriptor to its new owner")
	require.NoError(t, unix.Close(raw))
	require.NoError(t, d.Close())
}

// A Close racing loans never closes a number while it is lent: if it did,
// the files opened meanwhile would take the number over.
func TestCloseRacingLoans(t *testing.T) {
	for range 200 {
		raw := open(t)
		var st unix.Stat_t
		require.NoError(t, unix.Fstat(raw, &st))
		f := fd.New(raw)
		var wg sync.WaitGroup
		var bad sync.Once
		wrong := false
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 50 {
					n, err := f.Lend()
					if err != nil {
						return
					}
					var now unix.Stat_t
					if unix.Fstat(n, &now) != nil || now.Ino != st.Ino || now.Rdev != st.Rdev {
						bad.Do(func() { wrong = true })
					}
					_ = f.Return()
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = f.Close()
			if other, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err == nil {
				defer unix.Close(other) // would reuse a freed number
			}
		}()
		wg.Wait()
		require.False(t, wrong, "a lent number referred to another file")
	}
}

// CloseAll closes runs of neighbouring descriptors in one call and the
// rest one by one, skips negative ones, and closes nothing else.
func TestCloseAll(t *testing.T) {
	var raws []int
	for range 6 {
		raw, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		require.NoError(t, err)
		raws = append(raws, raw)
	}
	// A run of two, then one alone, out of order; 2, 4 and 5 stay.
	fd.CloseAll([]int{raws[3], -1, raws[0], raws[1]})
	for i, raw := range raws {
		_, err := unix.FcntlInt(uintptr(raw), unix.F_GETFD, 0)
		if i == 2 || i >= 4 {
			assert.NoError(t, err, "descriptor %d is not the caller's to close", i)
			require.NoError(t, unix.Close(raw))
		} else {
			assert.ErrorIs(t, err, unix.EBADF, "descriptor %d is closed", i)
		}
	}
}

func TestOutOfDescriptors(t *testing.T) {
	assert.True(t, fd.OutOfDescriptors(fmt.Errorf("opening: %w", unix.EMFILE)))
	assert.True(t, fd.OutOfDescriptors(unix.ENFILE))
	assert.False(t, fd.OutOfDescriptors(unix.ENOMEM))
}

func TestNumAndCloseEach(t *testing.T) {
	a, b := open(t), open(t)
	fa, fb := fd.New(a), fd.New(b)
	assert.Equal(t, a, fa.Num())
	assert.Equal(t, b, fb.Num())
	assert.Equal(t, -1, (*fd.FD)(nil).Num(), "a nil FD has no number")

	n, err := fb.Lend()
	require.NoError(t, err)
	fd.CloseEach([]*fd.FD{fa, nil, fb})
	assert.False(t, isOpen(a), "closed")
	assert.True(t, isOpen(n), "a lent one waits for its loan")
	require.NoError(t, fb.Return())
	assert.False(t, isOpen(b))
}

//go:build linux

package leakcheck_test

import (
	"fmt"
	"os"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/shm"
)

// recorder stands in for a test: it collects cleanups and errors instead
// of failing the real test.
type recorder struct {
	testing.TB
	cleanups []func()
	errs     []string
}

func (r *recorder) Helper()          {}
func (r *recorder) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }
func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}
func (r *recorder) Fatalf(format string, args ...any) { r.Errorf(format, args...) }

func (r *recorder) finish() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

func TestCleanRunPasses(t *testing.T) {
	r := &recorder{TB: t}
	leakcheck.Check(r)
	f, err := os.Open(os.DevNull)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	r.finish()
	assert.Empty(t, r.errs)
}

func TestFindsLeaks(t *testing.T) {
	r := &recorder{TB: t}
	leakcheck.Check(r)
	f, err := os.Open(os.DevNull)
	require.NoError(t, err)
	a, err := shm.Create(4096, shm.RefCount)
	require.NoError(t, err)
	r.finish()
	require.Len(t, r.errs, 3, "%q", r.errs)
	assert.Contains(t, r.errs[0], "descriptors leaked")
	assert.Contains(t, r.errs[0], os.DevNull)
	assert.Contains(t, r.errs[1], "1 more segment mappings")
	assert.Contains(t, r.errs[2], a.Name())
	require.NoError(t, f.Close())
	require.NoError(t, a.Release())
}

// An eventfd or an epoll descriptor the test leaks is reported too: only
// the ones recorded as lifelong (fd.Lifelong) are excused, not every
// anonymous inode.
func TestFindsLeakedAnonInodes(t *testing.T) {
	for name, open := range map[string]func() (int, error){
		"eventfd": func() (int, error) { return unix.Eventfd(0, unix.EFD_CLOEXEC) },
		"epoll":   func() (int, error) { return unix.EpollCreate1(unix.EPOLL_CLOEXEC) },
	} {
		t.Run(name, func(t *testing.T) {
			r := &recorder{TB: t}
			leakcheck.Check(r)
			fd, err := open()
			require.NoError(t, err)
			r.finish()
			require.NoError(t, unix.Close(fd))
			require.Len(t, r.errs, 1, "%q", r.errs)
			assert.Contains(t, r.errs[0], "descriptors leaked")
			assert.Contains(t, r.errs[0], "anon_inode:")
		})
	}
}

// A descriptor a package keeps for the process's life is not counted,
// so that a count taken before the package's first use and one after
// agree; any other is.
func TestCountLeavesOutLifelongDescriptors(t *testing.T) {
	base := leakcheck.Count()
	other, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	require.NoError(t, err)
	assert.Equal(t, base+1, leakcheck.Count(), "a descriptor opened")
	require.NoError(t, unix.Close(other))
	lifelong, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	require.NoError(t, err)
	fd.KeepForLife(lifelong) // open until the process exits
	assert.Equal(t, base, leakcheck.Count(), "a lifelong descriptor")
}

// released counts its releases.
type released struct{ n *int }

func (r released) Release() error { *r.n++; return nil }

// releasedInt counts its releases, a number that holds something.
type releasedInt int

var releasedInts atomic.Int64

func (releasedInt) Release() error { releasedInts.Add(1); return nil }

// closed counts its closes.
type closed struct{ n *int }

func (c *closed) Close() error { *c.n++; return nil }

func TestFreeReachesEveryHolder(t *testing.T) {
	var n int
	r := func() released { return released{&n} }
	c := func() *closed { return &closed{&n} }
	var nilCloser *closed
	for _, tc := range []struct {
		name string
		v    any
		want int
	}{
		{"a holder", r(), 1},
		{"a nil holder", nilCloser, 0},
		{"decoded", []any{r(), map[string]any{"a": c(), "b": nil}, map[any]any{1: []any{r()}}}, 3},
		{"a typed slice", []*closed{c(), nil, c()}, 2},
		{"an array", [2]released{r(), r()}, 2},
		{"a typed map", map[int][]released{1: {r()}, 2: {r(), r()}}, 3},
		{"a pointer to a slice", &[]*closed{c()}, 1},
		{"a nil pointer", (*[]released)(nil), 0},
		{"no holder", []int{1, 2}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n = 0
			leakcheck.Free(tc.v)
			assert.Equal(t, tc.want, n)
		})
	}
	t.Run("numbers that hold something", func(t *testing.T) {
		releasedInts.Store(0)
		leakcheck.Free([]releasedInt{1, 2})
		assert.Equal(t, int64(2), releasedInts.Load())
	})
}

package fd_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/internal/fd"
)

// A Set owns a message's descriptors until each is taken: Close closes
// the ones nobody took, and only those.
func TestSetOwnsWhatIsNotTaken(t *testing.T) {
	raws := []int{open(t), open(t), open(t), open(t)}
	s := fd.NewSet(raws)
	assert.Equal(t, 4, s.Len())
	assert.Equal(t, 4, s.Unused())

	n, err := s.Borrow(0)
	require.NoError(t, err)
	assert.Equal(t, raws[0], n, "a borrowed descriptor is the message's own")
	taken, err := s.Take(1)
	require.NoError(t, err)
	assert.True(t, s.Taken(1))
	assert.False(t, s.Taken(0))
	disowned, err := s.Disown(2)
	require.NoError(t, err)
	assert.Equal(t, raws[2], disowned)
	assert.Equal(t, 1, s.Unused(), "descriptor 3 is unused")

	s.Close()
	assert.False(t, isOpen(raws[0]), "borrowed, still the set's: closed")
	assert.False(t, isOpen(raws[3]), "unused: closed")
	assert.True(t, isOpen(raws[1]), "taken: the FD's")
	assert.True(t, isOpen(raws[2]), "disowned: the caller's")
	assert.Equal(t, 0, s.Len(), "closing empties the set")
	require.NoError(t, taken.Close())
	require.NoError(t, closeRaw(disowned))
}

// A descriptor named twice by a message is taken once and duplicated the
// second time, so that each owner closes its own.
func TestSetTakesTwiceByDuplicating(t *testing.T) {
	raw := open(t)
	s := fd.NewSet([]int{raw})
	a, err := s.Take(0)
	require.NoError(t, err)
	b, err := s.Take(0)
	require.NoError(t, err)
	assert.NotEqual(t, a.Num(), b.Num())
	s.Close()
	assert.True(t, isOpen(a.Num()))
	require.NoError(t, a.Close())
	assert.True(t, isOpen(b.Num()), "the duplicate outlives the first")
	require.NoError(t, b.Close())
}

// An index the message does not have is an error, and changes nothing.
func TestSetIndexOutOfRange(t *testing.T) {
	raw := open(t)
	s := fd.NewSet([]int{raw})
	for _, i := range []int{-1, 1} {
		_, err := s.Borrow(i)
		assert.ErrorContains(t, err, "out of range: the message has 1")
		_, err = s.Take(i)
		assert.Error(t, err)
		assert.False(t, s.Taken(i))
	}
	assert.Equal(t, 1, s.Unused())
	s.Close()
	assert.False(t, isOpen(raw))
}

// Move hands what a Set owns to a new one, whose descriptors survive the
// old one's reuse.
func TestSetMove(t *testing.T) {
	raws := []int{open(t), open(t)}
	s := fd.NewSet(raws)
	_, err := s.Borrow(0)
	require.NoError(t, err)
	m := s.Move()
	assert.Equal(t, 0, s.Len())
	s.Close() // owns nothing now
	s.Reset([]int{-1, -1})
	assert.True(t, isOpen(raws[0]))
	assert.Equal(t, 1, m.Unused(), "what was used stays used")
	m.Close()
	assert.False(t, isOpen(raws[0]))
	assert.False(t, isOpen(raws[1]))
	var none *fd.Set
	none.Close() // a nil Set owns nothing
}

func closeRaw(raw int) error { return fd.New(raw).Close() }

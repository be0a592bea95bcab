package reduction

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/shm"
)

// A decode's failure is the message's fault, and wraps ErrMalformed,
// unless the machine failed: out of descriptors, memory or shared-memory
// space is the receiver's own, and a caller that retries later must be
// able to tell.
func TestMalformedLeavesTheMachinesFailures(t *testing.T) {
	for _, err := range []error{unix.EMFILE, unix.ENFILE, unix.ENOMEM, unix.ENOSPC, shm.ErrNoSpace} {
		wrapped := fmt.Errorf("mapping a segment: %w", err)
		assert.NotErrorIs(t, malformed(wrapped), ErrMalformed, "%v", err)
		assert.Same(t, wrapped, malformed(wrapped))
	}
	bad := errors.New("descriptor index 3 out of range: the message has 1")
	got := malformed(bad)
	assert.ErrorIs(t, got, ErrMalformed)
	assert.ErrorIs(t, got, bad)
	assert.Equal(t, bad.Error(), got.Error(), "the text is the cause's")
	assert.NoError(t, malformed(nil))
}

package cpuid

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// A leaf past the top of its range is not asked: an Intel processor
// answers it with the highest basic leaf's bits, as this stand-in does.
func TestHasAsksNoLeafPastTheTop(t *testing.T) {
	intel := func(leaf, sub uint32) (a, b, c, d uint32) {
		switch {
		case leaf == 0:
			return 7, 0, 0, 0
		case leaf == 0x80000000:
			return 0x80000001, 0, 0, 0
		case leaf <= 7, leaf == 0x80000001:
			return 0, 0, 1 << 8, 0
		}
		return 0, ^uint32(0), ^uint32(0), ^uint32(0) // leaf 7's, say
	}
	assert.True(t, has(intel, 7, 0, ECX, 8))
	assert.True(t, has(intel, 0x80000001, 0, ECX, 8))
	assert.False(t, has(intel, 8, 0, EBX, 3), "a basic leaf past the top")
	assert.False(t, has(intel, 0x80000002, 0, ECX, 8), "an extended leaf past the top")
}

package cacheline_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/cacheline"
)

// WriteAhead faults on nothing and changes no byte: not for slices that
// end where the mapping does, before a page the process may not touch,
// nor for an empty or nil one.
func TestWriteAheadStaysInItsBytes(t *testing.T) {
	page := unix.Getpagesize()
	mem, err := unix.Mmap(-1, 0, 2*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer unix.Munmap(mem)
	require.NoError(t, unix.Mprotect(mem[page:], unix.PROT_NONE))
	for i := range page {
		mem[i] = byte(i)
	}
	for _, r := range [][2]int{{0, page}, {1, page}, {page - 1, page}, {page - 100, page}, {3, 67}, {0, 0}} {
		cacheline.WriteAhead(mem[r[0]:r[1]])
	}
	cacheline.WriteAhead(nil)
	for i := range page {
		require.Equal(t, byte(i), mem[i], "byte %d", i)
	}
}

// BenchmarkClearAfterWriteAhead clears 4 KiB blocks of a set larger than
// the caches, as a pool's tensors recycle them: each cleared at once, and
// each asked for one block ahead, while the one before is cleared.
func BenchmarkClearAfterWriteAhead(b *testing.B) {
	const block, blocks = 4 << 10, 16 << 10 // 64 MiB
	mem := make([]byte, block*blocks)
	at := func(i int) []byte { return mem[i%blocks*block:][:block] }
	b.Run("cold", func(b *testing.B) {
		i := 0
		for b.Loop() {
			clear(at(i))
			i += 7 // not the next, which the processor would fetch itself
		}
	})
	b.Run("asked-ahead", func(b *testing.B) {
		i := 0
		for b.Loop() {
			cacheline.WriteAhead(at(i + 7))
			clear(at(i))
			i += 7
		}
	})
}

// Package cacheline asks the processor for cache lines ahead of their
// use, without waiting for them: a line another CPU wrote last, or one
// that has left this CPU's caches, then moves while the caller does
// other work, not at its first load or store, which would wait for the
// move. Package sock asks for the lines of a lane that a message is about
// to use; package shm for the block its pool hands out next, which the
// tensor it becomes clears or fills.
//
// A request is a hint: it faults on nothing, changes no memory, and may
// be dropped (for a page not mapped yet, say). Where the processor has no
// such instruction (off amd64), it does nothing. Its only effect is on
// time, which benchmarks measure (BenchmarkClearAfterWriteAhead).
package cacheline

import "unsafe"

// Size is the length of a line, which every processor tensormp runs on
// has, in bytes.
const Size = 64

// ForWrite asks for the line at p in the state a write needs: for
// reading, where the processor cannot ask for that. It returns at once.
func ForWrite(p unsafe.Pointer) { forWrite(p) }

// ForRead asks for the line at p for reading, and returns at once.
func ForRead(p unsafe.Pointer) { forRead(p) }

// WriteAhead asks for every line of b for writing, from the first, and
// returns once it has asked for all of them: a few nanoseconds a line,
// which is for small memory about to be written whole (a 4 KiB block is
// 64 lines). Where the processor cannot ask for a line to write, it asks
// for nothing.
func WriteAhead(b []byte) {
	if len(b) == 0 {
		return
	}
	p := unsafe.Pointer(unsafe.SliceData(b))
	// The first line b touches to its last, which may start past b's
	// start plus a multiple of Size.
	lines := (uintptr(p)&(Size-1) + uintptr(len(b)) + Size - 1) / Size
	writeAhead(p, lines)
}

package shm

import (
	"fmt"
	"runtime/debug"
)

// Guard runs f, which reads or writes shared memory, on the calling
// goroutine with faults of memory access turned into an error wrapping
// ErrFault instead of a SIGBUS that ends the process. f must not start
// goroutines that touch the memory: each goroutine needs its own Guard.
// Any other panic of f passes through.
func Guard(f func()) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			fault, ok := r.(interface{ Addr() uintptr })
			if !ok {
				panic(r)
			}
			err = fmt.Errorf("%w (at %#x)", ErrFault, fault.Addr())
		}
	}()
	f()
	return nil
}

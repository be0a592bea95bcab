package tensor

import (
	"errors"
	"fmt"
	"runtime"
	"sync"

	"github.com/tensormp/tensormp/internal/shm"
)

// parallelCopyMin is the size from which copyBytes splits a copy across
// the available cores: one core copies about 7 GB/s here, two about 15.
const parallelCopyMin = 8 << 20

// copyBytes copies src into dst (as the built-in copy does), using every
// core the process may run on for large copies. Either may be shared
// memory: a fault is an error wrapping mmapalloc.ErrFault.
func copyBytes(dst, src []byte) error {
	n := min(len(dst), len(src))
	procs := runtime.GOMAXPROCS(0)
	if n < parallelCopyMin || procs < 2 {
		return shm.Guard(func() { copy(dst, src) })
	}
	chunk := (n/procs + 4095) &^ 4095
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	for off := 0; off < n; off += chunk {
		end := min(off+chunk, n)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := shm.Guard(func() { copy(dst[off:end], src[off:end]) }); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// touch runs f, which reads or writes the storages' memory, turning a
// fault of shared memory into an error: a peer can truncate a named
// segment under its mappings. Private memory needs no guard.
func touch(f func(), storages ...*Storage) error {
	for _, s := range storages {
		if s.IsShared() {
			if err := shm.Guard(f); err != nil {
				return fmt.Errorf("tensor: %v: %w", s, err)
			}
			return nil
		}
	}
	f()
	return nil
}

//go:build !linux

package shm

import (
	"syscall"

	"github.com/tensormp/tensormp/internal/fd"
)

// Create is not supported on this system.
func Create(size int64, flags Flags) (*Allocation, error) { return nil, ErrUnsupported }

// OpenFD is not supported on this system; it closes f, which it owns.
func OpenFD(f *fd.FD, size int64, flags Flags) (*Allocation, error) {
	_ = f.Close()
	return nil, ErrUnsupported
}

func openFD(fd int, size int64, flags Flags) (*Allocation, error) {
	_ = syscall.Close(fd)
	return nil, ErrUnsupported
}

// OpenName is not supported on this system.
func OpenName(name string, size int64, flags Flags) (*Allocation, error) {
	return nil, ErrUnsupported
}

// Reserve is not supported on this system.
func (a *Allocation) Reserve(off, n int64) error { return ErrUnsupported }

// Stat is not supported on this system.
func Stat(fd int) (SegmentRef, error) { return SegmentRef{}, ErrUnsupported }

// Release marks the Allocation released; none can be made on this system.
func (a *Allocation) Release() error {
	a.closed.Store(true)
	return nil
}

func (a *Allocation) dropRef() error { return nil }

// Remove does nothing on this system.
func (a *Allocation) Remove() error { return nil }

// SealedCopy is not supported on this system.
func SealedCopy(data []byte) (int, error) { return -1, ErrUnsupported }

// MapSealed is not supported on this system.
func MapSealed(fd int, n int64) ([]byte, error) { return nil, ErrUnsupported }

// Unmap does nothing on this system.
func Unmap(b []byte) error { return nil }

package shm

import (
	"errors"
	"syscall"

	"github.com/tensormp/tensormp/internal/fd"
)

// Sentinel errors. Errors returned by this package wrap them where they
// apply, so callers test with errors.Is; package mmapalloc exports those
// a user meets.
var (
	// ErrNoSpace: the shared-memory directory cannot hold the segment.
	// The error also wraps the ENOSPC the system returned.
	ErrNoSpace = errors.New("no space left in the shared-memory directory")
	// ErrBadName: a segment name that tensormp did not make.
	ErrBadName = errors.New("not a tensormp segment name")
	// ErrReleased: a RefCount segment whose last holder already released
	// it.
	ErrReleased = errors.New("segment already released by its last holder")
	// ErrUnsupported: shared segments are not implemented on this system.
	ErrUnsupported = errors.New("shared-memory segments are not supported on this system")
	// ErrClosed: the Allocation was closed.
	ErrClosed = errors.New("allocation closed")
	// ErrUnsealed: a descriptor received for a file_descriptor segment
	// whose size is not sealed, so that any holder could make the
	// others' mappings fault, or for a spilled message that its sender
	// could still change.
	ErrUnsealed = errors.New("segment is not sealed")
	// ErrFault: shared memory could not be read or written, because the
	// file behind it was cut short under the mapping. A peer that can
	// open a named (file_system) segment can do that; file_descriptor
	// segments are sealed against it.
	ErrFault = errors.New("shared memory faulted: its segment was truncated under the mapping")
	// ErrStaleBlock: a block whose generation differs from the
	// message's: it was recycled, which a correct sender never lets
	// happen while a message refers to it.
	ErrStaleBlock = errors.New("block recycled since the message was sent")
	// ErrNotMapped: a message named a block by its segment's identity
	// alone, as a lane's messages do, and this process does not map the
	// segment: the reader that kept it mapped for the lane handed the
	// lane on before it took the message.
	ErrNotMapped = errors.New("segment is not mapped by this process")
	// ErrNoExtent: a block of a segment whose slots hold their data
	// themselves, where one of an extent pool's was due, or the reverse.
	ErrNoExtent = errors.New("not a block of an extent pool")
)

// Error records a failed operation on shared memory: what was done to
// what, as fs.PathError does. Its message names no package: the package
// a user calls (mmapalloc, tensor, reduction) says where it failed.
type Error struct {
	Op   string // "create", "open", "map", "attach", ...
	Path string // what it was done to: a segment's path, "fd N", a block; "" for none
	Err  error
}

func (e *Error) Error() string {
	msg := e.Op + ": " + e.Err.Error()
	if e.Path != "" {
		msg = e.Op + " " + e.Path + ": " + e.Err.Error()
	}
	if fd.OutOfDescriptors(e.Err) {
		msg += " (out of file descriptors: " + fd.LimitHint + ")"
	}
	return msg
}

func (e *Error) Unwrap() error { return e.Err }

// Is makes a no-space error match ErrNoSpace as well as ENOSPC.
func (e *Error) Is(target error) bool {
	return target == ErrNoSpace && errors.Is(e.Err, syscall.ENOSPC)
}

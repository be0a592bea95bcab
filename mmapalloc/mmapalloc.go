package mmapalloc

import (
	"github.com/tensormp/tensormp/internal/shm"
)

// EnvDir names the environment variable that overrides the directory
// segments live in.
const EnvDir = "TENSORMP_SHM_DIR"

// DefaultDir is where segments live unless TENSORMP_SHM_DIR says otherwise;
// it is where glibc's shm_open puts them.
const DefaultDir = "/dev/shm"

// EnvSession names the environment variable that carries the session id
// from a parent to the processes it starts.
const EnvSession = "TENSORMP_SESSION"

// EnvCache names the environment variable that bounds, in bytes, the
// shared memory a process keeps for reuse after its tensors let go of it
// (default 1 GiB); Trim gives it back at once.
const EnvCache = "TENSORMP_SHM_CACHE"

// NamePrefix starts every segment name tensormp makes.
const NamePrefix = "tensormp_"

// Sentinel errors. Errors of this package, and those of the packages that
// share memory through it, wrap them where they apply: test with
// errors.Is.
var (
	// ErrNoSpace: the shared-memory directory cannot hold the segment.
	// The error also wraps the ENOSPC the system returned.
	ErrNoSpace = shm.ErrNoSpace
	// ErrBadName: a segment name that tensormp did not make.
	ErrBadName = shm.ErrBadName
	// ErrReleased: a RefCount segment whose last holder already released
	// it.
	ErrReleased = shm.ErrReleased
	// ErrUnsealed: a descriptor given to OpenFD is of a file that is not
	// sealed against resizing, so any of its holders could make the
	// mapping fault.
	ErrUnsealed = shm.ErrUnsealed
	// ErrClosed: the Allocation was released.
	ErrClosed = shm.ErrClosed
	// ErrFault: shared memory could not be read or written, because the
	// file behind it was cut short under the mapping (see Guard).
	ErrFault = shm.ErrFault
	// ErrStaleBlock: a message named a block of shared memory that its
	// producer recycled before the message was received.
	ErrStaleBlock = shm.ErrStaleBlock
	// ErrNotMapped: a message that came by a pipe's lane named a block
	// by its segment's identity alone, and this process neither maps the
	// segment nor made it: the process that did handed the pipe's end on,
	// or closed it, before it took the message.
	ErrNotMapped = shm.ErrNotMapped
	// ErrUnsupported: shared segments are not implemented on this
	// system.
	ErrUnsupported = shm.ErrUnsupported
)

// Dir returns the directory segments are created in and opened from:
// $TENSORMP_SHM_DIR, or DefaultDir.
func Dir() string { return shm.Dir() }

// Session returns this process's session id: inherited from
// TENSORMP_SESSION when a parent set it, else made at first use. It is
// part of every segment name, so that a session's segments can be found
// and removed together.
func Session() string { return shm.Session() }

// SessionPrefix returns the prefix of every segment name of this session,
// for example tensormp_7dbeea39762f_.
func SessionPrefix() string { return shm.SessionPrefix() }

// ValidName reports whether name is the name of a segment tensormp made.
// OpenName refuses any other before it reaches the file system.
func ValidName(name string) bool {
	n, ok := shm.ParseName(name)
	return ok && !n.Lock
}

// Guard runs f, which reads or writes shared memory, on the calling
// goroutine with faults of memory access turned into an error wrapping
// ErrFault instead of a SIGBUS that ends the process. f must not start
// goroutines that touch the memory: each goroutine needs its own Guard.
// Any other panic of f passes through.
func Guard(f func()) error { return shm.Guard(f) }

// Trim gives back to the system what this process keeps only for reuse:
// the unused segments of its pools and the mappings of received segments
// that no storage uses.
func Trim() { shm.Trim() }

package mmapalloc

import (
	"fmt"

	ifd "github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
)

// Flags say how a segment is created or opened and who keeps what. They
// follow the flags of torch's MapAllocator and Paddle's MemoryMapAllocation.
type Flags uint32

const (
	// SharedMem: the segment lives in the shared-memory directory
	// (Dir). Create always sets it.
	SharedMem Flags = 1 << iota
	// Exclusive: creating fails if the name exists (O_EXCL). Create
	// always sets it.
	Exclusive
	// NoCreate: open an existing segment, never create one. OpenName
	// always sets it.
	NoCreate
	// KeepFD: keep the descriptor open after mapping, owned by the
	// Allocation, so that the segment can be passed on by descriptor.
	KeepFD
	// FromFD: map a descriptor the caller hands over. OpenFD always
	// sets it.
	FromFD
	// Unlink: remove the segment's name once it is mapped. With KeepFD
	// this is the file_descriptor strategy: the segment is a memfd that
	// lives exactly as long as some process holds a descriptor or a
	// mapping of it.
	Unlink
	// RefCount: the segment starts with a 64-byte header holding a
	// reference count of the processes that have it mapped; the last
	// Release unlinks the name. This is the file_system strategy.
	RefCount
	// Memfd: the segment is anonymous shared memory (memfd_create),
	// sealed against shrinking and growing. Create sets it for Unlink;
	// callers never pass it.
	Memfd
)

func (f Flags) String() string { return shm.Flags(f).String() }

// Allocation is one mapping of a shared segment. It owns the mapping, the
// descriptor when KeepFD is set, and, for RefCount segments, one reference;
// Release gives all three back exactly once. An Allocation may be used from
// several goroutines; its Bytes are invalid after Release.
//
// An Allocation is memory of the caller's: a tensor storage made on one
// (tensor.NewStorage) counts as private, and sending it copies it into
// memory whose holders tensormp tracks.
type Allocation struct {
	a *shm.Allocation
}

func wrap(a *shm.Allocation, err error) (*Allocation, error) {
	if err != nil {
		return nil, wrapErr(err)
	}
	return &Allocation{a}, nil
}

// wrapErr says that err, an error of the implementation, which names the
// operation and the segment, comes from this package.
func wrapErr(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("mmapalloc: %w", err)
}

// Create makes a segment of size data bytes in Dir, under a new,
// unpredictable name, reserves its pages, and maps it. flags may add
// KeepFD, Unlink (with KeepFD) and RefCount. A directory that cannot hold
// the segment gives an error matching ErrNoSpace, and nothing is left
// behind on any error.
func Create(size int64, flags Flags) (*Allocation, error) {
	return wrap(shm.Create(size, shm.Flags(flags)))
}

// OpenFD maps the segment behind fd, which must be a regular file holding
// at least size bytes, sealed against shrinking and growing (ErrUnsealed
// otherwise). OpenFD takes ownership of fd in every case: it keeps it when
// flags has KeepFD and the call succeeds, and closes it otherwise.
func OpenFD(fd int, size int64, flags Flags) (*Allocation, error) {
	return wrap(shm.OpenFD(ifd.New(fd), size, shm.Flags(flags)))
}

// OpenName maps the existing segment name in Dir, which must hold at least
// size data bytes. name must be one tensormp made (ValidName); a path, a
// link or another program's file is refused. With RefCount it takes a
// reference that Release gives back, and fails with ErrReleased when the
// segment's last holder already let it go.
func OpenName(name string, size int64, flags Flags) (*Allocation, error) {
	return wrap(shm.OpenName(name, size, shm.Flags(flags)))
}

// Bytes returns the segment's data (after the header of a RefCount
// segment). The slice aliases the shared mapping: writes are seen by every
// process that maps the segment. It is nil after Release.
func (a *Allocation) Bytes() []byte { return a.a.Bytes() }

// Size returns the number of data bytes.
func (a *Allocation) Size() int64 { return a.a.Size() }

// Name returns the segment's name in Dir, or "" for one opened from a bare
// descriptor. A name that was unlinked is still reported.
func (a *Allocation) Name() string { return a.a.Name() }

// FD returns the descriptor the Allocation keeps (KeepFD), or -1. The
// descriptor stays owned by the Allocation and is closed by its Release:
// use the number only while the Allocation is surely open, and lend it
// with LendFD to pass it to another process.
func (a *Allocation) FD() int { return a.a.FD() }

// LendFD lends the kept descriptor, to a message that passes it to
// another process: the number stays open, and the same file, until
// ReturnFD, whatever Release does meanwhile.
func (a *Allocation) LendFD() (int, error) { return a.a.LendFD() }

// ReturnFD ends a LendFD.
func (a *Allocation) ReturnFD() { a.a.ReturnFD() }

// Flags returns the flags the Allocation was made with.
func (a *Allocation) Flags() Flags { return Flags(a.a.Flags()) }

// Sealed reports whether no holder of the segment can resize it under the
// others' mappings: a memfd is; a named segment is not.
func (a *Allocation) Sealed() bool { return a.a.Sealed() }

// Refs returns the reference count of a RefCount segment: how many
// mappings across all processes hold it. It is 0 for other segments.
func (a *Allocation) Refs() int32 { return a.a.Refs() }

// Release gives back the mapping, the kept descriptor and, for a RefCount
// segment, this mapping's reference; the last reference unlinks the name.
// Releasing twice returns nil.
func (a *Allocation) Release() error { return wrapErr(a.a.Release()) }

// Remove unlinks the segment's name, if it has one still; the mapping
// stays.
func (a *Allocation) Remove() error { return wrapErr(a.a.Remove()) }

func (a *Allocation) String() string { return a.a.String() }

package shm

import (
	"errors"
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

const (
	createFlags = KeepFD | Unlink | RefCount | sharedMem | exclusive | sparse
	openFDFlags = KeepFD | fromFD | sharedMem
	openFlags   = KeepFD | Unlink | RefCount | noCreate | sharedMem
)

// Create makes a new segment of size data bytes in Dir under a fresh,
// unpredictable name, reserves its pages, and maps it. flags may add
// KeepFD, Unlink (with KeepFD) and RefCount. A directory that cannot hold
// the segment gives an error matching ErrNoSpace, and nothing is left
// behind on any error.
func Create(size int64, flags Flags) (*Allocation, error) {
	flags |= sharedMem | exclusive
	if flags&^createFlags != 0 {
		return nil, &Error{Op: "create", Err: fmt.Errorf("flags %v not allowed (use OpenFD or OpenName)", flags&^createFlags)}
	}
	if flags&Unlink != 0 && flags&KeepFD == 0 {
		return nil, &Error{Op: "create", Err: errors.New("flag Unlink without KeepFD would leave the segment unreachable")}
	}
	if flags&Unlink != 0 && flags&RefCount != 0 {
		return nil, &Error{Op: "create", Err: errors.New("flag RefCount with Unlink: a RefCount segment is shared by name and cannot be unlinked at once")}
	}
	if flags&sparse != 0 && (flags&KeepFD == 0 || flags&RefCount != 0) {
		return nil, &Error{Op: "create", Err: errors.New("a sparse segment needs KeepFD, to reserve its ranges, and no RefCount header")}
	}
	total, err := totalSize(size, flags)
	if err != nil {
		return nil, &Error{Op: "create", Err: err}
	}

	if flags&Unlink != 0 {
		// A segment that travels by descriptor needs no name: anonymous
		// shared memory, sealed so that no holder can resize it under
		// the others' mappings, and not limited by the size of the
		// shared-memory directory (Docker's 64 MiB /dev/shm, say).
		return createMemfd(total, flags)
	}
	dir := Dir()
	var fd int
	var path string
	for tries := 0; ; tries++ {
		path = filepath.Join(dir, newName())
		fd, err = unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err == nil {
			break
		}
		if err == unix.EEXIST && tries < 8 {
			continue
		}
		return nil, &Error{Op: "create", Path: path, Err: err}
	}
	a, err := setUp(fd, path, total, flags, true)
	if err != nil {
		_ = unix.Unlink(path)
		return nil, err
	}
	return a, nil
}

// createMemfd makes a file_descriptor segment with memfd_create, sealed
// against shrinking and growing so that no holder can make another's
// mapping fault.
func createMemfd(total int64, flags Flags) (*Allocation, error) {
	name := newName()
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, &Error{Op: "memfd_create", Path: name, Err: err}
	}
	if err := unix.Fchmod(fd, 0o600); err != nil {
		_ = unix.Close(fd)
		return nil, &Error{Op: "chmod", Path: name, Err: err}
	}
	a, err := setUp(fd, "", total, flags|memfd, true)
	if err != nil {
		return nil, err
	}
	if _, err := unix.FcntlInt(uintptr(a.fd()), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		_ = a.closeMapping()
		return nil, &Error{Op: "seal", Path: name, Err: err}
	}
	return a, nil
}

// OpenFD maps the segment behind f, which must be a regular file holding
// at least size bytes, sealed against shrinking and growing (ErrUnsealed
// otherwise: any holder of an unsealed one could make this mapping fault).
// OpenFD takes f over in every case: the Allocation keeps its descriptor
// when flags has KeepFD and the call succeeds, and it is closed otherwise.
func OpenFD(f *fd.FD, size int64, flags Flags) (*Allocation, error) {
	raw, err := f.Disown()
	if err != nil { // lent: closed once the loan is returned
		_ = f.Close()
		return nil, &Error{Op: "open", Path: f.String(), Err: err}
	}
	return openFD(raw, size, flags)
}

// openFD is OpenFD for a descriptor this package holds by its number.
func openFD(fd int, size int64, flags Flags) (*Allocation, error) {
	flags |= fromFD | sharedMem
	if flags&^openFDFlags != 0 {
		_ = unix.Close(fd)
		return nil, &Error{Op: "open", Path: fmt.Sprintf("fd %d", fd), Err: fmt.Errorf("flags %v not allowed", flags&^openFDFlags)}
	}
	total, err := totalSize(size, flags)
	if err != nil {
		_ = unix.Close(fd)
		return nil, &Error{Op: "open", Path: fmt.Sprintf("fd %d", fd), Err: err}
	}
	return setUp(fd, "", total, flags, false)
}

// OpenName maps the existing segment name in Dir, which must hold at least
// size data bytes. name must be one tensormp made (ParseName); a path, a
// link or another program's file is refused. With RefCount it takes a
// reference that Release gives back, and fails with ErrReleased when the
// segment's last holder already let it go.
func OpenName(name string, size int64, flags Flags) (*Allocation, error) {
	flags |= noCreate | sharedMem
	if flags&^openFlags != 0 {
		return nil, &Error{Op: "open", Path: fmt.Sprintf("%q", name), Err: fmt.Errorf("flags %v not allowed", flags&^openFlags)}
	}
	if !validName(name) {
		return nil, &Error{Op: "open", Path: fmt.Sprintf("%q", name), Err: ErrBadName}
	}
	total, err := totalSize(size, flags)
	if err != nil {
		return nil, &Error{Op: "open", Path: name, Err: err}
	}
	path := filepath.Join(Dir(), name)
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, &Error{Op: "open", Path: path, Err: err}
	}
	a, err := setUp(fd, path, total, flags, false)
	if err != nil {
		return nil, err
	}
	if flags&Unlink != 0 {
		if err := unix.Unlink(path); err != nil && err != unix.ENOENT {
			_ = a.Release()
			return nil, &Error{Op: "unlink", Path: path, Err: err}
		}
	}
	return a, nil
}

func totalSize(size int64, flags Flags) (int64, error) {
	if size <= 0 {
		return 0, fmt.Errorf("size %d: must be positive", size)
	}
	total := size
	if flags&RefCount != 0 {
		total += headerSize
	}
	if total < size || total > maxSegment {
		return 0, fmt.Errorf("size %d exceeds the limit of %d bytes", size, int64(maxSegment))
	}
	return total, nil
}

// maxSegment bounds a segment's size to what a slice can address.
const maxSegment = 1<<47 - 1

// setUp checks, reserves (create) and maps raw, and builds the
// Allocation. It owns raw: on error it is closed; on success it is kept or
// closed as flags say.
func setUp(raw int, path string, total int64, flags Flags, create bool) (a *Allocation, err error) {
	where := path
	if where == "" {
		where = fmt.Sprintf("fd %d", raw)
	}
	defer func() {
		if err != nil {
			_ = unix.Close(raw)
		}
	}()

	if create {
		size := reserve
		if flags&sparse != 0 {
			size = unix.Ftruncate
		}
		if err := size(raw, total); err != nil {
			return nil, &Error{Op: "reserve", Path: where, Err: err}
		}
	}
	st, err := statFile(raw, where)
	if err != nil {
		return nil, err
	}
	if st.Size < total {
		return nil, &Error{Op: "open", Path: where, Err: fmt.Errorf("file holds %d bytes, fewer than the %d claimed", st.Size, total)}
	}
	if flags&fromFD != 0 {
		if err := checkSealed(raw); err != nil {
			return nil, err
		}
	}

	mapping, err := unix.Mmap(raw, 0, int(total), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, &Error{Op: "map", Path: where, Err: err}
	}
	a = &Allocation{
		mapping: mapping,
		data:    mapping,
		path:    path,
		flags:   flags,
		id:      idOf(&st),
	}
	if flags&RefCount != 0 {
		a.data = mapping[headerSize:]
		if err := a.takeRef(create, total-headerSize); err != nil {
			_ = unix.Munmap(mapping)
			return nil, &Error{Op: "open", Path: where, Err: err}
		}
		refHolders.add(a)
	}
	if flags&KeepFD != 0 {
		a.own = fd.New(raw)
	} else {
		_ = unix.Close(raw)
	}
	return a, nil
}

// reserve gives the file its pages now, so that a full tmpfs fails here
// with ENOSPC instead of raising SIGBUS at the first write.
func reserve(fd int, size int64) error { return reserveRange(fd, 0, size) }

// Reserve gives the n bytes at off of a sparse segment their pages, so
// that a full directory (or memory) is an error matching ErrNoSpace here
// rather than SIGBUS at the first write of them. The range must lie
// within the segment: a sealed one cannot grow.
func (a *Allocation) Reserve(off, n int64) error {
	if off < 0 || n <= 0 || off > int64(len(a.mapping))-n {
		return &Error{Op: "reserve", Path: a.where(), Err: fmt.Errorf("%d bytes at %d: out of range", n, off)}
	}
	raw, err := a.LendFD()
	if err != nil {
		return err
	}
	defer a.ReturnFD()
	if err := reserveRange(raw, off, n); err != nil {
		return &Error{Op: "reserve", Path: a.String(), Err: err}
	}
	return nil
}

func reserveRange(fd int, off, size int64) error {
	for {
		err := unix.Fallocate(fd, 0, off, size)
		switch err {
		case nil:
			return nil
		case unix.EINTR:
			continue
		case unix.EOPNOTSUPP:
			// A file system without fallocate (not tmpfs): size the file;
			// its pages are allocated on first touch.
			if off > 0 {
				return nil // sized when it was made
			}
			return unix.Ftruncate(fd, size)
		}
		return err
	}
}

// takeRef initialises the header of a new RefCount segment, or takes a
// reference on an existing one unless it already dropped to zero.
func (a *Allocation) takeRef(create bool, size int64) (err error) {
	h := a.hdr()
	if create {
		return Guard(func() {
			h.magic = headerMagic
			h.version = headerVersion
			h.size = size
			h.refs.Store(1)
		})
	}
	if ferr := Guard(func() { err = takeRefOn(h, size) }); ferr != nil {
		return ferr
	}
	return err
}

func takeRefOn(h *header, size int64) error {
	if h.magic != headerMagic || h.version != headerVersion {
		return errors.New("no tensormp segment header")
	}
	if h.size < size {
		return fmt.Errorf("segment header says %d bytes, fewer than the %d claimed", h.size, size)
	}
	for {
		n := h.refs.Load()
		if n <= 0 {
			return ErrReleased
		}
		if h.refs.CompareAndSwap(n, n+1) {
			return nil
		}
	}
}

// Release gives back the mapping, the kept descriptor and, for a RefCount
// segment, this mapping's reference; the last reference unlinks the name.
// Releasing twice returns nil.
func (a *Allocation) Release() error {
	if !a.closed.CompareAndSwap(false, true) {
		return nil
	}
	var errs []error
	if err := a.dropRef(); err != nil {
		errs = append(errs, err)
	}
	if err := a.closeMapping(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Remove unlinks the segment's name, if it has one still; the mapping
// stays. A pool removes the named segments it made when it closes them.
func (a *Allocation) Remove() error {
	if a.path == "" || a.flags&Unlink != 0 {
		return nil
	}
	if err := unix.Unlink(a.path); err != nil && err != unix.ENOENT {
		return &Error{Op: "unlink", Path: a.path, Err: err}
	}
	return nil
}

// dropRef gives back a RefCount segment's reference once; the last
// reference unlinks the name.
func (a *Allocation) dropRef() error {
	if a.flags&RefCount == 0 || !a.refDropped.CompareAndSwap(false, true) {
		return nil
	}
	refHolders.remove(a)
	var left int32
	if err := Guard(func() { left = a.hdr().refs.Add(-1) }); err != nil {
		// Cut short under its mappings: it is of no use to anybody.
		if a.path != "" {
			_ = unix.Unlink(a.path)
		}
		return &Error{Op: "release", Path: a.path, Err: err}
	}
	if left == 0 && a.path != "" {
		if err := unix.Unlink(a.path); err != nil && err != unix.ENOENT {
			return &Error{Op: "unlink", Path: a.path, Err: err}
		}
	}
	return nil
}

// closeMapping unmaps and closes the kept descriptor. The fields stay as
// they are, so that readers racing with Release see a consistent (closed)
// Allocation rather than torn fields.
func (a *Allocation) closeMapping() error {
	var errs []error
	if err := unix.Munmap(a.mapping); err != nil {
		errs = append(errs, &Error{Op: "unmap", Path: a.path, Err: err})
	}
	if a.own != nil {
		if err := a.own.Close(); err != nil {
			errs = append(errs, &Error{Op: "close", Path: a.path, Err: err})
		}
	}
	return errors.Join(errs...)
}

// Stat returns the segment behind fd, a descriptor a message carried:
// its file's identity and size, checking that it is a regular file.
func Stat(fd int) (SegmentRef, error) {
	st, err := statFile(fd, "")
	if err != nil {
		return SegmentRef{}, err
	}
	return SegmentRef{ID: idOf(&st), Size: st.Size}, nil
}

// idOf is the identity of the file st describes.
func idOf(st *unix.Stat_t) ID { return ID{Dev: st.Dev, Ino: st.Ino} }

// statFile returns fd's status, checking that it is a regular file: a
// segment, never a pipe, socket or device another process slipped us.
// An empty where names the file by its descriptor.
func statFile(fd int, where string) (unix.Stat_t, error) {
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	if err == nil && st.Mode&unix.S_IFMT != unix.S_IFREG {
		err = fmt.Errorf("not a regular file (mode %#o)", st.Mode)
	}
	if err != nil {
		if where == "" {
			where = fmt.Sprintf("fd %d", fd)
		}
		return st, &Error{Op: "stat", Path: where, Err: err}
	}
	return st, nil
}

// SealedCopy returns a new memfd holding a copy of data, sealed against
// any change (writing, shrinking, growing, new seals), so that whoever
// receives its descriptor may read it in place. The caller owns the
// descriptor.
func SealedCopy(data []byte) (int, error) {
	name := newName()
	raw, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, &Error{Op: "memfd_create", Path: name, Err: err}
	}
	fail := func(op string, err error) (int, error) {
		_ = unix.Close(raw)
		return -1, &Error{Op: op, Path: name, Err: err}
	}
	if err := reserve(raw, int64(len(data))); err != nil {
		return fail("reserve", err)
	}
	for off := 0; off < len(data); {
		n, err := unix.Pwrite(raw, data[off:], int64(off))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fail("write", err)
		}
		off += n
	}
	const all = unix.F_SEAL_WRITE | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	if _, err := unix.FcntlInt(uintptr(raw), unix.F_ADD_SEALS, all); err != nil {
		return fail("seal", err)
	}
	return raw, nil
}

// MapSealed maps the first n bytes of the file behind fd read-only, after
// checking that it is a regular file of at least n bytes that nobody can
// change any more (see SealedCopy). fd stays the caller's; Unmap releases
// the mapping.
func MapSealed(fd int, n int64) ([]byte, error) {
	where := fmt.Sprintf("fd %d", fd)
	st, err := statFile(fd, where)
	if err != nil {
		return nil, err
	}
	if st.Size < n || n <= 0 || n > maxSegment {
		return nil, &Error{Op: "map", Path: where, Err: fmt.Errorf("file holds %d bytes, not the %d claimed", st.Size, n)}
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, &Error{Op: "seals", Path: where, Err: err}
	}
	if want := unix.F_SEAL_WRITE | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW; seals&want != want {
		return nil, &Error{Op: "seals", Path: where, Err: ErrUnsealed}
	}
	b, err := unix.Mmap(fd, 0, int(n), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, &Error{Op: "map", Path: where, Err: err}
	}
	return b, nil
}

// Unmap releases a mapping made by MapSealed.
func Unmap(b []byte) error { return unix.Munmap(b) }

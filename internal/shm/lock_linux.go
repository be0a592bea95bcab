package shm

import (
	"encoding/binary"
	"fmt"
	"math"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

// Ownership of pooled blocks is kept by the kernel, as open-file-description
// (OFD) locks on the segment's file: a read lock on a block's lock byte is a
// hold on the block. An OFD lock belongs to one open file description, not
// to a process: it is released when the last descriptor of that description
// is closed, which the kernel does for a process that dies however it dies,
// and for a descriptor in flight in a socket nobody will read. No process
// can drop a lock on a description it has no descriptor of. The lock
// bytes are laid out in block.go.

// lockRead takes a read lock on n bytes at off through fd's description,
// without waiting. It reports false when a write lock is in the way.
func lockRead(fd int, off, n int64) (bool, error) {
	return setLock(fd, unix.F_RDLCK, off, n)
}

// lockWrite takes a write lock on n bytes at off through fd's description,
// without waiting. It reports false when any other description holds a
// lock there.
func lockWrite(fd int, off, n int64) (bool, error) {
	return setLock(fd, unix.F_WRLCK, off, n)
}

// unlock releases fd's description's locks on n bytes at off.
func unlock(fd int, off, n int64) error {
	_, err := setLock(fd, unix.F_UNLCK, off, n)
	return err
}

func setLock(fd int, typ int16, off, n int64) (bool, error) {
	lk := unix.Flock_t{Type: typ, Whence: 0, Start: off, Len: n}
	for {
		err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_SETLK, &lk)
		switch err {
		case nil:
			return true, nil
		case unix.EINTR:
			continue
		case unix.EAGAIN, unix.EACCES:
			return false, nil
		}
		return false, &Error{Op: "lock", Path: "fd " + strconv.Itoa(fd), Err: err}
	}
}

// lockInWay reports whether a description other than fd's holds a lock on
// any of n bytes at off and, if one does, the bytes [from, to) of one such
// lock, all of them held. Which lock the kernel names, when several are in
// the way, is its choice.
func lockInWay(fd int, off, n int64) (from, to int64, held bool, err error) {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: off, Len: n}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &lk); err != nil {
		return 0, 0, false, &Error{Op: "lock", Path: "fd " + strconv.Itoa(fd), Err: err}
	}
	if lk.Type == unix.F_UNLCK {
		return 0, 0, false, nil
	}
	to = math.MaxInt64 // a length of 0 locks to the end of any file
	if lk.Len > 0 {
		to = lk.Start + lk.Len
	}
	return lk.Start, to, true, nil
}

// reopen returns a new descriptor, close-on-exec, of the file behind fd
// with an open file description of its own, so that its locks are its
// own. The caller owns it.
func reopen(fd int) (int, error) {
	path := "/proc/self/fd/" + strconv.Itoa(fd)
	for {
		n, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return -1, &Error{Op: "reopen", Path: fmt.Sprintf("fd %d", fd), Err: err}
		}
		return n, nil
	}
}

// checkSealed refuses a file_descriptor segment that some holder could
// shrink or grow under the mappings of the others.
func checkSealed(fd int) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return &Error{Op: "seals", Path: fmt.Sprintf("fd %d", fd), Err: err}
	}
	if want := unix.F_SEAL_SHRINK | unix.F_SEAL_GROW; seals&want != want {
		return &Error{Op: "seals", Path: fmt.Sprintf("fd %d", fd), Err: ErrUnsealed}
	}
	return nil
}

// removeIfAbandoned removes the name path if it still names the segment id
// and no description holds any lock on it. It reports whether the watch
// is over: the name is gone, names another file, or was removed now.
func removeIfAbandoned(path string, id ID) bool {
	raw, err := unix.Open(path, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return err != unix.EINTR && !fd.OutOfDescriptors(err)
	}
	defer unix.Close(raw)
	if st, err := Stat(raw); err != nil || st.ID != id {
		return true
	}
	// Only a pool's segment is held through locks; any other (a RefCount
	// segment counts its holders in its header) is not this watch's.
	var magic [4]byte
	if n, err := unix.Pread(raw, magic[:], 0); err != nil || n != len(magic) || binary.LittleEndian.Uint32(magic[:]) != slabMagic {
		return true
	}
	ok, err := lockWrite(raw, lockBase, 0)
	if err != nil {
		return true
	}
	if !ok {
		return false
	}
	// Nobody can take a hold while this lock is in the way, and once the
	// name is gone nobody can open the segment to try.
	_ = unix.Unlink(path)
	return true
}

// statName returns the identity of the regular file at path, not
// following a link.
func statName(path string) (ID, bool) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return ID{}, false
	}
	return idOf(&st), true
}

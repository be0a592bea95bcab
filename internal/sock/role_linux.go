package sock

import (
	"fmt"
	"io"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

// takeRole takes the write lock on byte b of f's file, without waiting,
// through a description of the file of its own, which it returns, the
// caller's: the lock lasts while that description is open. It returns
// nil if another description holds the lock.
func takeRole(f *fd.FD, b int64) (*fd.FD, error) {
	raw, err := f.Lend()
	if err != nil {
		return nil, err
	}
	defer f.Return()
	var own int
	for {
		own, err = unix.Open("/proc/self/fd/"+strconv.Itoa(raw), unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("mp: opening a lane for its role: %w%s", err, FDHint(err))
	}
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart, Start: b, Len: 1}
	for {
		err = unix.FcntlFlock(uintptr(own), unix.F_OFD_SETLK, &lk)
		if err != unix.EINTR {
			break
		}
	}
	switch {
	case err == unix.EAGAIN || err == unix.EACCES:
		_ = unix.Close(own)
		return nil, nil
	case err != nil:
		_ = unix.Close(own)
		return nil, fmt.Errorf("mp: locking a lane's role: %w", err)
	}
	return fd.New(own), nil
}

package cuda

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// sameDescription checks that descriptor fd, a message's, is of the same
// open file description as own, the slab this process maps for the
// segment the message names. A producer exports each slab once, and
// SCM_RIGHTS and dup keep the description, so every honest message about
// a slab carries it; every export of the driver is an open of one device
// file, so nothing else (fstat) tells two allocations apart. A message
// that pairs a segment with another allocation is refused, however many
// came before it. Where the kernel cannot compare descriptors (kcmp), the
// check is skipped.
func sameDescription(own, fd int) error {
	pid := uintptr(os.Getpid())
	const kcmpFile = 0 // KCMP_FILE
	r, _, errno := unix.Syscall6(unix.SYS_KCMP, pid, pid, kcmpFile, uintptr(own), uintptr(fd), 0)
	switch {
	case errno == unix.ENOSYS || errno == unix.EPERM:
		return nil
	case errno != 0:
		return fmt.Errorf("comparing the message's descriptor %d with the slab's: %w", fd, errno)
	case r != 0:
		return errors.New("the message's descriptor is not of the allocation this process maps for its segment")
	}
	return nil
}

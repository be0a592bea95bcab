package mp

import (
	"syscall"

	"golang.org/x/sys/unix"
)

const (
	// sockType makes close-on-exec SOCK_SEQPACKET sockets.
	sockType = unix.SOCK_SEQPACKET | unix.SOCK_CLOEXEC
	// pollPeerGone is the poll event of a socket whose peer is closed.
	pollPeerGone = unix.POLLRDHUP
	// recvFlags makes received descriptors close-on-exec atomically.
	recvFlags = unix.MSG_CMSG_CLOEXEC
)

// workerAttr kills a worker when the thread that started it, the
// spawner thread, goes away: when the parent dies.
func workerAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

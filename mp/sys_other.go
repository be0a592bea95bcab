//go:build !linux

package mp

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// Other systems build, but sharing needs Linux: the segments behind
// tensors return mmapalloc.ErrUnsupported, and workers have no parent-death
// signal, only the control-socket backstop.
const (
	sockType     = unix.SOCK_SEQPACKET
	recvFlags    = 0
	pollPeerGone = unix.POLLHUP
)

func workerAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{} }

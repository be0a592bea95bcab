//go:build !linux

package sock

import (
	"errors"

	"golang.org/x/sys/unix"
)

// Other systems build, but sharing needs Linux: the segments behind
// tensors return mmapalloc.ErrUnsupported.
const (
	sockType     = unix.SOCK_SEQPACKET
	recvFlags    = 0
	pollPeerGone = unix.POLLHUP
)

// placesPipe returns a non-blocking, close-on-exec pipe, its ends owned
// by the caller. Its room is the system's: at least 16 KiB.
func placesPipe(n int) ([2]int, error) {
	var p [2]int
	if err := unix.Pipe(p[:]); err != nil {
		return p, err
	}
	for _, f := range p {
		unix.CloseOnExec(f)
		if err := unix.SetNonblock(f, true); err != nil {
			_, _ = unix.Close(p[0]), unix.Close(p[1])
			return p, err
		}
	}
	return p, nil
}

func accept(ls int) (int, error) {
	s, _, err := unix.Accept(ls)
	if err != nil {
		return -1, err
	}
	unix.CloseOnExec(s)
	if err := unix.SetNonblock(s, true); err != nil {
		_ = unix.Close(s)
		return -1, err
	}
	return s, nil
}

// peerCred needs Linux's SO_PEERCRED.
func peerCred(int) (Cred, error) {
	return Cred{}, errors.New("reading a peer's credentials needs Linux")
}

func recvmsg(s int, p, oob []byte, flags int) (n, oobn, recvflags int, err error) {
	n, oobn, recvflags, _, err = unix.Recvmsg(s, p, oob, flags)
	return n, oobn, recvflags, err
}

// peek reads the start of the socket's next message into p without
// receiving it, and without waiting.
func peek(s int, p []byte) (int, error) {
	n, _, err := unix.Recvfrom(s, p, unix.MSG_PEEK|unix.MSG_DONTWAIT)
	return n, err
}

// socketKind is what a received queue's or pipe's socket descriptor is,
// for its check (CheckSocket). Without SO_DOMAIN, a socket that is not a
// Unix one cannot be told here: its type is checked alone.
func socketKind(s int) (domain, typ int, err error) {
	typ, err = unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_TYPE)
	return unix.AF_UNIX, typ, err
}

func describeFD(int) string { return "a descriptor" }

// sharesCPU reports false here: see sys_linux.go.
func sharesCPU(uint32, int64) bool { return false }

// apartCPU reports false here: see sys_linux.go.
func apartCPU(uint32) bool { return false }

// lookCPU does nothing here.
func lookCPU(int64) {}

// spinYield does nothing here.
func spinYield() {}

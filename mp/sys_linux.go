package mp

import (
	"fmt"
	"os"
	"strconv"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leftover"
)

const (
	// sockType makes close-on-exec SOCK_SEQPACKET sockets.
	sockType = unix.SOCK_SEQPACKET | unix.SOCK_CLOEXEC
	// streamType makes close-on-exec SOCK_STREAM sockets.
	streamType = unix.SOCK_STREAM | unix.SOCK_CLOEXEC
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

// placesPipe returns a non-blocking, close-on-exec pipe with room for n
// bytes, its ends owned by the caller.
func placesPipe(n int) ([2]int, error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return p, err
	}
	if n > 64<<10 {
		if _, err := unix.FcntlInt(uintptr(p[1]), unix.F_SETPIPE_SZ, n); err != nil {
			_, _ = unix.Close(p[0]), unix.Close(p[1])
			return p, fmt.Errorf("%w (see /proc/sys/fs/pipe-max-size)", err)
		}
	}
	return p, nil
}

// accept takes a connection from the listening socket ls, non-blocking
// and close-on-exec.
func accept(ls int) (int, error) {
	s, _, err := unix.Accept4(ls, unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
	return s, err
}

// peerCred returns the credentials of the process at the other end of
// the connected socket s, as the kernel recorded them at connect.
func peerCred(s int) (Cred, error) {
	u, err := unix.GetsockoptUcred(s, unix.SOL_SOCKET, unix.SO_PEERCRED)
	if err != nil {
		return Cred{}, fmt.Errorf("reading the peer's credentials: %w", err)
	}
	return Cred{PID: int(u.Pid), UID: int(u.Uid), GID: int(u.Gid)}, nil
}

// recvmsg is unix.Recvmsg for a connected socket, without the sender's
// address, which that allocates for each call.
func recvmsg(s int, p, oob []byte, flags int) (n, oobn, recvflags int, err error) {
	iov := unix.Iovec{Base: &p[0]}
	iov.SetLen(len(p))
	msg := unix.Msghdr{Iov: &iov, Control: &oob[0]}
	msg.SetIovlen(1)
	msg.SetControllen(len(oob))
	r, _, errno := unix.Syscall(unix.SYS_RECVMSG, uintptr(s), uintptr(unsafe.Pointer(&msg)), uintptr(flags))
	if errno != 0 {
		return 0, 0, 0, errno
	}
	return int(r), int(msg.Controllen), int(msg.Flags), nil
}

// waitExited waits until child pid has exited and leaves it unreaped: its
// pid stays its own until Wait.
func waitExited(pid int) error {
	var info unix.Siginfo
	for {
		err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil)
		if err != unix.EINTR {
			return err
		}
	}
}

// socketKind is what a received queue's or pipe's socket descriptor is,
// for its check (checkSocket).
func socketKind(s int) (domain, typ int, err error) {
	if domain, err = unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_DOMAIN); err != nil {
		return 0, 0, err
	}
	typ, err = unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_TYPE)
	return domain, typ, err
}

// describeFD names what descriptor fd refers to, for errors about
// descriptors that are not what they should be: the kernel's own name
// of it ("socket:[123]", "pipe:[45]", "anon_inode:[eventfd]", a path).
func describeFD(fd int) string {
	target, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return "an unknown descriptor"
	}
	return target
}

// watchPeer has what process pid leaves behind under its pid removed
// (package leftover) as soon as it dies, until the returned stop is
// called: pid is the peer of an endpoint, known by SO_PEERCRED. The wait
// is a pidfd on the runtime's poller, not a thread. Without pidfds
// (Linux before 5.3) nothing is watched.
func watchPeer(pid int) (stop func()) {
	if pid <= 0 || !leftover.Any() {
		return func() {}
	}
	pfd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err == unix.ESRCH {
		leftover.Remove(pid) // dead already
	}
	if err != nil {
		return func() {}
	}
	f := os.NewFile(uintptr(pfd), "pidfd of peer "+strconv.Itoa(pid))
	rc, err := f.SyscallConn()
	if err != nil {
		_ = f.Close()
		return func() {}
	}
	go func() {
		// Ends when the peer exits, or with an error once stop closes f.
		if rc.Read(func(fd uintptr) bool { return exited(int(fd)) }) == nil {
			leftover.Remove(pid)
		}
		_ = f.Close()
	}()
	return func() { _ = f.Close() }
}

// exited reports whether the process of pidfd fd has exited.
func exited(fd int) bool {
	p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(p, 0)
	return err == nil && n == 1 && p[0].Revents&unix.POLLIN != 0
}

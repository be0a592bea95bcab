package mp

import (
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leftover"
)

// workerAttr kills a worker when the thread that started it, the
// spawner thread, goes away: when the parent dies.
func workerAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
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

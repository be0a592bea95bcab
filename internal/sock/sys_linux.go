package sock

import (
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"time"
	"unsafe"

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

// peek reads the start of the socket's next message into p without
// receiving it, or its descriptors, and without waiting.
func peek(s int, p []byte) (int, error) {
	for {
		r, _, errno := unix.Syscall6(unix.SYS_RECVFROM, uintptr(s), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)),
			unix.MSG_PEEK|unix.MSG_DONTWAIT|unix.MSG_TRUNC, 0, 0)
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return 0, errno
		}
		return min(int(r), len(p)), nil
	}
}

// socketKind is what a received queue's or pipe's socket descriptor is,
// for its check (CheckSocket).
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

// sharesCPU reports whether a spin that waits for another process, last
// seen on CPU peer (see runningCPU), should yield its CPU as it spins
// (spinYield): if this thread runs on that CPU too, the peer, which would
// run there, waits while it spins (a spin would hold it off to the end of
// the slice); else a yield would hand the CPU to whatever else is
// runnable, not to a peer that runs on another. For two processes pinned
// to one CPU each the answer is sure; for others it holds until the
// kernel moves one of them. now is monoNow, for lookCPU.
func sharesCPU(peer uint32, now int64) bool {
	lookCPU(now) // also where no Way looks: a lane's ringer stamps it
	return sameCPU(runningCPU(), peer)
}

// sameCPU reports whether CPUs mine and peer (each plus one, 0 unknown)
// are known and one; apartCPUs whether they are known and two.
func sameCPU(mine, peer uint32) bool   { return peer != 0 && mine == peer }
func apartCPUs(mine, peer uint32) bool { return peer != 0 && mine != 0 && mine != peer }

// apartCPU reports whether this thread runs on one CPU and the other
// process, last seen on CPU peer (see runningCPU), on another: a spin
// then holds no CPU the peer needs, as sure as sharesCPU's answer is.
// sharesCPU looks first.
func apartCPU(peer uint32) bool { return apartCPUs(runningCPU(), peer) }

// runningCPU returns one more than the CPU the calling thread runs on: the
// one CPU it may only run on (pinnedCPU), or else the one it runs on now
// (cpuNow), which holds until the kernel moves it; 0 where neither is
// known. What a ring stamps, and what a spin compares with the ringer's
// stamp.
func runningCPU() uint32 {
	if c := pinnedCPU(); c != 0 {
		return c
	}
	return cpuNow()
}

// spinYield yields the CPU, as a spin for a peer that shares it does
// every spinTurns turns: a raw system call, as the runtime's own yield
// makes, since sched_yield waits for nothing but the CPU. The runtime
// would hand the thread's P to another thread only after at least one
// tick of its monitor (20 µs or more) in a system call, which a yield
// outlasts only when the peer runs on for a slice; a process pinned to
// the CPU it shares could not run that thread meanwhile anyway. The runtime's bookkeeping around a system
// call (entersyscall, exitsyscall) was 1.4% of the samples of a round
// trip on one CPU (perf record).
func spinYield() {
	_, _, _ = unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
	spinYields.Add(1)
	if hook := afterYield.Load(); hook != nil {
		(*hook)()
	}
}

// spinYields counts spinYield's yields, for tests.
var spinYields atomic.Uint64

// afterYield, if set, runs after each spinYield, for tests: what the
// process the yield let run did meanwhile.
var afterYield atomic.Pointer[func()]

// pinnedCPU returns one more than the CPU the calling thread may only run
// on, or 0 if it may run on more than one (or its affinity cannot be
// read, or no look has been taken), as the kernel said at the process's
// last look (lookCPU): the answer is the process's, right for a process
// pinned whole (`taskset -c 0`, `spawn bench -cpus`, and the threads it
// starts after), not for one whose threads are pinned apart, where it
// costs a yield for nothing or a spin without one. It is a load: a ring
// stamps it.
func pinnedCPU() uint32 { return cpusPinned.Load() }

// lookCPU asks the kernel for pinnedCPU's answer if cpusLookEvery has
// gone by since it last did (now is monoNow): at each Send and receive
// of a Way, and at each spin, which read the clock already.
func lookCPU(now int64) {
	if now-cpusLooked.Load() < int64(cpusLookEvery) {
		return
	}
	cpusLooked.Store(now)
	var set unix.CPUSet
	c := uint32(0)
	if unix.SchedGetaffinity(0, &set) == nil && set.Count() == 1 {
		for !set.IsSet(int(c)) {
			c++
		}
		c++
	}
	cpusPinned.Store(c)
}

// cpusLookEvery is how often lookCPU asks the kernel; cpusLooked is when
// it last did (monoNow), and cpusPinned what it found.
const cpusLookEvery = 100 * time.Millisecond

var (
	cpusLooked atomic.Int64
	cpusPinned atomic.Uint32
)

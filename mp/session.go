package mp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/mmapalloc"
)

// A session is a program's process and every worker it spawns, however
// deep. Its segments are named tensormp_<session>_..., and every member
// holds a shared flock on the session's lock file,
// tensormp_<session>_lock. A keeper process, started with the session,
// waits for an exclusive lock on that file, which the kernel grants only
// once every member has exited, however it died, and then removes the
// session's segments: what file_system segments a SIGKILL left behind
// does not outlive the session.

const keeperName = "mp.keeper"

func init() {
	reexec.Register(keeperName, runKeeper)
}

var session struct {
	mu   sync.Mutex
	lock *os.File // the lock this process holds shared, for its life
	err  error
}

func lockPath(dir, id string) string {
	return filepath.Join(dir, mmapalloc.LockName(id))
}

// openLock opens the session lock at path, creating it (O_EXCL, mode
// 0600) when create is set and there is none. An existing lock is used
// only if it is a regular file of this user's with mode 0600: one planted
// by another user, or writable by others, could be held by them to block
// the keeper forever.
func openLock(path string, create bool) (*os.File, error) {
	const flags = os.O_RDWR | syscall.O_NOFOLLOW | syscall.O_CLOEXEC
	if create {
		f, err := os.OpenFile(path, flags|os.O_CREATE|os.O_EXCL, 0o600)
		if !errors.Is(err, os.ErrExist) {
			return f, err
		}
	}
	f, err := os.OpenFile(path, flags|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		_ = f.Close()
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != os.Geteuid() || st.Mode&0o777 != 0o600 {
		_ = f.Close()
		return nil, fmt.Errorf("%w: %s (owner uid %d, mode %#o)", ErrForeignLock, path, st.Uid, st.Mode&0o7777)
	}
	return f, nil
}

// ErrForeignLock: a session lock that another user owns, or that others
// may write, is in the way; tensormp refuses to use it.
var ErrForeignLock = errors.New("mp: the session lock is not this user's own (regular file, mode 0600)")

// keepSessionLock adopts the lock a worker inherited as fd.
func keepSessionLock(fd int) {
	session.mu.Lock()
	defer session.mu.Unlock()
	session.lock = os.NewFile(uintptr(fd), "session lock")
	mmapalloc.EnableNamedPool() // the session's keeper removes what the pool keeps
}

// StartSession makes this process the first member of its session and
// starts the session's keeper, once; Spawn calls it. A program that shares
// tensors under file_system before spawning calls it early, so that its
// segments are cleaned up even if it dies first. It returns the lock file,
// which the process holds until it exits.
func StartSession() (*os.File, error) {
	checkInit("mp.StartSession")
	session.mu.Lock()
	defer session.mu.Unlock()
	if session.lock != nil || session.err != nil {
		return session.lock, session.err
	}
	session.lock, session.err = startSession()
	if session.err == nil {
		// The keeper removes named segments a pool keeps for reuse if
		// this process dies, so file_system storages may be pooled too.
		mmapalloc.EnableNamedPool()
	}
	return session.lock, session.err
}

func startSession() (*os.File, error) {
	dir, id := mmapalloc.Dir(), mmapalloc.Session()
	path := lockPath(dir, id)
	f, err := openLock(path, true)
	if err != nil {
		return nil, fmt.Errorf("mp: session lock: %w%s", err, fdHint(err))
	}
	if err := flock(f, unix.LOCK_SH); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("mp: session lock %s: %w", path, err)
	}
	cmd, err := startKeeper(id, dir)
	if err != nil {
		// No keeper, and no other member yet: the lock is this
		// process's to remove.
		_ = os.Remove(path)
		_ = f.Close()
		return nil, err
	}
	go keepKeeper(cmd, id, dir)
	return f, nil
}

// The keeper says on its descriptor keeperFD that it runs, with
// keeperReady, before it waits for the session to end. A keeper that
// writes anything else, or exits first, did not start: its program's main
// does not call Init first, and started running instead of keeping.
const (
	keeperFD    = 3
	keeperReady = "ready"
	// keeperStart bounds how long a keeper may take to say it runs.
	keeperStart = 10 * time.Second
)

// startKeeper starts the session's keeper process and waits until it
// says it runs.
func startKeeper(id, dir string) (*exec.Cmd, error) {
	cmd, err := reexec.Command(context.Background(), keeperName, id, dir)
	if err != nil {
		return nil, err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("mp: starting the session keeper: %w%s", err, fdHint(err))
	}
	defer r.Close()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, nil, nil
	cmd.ExtraFiles = []*os.File{w}
	// Its own session: a kill of our process group does not reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	_ = w.Close()
	if err != nil {
		return nil, fmt.Errorf("mp: starting the session keeper: %w", err)
	}
	_ = r.SetReadDeadline(time.Now().Add(keeperStart))
	said, err := io.ReadAll(io.LimitReader(r, 4096))
	if string(said) == keeperReady {
		return cmd, nil
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	switch {
	case len(said) > 0:
		return nil, fmt.Errorf("mp: the session keeper did not start: %s", said)
	case err != nil:
		return nil, fmt.Errorf("mp: the session keeper did not start within %v: %w (%s)", keeperStart, err, initHint)
	default:
		return nil, fmt.Errorf("mp: the session keeper exited before it started: %s", initHint)
	}
}

// keepKeeper reaps the keeper and starts another whenever it dies: a
// keeper exits by itself only once every member, this process included,
// is gone, so one that exits while this process runs was killed, and the
// session would otherwise end with its segments and lock left behind. A
// keeper that keeps dying at once is restarted ever more slowly.
func keepKeeper(cmd *exec.Cmd, id, dir string) {
	backoff := 10 * time.Millisecond
	for {
		started := time.Now()
		err := cmd.Wait()
		Logger().Warn("session keeper died; starting another", "session", id, "error", err)
		if time.Since(started) > time.Minute {
			backoff = 10 * time.Millisecond
		}
		for {
			time.Sleep(backoff)
			backoff = min(2*backoff, 10*time.Second)
			if cmd, err = startKeeper(id, dir); err == nil {
				break
			}
			Logger().Error("restarting the session keeper", "session", id, "error", err)
		}
	}
}

func flock(f *os.File, how int) error {
	for {
		err := unix.Flock(int(f.Fd()), how)
		if err != unix.EINTR {
			return err
		}
	}
}

// runKeeper is the keeper's main: block until the session has no member,
// then remove its segments and lock.
func runKeeper() int {
	if len(os.Args) < 3 {
		return 2
	}
	id, dir := os.Args[1], os.Args[2]
	unix.CloseOnExec(keeperFD)
	f, err := openLock(lockPath(dir, id), false)
	if err != nil {
		_ = unix.Close(keeperFD)
		return 1
	}
	_, _ = unix.Write(keeperFD, []byte(keeperReady))
	_ = unix.Close(keeperFD)
	if err := flock(f, unix.LOCK_EX); err != nil {
		return 1
	}
	if _, err := removeSession(dir, id, false); err != nil {
		return 1
	}
	return 0
}

// removeSession removes the session's entries from dir, the lock last,
// and returns their names. An entry is the session's when it is a regular
// file whose whole name is one of the session's (mmapalloc.ParseName);
// anything else stays. With dryRun it only lists them.
func removeSession(dir, id string, dryRun bool) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range entries {
		if n, ok := mmapalloc.ParseName(e.Name()); ok && n.Session == id && !n.Lock && e.Type().IsRegular() {
			names = append(names, e.Name())
		}
	}
	lock := mmapalloc.LockName(id)
	if st, err := os.Lstat(filepath.Join(dir, lock)); err == nil && st.Mode().IsRegular() {
		names = append(names, lock)
	}
	var removed []string
	var errs []error
	for _, n := range names {
		if dryRun {
			removed = append(removed, n)
			continue
		}
		err := os.Remove(filepath.Join(dir, n))
		switch {
		case err == nil:
			removed = append(removed, n)
		case !errors.Is(err, os.ErrNotExist):
			errs = append(errs, err)
		}
	}
	return removed, errors.Join(errs...)
}

// Clean removes from dir the segments of sessions that have no live
// member: a session whose lock nobody holds, or, without a lock, whose
// segments' creating processes are all gone. Only regular files whose
// whole name tensormp gives are considered; a session whose lock is not
// this user's own is left alone. It returns what it removed, or with
// dryRun what it would remove.
func Clean(dir string, dryRun bool) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("mp: clean: %w", err)
	}
	sessions := map[string][]mmapalloc.Name{}
	for _, e := range entries {
		n, ok := mmapalloc.ParseName(e.Name())
		if !ok || !e.Type().IsRegular() {
			continue // not ours: leave it
		}
		sessions[n.Session] = append(sessions[n.Session], n)
	}
	var removed []string
	var errs []error
	for _, id := range slices.Sorted(maps.Keys(sessions)) {
		if sessionLive(dir, id, sessions[id]) {
			continue
		}
		r, err := removeSession(dir, id, dryRun)
		removed = append(removed, r...)
		if err != nil {
			errs = append(errs, err)
		}
	}
	return removed, errors.Join(errs...)
}

// sessionLive reports whether some process still belongs to session id,
// or whether that cannot be told (a lock that is not this user's own).
func sessionLive(dir, id string, names []mmapalloc.Name) bool {
	f, err := openLock(lockPath(dir, id), false)
	switch {
	case err == nil:
		defer f.Close()
		return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil
	case !errors.Is(err, os.ErrNotExist):
		return true
	}
	for _, n := range names {
		if n.Lock {
			continue
		}
		if err := unix.Kill(n.Pid, 0); err == nil || err == unix.EPERM {
			return true
		}
	}
	return false
}

package mp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"

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
	return filepath.Join(dir, mmapalloc.NamePrefix+id+"_lock")
}

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
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("mp: session lock: %w%s", err, fdHint(err))
	}
	if err := flock(f, unix.LOCK_SH); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("mp: session lock %s: %w", path, err)
	}
	cmd, err := reexec.Command(context.Background(), keeperName, id, dir)
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, nil, nil
	// Its own session: a kill of our process group does not reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("mp: starting the session keeper: %w", err)
	}
	go func() { _ = cmd.Wait() }() // reap it if it ever exits before us
	return f, nil
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
	f, err := os.OpenFile(lockPath(dir, id), os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return 1
	}
	if err := flock(f, unix.LOCK_EX); err != nil {
		return 1
	}
	if _, err := removeSession(dir, id, false); err != nil {
		return 1
	}
	return 0
}

// removeSession removes the session's entries from dir, the lock last,
// and returns their names. With dryRun it only lists them.
func removeSession(dir, id string, dryRun bool) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	prefix := mmapalloc.NamePrefix + id + "_"
	lock := filepath.Base(lockPath(dir, id))
	var names []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) && e.Name() != lock {
			names = append(names, e.Name())
		}
	}
	names = append(names, lock)
	var removed []string
	var errs []error
	for _, n := range names {
		if dryRun {
			if _, err := os.Lstat(filepath.Join(dir, n)); err == nil {
				removed = append(removed, n)
			}
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
// segments' creating processes are all gone. It returns what it removed,
// or with dryRun what it would remove.
func Clean(dir string, dryRun bool) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("mp: clean: %w", err)
	}
	sessions := map[string][]string{} // id -> names
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), mmapalloc.NamePrefix)
		if !ok {
			continue
		}
		id, _, ok := strings.Cut(rest, "_")
		if !ok || !(mmapalloc.ValidName(e.Name()) || e.Name() == filepath.Base(lockPath(dir, id))) {
			continue // not ours: leave it
		}
		sessions[id] = append(sessions[id], e.Name())
	}
	ids := make([]string, 0, len(sessions))
	for id := range sessions {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var removed []string
	var errs []error
	for _, id := range ids {
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

// sessionLive reports whether some process still belongs to session id.
func sessionLive(dir, id string, names []string) bool {
	f, err := os.OpenFile(lockPath(dir, id), os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if err == nil {
		defer f.Close()
		return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil
	}
	for _, n := range names {
		parts := strings.Split(n, "_")
		if len(parts) != 4 {
			continue
		}
		pid, err := strconv.Atoi(parts[2])
		if err != nil || pid <= 0 {
			continue
		}
		if err := unix.Kill(pid, 0); err == nil || err == unix.EPERM {
			return true
		}
	}
	return false
}

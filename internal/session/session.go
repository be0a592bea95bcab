package session

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
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/leftover"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/sock"
)

const (
	// KeeperName is the name a keeper process runs under (package
	// reexec): a program's processes are its keepers too.
	KeeperName = "mp.keeper"
	// keepers is how many keepers a session has.
	keepers = 2
)

// InitHint is the fix for a keeper or worker process that runs its
// program's main instead of its job: without mp.Init first, it would
// start keepers and workers of its own.
const InitHint = "call mp.Init first in main"

// How a keeper opens the lock: keeperNew makes it if there is none (the
// session's first keepers), keeperJoin only opens it (a replacement: a
// lock that is gone means a session that ended).
const (
	keeperNew  = "new"
	keeperJoin = "join"
)

func init() {
	reexec.Register(KeeperName, runKeeper)
}

// session is this process's membership of its session.
var session struct {
	mu   sync.Mutex
	lock *os.File // the lock this process holds shared, for its life
	err  error
	log  hclog.Logger
}

func lockPath(dir, id string) string {
	return filepath.Join(dir, shm.LockName(id))
}

// openLock opens the session lock at path, creating it (O_EXCL, mode
// 0600) when create is set and there is none. An existing lock is used
// only if it is a regular file of this user's with mode 0600: one planted
// by another user, or writable by others, could be held by them to block
// the keepers forever. Writes to it append: members add themselves to
// the roll through it.
func openLock(path string, create bool) (*os.File, error) {
	const flags = os.O_RDWR | os.O_APPEND | syscall.O_NOFOLLOW | syscall.O_CLOEXEC
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
// may write, is in the way; tensormp refuses to use it. It is
// mp.ErrForeignLock.
var ErrForeignLock = errors.New("mp: the session lock is not this user's own (regular file, mode 0600)")

// Join makes this process, a worker, a member of the session whose lock
// it inherited as fd: it adopts the descriptor, which it holds shared for
// its life, and adds itself to the session's roll. log is told what goes
// wrong.
func Join(fd int, log hclog.Logger) {
	session.mu.Lock()
	defer session.mu.Unlock()
	session.lock, session.log = os.NewFile(uintptr(fd), "session lock"), log
	joinRoll(session.lock)
	shm.EnableNamedPool() // the session's keeper removes what the pool keeps
}

// joinRoll appends this process's pid to the session's roll, through f,
// the session lock, opened for appending.
func joinRoll(f *os.File) {
	if _, err := fmt.Fprintf(f, "%d\n", os.Getpid()); err != nil {
		session.log.Warn("adding this process to the session's roll: the keepers will not remove what it leaves under its pid", "error", err)
	}
}

// Start makes this process the first member of its session and starts
// the session's keepers, once: later calls return what the first did,
// also in a process that joined its session (Join). It returns the lock
// file, which the process holds, and keeps a keeper's place, until it
// exits: the caller passes it to the workers it starts and never closes
// it. log is told what goes wrong, then and later.
func Start(log hclog.Logger) (*os.File, error) {
	session.mu.Lock()
	defer session.mu.Unlock()
	if session.lock != nil || session.err != nil {
		return session.lock, session.err
	}
	session.log = log
	session.lock, session.err = startSession()
	if session.err == nil {
		// The keeper removes named segments a pool keeps for reuse if
		// this process dies, so file_system storages may be pooled too.
		shm.EnableNamedPool()
	}
	return session.lock, session.err
}

func startSession() (*os.File, error) {
	dir, id := shm.Dir(), shm.Session()
	path := lockPath(dir, id)
	// A lock there already must be this user's own before any keeper
	// adopts it.
	if f, err := openLock(path, false); err == nil {
		_ = f.Close()
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("mp: session lock: %w%s", err, sock.FDHint(err))
	}
	type start struct {
		k   *keeper
		err error
	}
	starts := make(chan start, keepers)
	for range keepers {
		go func() {
			k, err := startKeeper(id, dir, keeperNew)
			starts <- start{k, err}
		}()
	}
	var ks []*keeper
	var errs []error
	for range keepers {
		s := <-starts
		if s.err != nil {
			errs = append(errs, s.err)
		} else {
			ks = append(ks, s.k)
		}
	}
	if len(ks) == 0 {
		return nil, errs[0] // the same reason twice, as a rule: the program's main without Init
	}
	f, err := openLock(path, false)
	if err == nil {
		if err = flock(f, unix.LOCK_SH); err != nil {
			_ = f.Close()
		}
	}
	if err != nil {
		// The keepers see this process go without a word, and remove
		// the lock.
		for _, k := range ks {
			k.abandon()
		}
		return nil, fmt.Errorf("mp: session lock %s: %w%s", path, err, sock.FDHint(err))
	}
	joinRoll(f)
	for _, k := range ks {
		k.held()
		go keepKeeper(k, id, dir)
	}
	for range keepers - len(ks) {
		// A keeper that did not start (killed as it started, say) is
		// replaced as a killed one is.
		go keepKeeper(nil, id, dir)
	}
	return f, nil
}

// The keeper says on its descriptor keeperFD, a stream socket to the
// process that started it, that it runs, with keeperReady, once it holds
// the lock; that process answers keeperHeld once it holds the lock
// itself, and the keeper then waits for the session to end. A keeper
// that writes anything else, or exits first, did not start: it writes why
// (its program's main does not call Init first, say). A keeper whose
// starter goes without answering waits for the session's end at once.
const (
	keeperFD    = 3
	keeperReady = "ready"
	keeperHeld  = "held"
	// keeperStart bounds how long a keeper may take to say it runs.
	keeperStart = 10 * time.Second
)

// keeper is a keeper process this process started, and its end of the
// keeper's socket until it has answered.
type keeper struct {
	cmd *exec.Cmd
	ctl *os.File
}

// startKeeper starts a keeper of session id in dir, opening the lock as
// how says (keeperNew or keeperJoin), and waits until it says it runs.
func startKeeper(id, dir, how string) (*keeper, error) {
	cmd, err := reexec.Command(context.Background(), KeeperName, id, dir, how)
	if err != nil {
		return nil, err
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, streamType, 0)
	if err != nil {
		return nil, fmt.Errorf("mp: starting the session keeper: %w%s", err, sock.FDHint(err))
	}
	if err := unix.SetNonblock(pair[0], true); err != nil {
		_, _ = unix.Close(pair[0]), unix.Close(pair[1])
		return nil, fmt.Errorf("mp: starting the session keeper: %w", err)
	}
	ctl := os.NewFile(uintptr(pair[0]), "keeper control") // non-blocking: with deadlines
	theirs := os.NewFile(uintptr(pair[1]), "keeper control")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, nil, nil
	cmd.ExtraFiles = []*os.File{theirs}
	// Its own session: a kill of our process group does not reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	_ = theirs.Close()
	if err != nil {
		_ = ctl.Close()
		return nil, fmt.Errorf("mp: starting the session keeper: %w", err)
	}
	_ = ctl.SetReadDeadline(time.Now().Add(keeperStart))
	said, err := readWord(ctl)
	if said == keeperReady {
		return &keeper{cmd: cmd, ctl: ctl}, nil
	}
	_ = ctl.Close()
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	switch {
	case len(said) > 0:
		return nil, fmt.Errorf("mp: the session keeper did not start: %s", said)
	case err != nil && !errors.Is(err, io.EOF):
		return nil, fmt.Errorf("mp: the session keeper did not start within %v: %w (%s)", keeperStart, err, InitHint)
	default:
		return nil, fmt.Errorf("mp: the session keeper exited before it started: %s", InitHint)
	}
}

// readWord reads what a keeper or its starter says on r: keeperReady or
// keeperHeld, said whole, or a reason followed by the end of the stream.
func readWord(r io.Reader) (string, error) {
	buf := make([]byte, 0, 64)
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)] // more room, for a long reason
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if s := string(buf); s == keeperReady || s == keeperHeld || err != nil || len(buf) >= 4096 {
			return s, err
		}
	}
}

// held tells the keeper that this process holds the lock, and lets go of
// its socket.
func (k *keeper) held() {
	_, _ = k.ctl.Write([]byte(keeperHeld))
	_ = k.ctl.Close()
}

// abandon lets go of a keeper without answering it: it ends the session
// at once, and is reaped in the background.
func (k *keeper) abandon() {
	_ = k.ctl.Close()
	go func() { _ = k.cmd.Wait() }()
}

// keepKeeper reaps keeper k and starts another whenever it dies (at once
// when k is nil): a keeper exits by itself only once every member, this
// process included, is gone, so one that exits while this process runs
// was killed. A keeper that keeps dying at once is restarted ever more
// slowly.
func keepKeeper(k *keeper, id, dir string) {
	backoff := 10 * time.Millisecond
	for {
		if k != nil {
			started := time.Now()
			err := k.cmd.Wait()
			session.log.Warn("session keeper died; starting another", "session", id, "error", err)
			if time.Since(started) > time.Minute {
				backoff = 10 * time.Millisecond
			}
		}
		for {
			var err error
			if k, err = startKeeper(id, dir, keeperJoin); err == nil {
				k.held()
				break
			}
			session.log.Error("restarting the session keeper", "session", id, "error", err)
			time.Sleep(backoff)
			backoff = min(2*backoff, 10*time.Second)
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

// FailKeeper tells the process starting this keeper process why it
// cannot run, and exits with code 2.
func FailKeeper(reason string) {
	fmt.Fprintf(os.Stderr, "tensormp: %s\n", reason)
	_, _ = unix.Write(keeperFD, []byte(reason))
	os.Exit(2)
}

// runKeeper is a keeper's main: hold the lock for the session's first
// member until it holds it, block until the session has no member, then
// end it.
func runKeeper() int {
	if len(os.Args) < 4 {
		return 2
	}
	id, dir, how := os.Args[1], os.Args[2], os.Args[3]
	unix.CloseOnExec(keeperFD)
	ctl := os.NewFile(keeperFD, "keeper control")
	path := lockPath(dir, id)
	f, err := openLock(path, how == keeperNew)
	if err == nil {
		err = flock(f, unix.LOCK_SH)
	}
	if err != nil {
		_, _ = fmt.Fprintf(ctl, "session lock %s: %v", path, err)
		_ = ctl.Close()
		return 1
	}
	_, _ = ctl.Write([]byte(keeperReady))
	// Until the starter holds the lock, or goes without a word.
	_, _ = readWord(ctl)
	_ = ctl.Close()
	// Converts the shared lock: granted once no member, and no other
	// keeper still waiting for its starter, holds one.
	if err := flock(f, unix.LOCK_EX); err != nil {
		return 1
	}
	if !sameFile(f, path) {
		return 0 // the other keeper ended the session
	}
	if _, err := removeSession(dir, id, false, membersGone); err != nil {
		return 1
	}
	return 0
}

// sameFile reports whether path names the file f has open.
func sameFile(f *os.File, path string) bool {
	var a, b unix.Stat_t
	return unix.Fstat(int(f.Fd()), &a) == nil && unix.Lstat(path, &b) == nil && a.Dev == b.Dev && a.Ino == b.Ino
}

// removeSession removes the session's entries from dir, the lock last,
// and returns their names; before them, what the session's members left
// under their pids (see removeMembers, which waits up to wait for members
// that look alive). An entry is the session's when it is a regular file
// whose whole name is one of the session's (shm.ParseName);
// anything else stays. With dryRun it only lists them.
func removeSession(dir, id string, dryRun bool, wait time.Duration) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range entries {
		if n, ok := shm.ParseName(e.Name()); ok && n.Session == id && !n.Lock && e.Type().IsRegular() {
			names = append(names, e.Name())
		}
	}
	lock := shm.LockName(id)
	if st, err := os.Lstat(filepath.Join(dir, lock)); err == nil && st.Mode().IsRegular() {
		names = append(names, lock)
		if !dryRun {
			removeMembers(readRoll(filepath.Join(dir, lock)), wait)
		}
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

// maxRoll bounds what readRoll reads of a roll, which any process of the
// user may write: a million members' pids.
const maxRoll = 8 << 20

// readRoll returns the pids in the roll of the session whose lock is at
// path, each once, in the order they joined.
func readRoll(path string) []int {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	defer f.Close()
	b, _ := io.ReadAll(io.LimitReader(f, maxRoll))
	seen := map[int]bool{}
	var pids []int
	for line := range strings.Lines(string(b)) {
		pid, err := strconv.Atoi(strings.TrimSuffix(line, "\n"))
		if err == nil && pid > 0 && !seen[pid] {
			seen[pid] = true
			pids = append(pids, pid)
		}
	}
	return pids
}

// membersGone bounds how long a keeper waits for a member that still
// looks alive: one that let go of the lock as it exits but has not died
// yet, or one whose pid another process took.
const membersGone = 2 * time.Second

// removeMembers removes what the processes pids, a session's members,
// left under their pids (package leftover), each once it is dead,
// waiting up to wait for those that look alive.
func removeMembers(pids []int, wait time.Duration) {
	deadline := time.Now().Add(wait)
	for {
		var alive []int
		for _, pid := range pids {
			if leftover.Dead(pid) {
				leftover.Remove(pid)
			} else {
				alive = append(alive, pid)
			}
		}
		if len(alive) == 0 || time.Now().After(deadline) {
			return
		}
		pids = alive
		time.Sleep(50 * time.Millisecond)
	}
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
	sessions := map[string][]shm.Name{}
	for _, e := range entries {
		n, ok := shm.ParseName(e.Name())
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
		r, err := removeSession(dir, id, dryRun, 0)
		removed = append(removed, r...)
		if err != nil {
			errs = append(errs, err)
		}
	}
	return removed, errors.Join(errs...)
}

// sessionLive reports whether some process still belongs to session id,
// or whether that cannot be told (a lock that is not this user's own).
func sessionLive(dir, id string, names []shm.Name) bool {
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

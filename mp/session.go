package mp

import "github.com/tensormp/tensormp/internal/session"

// ErrForeignLock: a session lock that another user owns, or that others
// may write, is in the way; tensormp refuses to use it.
var ErrForeignLock = session.ErrForeignLock

// StartSession makes this process the first member of its session and
// starts the session's keepers, once; Spawn calls it. A program that
// shares tensors under file_system before spawning calls it early, so
// that its segments are cleaned up even if it dies first. The process
// holds the session's lock until it exits.
func StartSession() error {
	checkInit("mp.StartSession")
	_, err := session.Start(Logger())
	return err
}

// Clean removes from dir the segments of sessions that have no live
// member: a session whose lock nobody holds, or, without a lock, whose
// segments' creating processes are all gone. Only regular files whose
// whole name tensormp gives are considered; a session whose lock is not
// this user's own is left alone. It returns what it removed, or with
// dryRun what it would remove.
func Clean(dir string, dryRun bool) ([]string, error) { return session.Clean(dir, dryRun) }

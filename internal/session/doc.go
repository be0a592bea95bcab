// Package session keeps package mp's sessions: it removes what a
// program's processes leave behind once they have all exited, however
// they died.
//
// A session is a program's process and every worker it spawns, however
// deep. Its segments are named tensormp_<session>_..., and every member
// holds a shared flock on the session's lock file,
// tensormp_<session>_lock, through one open file description that the
// first member opens (Start) and each worker inherits (Join); each member
// also appends its pid to that file, one decimal line each: the session's
// roll.
//
// Two keeper processes, started with the session in sessions of their
// own, each wait for an exclusive lock on the file, which the kernel
// grants only once every member has exited, however it died. The first
// to get it ends the session: it removes what the members left under
// their pids (the CUDA driver's files, through package leftover), then
// the session's segments, then the lock; the other then finds no lock of
// its own and exits. Two, so that a keeper killed at any moment, while
// the last member exits or while it removes, leaves the other to finish;
// a keeper killed while a member lives is replaced by the first member.
//
// The keepers make the lock file, and hold it shared for the first
// member until it holds the lock itself and says so: a first member
// killed while it starts the session leaves them to remove the lock.
//
// Ownership: a member's lock descriptor is this package's for the life of
// the process; the first member reaps its keepers and starts new ones.
// The lock must be this user's own, mode 0600 (ErrForeignLock). Clean
// removes what sessions with no live member left behind: regular files
// whose whole name is one tensormp gives, nothing else. Errors speak as
// package mp's, whose they are.
package session

package dist

import (
	"errors"
	"fmt"

	"github.com/tensormp/tensormp/reduction"
)

// ErrPeerLost is what a *PeerError wraps: the peer died, left or could
// not be reached within the heartbeat bound.
var ErrPeerLost = errors.New("peer lost")

// ErrStoreLost is the error of every rank when rank 0, which serves the
// group's store and watches its ranks, dies or becomes unreachable.
var ErrStoreLost = errors.New("dist: rank 0, the group's store, lost")

// ErrClosed is returned by a Group, Queue or Pipe used after Close.
var ErrClosed = errors.New("dist: group closed")

// PeerError is a failure to reach another rank: its process died, its
// host went away, or it did not answer within the heartbeat bound.
// errors.Is(err, ErrPeerLost) holds for every PeerError.
type PeerError struct {
	Rank int    // the peer's rank
	Addr string // the peer's address, when known
	Op   string // what was being done with it: "watch", "put", "get", "pipe", ...
	Err  error  // the cause
}

func (e *PeerError) Error() string {
	if e.Addr == "" {
		return fmt.Sprintf("dist: %s with rank %d: %v", e.Op, e.Rank, e.Err)
	}
	return fmt.Sprintf("dist: %s with rank %d at %s: %v", e.Op, e.Rank, e.Addr, e.Err)
}

func (e *PeerError) Unwrap() error { return e.Err }

func (e *PeerError) Is(target error) bool { return target == ErrPeerLost }

// RankError is a rank's own failure, reported to the group with
// Group.Abort: every other rank sees it as the group's cause.
type RankError struct {
	Rank int
	Err  error
}

func (e *RankError) Error() string { return fmt.Sprintf("dist: rank %d failed: %v", e.Rank, e.Err) }

func (e *RankError) Unwrap() error { return e.Err }

// malformedf is the error for what a peer sent that is not well formed:
// "dist: malformed message: " and what format says, wrapping
// reduction.ErrMalformed.
func malformedf(format string, args ...any) error {
	return fmt.Errorf("dist: %w: "+format, append([]any{reduction.ErrMalformed}, args...)...)
}

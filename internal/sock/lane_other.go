//go:build !linux

package sock

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
)

// A Lane is a ring of messages in shared memory; only Linux has one (see
// lane_linux.go).
type Lane struct{ entries uint32 }

// ErrTooLarge is returned by Send for a message larger than the lane's
// entries hold.
var ErrTooLarge = errors.New("mp: message too large for the lane")

var errNoLane = fmt.Errorf("mp: a lane: %w", errors.ErrUnsupported)

var errCounts = errors.New("mp: the lane's counts")

// CreateLane returns an error wrapping errors.ErrUnsupported.
func CreateLane(n, size int) (*fd.FD, error) { return nil, errNoLane }

// OpenLane returns an error wrapping errors.ErrUnsupported.
func OpenLane(f *fd.FD) (*Lane, error) { return nil, errNoLane }

// Close does nothing.
func (l *Lane) Close() error { return nil }

// Send returns an error wrapping errors.ErrUnsupported.
func (l *Lane) Send(ctx context.Context, data []byte, alive func() error) error { return errNoLane }

// Recv returns an error wrapping errors.ErrUnsupported.
func (l *Lane) Recv(ctx context.Context, buf []byte, alive func() error) ([]byte, error) {
	return buf[:0], errNoLane
}

// TrySend returns an error wrapping errors.ErrUnsupported.
func (l *Lane) TrySend(data []byte) error { return errNoLane }

func (l *Lane) send(context.Context, []byte, func() error, bool, time.Duration) error {
	return errNoLane
}

// TryRecv returns an error wrapping errors.ErrUnsupported.
func (l *Lane) TryRecv(buf []byte) ([]byte, uint32, error) { return buf[:0], 0, errNoLane }

// Resume does nothing.
func (l *Lane) Resume() {}

// Ahead calls yield with nothing.
func (l *Lane) Ahead(buf []byte, yield func(data []byte) bool) []byte { return buf }

// Heads calls yield with nothing.
func (l *Lane) Heads(buf []byte, limit int, yield func(head []byte) bool) []byte { return buf }

// Room returns 0.
func (l *Lane) Room() int { return 0 }

// warmSend and warmTake ask for nothing.
func (l *Lane) warmSend(bool)   {}
func (l *Lane) warmTake(uint32) {}

// Tail, Sent and Taken return 0.
func (l *Lane) Tail() uint32  { return 0 }
func (l *Lane) Sent() uint32  { return 0 }
func (l *Lane) Taken() uint32 { return 0 }

func (l *Lane) readerCPU() uint32 { return 0 }

func (l *Lane) readerSpunWithin(int64, time.Duration) bool { return false }

func (l *Lane) readerStamp(int) *atomic.Int64 { return nil }

func (l *Lane) stampCPU(bool) {}

// Nudge does nothing.
func (l *Lane) Nudge() {}

// WaitSent returns an error wrapping errors.ErrUnsupported.
func (l *Lane) WaitSent(ctx context.Context, last uint32, alive func() error) (uint32, error) {
	return last, errNoLane
}

// SpinSent reports false.
func (l *Lane) SpinSent(last uint32) bool { return false }

// WaitSentUntil returns an error wrapping errors.ErrUnsupported.
func (l *Lane) WaitSentUntil(ctx context.Context, last uint32, alive func() error, patience time.Duration, look func() error) (uint32, error) {
	return last, errNoLane
}

// readerWord returns nil: there is no lane.
func (l *Lane) readerWord(off int) *atomic.Uint32 { return nil }

func (l *Lane) readerID(off int) shm.ID        { return shm.ID{} }
func (l *Lane) setReaderID(off int, id shm.ID) {}

//go:build !linux

package main

import (
	"errors"
	"time"

	"github.com/tensormp/tensormp/internal/fd"
)

// The floors are measured on Linux only, where tensormp shares memory.
type floor struct{}

func newFloor() (f *floor, peer, page *fd.FD, err error)  { return nil, nil, nil, errors.ErrUnsupported }
func (*floor) close()                                     {}
func (*floor) roundTrip() (time.Duration, error)          { return 0, errors.ErrUnsupported }
func (*floor) futexRoundTrip() (time.Duration, error)     { return 0, errors.ErrUnsupported }
func (*floor) spinRoundTrip() (time.Duration, error)      { return 0, errors.ErrUnsupported }
func (*floor) stream(n, batch int) (time.Duration, error) { return 0, errors.ErrUnsupported }
func serveFloor(sock *fd.FD) error                        { _ = sock.Close(); return errors.ErrUnsupported }
func serveFutex(sock, page *fd.FD) error                  { _ = page.Close(); return errors.ErrUnsupported }
func (*floor) startLanes() (to, from *fd.FD, err error)   { return nil, nil, errors.ErrUnsupported }
func (*floor) laneRoundTrip() (time.Duration, error)      { return 0, errors.ErrUnsupported }
func (*floor) laneStream(n, batch int) (time.Duration, error) {
	return 0, errors.ErrUnsupported
}
func serveLanes(sock, to, from *fd.FD) error {
	_, _ = to.Close(), from.Close()
	return errors.ErrUnsupported
}

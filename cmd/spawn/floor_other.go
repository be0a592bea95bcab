//go:build !linux

package main

import (
	"errors"
	"time"

	"github.com/tensormp/tensormp/internal/fd"
)

// The floor is measured on Linux only, where tensormp shares memory.
type floor struct{}

func newFloor() (*floor, *fd.FD, error)                   { return nil, nil, errors.ErrUnsupported }
func (*floor) close()                                     {}
func (*floor) roundTrip() (time.Duration, error)          { return 0, errors.ErrUnsupported }
func (*floor) stream(n, batch int) (time.Duration, error) { return 0, errors.ErrUnsupported }
func serveFloor(sock *fd.FD) error                        { _ = sock.Close(); return errors.ErrUnsupported }

//go:build !linux

package mp

import (
	"errors"
	"syscall"
)

// Other systems build, but sharing needs Linux: workers have no
// parent-death signal, only the control-socket backstop.
func workerAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{} }

// waitExited is Linux's: elsewhere a dead worker's leftovers stay.
func waitExited(int) error { return errors.ErrUnsupported }

// watchPeer is Linux's: elsewhere a dead peer's leftovers stay.
func watchPeer(int) (stop func()) { return func() {} }

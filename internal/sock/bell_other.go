//go:build !linux

package sock

import (
	"context"
	"errors"
	"fmt"
)

// A Bell wakes a process that waits for a word in shared memory to
// change; only Linux has one (see bell_linux.go).
type Bell struct{}

const bellSize = 128

// NewBell returns an error wrapping errors.ErrUnsupported.
func NewBell(mem []byte) (*Bell, error) {
	return nil, fmt.Errorf("mp: a lane's bell: %w", errors.ErrUnsupported)
}

// Load returns 0.
func (b *Bell) Load() uint32 { return 0 }

// Ring does nothing.
func (b *Bell) Ring() {}

// Advance reports false.
func (b *Bell) Advance(old uint32) bool { return false }

// Wait returns an error wrapping errors.ErrUnsupported.
func (b *Bell) Wait(ctx context.Context, last uint32, alive func() error) (uint32, error) {
	return last, fmt.Errorf("mp: a lane's bell: %w", errors.ErrUnsupported)
}

// Spin returns last and false.
func (b *Bell) Spin(last uint32) (uint32, bool) { return last, false }

// RingerCPU returns 0.
func (b *Bell) RingerCPU() uint32 { return 0 }

// Nudge does nothing.
func (b *Bell) Nudge() {}

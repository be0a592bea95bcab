//go:build !linux

package sock

import (
	"context"

	"golang.org/x/sys/unix"
)

// sendFlags: never block.
const sendFlags = unix.MSG_DONTWAIT

// Elsewhere than Linux a caller does not wait in the kernel first, and
// parking polls its socket every few milliseconds: sharing needs Linux,
// and these systems only build.
type waitSlot struct{}

func takeWaitSlot() *waitSlot          { return nil }
func putWaitSlot(*waitSlot)            {}
func (*waitSlot) poke()                {}
func (*waitSlot) current() uint64      { return 0 }
func (*waitSlot) interrupt(uint64)     {}
func (*waitSlot) wait(int, int16) bool { return false }

// Receives do not block in the call: they poll.
func blockingReceives(int) bool { return false }

func (*Conn) blockingCall(context.Context, func(int) error) error { return unix.EAGAIN }

type parking struct{ ready chan struct{} }

func newParking() parking { return parking{ready: make(chan struct{}, 1)} }

// arm polls s for a few milliseconds and says it may be ready.
func (p *parking) arm(s int, ev int16) (<-chan struct{}, error) {
	fds := []unix.PollFd{{Fd: int32(s), Events: ev}}
	_, _ = unix.Poll(fds, 5)
	select {
	case p.ready <- struct{}{}:
	default:
	}
	return p.ready, nil
}

func (p *parking) release(int) {}

// watchGone does nothing: a waiter sees the other end's close when it
// next looks.
func (p *parking) watchGone(int, any, func()) error { return nil }

func (p *parking) unwatchGone(any) {}

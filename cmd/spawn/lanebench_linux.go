package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/sock"
)

// The lane cases measure package sock's Lane between the parent and the
// worker: the messages the floors send, through two rings in shared
// memory instead of the socket, each side spinning and sleeping on its
// Bell. A lane carries bytes only, so these cases bound what a tensor
// hand-off over a lane could cost; an mp.Pipe uses lanes for values
// without descriptors (pipe_roundtrip, pipe_stream) and for tensors whose
// segments its receiver maps (pipe_tensor_roundtrip, pipe_tensor_stream).

// laneEntries and laneEntry size the bench's lanes: a batch of records
// fits an entry.
const (
	laneEntries = 256
	laneEntry   = 2048
)

// benchLanes is the parent's side of the lane cases: to the worker and
// back. It owns both mappings.
type benchLanes struct {
	to, from *sock.Lane
	alive    func() error // the worker's end of the floor socket is open
	buf, msg []byte
}

// newBenchLanes makes the two lanes' memory and maps it here; the
// descriptors are for the worker, which serves them with serveLanes.
func newBenchLanes(floorSock int) (l *benchLanes, to, from *fd.FD, err error) {
	if to, err = sock.CreateLane(laneEntries, laneEntry); err != nil {
		return nil, nil, nil, err
	}
	if from, err = sock.CreateLane(laneEntries, laneEntry); err != nil {
		_ = to.Close()
		return nil, nil, nil, err
	}
	l = &benchLanes{alive: socketAlive(floorSock), msg: make([]byte, 1+laneEntry)}
	if l.to, err = sock.OpenLane(to); err == nil {
		if l.from, err = sock.OpenLane(from); err != nil {
			_ = l.to.Close()
		}
	}
	if err != nil {
		_, _ = to.Close(), from.Close()
		return nil, nil, nil, err
	}
	return l, to, from, nil
}

func (l *benchLanes) close() {
	_ = l.to.Close()
	_ = l.from.Close()
}

// socketAlive returns an alive for a lane's waits: an error once the
// other end of socket s is gone.
func socketAlive(s int) func() error {
	return func() error {
		if peerGone(s) {
			return errFloorClosed
		}
		return nil
	}
}

// roundTrip sends one record of kind floorEcho and waits for it back.
func (l *benchLanes) roundTrip() (time.Duration, error) {
	ctx := context.Background()
	msg := l.msg[:1+floorRecord]
	msg[0] = floorEcho
	start := time.Now()
	if err := l.to.Send(ctx, msg, l.alive); err != nil {
		return 0, err
	}
	var err error
	if l.buf, err = l.from.Recv(ctx, l.buf, l.alive); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// stream sends n records one way, batch per message, and returns the time
// until the worker has taken them all.
func (l *benchLanes) stream(n, batch int) (time.Duration, error) {
	ctx := context.Background()
	start := time.Now()
	for sent := 0; sent < n; sent += batch {
		msg := l.msg[:1+min(batch, n-sent)*floorRecord]
		msg[0] = floorCount
		if err := l.to.Send(ctx, msg, l.alive); err != nil {
			return 0, err
		}
	}
	if err := l.to.Send(ctx, []byte{floorEnd}, l.alive); err != nil {
		return 0, err
	}
	var err error
	if l.buf, err = l.from.Recv(ctx, l.buf, l.alive); err != nil {
		return 0, err
	}
	d := time.Since(start)
	if len(l.buf) != 8 || int(binary.LittleEndian.Uint64(l.buf)) != n {
		return 0, fmt.Errorf("lane stream: the worker counted %x, not %d records", l.buf, n)
	}
	return d, nil
}

// serveLanes answers the floor messages that come on the lane in to, on
// the lane from, until the other end of sock, which it borrows, is gone.
// It closes to and from once it has mapped them.
func serveLanes(s, to, from *fd.FD) error {
	defer func() { _, _ = to.Close(), from.Close() }()
	raw, err := s.Lend()
	if err != nil {
		return nil // the floor ended before it began
	}
	defer func() { _ = s.Return() }()
	in, err := sock.OpenLane(to)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := sock.OpenLane(from)
	if err != nil {
		return err
	}
	defer out.Close()
	alive := socketAlive(raw)
	ctx := context.Background()
	var buf []byte
	var counted uint64
	for {
		if buf, err = in.Recv(ctx, buf, alive); err != nil {
			if errors.Is(err, errFloorClosed) {
				return nil
			}
			return err
		}
		if len(buf) == 0 {
			return errors.New("lane: an empty message")
		}
		switch buf[0] {
		case floorEcho:
			err = out.Send(ctx, buf, alive)
		case floorCount:
			counted += uint64((len(buf) - 1) / floorRecord)
		case floorEnd:
			err = out.Send(ctx, binary.LittleEndian.AppendUint64(nil, counted), alive)
			counted = 0
		}
		if err != nil {
			return err
		}
	}
}

// startLanes makes the lane cases' rings; the descriptors are the
// worker's.
func (f *floor) startLanes() (to, from *fd.FD, err error) {
	l, to, from, err := newBenchLanes(f.s)
	if err != nil {
		return nil, nil, err
	}
	f.lanes = l
	return to, from, nil
}

func (f *floor) laneRoundTrip() (time.Duration, error) { return f.lanes.roundTrip() }

func (f *floor) laneStream(n, batch int) (time.Duration, error) { return f.lanes.stream(n, batch) }

package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

// The floor is what the kernel alone costs: the same socket type tensormp
// uses (SOCK_SEQPACKET) between the same two processes, driven with
// blocking system calls, with one descriptor (a memfd's) in each message
// as tensormp's carry one, and no encoding, mapping or bookkeeping.
// spawn bench measures it in the same run as the cases it bounds, so that
// ratios, not absolute times, are what it reports.

// floorRecord is the bytes a floor message carries per tensor: about what
// tensormp's metadata of a 4 KiB tensor takes.
const floorRecord = 64

// Floor message kinds, the first byte of each message.
const (
	floorEcho  = 'r' // send the message back with the descriptor, close it
	floorCount = 's' // close the descriptor, count the message's records
	floorEnd   = 'e' // reply with the records counted since the last end
)

// floor is the parent's end of a floor socket and its mapping of the
// floor page. It owns s, memfd and page, and uses the numbers directly:
// nothing else can close them while it runs.
type floor struct {
	s, memfd int
	rights   []byte // the control message that carries memfd
	buf      []byte
	oob      []byte
	page     *floorPage
	calls    uint32      // calls made on page
	lanes    *benchLanes // the lane cases' rings, once started
}

// newFloor makes a floor socket pair, a memfd to send and a floor page.
// The peer end and the page's memfd are for the bench worker, which
// serves the one with serveFloor and both with serveFutex.
func newFloor() (f *floor, peer, page *fd.FD, err error) {
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("floor socket pair: %w", err)
	}
	m, err := unix.MemfdCreate("tensormp-floor", unix.MFD_CLOEXEC)
	if err != nil {
		_ = unix.Close(pair[0])
		_ = unix.Close(pair[1])
		return nil, nil, nil, fmt.Errorf("floor memfd: %w", err)
	}
	p, pageFD, err := newFloorPage()
	if err != nil {
		closeRaw([]int{pair[0], pair[1], m})
		return nil, nil, nil, err
	}
	f = &floor{s: pair[0], memfd: m, rights: unix.UnixRights(m), buf: make([]byte, 64<<10), oob: make([]byte, unix.CmsgSpace(4*4)), page: p}
	return f, fd.New(pair[1]), fd.New(pageFD), nil
}

// close stops the worker's serveFutex and closes the socket, which ends
// its serveFloor.
func (f *floor) close() {
	if f.lanes != nil {
		f.lanes.close()
	}
	f.stopPage()
	_ = f.page.unmap()
	_ = unix.Close(f.s)
	_ = unix.Close(f.memfd)
}

// send sends a message of kind k holding records records and the memfd.
func (f *floor) send(k byte, records int) error {
	msg := f.buf[:1+records*floorRecord]
	msg[0] = k
	return unix.Sendmsg(f.s, msg, f.rights, nil, unix.MSG_NOSIGNAL)
}

// recv receives a message and closes the descriptors it carried.
func (f *floor) recv() ([]byte, error) { return recvFloor(f.s, f.buf, f.oob) }

// roundTrip sends one record and a descriptor, and waits for them to come
// back.
func (f *floor) roundTrip() (time.Duration, error) {
	start := time.Now()
	if err := f.send(floorEcho, 1); err != nil {
		return 0, err
	}
	if _, err := f.recv(); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// stream sends n records one way, batch per message with one descriptor
// each, and returns the time until the peer has received them all.
func (f *floor) stream(n, batch int) (time.Duration, error) {
	start := time.Now()
	for sent := 0; sent < n; sent += batch {
		if err := f.send(floorCount, min(batch, n-sent)); err != nil {
			return 0, err
		}
	}
	if err := f.send(floorEnd, 0); err != nil {
		return 0, err
	}
	reply, err := f.recv()
	if err != nil {
		return 0, err
	}
	d := time.Since(start)
	if len(reply) != 8 || int(binary.LittleEndian.Uint64(reply)) != n {
		return 0, fmt.Errorf("floor stream: the peer counted %x, not %d records", reply, n)
	}
	return d, nil
}

// serveFloor answers floor messages on s until the other end closes it.
// It blocks its thread in the kernel, as the floor means to.
func serveFloor(sock *fd.FD) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer sock.Close()
	s, err := sock.Lend()
	if err != nil {
		return err
	}
	defer func() { _ = sock.Return() }()
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*4))
	var counted uint64
	for {
		n, rights, err := recvFloorFDs(s, buf, oob)
		if err != nil {
			if errors.Is(err, errFloorClosed) {
				return nil
			}
			return err
		}
		msg := buf[:n]
		switch msg[0] {
		case floorEcho:
			if len(rights) != 1 {
				closeRaw(rights)
				return fmt.Errorf("floor: an echo carried %d descriptors", len(rights))
			}
			err = unix.Sendmsg(s, msg, unix.UnixRights(rights[0]), nil, unix.MSG_NOSIGNAL)
		case floorCount:
			counted += uint64((len(msg) - 1) / floorRecord)
		case floorEnd:
			err = unix.Sendmsg(s, binary.LittleEndian.AppendUint64(nil, counted), nil, nil, unix.MSG_NOSIGNAL)
			counted = 0
		}
		closeRaw(rights)
		if err != nil {
			return err
		}
	}
}

var errFloorClosed = errors.New("floor socket closed")

func recvFloor(s int, buf, oob []byte) ([]byte, error) {
	n, rights, err := recvFloorFDs(s, buf, oob)
	closeRaw(rights)
	return buf[:n], err
}

// recvFloorFDs receives one message into buf and returns its length and
// the descriptors it carried, which the caller closes.
func recvFloorFDs(s int, buf, oob []byte) (int, []int, error) {
	for {
		n, oobn, _, _, err := unix.Recvmsg(s, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return 0, nil, fmt.Errorf("floor recvmsg: %w", err)
		}
		if n == 0 {
			return 0, nil, errFloorClosed
		}
		if oobn == 0 {
			return n, nil, nil
		}
		rights, err := parseRights(oob[:oobn])
		return n, rights, err
	}
}

// parseRights returns the descriptors of the SCM_RIGHTS messages in oob.
func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("floor control message: %w", err)
	}
	var fds []int
	for i := range msgs {
		if got, err := unix.ParseUnixRights(&msgs[i]); err == nil {
			fds = append(fds, got...)
		}
	}
	return fds, nil
}

func closeRaw(fds []int) {
	for _, d := range fds {
		_ = unix.Close(d)
	}
}

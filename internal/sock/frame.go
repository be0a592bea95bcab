package sock

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
)

// A message on a Conn's socket is one frame, sent by one sendmsg: a
// header, then the payload, with the descriptors in one SCM_RIGHTS
// control message:
//
//	header: flags(1) | direct fds(4) | carried fds(4) | spilled bytes(8)
//	[tag(4)]
//	rights: [spill segment] [carrier socket] direct fds...
//
// A tag (flagTag) is a lane position that the message follows: a sender
// that also writes a lane says so of the messages it sends on the socket
// (see Way). A frame of a header alone whose flags are flagWake is no
// message: a lane's writer wakes with it a reader that waits on the
// socket (see Way.park); a receive skips it.
//
// A payload over maxInline is copied into a sealed segment (flagSpill),
// whose descriptor travels instead of it; the descriptors beyond what one
// message carries go through a private socketpair whose reading end
// travels in the message (flagCarrier). Integers are little-endian.

// Limits of one socket message.
const (
	// maxInline is the largest payload sent in the socket message itself;
	// larger ones spill into a shared segment whose descriptor travels
	// instead.
	maxInline = 64 << 10
	// maxSpill bounds a spilled payload: a receiver copies at most this
	// much out of a segment another process sent, whatever it claims.
	maxSpill = 1 << 30
	// maxFDs is SCM_MAX_FD, the most descriptors one sendmsg may carry.
	maxFDs = 253
	// maxCarried bounds the descriptors a receiver takes from a carrier.
	maxCarried = 1 << 20
	// headerLen is the size of the frame header.
	headerLen = 17
)

// Frame header flags.
const (
	flagSpill   = 1 << 0 // the payload is in a segment; its descriptor comes first
	flagCarrier = 1 << 1 // more descriptors wait in a carrier socket, sent next
	flagTag     = 1 << 2 // a tag follows the header
	flagWake    = 1 << 3 // no message: a wake (nothing else may be set)
	tagLen      = 4
)

// errWoken is a receive's error for a wake frame (flagWake).
var errWoken = errors.New("mp: woken by the lane's writer")

// header is a frame's header.
type header struct {
	flags   byte
	direct  uint32 // descriptors in the message after the spill's and carrier's
	carried uint32 // descriptors in the carrier socket
	spilled uint64 // the payload's length, when it is in a segment
}

// put writes h into b[:headerLen].
func (h header) put(b []byte) {
	b[0] = h.flags
	binary.LittleEndian.PutUint32(b[1:], h.direct)
	binary.LittleEndian.PutUint32(b[5:], h.carried)
	binary.LittleEndian.PutUint64(b[9:], h.spilled)
}

// parseHeader reads the header at the start of msg, which is at least
// headerLen bytes.
func parseHeader(msg []byte) header {
	return header{
		flags:   msg[0],
		direct:  binary.LittleEndian.Uint32(msg[1:]),
		carried: binary.LittleEndian.Uint32(msg[5:]),
		spilled: binary.LittleEndian.Uint64(msg[9:]),
	}
}

// special is the number of descriptors ahead of the direct ones.
func (h header) special() int {
	n := 0
	if h.flags&flagSpill != 0 {
		n++
	}
	if h.flags&flagCarrier != 0 {
		n++
	}
	return n
}

// frame frames data and fds, which stay the caller's, for one sendmsg. It
// returns the header, the payload that follows it (nil if data spilled),
// the rights to send, appended to rights, and the descriptors it made for
// the message (the spill segment, the carrier), which the caller closes
// once it is sent.
func frame(data []byte, fds, rights []int) (h header, payload []byte, out, made []int, err error) {
	if len(data) > maxSpill {
		return h, nil, rights, nil, fmt.Errorf("mp: send: a message of %d bytes exceeds the limit of %d", len(data), maxSpill)
	}
	defer func() {
		if err != nil {
			fd.CloseAll(made)
			made = nil
		}
	}()
	payload = data
	if len(data) > maxInline {
		// A sealed copy: the receiver reads it in place, and nobody can
		// change it after the receiver has checked it.
		spill, err := shm.SealedCopy(data)
		if err != nil {
			return h, nil, rights, made, fmt.Errorf("mp: spilling a %d-byte message: %w", len(data), err)
		}
		made = append(made, spill)
		h.flags |= flagSpill
		h.spilled = uint64(len(data))
		rights = append(rights, spill)
		payload = nil
	}
	direct := fds
	if room := maxFDs - len(rights) - 1; len(fds) > room+1 {
		carrier, err := sendCarried(fds[room:])
		if err != nil {
			return h, nil, rights, made, err
		}
		made = append(made, carrier)
		h.flags |= flagCarrier
		h.carried = uint32(len(fds) - room)
		rights = append(rights, carrier)
		direct = fds[:room]
	}
	h.direct = uint32(len(direct))
	return h, payload, append(rights, direct...), made, nil
}

// appendRights appends to b the control message that carries fds, as
// unix.UnixRights makes it, for a buffer the caller reuses.
func appendRights(b []byte, fds []int) []byte {
	start, n := len(b), 4*len(fds)
	b = append(b, make([]byte, unix.CmsgSpace(n))...)
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[start]))
	h.Level = unix.SOL_SOCKET
	h.Type = unix.SCM_RIGHTS
	h.SetLen(unix.CmsgLen(n))
	data := b[start+unix.CmsgLen(0):]
	for i, fd := range fds {
		binary.NativeEndian.PutUint32(data[4*i:], uint32(int32(fd)))
	}
	return b
}

// sendCarried puts fds into a new private socket, maxFDs at a time, and
// returns the reading end, which the caller sends and then closes.
func sendCarried(fds []int) (int, error) {
	pair, err := unix.Socketpair(unix.AF_UNIX, sockType, 0)
	if err != nil {
		return -1, fmt.Errorf("mp: carrier socket: %w%s", err, FDHint(err))
	}
	defer unix.Close(pair[0])
	for len(fds) > 0 {
		n := min(len(fds), maxFDs)
		if err := unix.Sendmsg(pair[0], []byte{1}, unix.UnixRights(fds[:n]...), nil, 0); err != nil {
			_ = unix.Close(pair[1])
			return -1, fmt.Errorf("mp: carrying %d descriptors: %w%s", len(fds), err, FDHint(err))
		}
		fds = fds[n:]
	}
	return pair[1], nil
}

// unframe undoes frame on a received message msg, at least headerLen
// bytes, whose descriptors are rights. It owns rights: the returned
// descriptors are the caller's, the others are closed (by the caller's
// deferred close, on error). spill is the mapping a spilled payload lies
// in; tag is the message's tag, or -1 if it has none.
func unframe(msg []byte, rights []int) (payload []byte, fds []int, spill []byte, tag int64, err error) {
	h := parseHeader(msg)
	payload = msg[headerLen:]
	tag = -1
	if h.flags&flagWake != 0 {
		if h != (header{flags: flagWake}) || len(payload) != 0 || len(rights) != 0 {
			return nil, rights, nil, 0, fmt.Errorf("mp: receive: %w: a wake with %d bytes and %d descriptors", ErrMalformed, len(msg), len(rights))
		}
		return nil, nil, nil, -1, errWoken
	}
	if h.flags&flagTag != 0 {
		if len(payload) < tagLen {
			return nil, rights, nil, 0, fmt.Errorf("mp: receive: %w: a tag cut short", ErrMalformed)
		}
		tag, payload = int64(binary.LittleEndian.Uint32(payload)), payload[tagLen:]
	}
	special := h.special()
	if h.flags&^(flagSpill|flagCarrier|flagTag) != 0 || uint64(len(rights)) != uint64(special)+uint64(h.direct) || h.flags&flagCarrier == 0 && h.carried != 0 {
		return nil, rights, nil, 0, fmt.Errorf("mp: receive: %w: frame says %d+%d descriptors, %d arrived", ErrMalformed, special, h.direct, len(rights))
	}
	next := 0
	if h.flags&flagSpill != 0 {
		if len(payload) != 0 || h.spilled > maxSpill || h.spilled <= maxInline {
			return nil, rights, nil, 0, fmt.Errorf("mp: receive: %w: a spill of %d bytes", ErrMalformed, h.spilled)
		}
		spill, err = shm.MapSealed(rights[0], int64(h.spilled))
		_ = unix.Close(rights[0]) // the mapping keeps the file
		rights[0] = -1
		if err != nil {
			return nil, rights, nil, 0, fmt.Errorf("mp: receive: spilled message: %w", err)
		}
		payload = spill
		next++
	}
	fds = rights[special:] // rights is the caller's, made for this message
	if h.flags&flagCarrier != 0 {
		more, err := recvCarried(rights[next], int(h.carried))
		rights[next] = -1
		if err != nil {
			if spill != nil {
				_ = shm.Unmap(spill)
			}
			return nil, fds, nil, 0, err
		}
		fds = append(fds, more...)
	}
	return payload, fds, spill, tag, nil
}

// recvCarried reads want descriptors from the carrier socket and closes it.
func recvCarried(carrier, want int) (fds []int, err error) {
	defer unix.Close(carrier)
	defer func() {
		if err != nil {
			fd.CloseAll(fds)
			fds = nil
		}
	}()
	if want <= 0 || want > maxCarried {
		return nil, fmt.Errorf("mp: receive: carrier of %d descriptors", want)
	}
	var b [1]byte
	oob := make([]byte, unix.CmsgSpace(maxFDs*4))
	for len(fds) < want {
		_, oobn, flags, _, err := unix.Recvmsg(carrier, b[:], oob, recvFlags|unix.MSG_DONTWAIT)
		if oobn > 0 {
			var perr error
			fds, perr = parseRights(fds, oob[:oobn])
			if perr != nil && err == nil {
				err = perr
			}
		}
		if err != nil {
			return fds, fmt.Errorf("mp: receive: carried descriptors: %w%s", err, FDHint(err))
		}
		if flags&unix.MSG_CTRUNC != 0 {
			return fds, errors.New("mp: receive: carried descriptors were dropped by the kernel (MSG_CTRUNC): " + fd.LimitHint)
		}
		if oobn == 0 {
			return fds, fmt.Errorf("mp: receive: carrier ended after %d of %d descriptors", len(fds), want)
		}
	}
	if len(fds) != want {
		return fds, fmt.Errorf("mp: receive: carrier held %d descriptors, frame said %d", len(fds), want)
	}
	return fds, nil
}

// parseRights appends to fds every descriptor in a control message. After
// an error it returns those it read before, for the caller to close.
func parseRights(fds []int, oob []byte) ([]int, error) {
	for len(oob) > 0 {
		h, data, rest, err := unix.ParseOneSocketControlMessage(oob)
		if err != nil {
			return fds, fmt.Errorf("mp: receive: control message: %w", err)
		}
		if h.Level == unix.SOL_SOCKET && h.Type == unix.SCM_RIGHTS {
			for ; len(data) >= 4; data = data[4:] {
				fds = append(fds, int(int32(binary.NativeEndian.Uint32(data))))
			}
		}
		oob = rest
	}
	return fds, nil
}

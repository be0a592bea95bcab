package sock

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
)

// A Lane is a ring of messages in memory that two processes map: one
// writing process, whose goroutines Send in turn, and readers that take
// each message once, in order, with no system call while the other side is
// awake (see Bell). It carries bytes only: what a message's bytes refer to
// is the caller's to keep alive, and a message larger than an entry takes
// another way (ErrTooLarge).
//
// The lane's memory is a sealed memfd (it cannot shrink under its mappers)
// that CreateLane makes and each side maps with OpenLane; each Lane owns
// its mapping until Close. Layout, in pages:
//
//	0      header: magic, version, entries, entry size
//	       +128  the writer's bell: its word counts messages published
//	       +256  the readers' bell: its word counts messages taken
//	4096   entries, each: uint32 its position, uint32 length, the bytes
//
// A writer publishes an entry by filling it and then ringing; a reader
// copies an entry out, checks it, and takes it by moving the taken count
// from its position to the next (a compare-and-swap, so that readers in
// several processes take each message once). Neither side trusts what the
// other wrote: a count that runs ahead of the ring, an entry whose position
// or length is not the one expected, are errors wrapping ErrMalformed, for
// the reader, which goes on past a bad entry, or the writer. A process
// killed anywhere leaves nothing half done: an entry is published or
// taken by one atomic store or swap.
type Lane struct {
	mem     []byte
	entries uint32 // a power of two
	size    int    // bytes of an entry
	sent    *Bell
	taken   *Bell

	wmu  sync.Mutex
	tail uint32 // the writer's own count of what it published, under wmu
	rmu  sync.Mutex
}

// ErrTooLarge is returned by Send for a message larger than the lane's
// entries hold.
var ErrTooLarge = errors.New("mp: message too large for the lane")

var errLaneClosed = fmt.Errorf("%w (the lane)", ErrClosed)

const (
	laneMagic   = 0x454e4c54 // "TLNE" little-endian
	laneVersion = 1
	laneHeader  = 4096
	entryHeader = 8 // position, length

	sentBell  = 128
	takenBell = 256

	// maxLaneEntries and maxEntrySize bound a lane, and what an opener
	// accepts.
	maxLaneEntries = 1 << 16
	// maxBehind is how many times in a row a reader may find the taken
	// count ahead of the sent one it read before, as other readers and
	// the writer move on, before it calls the counts malformed.
	maxBehind    = 1 << 16
	maxEntrySize = 64 << 10
)

// CreateLane makes the memory of a lane of n entries (a power of two) of
// size bytes each (the header included; a multiple of 64), sealed against changes of
// size, owned by the caller.
func CreateLane(n, size int) (*fd.FD, error) {
	if n < 1 || n > maxLaneEntries || n&(n-1) != 0 || size <= entryHeader || size > maxEntrySize || size%64 != 0 {
		return nil, fmt.Errorf("mp: a lane of %d entries of %d bytes", n, size)
	}
	raw, err := unix.MemfdCreate("tensormp-lane", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("mp: making a lane: %w%s", err, FDHint(err))
	}
	f := fd.New(raw)
	total := int64(laneHeader) + int64(n)*int64(size)
	err = unix.Ftruncate(raw, total)
	if err == nil {
		var mem []byte
		if mem, err = unix.Mmap(raw, 0, laneHeader, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
			binary.LittleEndian.PutUint32(mem[0:], laneMagic)
			binary.LittleEndian.PutUint32(mem[4:], laneVersion)
			binary.LittleEndian.PutUint32(mem[8:], uint32(n))
			binary.LittleEndian.PutUint32(mem[12:], uint32(size))
			err = unix.Munmap(mem)
		}
	}
	if err == nil {
		_, err = unix.FcntlInt(uintptr(raw), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL)
	}
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("mp: making a lane: %w", err)
	}
	return f, nil
}

// OpenLane maps the lane whose memory f is, which stays the caller's,
// after checking that it is one: sealed against shrinking, with a header
// whose sizes fit the file.
func OpenLane(f *fd.FD) (*Lane, error) {
	raw, err := f.Lend()
	if err != nil {
		return nil, fmt.Errorf("mp: opening a lane: %w", err)
	}
	defer f.Return()
	malformed := func(format string, a ...any) error {
		return fmt.Errorf("mp: opening a lane: %w: "+format, append([]any{ErrMalformed}, a...)...)
	}
	seals, err := unix.FcntlInt(uintptr(raw), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return nil, malformed("its memory can shrink")
	}
	var st unix.Stat_t
	if err := unix.Fstat(raw, &st); err != nil {
		return nil, fmt.Errorf("mp: opening a lane: %w", err)
	}
	if st.Size < laneHeader {
		return nil, malformed("%d bytes", st.Size)
	}
	mem, err := unix.Mmap(raw, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mp: mapping a lane: %w", err)
	}
	magic := binary.LittleEndian.Uint32(mem[0:])
	version := binary.LittleEndian.Uint32(mem[4:])
	n := int64(binary.LittleEndian.Uint32(mem[8:]))
	size := int64(binary.LittleEndian.Uint32(mem[12:]))
	switch {
	case magic != laneMagic || version != laneVersion:
		err = malformed("magic %#x, version %d", magic, version)
	case n < 1 || n > maxLaneEntries || n&(n-1) != 0 || size <= entryHeader || size > maxEntrySize || size%64 != 0:
		err = malformed("%d entries of %d bytes", n, size)
	case laneHeader+n*size > st.Size:
		err = malformed("%d entries of %d bytes in %d", n, size, st.Size)
	}
	l := &Lane{mem: mem, entries: uint32(n), size: int(size)}
	if err == nil {
		if l.sent, err = NewBell(mem[sentBell : sentBell+bellSize]); err == nil {
			l.taken, err = NewBell(mem[takenBell : takenBell+bellSize])
		}
	}
	if err != nil {
		_ = unix.Munmap(mem)
		return nil, err
	}
	l.tail = l.sent.Load()
	return l, nil
}

// Close unmaps the lane once the calls using it have returned (end their
// contexts first: a waiting call holds the lane). Calls after it return
// ErrClosed.
func (l *Lane) Close() error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	l.rmu.Lock()
	defer l.rmu.Unlock()
	if l.mem == nil {
		return nil
	}
	err := unix.Munmap(l.mem)
	l.mem = nil
	return err
}

// entry returns the memory of the entry at position pos.
func (l *Lane) entry(pos uint32) []byte {
	off := laneHeader + int(pos&(l.entries-1))*l.size
	return l.mem[off : off+l.size : off+l.size]
}

// Send publishes data as the next message, waiting while the ring is full
// until ctx ends or alive reports the readers gone.
func (l *Lane) Send(ctx context.Context, data []byte, alive func() error) error {
	if len(data) > l.size-entryHeader {
		return ErrTooLarge
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if l.mem == nil {
		return errLaneClosed
	}
	for {
		taken := l.taken.Load()
		used := l.tail - taken
		if used > l.entries {
			return fmt.Errorf("mp: sending on a lane: %w: %d taken of %d sent", ErrMalformed, taken, l.tail)
		}
		if used < l.entries {
			break
		}
		if _, err := l.taken.Wait(ctx, taken, alive); err != nil {
			return err
		}
	}
	e := l.entry(l.tail)
	binary.LittleEndian.PutUint32(e[0:], l.tail)
	binary.LittleEndian.PutUint32(e[4:], uint32(len(data)))
	copy(e[entryHeader:], data)
	l.tail++
	return l.sent.Ring() // the word's atomic add publishes the entry
}

// Recv takes the next message, copying it into buf's room (growing it as
// needed) and returning it, waiting for one until ctx ends or alive
// reports the writer gone. An entry that is not what the writer should
// have written is taken and returned as an error wrapping ErrMalformed.
func (l *Lane) Recv(ctx context.Context, buf []byte, alive func() error) ([]byte, error) {
	l.rmu.Lock()
	defer l.rmu.Unlock()
	if l.mem == nil {
		return buf[:0], errLaneClosed
	}
	for behind := 0; ; {
		// sent first: taken, read second, is then at least sent less
		// the entries, from an honest writer. Another reader may have
		// taken what was sent since: then taken is ahead, and both are
		// read again, a bounded number of times.
		sent := l.sent.Load()
		taken := l.taken.Load()
		if sent == taken {
			if _, err := l.sent.Wait(ctx, taken, alive); err != nil {
				return buf[:0], err
			}
			continue
		}
		if int32(sent-taken) < 0 && behind < maxBehind {
			behind++
			continue
		}
		if sent-taken > l.entries {
			return buf[:0], fmt.Errorf("mp: receiving on a lane: %w: %d sent, %d taken, in %d entries", ErrMalformed, sent, taken, l.entries)
		}
		// Copy first, check second, take third: an entry the writer
		// reuses once another reader has taken it fails the swap.
		e := l.entry(taken)
		pos := binary.LittleEndian.Uint32(e[0:])
		n := binary.LittleEndian.Uint32(e[4:])
		var err error
		if pos != taken || int(n) > l.size-entryHeader {
			err = fmt.Errorf("mp: receiving on a lane: %w: an entry at %d says position %d, %d bytes", ErrMalformed, taken, pos, n)
		} else {
			buf = append(buf[:0], e[entryHeader:entryHeader+int(n)]...)
		}
		took, werr := l.taken.Advance(taken)
		if !took {
			continue // another reader took it
		}
		if werr != nil && err == nil {
			err = werr
		}
		if err != nil {
			return buf[:0], err
		}
		return buf, nil
	}
}

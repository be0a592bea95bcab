package sock

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/cacheline"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/shm"
)

// A Lane is a ring of messages in memory that two processes map: one
// writing process, whose goroutines Send in turn through one Lane (two
// Lanes of one memory each keep their own count of what they sent: only
// one may Send), and readers that take
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
//	       +256  the readers' bell: its word counts messages taken;
//	             the rest of its first line holds the words a Way's
//	             reader writes as it takes messages (see way_pins.go)
//	       +1024 a Way's reader's page (see way_pins.go)
//	4096   entries, each: uint32 its position, uint32 length, the bytes
//
// A writer publishes an entry by filling it and then ringing; a reader
// copies an entry out, checks it, and takes it by moving the taken count
// from its position to the next (a compare-and-swap, so that readers in
// several processes take each message once). The writer reads the taken
// count only when the count it read last leaves no room. Neither side
// trusts what the other wrote: a count that runs ahead of the ring, an
// entry whose position or length is not the one expected, are errors
// wrapping ErrMalformed, for the reader, which goes on past a bad entry,
// or the writer, at its next look at the taken count. A process
// killed anywhere leaves nothing half done: an entry is published or
// taken by one atomic store or swap.
type Lane struct {
	mem     []byte
	entries uint32 // a power of two
	size    int    // bytes of an entry
	sent    *Bell
	taken   *Bell

	wmu sync.Mutex
	// tail is the writer's own count of what it published, changed
	// under wmu and read without it (Tail), as a Way's writer and its
	// Maps read it at each message: this process's word, not the sent
	// count, whose line its reader reads and may write.
	tail atomic.Uint32
	// seen is the taken count as the writer last read it, under wmu: it
	// publishes up to seen+entries without reading it again, so that the
	// taken word's line, which each take writes, stays with the readers
	// while the lane has room.
	seen uint32
	rmu  sync.Mutex
	// nudged wakes this process's writer waiting for room without a
	// thread (see waitRoom) at a Nudge; it holds one wake at most.
	nudged chan struct{}
	// roomFirst is the first slice of such a wait (roomSlice; tests
	// change it).
	roomFirst time.Duration
}

// ErrTooLarge is returned by Send for a message larger than the lane's
// entries hold.
var ErrTooLarge = errors.New("mp: message too large for the lane")

var errLaneClosed = fmt.Errorf("%w (the lane)", ErrClosed)

// errCounts wraps ErrMalformed for a lane whose counts no honest peer
// writes: the lane is of no use any more.
var errCounts = fmt.Errorf("%w: the lane's counts", ErrMalformed)

const (
	laneMagic   = 0x454e4c54 // "TLNE" little-endian
	laneVersion = 8          // 2: the bells sleep on a count, odd while armed; 3: the reader's bell; 4: none (a writer spins for its reader); 5: laneMisses; 6: a Pipe's reader parks on its socket, woken by a wake frame; 7: entries may hold tensors in package reduction's compact form; 8: the reader's words on the taken count's line
	laneHeader  = 4096
	entryHeader = 8 // position, length

	sentBell  = 128
	takenBell = 256

	// maxLaneEntries and maxEntrySize bound a lane, and what an opener
	// accepts.
	maxLaneEntries = 1 << 16
	maxLaneBytes   = 256 << 20
	// maxBehind is how many times in a row a reader may find the taken
	// count ahead of the sent one it read before, as other readers and
	// the writer move on, before it calls the counts malformed.
	maxBehind    = 1 << 16
	maxEntrySize = 64 << 10
)

// CreateLane makes the memory of a lane of n entries (a power of two) of
// size bytes each (the header included; a multiple of 64), sealed against
// changes of size, owned by the caller.
func CreateLane(n, size int) (*fd.FD, error) {
	if err := checkLaneShape(int64(n), int64(size)); err != nil {
		return nil, fmt.Errorf("mp: making a lane: %w", err)
	}
	raw, err := unix.MemfdCreate("tensormp-lane", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("mp: making a lane: %w%s", err, FDHint(err))
	}
	f := fd.New(raw)
	hdr := make([]byte, 16)
	binary.LittleEndian.PutUint32(hdr[0:], laneMagic)
	binary.LittleEndian.PutUint32(hdr[4:], laneVersion)
	binary.LittleEndian.PutUint32(hdr[8:], uint32(n))
	binary.LittleEndian.PutUint32(hdr[12:], uint32(size))
	err = unix.Ftruncate(raw, laneHeader+int64(n)*int64(size))
	if err == nil {
		_, err = unix.Pwrite(raw, hdr, 0)
	}
	if err == nil {
		_, err = unix.FcntlInt(uintptr(raw), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL)
	}
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("mp: making a lane of %d entries of %d bytes: %w", n, size, err)
	}
	return f, nil
}

// checkLaneShape says what is wrong with a lane of n entries of size
// bytes, if anything.
func checkLaneShape(n, size int64) error {
	switch {
	case n < 1 || n > maxLaneEntries || n&(n-1) != 0:
		return fmt.Errorf("%d entries: want a power of two from 1 to %d", n, maxLaneEntries)
	case size <= entryHeader || size > maxEntrySize || size%64 != 0:
		return fmt.Errorf("entries of %d bytes: want a multiple of 64 from 64 to %d", size, maxEntrySize)
	case laneHeader+n*size > maxLaneBytes:
		return fmt.Errorf("%d entries of %d bytes: more than %d in all", n, size, maxLaneBytes)
	}
	return nil
}

// OpenLane maps the lane whose memory f is, which stays the caller's,
// after checking that it is one: sealed against shrinking, with a header
// whose sizes are a lane's and fit the file. It maps what the header
// says, no more.
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
	switch {
	case err != nil:
		return nil, malformed("its seals: %v (not a memfd?)", err)
	case seals&unix.F_SEAL_SHRINK == 0:
		return nil, malformed("its memory can shrink (seals %#x)", seals)
	}
	var st unix.Stat_t
	if err := unix.Fstat(raw, &st); err != nil {
		return nil, fmt.Errorf("mp: opening a lane: %w", err)
	}
	hdr := make([]byte, 16)
	if st.Size < laneHeader {
		return nil, malformed("%d bytes, less than a header", st.Size)
	}
	if _, err := unix.Pread(raw, hdr, 0); err != nil {
		return nil, fmt.Errorf("mp: reading a lane's header: %w", err)
	}
	magic := binary.LittleEndian.Uint32(hdr[0:])
	version := binary.LittleEndian.Uint32(hdr[4:])
	n := int64(binary.LittleEndian.Uint32(hdr[8:]))
	size := int64(binary.LittleEndian.Uint32(hdr[12:]))
	if magic != laneMagic || version != laneVersion {
		return nil, malformed("magic %#x, version %d", magic, version)
	}
	if err := checkLaneShape(n, size); err != nil {
		return nil, malformed("%v", err)
	}
	total := laneHeader + n*size
	if total > st.Size {
		return nil, malformed("%d entries of %d bytes in a file of %d", n, size, st.Size)
	}
	mem, err := unix.Mmap(raw, 0, int(total), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mp: mapping a lane of %d bytes: %w", total, err)
	}
	l := &Lane{mem: mem, entries: uint32(n), size: int(size), nudged: make(chan struct{}, 1), roomFirst: roomSlice}
	if l.sent, err = NewBell(mem[sentBell : sentBell+bellSize]); err == nil {
		l.taken, err = NewBell(mem[takenBell : takenBell+bellSize])
	}
	if err != nil {
		_ = unix.Munmap(mem)
		return nil, err
	}
	l.tail.Store(l.sent.Load())
	l.seen = l.taken.Load()
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
	off := l.entryAt(pos)
	return l.mem[off : off+l.size : off+l.size]
}

// entryAt returns the offset in the lane's memory of the entry at
// position pos.
func (l *Lane) entryAt(pos uint32) int { return laneHeader + int(pos&(l.entries-1))*l.size }

// Send publishes data as the next message, waiting while the ring is full
// until ctx ends or alive reports the readers gone (see waitRoom). Once
// it returns nil the message is the readers'.
func (l *Lane) Send(ctx context.Context, data []byte, alive func() error) error {
	return l.send(ctx, data, alive, true, laneSleep)
}

// TrySend is Send that returns ErrWouldBlock instead of waiting for room.
func (l *Lane) TrySend(data []byte) error {
	return l.send(context.Background(), data, nil, false, 0)
}

// Resume makes the next message this Lane sends follow the last one the
// lane's memory says was published: for a writer that takes over from
// another Lane of the same memory (another process's, gone).
func (l *Lane) Resume() {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if l.mem != nil {
		l.tail.Store(l.sent.Load())
		l.seen = l.taken.Load()
	}
}

// Room returns the most bytes one message may have.
func (l *Lane) Room() int { return l.size - entryHeader }

// Tail returns the position the next message sent will have: every
// message this Lane sent has a position before it.
func (l *Lane) Tail() uint32 { return l.tail.Load() }

// Sent returns the count of messages published, and Taken the count of
// those taken, as the lane's memory says now.
func (l *Lane) Sent() uint32  { return l.sent.Load() }
func (l *Lane) Taken() uint32 { return l.taken.Load() }

// warmSend asks, without waiting, for the cache lines the writer's next
// Send writes that the reader wrote last: the first line of the entry
// after the last one published, and with taken, the taken count's line
// (a fair Way's writer claims its reader there). They then move from the
// reader's CPU while the caller encodes the message, not at the send's
// first store or atomic operation. The sent count's line is left alone:
// a reader spinning on it would only take it back before the ring.
func (l *Lane) warmSend(taken bool) {
	mem := l.mem
	if mem == nil {
		return
	}
	if taken {
		cacheline.ForWrite(unsafe.Pointer(&mem[takenBell]))
	}
	// The writer's own count, not the sent count, whose line the
	// reader's spin takes from this CPU's cache as it reads it.
	cacheline.ForWrite(unsafe.Pointer(&mem[l.entryAt(l.tail.Load())]))
}

// warmTake asks, without waiting, for the first line of the entry at
// position pos, which a reader takes next.
func (l *Lane) warmTake(pos uint32) {
	mem := l.mem
	if mem == nil {
		return
	}
	cacheline.ForRead(unsafe.Pointer(&mem[l.entryAt(pos)]))
}

// readerCPU returns the CPU the reader that last took an entry, or
// stamped (stampCPU), ran on then, plus one, or 0 (see Bell.RingerCPU).
func (l *Lane) readerCPU() uint32 { return l.taken.RingerCPU() }

// readerStamp returns the stamp at off (readerAt) on the taken count's
// line (see way_pins.go), or nil once the lane is closed.
func (l *Lane) readerStamp(off int) *atomic.Int64 {
	if l.mem == nil {
		return nil
	}
	return (*atomic.Int64)(unsafe.Pointer(&l.mem[readerPage+off]))
}

// readerSpunWithin reports whether a reader stamped a spin on the lane,
// waiting for an entry, within d of now, a reading of monoNow (see
// Bell.spunWithin: a spin shorter than stampEvery stamps nothing).
func (l *Lane) readerSpunWithin(now int64, d time.Duration) bool { return l.sent.spunWithin(now, d) }

// stampCPU stamps the CPU this process runs on (see runningCPU)
// in the bell that its side rings, the writer's or the readers', as a
// ring would: for a side whose messages go by the socket for a while,
// which rings nothing, so that the other side's spins see it all the same.
func (l *Lane) stampCPU(writer bool) {
	if writer {
		l.sent.stampCPU()
	} else {
		l.taken.stampCPU()
	}
}

// WaitSent waits until the count of messages published is no longer
// last, as Bell.Wait does, and returns it.
func (l *Lane) WaitSent(ctx context.Context, last uint32, alive func() error) (uint32, error) {
	return l.sent.Wait(ctx, last, alive)
}

// SpinSent spins until the count of messages published is no longer
// last, as a wait does before it sleeps, and reports whether it moved
// (see Bell.Spin).
func (l *Lane) SpinSent(last uint32) bool {
	_, moved := l.sent.Spin(last)
	return moved
}

// WaitSentUntil is WaitSent that ends with errWaitedEnough once it has
// waited patience, and asks look once before it first sleeps (see
// Bell.WaitUntil).
func (l *Lane) WaitSentUntil(ctx context.Context, last uint32, alive func() error, patience time.Duration, look func() error) (uint32, error) {
	return l.sent.WaitUntil(ctx, last, alive, patience, look)
}

// Nudge wakes the readers and the writer asleep on the lane, if any,
// and this process's writer waiting for room without a thread, without
// a message: they look at their context and at alive at once.
func (l *Lane) Nudge() {
	l.sent.Nudge()
	l.taken.Nudge()
	select {
	case l.nudged <- struct{}{}:
	default: // a wake is pending already
	}
}

// send publishes data as Send does, or, unless block, as TrySend does. A
// writer that waits for room waits on the lane for patience at most (see
// waitRoom).
func (l *Lane) send(ctx context.Context, data []byte, alive func() error, block bool, patience time.Duration) error {
	if len(data) > l.size-entryHeader {
		return fmt.Errorf("%w: %d bytes, where an entry holds %d", ErrTooLarge, len(data), l.size-entryHeader)
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if l.mem == nil {
		return errLaneClosed
	}
	var slice time.Duration // see waitRoom
	tail := l.tail.Load()
	for pass := 1; ; pass++ {
		if tail-l.seen < l.entries {
			break // room as of the last look: takes only move the count on
		}
		taken := l.taken.Load()
		used := tail - taken
		if used > l.entries {
			return fmt.Errorf("mp: sending on a lane: %w: %d taken of %d sent", errCounts, taken, tail)
		}
		l.seen = taken
		if used < l.entries {
			break
		}
		if !block {
			return ErrWouldBlock
		}
		var err error
		if slice, err = l.waitRoom(ctx, taken, alive, patience, slice); err != nil {
			return err
		}
		if err := checkEvery(ctx, pass); err != nil {
			return err
		}
	}
	e := l.entry(tail)
	binary.LittleEndian.PutUint32(e[0:], tail)
	binary.LittleEndian.PutUint32(e[4:], uint32(len(data)))
	copy(e[entryHeader:], data)
	l.tail.Store(tail + 1)
	l.sent.Ring() // the word's atomic add publishes the entry
	return nil
}

// A writer that waits for room in a full lane waits on the lane's bell,
// a thread asleep in FUTEX_WAIT that the reader's take wakes, only while
// it holds one of its process's lane waits (laneWaiters, which readers
// share), taken once a send: for its patience, and on, a patience at a
// time, while no other wait was refused one meanwhile. Without one, or
// after that, it spins on the lane as a wait does, then looks at the
// lane each slice with its goroutine asleep on a timer, holding no
// thread: roomSlice first, doubling each time no room came, up to
// maxSleepSlice, the bell's own longest sleep. No reader's take wakes it
// there (the reader's process has no way to it but the socket, which
// carries the other direction's messages too): it sees room up to a
// slice late, and a slice is never much longer than its wait so far.
// Its context's end, its own Way's Close and the readers' end (see
// Way.watchPeer, which nudges it: Nudge) end the wait at once.
const roomSlice = 100 * time.Microsecond

// roomStep, if set, runs as a writer without a lane wait begins each
// slice of its wait for room, with the slice: for tests.
var roomStep atomic.Pointer[func(slice time.Duration)]

// waitRoom waits for room in the lane, whose reader had taken up to
// taken, as a writer does (see roomSlice): until the reader takes more,
// or, waiting on a timer, for one slice or until a Nudge; it returns
// ctx's error once ctx ends, and alive's if it fails. slice is zero in a
// send's first wait, which may take a lane wait; after that, the length
// of the send's next slice on a timer, which waitRoom returns.
func (l *Lane) waitRoom(ctx context.Context, taken uint32, alive func() error, patience, slice time.Duration) (time.Duration, error) {
	if slice == 0 {
		slice = l.roomFirst
		if takeLaneWait() {
			var err error
			var disarm func()
			refused := laneWaitsRefused.Load()
			for {
				_, err = l.taken.WaitUntil(ctx, taken, alive, patience, nil)
				if !errors.Is(err, errWaitedEnough) || laneWaitsRefused.Load() != refused {
					break
				}
				if disarm == nil && ctx.Done() != nil {
					// The next wait's first slice would see ctx's end
					// only at its end, as a hot wait's does.
					disarm = l.taken.nudgeAtEnd(ctx)
				}
			}
			if disarm != nil {
				disarm()
			}
			laneSleepers.Add(-1)
			if !errors.Is(err, errWaitedEnough) {
				return slice, err
			}
		}
		if _, moved := l.taken.Spin(taken); moved {
			return slice, nil
		}
	}
	// Asked before each sleep, which arms what nudges it at the readers'
	// end (see Way.watchPeer) before the first.
	if err := alive(); err != nil {
		return slice, err
	}
	if h := roomStep.Load(); h != nil {
		(*h)(slice)
	}
	t := time.NewTimer(slice)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return slice, ctx.Err()
	case <-l.nudged:
	case <-t.C:
		if l.taken.Load() == taken {
			slice = min(2*slice, max(maxSleepSlice, slice))
		}
	}
	return slice, nil
}

// Recv takes the next message, copying it into buf's room (growing it as
// needed) and returning it, waiting for one until ctx ends or alive
// reports the writer gone. An entry that is not what the writer should
// have written is taken and returned as an error wrapping ErrMalformed.
//
// Positions are 32-bit: a reader stalled between its copy and its take for
// exactly 2^32 messages of other readers would take a stale copy.
func (l *Lane) Recv(ctx context.Context, buf []byte, alive func() error) ([]byte, error) {
	buf, _, err := l.recv(ctx, buf, alive, true)
	return buf, err
}

// TryRecv is Recv that returns ErrWouldBlock instead of waiting for a
// message. It returns the message's position too.
func (l *Lane) TryRecv(buf []byte) ([]byte, uint32, error) {
	return l.recv(context.Background(), buf, nil, false)
}

func (l *Lane) recv(ctx context.Context, buf []byte, alive func() error, block bool) ([]byte, uint32, error) {
	l.rmu.Lock()
	defer l.rmu.Unlock()
	if l.mem == nil {
		return buf[:0], 0, errLaneClosed
	}
	for pass, behind := 1, 0; ; pass++ {
		if err := checkEvery(ctx, pass); err != nil {
			return buf[:0], 0, err
		}
		// sent first: taken, read second, is then at least sent less
		// the entries, from an honest writer. Another reader may have
		// taken what was sent since: then taken is ahead, and both are
		// read again, up to maxBehind times in a row.
		sent := l.sent.Load()
		taken := l.taken.Load()
		if sent == taken {
			behind = 0
			if !block {
				return buf[:0], 0, ErrWouldBlock
			}
			if _, err := l.sent.Wait(ctx, taken, alive); err != nil {
				return buf[:0], 0, err
			}
			continue
		}
		if int32(sent-taken) < 0 && behind < maxBehind {
			behind++
			continue
		}
		behind = 0
		if sent-taken > l.entries {
			return buf[:0], 0, fmt.Errorf("mp: receiving on a lane: %w: %d sent, %d taken, in %d entries", errCounts, sent, taken, l.entries)
		}
		// Copy first, check second, take third: an entry the writer
		// reuses once another reader has taken it fails the swap.
		e := l.entry(taken)
		pos := binary.LittleEndian.Uint32(e[0:])
		n := binary.LittleEndian.Uint32(e[4:])
		var err error
		if pos != taken || int64(n) > int64(l.size-entryHeader) {
			err = fmt.Errorf("mp: receiving on a lane: %w: an entry at %d says position %d, %d bytes", ErrMalformed, taken, pos, n)
		} else {
			buf = append(buf[:0], e[entryHeader:entryHeader+int(n)]...)
		}
		if !l.taken.Advance(taken) {
			continue // another reader took it
		}
		if err != nil {
			return buf[:0], taken, err
		}
		return buf, taken, nil
	}
}

// Ahead calls yield with each message published and not taken yet,
// oldest first, until yield returns false: a copy in buf's room, valid
// until yield returns. It takes nothing. An entry that is not what the
// writer should have written ends the walk; a writer that reuses an
// entry while it is copied, once another reader took it, is not
// noticed, so what yield gets is a hint, to be checked when the
// message is taken. It returns buf's room, grown as needed.
func (l *Lane) Ahead(buf []byte, yield func(data []byte) bool) []byte {
	return l.ahead(buf, l.size, yield)
}

// Heads is Ahead that copies at most limit bytes of each message, for a
// look at what they begin with.
func (l *Lane) Heads(buf []byte, limit int, yield func(head []byte) bool) []byte {
	return l.ahead(buf, limit, yield)
}

func (l *Lane) ahead(buf []byte, limit int, yield func(data []byte) bool) []byte {
	l.rmu.Lock()
	defer l.rmu.Unlock()
	if l.mem == nil {
		return buf
	}
	sent := l.sent.Load()
	taken := l.taken.Load()
	if int32(sent-taken) <= 0 || sent-taken > l.entries {
		return buf
	}
	for pos := taken; pos != sent; pos++ {
		e := l.entry(pos)
		n := binary.LittleEndian.Uint32(e[4:])
		if binary.LittleEndian.Uint32(e[0:]) != pos || int64(n) > int64(l.size-entryHeader) {
			return buf
		}
		buf = append(buf[:0], e[entryHeader:entryHeader+min(int(n), limit)]...)
		if !yield(buf) {
			return buf
		}
	}
	return buf
}

// readerWord returns the word at off from the lane's reader's page (see
// Way; the words before the page, at negative offsets, lie on the taken
// count's line), or nil for a closed lane. The caller keeps the lane
// open.
func (l *Lane) readerWord(off int) *atomic.Uint32 {
	if l.mem == nil {
		return nil
	}
	return (*atomic.Uint32)(unsafe.Pointer(&l.mem[readerPage+off]))
}

// readerID returns the segment identity at off in the reader's page.
func (l *Lane) readerID(off int) shm.ID {
	p := unsafe.Pointer(&l.mem[readerPage+off])
	return shm.ID{Dev: (*atomic.Uint64)(p).Load(), Ino: (*atomic.Uint64)(unsafe.Add(p, 8)).Load()}
}

// setReaderID writes id at off in the reader's page.
func (l *Lane) setReaderID(off int, id shm.ID) {
	p := unsafe.Pointer(&l.mem[readerPage+off])
	(*atomic.Uint64)(p).Store(id.Dev)
	(*atomic.Uint64)(unsafe.Add(p, 8)).Store(id.Ino)
}

var _ [laneHeader - readerPage - laneMisses - 4]byte // it fits, the last word included

// The reader's words on the taken bell's first line (takenLine) start
// where the bell's own words end, and end within the line.
var (
	_ [readerPage + takenLine - (takenBell + bellOwn)]struct{}
	_ [takenBell + bellOwn - (readerPage + takenLine)]struct{}
	_ [takenBell + 64 - (readerPage + readerAt + 8)]struct{}
	_ [1 - (readerPage+readerAt)%8]struct{} // readerAt loads whole
)

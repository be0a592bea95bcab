//go:build linux

package sock_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/sock"
)

func init() {
	reexec.Register("sock.lane-writer", laneWriter)
	reexec.Register("sock.lane-reader", laneReader)
}

// Lane tests use a small ring, so that writers wait for room and readers
// for messages, both asleep and spinning.
const (
	laneEntries = 8
	laneEntry   = 256
	laneMsgs    = 20000
)

// laneMsg returns message i: its index, then i%200 bytes that depend on it.
func laneMsg(i int) []byte {
	b := binary.LittleEndian.AppendUint32(nil, uint32(i))
	for j := range i % 200 {
		b = append(b, byte(i+j))
	}
	return b
}

// openLaneFD opens the lane whose memory is descriptor 3, a helper's.
func openLaneFD() (*sock.Lane, error) { return sock.OpenLane(fd.New(3)) }

// laneHelper runs a helper's part on the lane at fd 3, with a minute to do
// it, and returns its exit status.
func laneHelper(part func(ctx context.Context, l *sock.Lane) error) int {
	l, err := openLaneFD()
	if err != nil {
		return fail(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := part(ctx, l); err != nil {
		return fail(err)
	}
	return 0
}

// laneWriter sends laneMsgs messages on the lane at fd 3, pausing now and
// then so that its readers sleep.
func laneWriter() int {
	return laneHelper(func(ctx context.Context, l *sock.Lane) error {
		for i := range laneMsgs {
			if i%500 == 0 {
				time.Sleep(time.Millisecond)
			}
			if err := l.Send(ctx, laneMsg(i), func() error { return nil }); err != nil {
				return err
			}
		}
		return nil
	})
}

// laneReader takes messages from the lane at fd 3 until one says stop,
// checks each, and prints the index of each on stdout.
func laneReader() int {
	return laneHelper(func(ctx context.Context, l *sock.Lane) error {
		var buf []byte
		var err error
		for {
			if buf, err = l.Recv(ctx, buf, func() error { return nil }); err != nil {
				return err
			}
			if string(buf) == "stop" {
				return nil
			}
			i := int(binary.LittleEndian.Uint32(buf))
			if !bytes.Equal(buf, laneMsg(i)) {
				return fmt.Errorf("message %d is not what was sent", i)
			}
			fmt.Println(i)
		}
	})
}

// newLane makes a lane's memory and maps it here.
func newLane(t testing.TB) (*fd.FD, *sock.Lane) {
	t.Helper()
	f, err := sock.CreateLane(laneEntries, laneEntry)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	l, err := sock.OpenLane(f)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return f, l
}

// laneFile returns f as an *os.File for a helper's ExtraFiles, closed at
// the test's end.
func laneFile(t *testing.T, f *fd.FD) *os.File {
	t.Helper()
	dup, err := f.Dup()
	require.NoError(t, err)
	raw, err := dup.Disown()
	require.NoError(t, err)
	file := os.NewFile(uintptr(raw), "lane")
	t.Cleanup(func() { _ = file.Close() })
	return file
}

// Messages from a writer process arrive whole and in order, every one,
// through a ring much smaller than the stream.
func TestLaneCarriesAStream(t *testing.T) {
	f, l := newLane(t)
	wait, _, hangup := startPeer(t, "sock.lane-writer", nil, []*os.File{laneFile(t, f)})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	alive := hungUp(hangup)
	var buf []byte
	var err error
	for i := range laneMsgs {
		buf, err = l.Recv(ctx, buf, alive)
		require.NoError(t, err, "message %d", i)
		require.Equal(t, laneMsg(i), buf, "message %d", i)
	}
	require.NoError(t, wait())
}

// Readers in two processes take each message once: together, every one.
func TestLaneReadersTakeEachOnce(t *testing.T) {
	f, l := newLane(t)
	file := laneFile(t, f)
	var outs [2]strings.Builder
	var waits []func() error
	var hangups []func() error
	for i := range outs {
		wait, _, hangup := startPeer(t, "sock.lane-reader", &outs[i], []*os.File{file})
		waits = append(waits, wait)
		hangups = append(hangups, hungUp(hangup))
	}
	// The readers are gone once both have hung up.
	alive := func() error {
		for _, h := range hangups {
			if h() == nil {
				return nil
			}
		}
		return errGone
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := range laneMsgs {
		require.NoError(t, l.Send(ctx, laneMsg(i), alive), "message %d", i)
	}
	for range outs {
		require.NoError(t, l.Send(ctx, []byte("stop"), alive))
	}
	for _, wait := range waits {
		require.NoError(t, wait())
	}
	var got []int
	for i := range outs {
		for _, line := range strings.Fields(outs[i].String()) {
			n, err := strconv.Atoi(line)
			require.NoError(t, err)
			got = append(got, n)
		}
	}
	slices.Sort(got)
	require.Len(t, got, laneMsgs, "messages taken, counting twice-taken ones twice")
	for i, n := range got {
		require.Equal(t, i, n, "message %d taken twice or never", i)
	}
}

// A message larger than an entry is refused, whole; a lane's waits end
// with their context and with alive's error.
func TestLaneLimits(t *testing.T) {
	_, l := newLane(t)
	ctx := context.Background()
	alive := func() error { return nil }
	assert.ErrorIs(t, l.Send(ctx, make([]byte, laneEntry-7), alive), sock.ErrTooLarge)
	require.NoError(t, l.Send(ctx, make([]byte, laneEntry-8), alive), "a message that fills an entry")
	_, err := l.Recv(ctx, nil, alive)
	require.NoError(t, err)

	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	_, err = l.Recv(short, nil, alive)
	assert.ErrorIs(t, err, context.DeadlineExceeded)

	for range laneEntries {
		require.NoError(t, l.Send(ctx, []byte("x"), alive))
	}
	_, err = l.Recv(ctx, nil, func() error { return nil })
	require.NoError(t, err)
	require.NoError(t, l.Send(ctx, []byte("x"), alive))
	gone := fmt.Errorf("readers gone")
	err = l.Send(ctx, []byte("full"), func() error { return gone })
	assert.ErrorIs(t, err, gone, "a full ring whose readers are gone")
}

// OpenLane maps only what a lane made: sealed, big enough for what its
// header says.
func TestOpenLaneRefuses(t *testing.T) {
	memfd := func(sealed bool, size int64, header []uint32) *fd.FD {
		flags := unix.MFD_CLOEXEC
		if sealed {
			flags |= unix.MFD_ALLOW_SEALING
		}
		raw, err := unix.MemfdCreate("lane-test", flags)
		require.NoError(t, err)
		f := fd.New(raw)
		t.Cleanup(func() { _ = f.Close() })
		require.NoError(t, unix.Ftruncate(raw, size))
		var b []byte
		for _, w := range header {
			b = binary.LittleEndian.AppendUint32(b, w)
		}
		_, err = unix.Pwrite(raw, b, 0)
		require.NoError(t, err)
		if sealed {
			_, err = unix.FcntlInt(uintptr(raw), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW)
			require.NoError(t, err)
		}
		return f
	}
	// A lane's own magic and version, so that each case is refused for
	// what it names, not for an old version.
	made, err := sock.CreateLane(laneEntries, laneEntry)
	require.NoError(t, err)
	hdr := make([]byte, 8)
	_, err = unix.Pread(made.Num(), hdr, 0)
	require.NoError(t, err)
	require.NoError(t, made.Close())
	magic, version := binary.LittleEndian.Uint32(hdr), binary.LittleEndian.Uint32(hdr[4:])
	require.Equal(t, uint32(0x454e4c54), magic)
	for _, c := range []struct {
		name string
		f    *fd.FD
	}{
		{"unsealed", memfd(false, 4096+8*256, []uint32{magic, version, 8, 256})},
		{"shorter than a header", memfd(true, 100, nil)},
		{"not a lane", memfd(true, 4096+8*256, []uint32{0xdead, version, 8, 256})},
		{"another version", memfd(true, 4096+8*256, []uint32{magic, 99, 8, 256})},
		{"entries past its end", memfd(true, 4096+8*256, []uint32{magic, version, 16, 256})},
		{"entries not a power of two", memfd(true, 4096+8*256, []uint32{magic, version, 6, 256})},
		{"entries too small", memfd(true, 4096+8*256, []uint32{magic, version, 8, 8})},
		{"entries unaligned", memfd(true, 4096+8*256, []uint32{magic, version, 8, 200})},
		// Sparse, as a hostile creator's may be: the header's sizes fit
		// the file, but no lane is that large.
		{"larger than a lane may be", memfd(true, 4096+1<<32, []uint32{magic, version, 1 << 16, 1 << 16})},
	} {
		_, err := sock.OpenLane(c.f)
		assert.ErrorIs(t, err, sock.ErrMalformed, c.name)
	}
}

// laneMemory maps f's memory a second time, for a test to write as a
// hostile writer would.
func laneMemory(t testing.TB, f *fd.FD) []byte {
	t.Helper()
	mem, err := unix.Mmap(f.Num(), 0, 4096+laneEntries*laneEntry, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(mem) })
	return mem
}

// A replayed or corrupt entry is an error wrapping ErrMalformed, and the
// reader goes on to the next message.
func TestLaneRefusesABadEntry(t *testing.T) {
	f, l := newLane(t)
	mem := laneMemory(t, f)
	ctx := context.Background()
	alive := func() error { return nil }
	for i, c := range []struct {
		name    string
		corrupt func(e []byte, pos uint32)
	}{
		// What the entry held the lap before.
		{"replayed", func(e []byte, pos uint32) { binary.LittleEndian.PutUint32(e, pos-laneEntries) }},
		{"from the future", func(e []byte, pos uint32) { binary.LittleEndian.PutUint32(e, pos+1) }},
		{"longer than an entry", func(e []byte, _ uint32) { binary.LittleEndian.PutUint32(e[4:], laneEntry) }},
	} {
		// Each case starts at position 2i: "bad", then "good".
		pos := uint32(2 * i)
		require.NoError(t, l.Send(ctx, []byte("bad"), alive))
		require.NoError(t, l.Send(ctx, []byte("good"), alive))
		c.corrupt(mem[4096+int(pos%laneEntries)*laneEntry:], pos)
		_, err := l.Recv(ctx, nil, alive)
		assert.ErrorIs(t, err, sock.ErrMalformed, c.name)
		got, err := l.Recv(ctx, nil, alive)
		require.NoError(t, err, c.name)
		assert.Equal(t, "good", string(got), c.name)
	}
}

// Whatever a hostile writer puts in the lane's memory, a receive returns a
// message, an error wrapping ErrMalformed, or its context's end: never a
// crash, a hang, or bytes from outside the entry.
func FuzzLane(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{128, 0, 5, 0, 0, 0})                          // sent word ahead by 5
	f.Add([]byte{128, 0, 0xff, 0xff, 0xff, 0xff})              // sent word behind
	f.Add([]byte{0, 1, 0xff, 0xff, 0, 0, 128, 0, 1, 0, 0, 0})  // taken word moved, sent ahead
	f.Add([]byte{4, 16, 0xff, 0xff, 0, 0, 128, 0, 1, 0, 0, 0}) // entry 0's length
	f.Fuzz(func(t *testing.T, pokes []byte) {
		fd, l := newLane(t)
		mem := laneMemory(t, fd)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
		defer cancel()
		require.NoError(t, l.Send(ctx, []byte("honest"), func() error { return nil }))
		for i := 0; i+6 <= len(pokes) && i < 16*6; i += 6 {
			off := int(binary.LittleEndian.Uint16(pokes[i:])) % len(mem) &^ 3
			copy(mem[off:], pokes[i+2:i+6])
		}
		for range 3 {
			got, err := l.Recv(ctx, nil, func() error { return nil })
			switch {
			case err == nil:
				assert.LessOrEqual(t, len(got), laneEntry-8)
			case errors.Is(err, sock.ErrMalformed), errors.Is(err, context.DeadlineExceeded):
			default:
				t.Fatalf("an error that is not ErrMalformed: %v", err)
			}
		}
	})
}

// A writer that opens a lane, or resumes after another writer of the
// same memory, counts the entries that writer left untaken: it does not
// write over them, and has room again once they are taken.
func TestLaneWriterCountsWhatItFinds(t *testing.T) {
	f, first := newLane(t)
	resumed, err := sock.OpenLane(f) // opened before the first writer sends
	require.NoError(t, err)
	defer resumed.Close()
	for i := range laneEntries {
		require.NoError(t, first.TrySend([]byte{byte(i)}))
	}
	opened, err := sock.OpenLane(f)
	require.NoError(t, err)
	defer opened.Close()
	resumed.Resume()
	for _, l := range []*sock.Lane{opened, resumed} {
		assert.ErrorIs(t, l.TrySend([]byte("over")), sock.ErrWouldBlock, "the lane is full")
	}
	buf, _, err := opened.TryRecv(nil)
	require.NoError(t, err)
	assert.Equal(t, []byte{0}, buf, "the first entry, not written over")
	require.NoError(t, resumed.TrySend([]byte("next")), "room once one is taken")
	for i := 1; i < laneEntries; i++ {
		buf, _, err := opened.TryRecv(nil)
		require.NoError(t, err)
		assert.Equal(t, []byte{byte(i)}, buf)
	}
	buf, _, err = opened.TryRecv(nil)
	require.NoError(t, err)
	assert.Equal(t, []byte("next"), buf)
}

// A reader that says it took more than was sent is an error wrapping
// ErrMalformed for the writer, once the room it saw at its last look at
// the taken count is used up: not a wait for room that never comes, nor
// an entry written over one not taken.
func TestLaneRefusesAReaderAhead(t *testing.T) {
	f, l := newLane(t)
	mem := laneMemory(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	alive := func() error { return nil }
	require.NoError(t, l.Send(ctx, []byte("one"), alive))
	binary.LittleEndian.PutUint32(mem[256:], 1+laneEntries+5) // the taken word
	for i := 1; i < laneEntries; i++ {
		require.NoError(t, l.Send(ctx, []byte("more"), alive), "send %d: room as of the writer's last look", i)
	}
	assert.ErrorIs(t, l.Send(ctx, []byte("two"), alive), sock.ErrMalformed)
}

// Ahead shows the messages published and not taken yet, oldest first,
// taking none: a receive still gets each. It stops where yield says, and
// at an entry the writer did not write.
func TestLaneAhead(t *testing.T) {
	f, l := newLane(t)
	mem := laneMemory(t, f)
	ctx := context.Background()
	alive := func() error { return nil }
	ahead := func(most int) []string {
		var got []string
		l.Ahead(nil, func(data []byte) bool {
			got = append(got, string(data))
			return len(got) < most
		})
		return got
	}
	assert.Empty(t, ahead(10), "an empty lane")
	for _, s := range []string{"a", "bb", "ccc", "dddd"} {
		require.NoError(t, l.Send(ctx, []byte(s), alive))
	}
	assert.Equal(t, []string{"a", "bb", "ccc", "dddd"}, ahead(10))
	assert.Equal(t, []string{"a", "bb"}, ahead(2), "until yield says stop")
	got, err := l.Recv(ctx, nil, alive)
	require.NoError(t, err)
	assert.Equal(t, "a", string(got), "Ahead took nothing")
	assert.Equal(t, []string{"bb", "ccc", "dddd"}, ahead(10), "what is left after a receive")

	// The entry at position 3 ("dddd") longer than an entry holds, then
	// the one at position 2 ("ccc") replayed from the lap before.
	binary.LittleEndian.PutUint32(mem[4096+3*laneEntry+4:], laneEntry)
	assert.Equal(t, []string{"bb", "ccc"}, ahead(10), "a bad length ends the walk")
	replayed := uint32(2)
	replayed -= laneEntries
	binary.LittleEndian.PutUint32(mem[4096+2*laneEntry:], replayed)
	assert.Equal(t, []string{"bb"}, ahead(10), "a bad position ends the walk")
}

// A lane's mapping is one that leakcheck counts, so that a test that
// leaves one mapped fails, and Close unmaps it.
func TestLaneMappingIsCounted(t *testing.T) {
	before, err := leakcheck.Mappings()
	require.NoError(t, err)
	f, err := sock.CreateLane(laneEntries, laneEntry)
	require.NoError(t, err)
	defer f.Close()
	l, err := sock.OpenLane(f)
	require.NoError(t, err)
	mapped, err := leakcheck.Mappings()
	require.NoError(t, err)
	assert.Equal(t, before+1, mapped, "the lane's mapping")
	require.NoError(t, l.Close())
	after, err := leakcheck.Mappings()
	require.NoError(t, err)
	assert.Equal(t, before, after, "the lane unmapped")
}

// Counts that no honest writer or reader leaves are an error wrapping
// ErrMalformed at once, for a receive that waits and one that does not:
// a sent count further ahead of the taken one than the ring holds, though
// the entry at the taken count is a good one, and a taken count that
// stays ahead of the sent one (other readers' takes explain that only for
// a while), not a spin without end.
func TestLaneRefusesCountsNoPeerLeaves(t *testing.T) {
	f, l := newLane(t)
	mem := laneMemory(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	alive := func() error { return nil }
	require.NoError(t, l.TrySend([]byte("honest")))
	sent, taken := mem[128:], mem[256:] // the bells' words
	binary.LittleEndian.PutUint32(sent, laneEntries+1)
	_, err := l.Recv(ctx, nil, alive)
	assert.ErrorIs(t, err, sock.ErrMalformed, "a sent count beyond the ring")
	_, _, err = l.TryRecv(nil)
	assert.ErrorIs(t, err, sock.ErrMalformed, "a sent count beyond the ring, without waiting")

	binary.LittleEndian.PutUint32(sent, 1)
	binary.LittleEndian.PutUint32(taken, 5)
	_, err = l.Recv(ctx, nil, alive)
	assert.ErrorIs(t, err, sock.ErrMalformed, "a taken count that stays ahead")
	done := make(chan error, 1)
	go func() {
		_, _, err := l.TryRecv(nil)
		done <- err
	}()
	select {
	case err = <-done:
		assert.ErrorIs(t, err, sock.ErrMalformed, "a taken count that stays ahead, without waiting")
	case <-time.After(5 * time.Second):
		binary.LittleEndian.PutUint32(taken, 1) // ends the spin, so that the lane closes
		<-done
		t.Fatal("TryRecv spun on a taken count ahead of the sent one")
	}
}

// A message that fills its entry is shown whole by Ahead, as a receive
// takes it.
func TestLaneAheadShowsAFullEntry(t *testing.T) {
	_, l := newLane(t)
	full := bytes.Repeat([]byte{7}, l.Room())
	require.NoError(t, l.TrySend(full))
	var got [][]byte
	l.Ahead(nil, func(data []byte) bool {
		got = append(got, bytes.Clone(data))
		return true
	})
	assert.Equal(t, [][]byte{full}, got)
	buf, _, err := l.TryRecv(nil)
	require.NoError(t, err)
	assert.Equal(t, full, buf)
}

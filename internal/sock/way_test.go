//go:build linux

package sock_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
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
	reexec.Register("sock.way-writer", wayWriter)
	reexec.Register("sock.way-reader", wayReader)
}

// wayMsg is message i of a Way test: its index, then bytes that depend
// on it, more than a lane entry holds for every seventh.
func wayMsg(i int) []byte {
	n := i % 100
	if i%7 == 0 {
		n = 2 * sock.WayEntry
	}
	b := binary.LittleEndian.AppendUint32(nil, uint32(i))
	for j := range n {
		b = append(b, byte(i+j))
	}
	return b
}

// wayFDs says whether message i carries a descriptor: every fifth does.
func wayFDs(i int) bool { return i%5 == 0 }

// wayHelper runs a helper's part on the Way of its end (its socket at fd
// 3, the lane's memory at fd 4; writes says which way it goes), with its
// first argument as a number and a minute to do it, and returns its exit
// status.
func wayHelper(writes bool, part func(ctx context.Context, w *sock.Way, arg int) error) int {
	c, err := sock.New(fd.New(3), "pipe")
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	w := sock.NewWay(c, fd.New(4), writes)
	defer w.Close()
	arg, err := strconv.Atoi(os.Args[1])
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := part(ctx, w, arg); err != nil {
		return fail(err)
	}
	return 0
}

// wayWriter sends the messages from its first argument's index on, as
// many as its second says (or until killed, for "forever"), pausing now
// and then so that its reader sleeps.
func wayWriter() int {
	return wayHelper(true, func(ctx context.Context, w *sock.Way, from int) error {
		n := 1 << 30
		if os.Args[2] != "forever" {
			var err error
			if n, err = strconv.Atoi(os.Args[2]); err != nil {
				return err
			}
		}
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			return err
		}
		for i := from; i < from+n; i++ {
			var fds []int
			if wayFDs(i) {
				fds = p[:1]
			}
			if i%500 == 0 {
				time.Sleep(time.Millisecond)
			}
			if err := w.Send(ctx, wayMsg(i), fds); err != nil {
				return fmt.Errorf("message %d: %w", i, err)
			}
		}
		return nil
	})
}

// wayReader receives messages, checking each, and prints the count it
// has received each time it reaches a multiple of its first argument;
// then it waits to be killed.
func wayReader() int {
	return wayHelper(false, func(ctx context.Context, r *sock.Way, every int) error {
		for k := 1; ; k++ {
			if _, _, err := recvWayMsg(ctx, r); err != nil {
				return err
			}
			if k%every == 0 {
				fmt.Println(k)
			}
		}
	})
}

// recvWayMsg receives a message on r and returns its index, checking its
// bytes and its descriptors.
func recvWayMsg(ctx context.Context, r *sock.Way) (int, bool, error) {
	m, err := r.Recv(ctx)
	if err != nil {
		return -1, false, err
	}
	defer m.Done()
	if len(m.Data) < 4 {
		return -1, false, fmt.Errorf("a message of %d bytes", len(m.Data))
	}
	i := int(binary.LittleEndian.Uint32(m.Data))
	switch {
	case string(m.Data) != string(wayMsg(i)):
		return i, false, fmt.Errorf("message %d is not what was sent", i)
	case wayFDs(i) != (m.FDs.Len() == 1):
		return i, false, fmt.Errorf("message %d came with %d descriptors", i, m.FDs.Len())
	}
	return i, true, nil
}

// wayDirection is one direction of a pipe between this process and
// helpers: this process's end (its socket and lane descriptor), and the
// helper's end as files for ExtraFiles.
type wayDirection struct {
	conn  *sock.Conn
	lane  *fd.FD
	files []*os.File
}

func newWayDirection(t *testing.T) wayDirection {
	t.Helper()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	theirs := os.NewFile(uintptr(pair[1]), "pipe")
	t.Cleanup(func() { _ = theirs.Close() })
	c, err := sock.New(fd.New(pair[0]), "pipe")
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	lane, err := sock.CreateWayLane()
	require.NoError(t, err)
	t.Cleanup(func() { _ = lane.Close() })
	return wayDirection{conn: c, lane: lane, files: []*os.File{theirs, laneFile(t, lane)}}
}

// way returns a Way of this process's end, closed at the test's end.
func (d wayDirection) way(t *testing.T, writes bool) *sock.Way {
	t.Helper()
	dup, err := d.lane.Dup()
	require.NoError(t, err)
	w := sock.NewWay(d.conn, dup, writes)
	t.Cleanup(func() { _ = w.Close() })
	return w
}

// handOver closes this process's copies of the helper's end, once the
// helpers that hold it have started: the socket's end then closes with
// them.
func (d wayDirection) handOver() {
	for _, f := range d.files {
		_ = f.Close()
	}
}

// A writer process's messages, by lane and by socket, with descriptors
// and without, arrive whole and in order; once it has exited, what it
// sent is received and then ErrClosed.
func TestWayAcrossProcesses(t *testing.T) {
	leakcheck.Check(t)
	d := newWayDirection(t)
	r := d.way(t, false)
	const n, left = 20000, 100
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	wait, _, _ := startPeer(t, "sock.way-writer", nil, d.files, "0", strconv.Itoa(n))
	for i := range n {
		got, _, err := recvWayMsg(ctx, r)
		require.NoError(t, err, "message %d", i)
		require.Equal(t, i, got)
	}
	require.NoError(t, wait())
	// A second writer takes the role the first let go of, and exits
	// leaving what it sent in the lane and the socket.
	wait, _, _ = startPeer(t, "sock.way-writer", nil, d.files, strconv.Itoa(n), strconv.Itoa(left))
	d.handOver()
	require.NoError(t, wait())
	for i := n; i < n+left; i++ {
		got, _, err := recvWayMsg(ctx, r)
		require.NoError(t, err, "message %d", i)
		require.Equal(t, i, got)
	}
	_, err := r.Recv(ctx)
	require.ErrorIs(t, err, sock.ErrClosed)
}

// A writer killed anywhere in its stream leaves a reader that receives
// what it sent, in order, and then ErrClosed: no hang, no message twice.
func TestWayWriterKilled(t *testing.T) {
	leakcheck.Check(t)
	d := newWayDirection(t)
	r := d.way(t, false)
	_, kill, _ := startPeer(t, "sock.way-writer", nil, d.files, "0", "forever")
	d.handOver()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	next := 0
	for ; ; next++ {
		if next == 3210 {
			kill()
		}
		got, _, err := recvWayMsg(ctx, r)
		if errors.Is(err, sock.ErrClosed) && next >= 3210 {
			break
		}
		require.NoError(t, err, "message %d", next)
		require.Equal(t, next, got)
	}
	t.Logf("%d messages before the writer was gone", next)
}

// readCounts returns a channel of the counts a wayReader prints.
func readCounts(r io.Reader) <-chan int {
	out := make(chan int, 16)
	go func() {
		defer close(out)
		s := bufio.NewScanner(r)
		for s.Scan() {
			n, err := strconv.Atoi(s.Text())
			if err != nil {
				return
			}
			out <- n
		}
	}()
	return out
}

// When the reader that holds the lane's role dies, another process that
// holds the same end and waits on the socket takes the role over and
// receives the rest, in order.
func TestWayReaderTakesOver(t *testing.T) {
	leakcheck.Check(t)
	d := newWayDirection(t)
	pr, pw, err := os.Pipe()
	require.NoError(t, err)
	defer pr.Close()
	counts := readCounts(pr)
	const first = 300
	_, kill, hangup := startPeer(t, "sock.way-reader", pw, d.files, strconv.Itoa(first))
	_ = pw.Close()
	// This process writes the direction, and holds the helper's end too.
	theirs, err := sock.New(fd.New(mustDup(t, int(d.files[0].Fd()))), "pipe")
	require.NoError(t, err)
	defer theirs.Close()
	lane, err := d.lane.Dup()
	require.NoError(t, err)
	second := sock.NewWay(theirs, lane, false)
	defer second.Close()
	d.handOver()
	w := d.way(t, true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	send := waySender(t, w)
	for i := range first {
		require.NoError(t, send(ctx, i), "message %d", i)
	}
	require.Equal(t, first, <-counts, "the helper's count") // it holds the role
	// The second reader waits on the socket, without the role, until
	// the first is killed.
	got := make(chan error, 1)
	go func() {
		for i := first; i < 2*first; i++ {
			n, _, err := recvWayMsg(ctx, second)
			if err == nil && n != i {
				err = fmt.Errorf("message %d where %d was due", n, i)
			}
			if err != nil {
				got <- err
				return
			}
		}
		got <- nil
	}()
	time.Sleep(30 * time.Millisecond)
	kill()
	require.NoError(t, waitHangup(ctx, hangup))
	for i := first; i < 2*first; i++ {
		require.NoError(t, send(ctx, i), "message %d", i)
	}
	require.NoError(t, <-got)
}

// A writer whose readers are all gone gets ErrClosed: its peer's end is
// closed in every process, and the writer looks at it each millisecond.
func TestWayReadersGone(t *testing.T) {
	leakcheck.Check(t)
	d := newWayDirection(t)
	pr, pw, err := os.Pipe()
	require.NoError(t, err)
	defer pr.Close()
	counts := readCounts(pr)
	_, kill, hangup := startPeer(t, "sock.way-reader", pw, d.files, "10")
	_ = pw.Close()
	d.handOver()
	w := d.way(t, true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	send := waySender(t, w)
	for i := range 10 {
		require.NoError(t, send(ctx, i))
	}
	require.Equal(t, 10, <-counts)
	kill()
	require.NoError(t, waitHangup(ctx, hangup))
	// The writer looks at its readers once a peerCheck at most: a send
	// before that look, on a loaded machine, may still go to the lane.
	assert.Eventually(t, func() bool { return errors.Is(send(ctx, 11), sock.ErrClosed) }, 5*time.Second, time.Millisecond,
		"a send fails with ErrClosed once the writer has looked")
}

// waySender returns a function that sends message i on w, with a
// descriptor where wayFDs says so.
func waySender(t *testing.T, w *sock.Way) func(ctx context.Context, i int) error {
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	t.Cleanup(func() { _, _ = unix.Close(p[0]), unix.Close(p[1]) })
	return func(ctx context.Context, i int) error {
		var fds []int
		if wayFDs(i) {
			fds = p[:1]
		}
		return w.Send(ctx, wayMsg(i), fds)
	}
}

func mustDup(t *testing.T, raw int) int {
	t.Helper()
	d, err := unix.Dup(raw)
	require.NoError(t, err)
	unix.CloseOnExec(d)
	return d
}

// waitHangup waits until r's other end is closed in every process.
func waitHangup(ctx context.Context, r *os.File) error {
	gone := hungUp(r)
	for gone() == nil {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return nil
}

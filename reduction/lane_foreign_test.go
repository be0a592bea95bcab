//go:build linux

package reduction

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/carry"
	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

func init() { reexec.Register("produce-blocks", helperProduceBlocks) }

// producedSize is what helperProduceBlocks sends of each block: its
// segment's device, inode and size, and its offset and generation,
// little-endian.
const producedSize = 5 * 8

// helperProduceBlocks makes n blocks (its first argument) of size bytes
// (its second) of its own pool, every byte of block i i+1, and sends, in
// one message on the socket it was given (descriptor 3), where each lies
// and its ticket; it keeps them until its standard input closes.
func helperProduceBlocks() int {
	fail := func(err error) int {
		_, _ = os.Stderr.WriteString("produce-blocks: " + err.Error() + "\n")
		return 1
	}
	n, err := strconv.Atoi(os.Args[1])
	if err != nil {
		return fail(err)
	}
	size, err := strconv.Atoi(os.Args[2])
	if err != nil {
		return fail(err)
	}
	var msg []byte
	var tickets []int
	for i := range n {
		b, err := shm.DefaultPool().Alloc(int64(size))
		if err != nil {
			return fail(err)
		}
		defer b.Release()
		if err := shm.Guard(func() { copy(b.Bytes(), bytes.Repeat([]byte{byte(i + 1)}, size)) }); err != nil {
			return fail(err)
		}
		tk, err := b.Ticket()
		if err != nil {
			return fail(err)
		}
		defer tk.Done()
		id := b.Segment().ID()
		msg = binary.LittleEndian.AppendUint64(msg, id.Dev)
		msg = binary.LittleEndian.AppendUint64(msg, id.Ino)
		msg = binary.LittleEndian.AppendUint64(msg, uint64(b.Segment().Size()))
		msg = binary.LittleEndian.AppendUint64(msg, uint64(b.Offset()))
		msg = binary.LittleEndian.AppendUint64(msg, b.Gen())
		tickets = append(tickets, tk.FD())
	}
	if err := unix.Sendmsg(3, msg, unix.UnixRights(tickets...), nil, 0); err != nil {
		return fail(err)
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// foreignBlocks has a helper process make n blocks of size bytes of its
// own pool, every byte of block i i+1, and returns the Meta a lane's
// message names each with (by identity, a bare tensor of size bytes) and
// the block this process holds of the first, received by descriptor as a
// lane's reader receives one: this process maps their segment, and no pool
// of its own made them. The helper keeps them until the test ends.
func foreignBlocks(t testing.TB, n, size int) ([]Meta, *shm.Block) {
	t.Helper()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	mine := os.NewFile(uintptr(pair[0]), "socket")
	t.Cleanup(func() { _ = mine.Close() })
	theirs := os.NewFile(uintptr(pair[1]), "socket")
	defer theirs.Close() // at once once the helper has its copy, so that its death is EOF here
	cmd, err := reexec.Command(context.Background(), "produce-blocks", strconv.Itoa(n), strconv.Itoa(size))
	require.NoError(t, err)
	cmd.Env = append(cmd.Env, shm.EnvSession+"="+shm.Session())
	cmd.ExtraFiles = []*os.File{theirs}
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	require.NoError(t, theirs.Close())
	t.Cleanup(func() {
		_ = stdin.Close()
		assert.NoError(t, cmd.Wait(), "helper: %s", stderr.String())
	})

	buf, oob := make([]byte, n*producedSize), make([]byte, unix.CmsgSpace(4*n))
	got, oobn, _, _, err := unix.Recvmsg(pair[0], buf, oob, unix.MSG_CMSG_CLOEXEC)
	require.NoError(t, err)
	cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	require.NoError(t, err)
	require.Len(t, cmsgs, 1)
	fds, err := unix.ParseUnixRights(&cmsgs[0])
	require.NoError(t, err)
	require.Equal(t, n*producedSize, got, "the helper's message (its stderr is reported as it exits)")
	require.Len(t, fds, n)
	var ms []Meta
	for i := range n {
		word := func(j int) uint64 { return binary.LittleEndian.Uint64(buf[producedSize*i+8*j:]) }
		m := validMeta(shm.ID{Dev: word(0), Ino: word(1)})
		m.FDIndex, m.Shape, m.Strides, m.DType, m.Size = -1, []int{size}, []int{1}, tensor.Uint8, int64(size)
		m.SegmentSize, m.BlockOffset, m.Gen = int64(word(2)), int64(word(3)), word(4)
		ms = append(ms, m)
	}
	m := ms[0]
	held, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: m.segmentID(), Size: m.SegmentSize}, Offset: m.BlockOffset, Size: m.Size, Gen: m.Gen, Ticket: fds[0]})
	for _, f := range fds { // closed now, not by a transfer's timer, for the tests' counts
		_ = unix.Close(f)
	}
	require.NoError(t, err)
	return ms, held
}

// A lane's entry that names a block of another process's pool, whose
// segment this process pins (as a reader that took the lane's role over
// from the block's producer, which the entry returns the block to, does),
// is held as a block of the pin, with this process's own lock and a look
// at the generation: no pool of this process made it. Not pinned, the
// block is ErrNotMapped.
func TestLaneReturnOfAnotherProducerIsHeldByThePin(t *testing.T) {
	leakcheck.Check(t)
	ms, held := foreignBlocks(t, 1, 4096)
	m := ms[0]
	id := m.segmentID()
	unpin, _, ok := shm.Pin(id) // as the lane's reader pins what it received by descriptor
	require.True(t, ok)
	defer unpin()
	require.NoError(t, held.Release())

	var set fd.Set
	var x *tensor.Tensor
	err := carry.DecodeFrom(extMessage(t, m), &set, &x, pinnedLane{}, true)
	assert.ErrorIs(t, err, shm.ErrNotMapped, "a return of another's block, not pinned")
	assert.Nil(t, x)
	require.NoError(t, carry.DecodeFrom(extMessage(t, m), &set, &x, pinnedLane{id: true}, true), "a return of another's block, pinned")
	b, ok := x.Storage().Backing().(*shm.Block)
	require.True(t, ok)
	assert.Equal(t, id, b.Segment().ID())
	assert.Equal(t, byte(1), b.Bytes()[0], "the producer's bytes")
	require.NoError(t, x.Release())
}

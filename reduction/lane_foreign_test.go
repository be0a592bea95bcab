package reduction

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"os"
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

func init() { reexec.Register("produce-block", helperProduceBlock) }

// producedSize is what helperProduceBlock sends: the segment's device,
// inode and size, and the block's offset and generation, little-endian.
const producedSize = 5 * 8

// helperProduceBlock makes a block of 4096 bytes of its own pool, each
// 0x5a, and sends its ticket and where it lies on the socket it was given
// (descriptor 3); it keeps the block until its standard input closes.
func helperProduceBlock() int {
	fail := func(err error) int {
		_, _ = os.Stderr.WriteString("produce-block: " + err.Error() + "\n")
		return 1
	}
	b, err := shm.DefaultPool().Alloc(4096)
	if err != nil {
		return fail(err)
	}
	defer b.Release()
	if err := shm.Guard(func() { copy(b.Bytes(), bytes.Repeat([]byte{0x5a}, 4096)) }); err != nil {
		return fail(err)
	}
	tk, err := b.Ticket()
	if err != nil {
		return fail(err)
	}
	id := b.Segment().ID()
	msg := binary.LittleEndian.AppendUint64(nil, id.Dev)
	msg = binary.LittleEndian.AppendUint64(msg, id.Ino)
	msg = binary.LittleEndian.AppendUint64(msg, uint64(b.Segment().Size()))
	msg = binary.LittleEndian.AppendUint64(msg, uint64(b.Offset()))
	msg = binary.LittleEndian.AppendUint64(msg, b.Gen())
	err = unix.Sendmsg(3, msg, unix.UnixRights(tk.FD()), nil, 0)
	tk.Done()
	if err != nil {
		return fail(err)
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// A lane's entry that returns a block of another process's pool, whose
// segment this process pins (it took the lane's role over from the
// block's producer), is no return this process can take back from a pool
// of its own: it holds the block as a block of its pins, with its own lock
// and a look at the generation. Not pinned, the block is ErrNotMapped.
func TestLaneReturnOfAnotherProducerIsHeldByThePin(t *testing.T) {
	leakcheck.Check(t)
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(pair[0])
	theirs := os.NewFile(uintptr(pair[1]), "socket")
	defer theirs.Close() // at once once the helper has its copy, so that its death is EOF here
	cmd, err := reexec.Command(context.Background(), "produce-block", "0")
	require.NoError(t, err)
	cmd.Env = append(cmd.Env, shm.EnvSession+"="+shm.Session())
	cmd.ExtraFiles = []*os.File{theirs}
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	require.NoError(t, theirs.Close())
	defer func() {
		_ = stdin.Close()
		assert.NoError(t, cmd.Wait(), "helper: %s", stderr.String())
	}()

	buf, oob := make([]byte, producedSize), make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := unix.Recvmsg(pair[0], buf, oob, unix.MSG_CMSG_CLOEXEC)
	require.NoError(t, err)
	require.Equal(t, producedSize, n, "the helper's message (its stderr is reported as it exits)")
	cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	require.NoError(t, err)
	require.Len(t, cmsgs, 1)
	fds, err := unix.ParseUnixRights(&cmsgs[0])
	require.NoError(t, err)
	require.Len(t, fds, 1)
	word := func(i int) uint64 { return binary.LittleEndian.Uint64(buf[8*i:]) }
	id := shm.ID{Dev: word(0), Ino: word(1)}
	segSize, off, gen := int64(word(2)), int64(word(3)), word(4)

	held, err := shm.Attach(shm.BlockRef{Seg: shm.SegmentRef{ID: id, Size: segSize}, Offset: off, Size: 4096, Gen: gen, Ticket: fds[0]})
	shm.AdoptTicket(fds[0], id)
	require.NoError(t, err)
	unpin, _, ok := shm.Pin(id) // as the lane's reader pins what it received by descriptor
	require.True(t, ok)
	defer unpin()
	require.NoError(t, held.Release())

	m := validMeta(id)
	m.FDIndex, m.Shape, m.Strides, m.DType = -1, []int{4096}, []int{1}, tensor.Uint8
	m.SegmentSize, m.BlockOffset, m.Gen = segSize, off, gen
	var set fd.Set
	var x *tensor.Tensor
	err = carry.DecodeFrom(extMessage(t, m), &set, &x, returningLane{pinnedLane{}}, true)
	assert.ErrorIs(t, err, shm.ErrNotMapped, "a return of another's block, not pinned")
	assert.Nil(t, x)
	require.NoError(t, carry.DecodeFrom(extMessage(t, m), &set, &x, returningLane{pinnedLane{id: true}}, true), "a return of another's block, pinned")
	b, ok := x.Storage().Backing().(*shm.Block)
	require.True(t, ok)
	assert.Equal(t, id, b.Segment().ID())
	assert.Equal(t, byte(0x5a), b.Bytes()[0], "the producer's bytes")
	require.NoError(t, x.Release())
}

//go:build linux

package shm_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/internal/testmain"
	"github.com/tensormp/tensormp/mmapalloc"
)

func TestMain(m *testing.M) {
	reexec.Register("write-by-name", helperWriteByName)
	reexec.Register("tmpfs-full", helperTmpfsFull)
	reexec.Register("produce-named-and-die", helperProduceNamedAndDie)
	testmain.Run(m)
}

func inDir(name string) bool {
	_, err := os.Lstat(filepath.Join(shm.Dir(), name))
	return err == nil
}

func TestCreateFileDescriptor(t *testing.T) {
	leakcheck.Check(t)
	a, err := shm.Create(4096, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	defer a.Release()

	assert.Empty(t, a.Name(), "a segment that travels by descriptor has no name in the directory")
	assert.NotZero(t, a.Flags()&shm.Memfd, "it is a memfd")
	seals, err := unix.FcntlInt(uintptr(a.FD()), unix.F_GET_SEALS, 0)
	require.NoError(t, err)
	assert.Equal(t, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL, seals, "sealed against resizing")
	assert.Equal(t, int64(4096), a.Size())
	require.GreaterOrEqual(t, a.FD(), 0)
	flags, err := unix.FcntlInt(uintptr(a.FD()), unix.F_GETFD, 0)
	require.NoError(t, err)
	assert.NotZero(t, flags&unix.FD_CLOEXEC, "descriptors are close-on-exec")
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(a.FD(), &st))
	assert.Equal(t, uint32(0o600), st.Mode&0o777)
	assert.Equal(t, int64(4096), st.Size)

	copy(a.Bytes(), "hello")
	dup, err := unix.FcntlInt(uintptr(a.FD()), unix.F_DUPFD_CLOEXEC, 0)
	require.NoError(t, err)
	b, err := shm.OpenFD(fd.New(dup), 4096, 0)
	require.NoError(t, err)
	assert.Equal(t, -1, b.FD(), "without KeepFD the descriptor is closed after mapping")
	assert.Equal(t, "hello", string(b.Bytes()[:5]))
	assert.Equal(t, a.ID(), b.ID())
	b.Bytes()[0] = 'j'
	assert.Equal(t, byte('j'), a.Bytes()[0], "both mappings see the same pages")
	require.NoError(t, b.Release())
	require.NoError(t, a.Release())
	require.NoError(t, a.Release(), "closing twice is harmless")
	assert.Nil(t, a.Bytes())
	assert.Equal(t, -1, a.FD())
}

func TestCreateFileSystemRefCount(t *testing.T) {
	leakcheck.Check(t)
	a, err := shm.Create(1<<20, shm.RefCount)
	require.NoError(t, err)
	assert.True(t, inDir(a.Name()), "file_system segments keep their name")
	assert.Equal(t, int32(1), a.Refs())
	assert.Equal(t, -1, a.FD())
	assert.Len(t, a.Bytes(), 1<<20)

	b, err := shm.OpenName(a.Name(), 1<<20, shm.RefCount)
	require.NoError(t, err)
	assert.Equal(t, int32(2), a.Refs())
	a.Bytes()[1<<20-1] = 42
	assert.Equal(t, byte(42), b.Bytes()[1<<20-1])

	require.NoError(t, a.Release())
	assert.True(t, inDir(b.Name()), "a holder remains, so the name stays")
	assert.Equal(t, int32(1), b.Refs())
	require.NoError(t, b.Release())
	assert.False(t, inDir(b.Name()), "the last closer unlinks")

	_, err = shm.OpenName(b.Name(), 1<<20, shm.RefCount)
	assert.ErrorIs(t, err, os.ErrNotExist)
}

func TestDropRefsForExit(t *testing.T) {
	leakcheck.Check(t)
	a, err := shm.Create(4096, shm.RefCount)
	require.NoError(t, err)
	b, err := shm.OpenName(a.Name(), 4096, shm.RefCount)
	require.NoError(t, err)
	plain, err := shm.Create(4096, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	require.Equal(t, int32(2), a.Refs())

	shm.DropRefsForExit()
	assert.False(t, inDir(a.Name()), "the process held both references: the name is gone")
	a.Bytes()[0] = 1
	assert.Equal(t, byte(1), b.Bytes()[0], "the mappings stay usable until exit")
	require.NoError(t, a.Release(), "a later Close does not count the reference twice")
	require.NoError(t, b.Release())
	require.NoError(t, plain.Release())
}

func TestOpenNameReleased(t *testing.T) {
	leakcheck.Check(t)
	a, err := shm.Create(4096, shm.RefCount)
	require.NoError(t, err)
	shm.SetRefsForTest(a, 0)
	_, err = shm.OpenName(a.Name(), 4096, shm.RefCount)
	assert.ErrorIs(t, err, shm.ErrReleased)
	shm.SetRefsForTest(a, 1)
	require.NoError(t, a.Release())
}

func TestOpenNameUnlink(t *testing.T) {
	leakcheck.Check(t)
	a, err := shm.Create(4096, shm.RefCount)
	require.NoError(t, err)
	defer a.Release()
	b, err := shm.OpenName(a.Name(), 4096, shm.RefCount|shm.Unlink|shm.KeepFD)
	require.NoError(t, err)
	assert.False(t, inDir(a.Name()))
	assert.GreaterOrEqual(t, b.FD(), 0)
	require.NoError(t, b.Release())
}

func TestHostileNames(t *testing.T) {
	leakcheck.Check(t)
	dir := shm.Dir()
	good := shm.SessionPrefix() + "1_0123456789abcdef"
	require.True(t, mmapalloc.ValidName(good))

	// Valid names that point at things other than a segment.
	link := shm.SessionPrefix() + "2_0123456789abcdef"
	require.NoError(t, os.Symlink("/etc/passwd", filepath.Join(dir, link)))
	defer os.Remove(filepath.Join(dir, link))
	fifo := shm.SessionPrefix() + "3_0123456789abcdef"
	require.NoError(t, unix.Mkfifo(filepath.Join(dir, fifo), 0o600))
	defer os.Remove(filepath.Join(dir, fifo))
	sub := shm.SessionPrefix() + "4_0123456789abcdef"
	require.NoError(t, os.Mkdir(filepath.Join(dir, sub), 0o700))
	defer os.Remove(filepath.Join(dir, sub))

	cases := []struct {
		name string
		is   error
	}{
		{"", shm.ErrBadName},
		{"../../etc/passwd", shm.ErrBadName},
		{"tensormp_abc/../../etc/passwd", shm.ErrBadName},
		{"/dev/shm/" + good, shm.ErrBadName},
		{"other_abc_1_0123456789abcdef", shm.ErrBadName},
		{"tensormp_abc_1_0123456789ABCDEF", shm.ErrBadName},
		{"tensormp_abc_1_0123456789abcde", shm.ErrBadName},
		{"tensormp_a-c_1_0123456789abcdef", shm.ErrBadName},
		{"tensormp_abc_x_0123456789abcdef", shm.ErrBadName},
		{"tensormp_abc_1_0123456789abcdef_x", shm.ErrBadName},
		{"tensormp_.._1_0123456789abcdef", shm.ErrBadName},
		{good, os.ErrNotExist},
		{link, syscall.ELOOP},
		{fifo, nil},
		{sub, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := shm.OpenName(c.name, 4096, shm.RefCount)
			require.Error(t, err)
			if c.is != nil {
				assert.ErrorIs(t, err, c.is)
			}
			t.Log(err)
		})
	}
}

func TestSizeChecks(t *testing.T) {
	leakcheck.Check(t)
	for _, n := range []int64{0, -1, 1 << 62} {
		_, err := shm.Create(n, shm.KeepFD|shm.Unlink)
		assert.Error(t, err, "size %d", n)
	}
	segs, err := leakcheck.Segments()
	require.NoError(t, err)
	assert.Empty(t, segs, "a failed Create leaves nothing")

	a, err := shm.Create(4096, shm.RefCount)
	require.NoError(t, err)
	defer a.Release()
	_, err = shm.OpenName(a.Name(), 8192, shm.RefCount)
	assert.ErrorContains(t, err, "fewer than")
	plain, err := shm.OpenName(a.Name(), 4096, 0)
	require.NoError(t, err, "fstat covers the claim when the header is not counted")
	assert.Equal(t, int32(1), a.Refs(), "opening without RefCount takes no reference")
	require.NoError(t, plain.Release())

	b, err := shm.Create(4096, shm.KeepFD|shm.Unlink)
	require.NoError(t, err)
	defer b.Release()
	for _, size := range []int64{4097, 0, -5} {
		dup, err := unix.FcntlInt(uintptr(b.FD()), unix.F_DUPFD_CLOEXEC, 0)
		require.NoError(t, err)
		_, err = shm.OpenFD(fd.New(dup), size, 0)
		assert.Error(t, err, "size %d", size)
		assert.ErrorIs(t, unix.Close(dup), unix.EBADF, "OpenFD closed the descriptor it owned")
	}
}

func TestOpenFDNotAFile(t *testing.T) {
	leakcheck.Check(t)
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	defer unix.Close(p[1])
	_, err := shm.OpenFD(fd.New(p[0]), 4096, shm.KeepFD)
	assert.ErrorContains(t, err, "not a regular file")
	assert.ErrorIs(t, unix.Close(p[0]), unix.EBADF)

	_, err = shm.Stat(p[1])
	assert.ErrorContains(t, err, "not a regular file")
	_, err = shm.Stat(-1)
	assert.Error(t, err)
}

func TestFlagRules(t *testing.T) {
	leakcheck.Check(t)
	bad := []shm.Flags{
		shm.Unlink,
		shm.NoCreate,
		shm.FromFD | shm.KeepFD,
		shm.KeepFD | shm.Unlink | shm.RefCount,
	}
	for _, f := range bad {
		_, err := shm.Create(4096, f)
		assert.Error(t, err, "Create with %v", f)
	}
	_, err := shm.OpenName(shm.SessionPrefix()+"1_0123456789abcdef", 10, shm.Exclusive)
	assert.ErrorContains(t, err, "not allowed")
	assert.Equal(t, "KeepFD|Unlink", (shm.KeepFD | shm.Unlink).String())
	assert.Equal(t, "0", shm.Flags(0).String())
}

func TestConcurrentOpenClose(t *testing.T) {
	leakcheck.Check(t)
	a, err := shm.Create(4096, shm.RefCount)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				b, err := shm.OpenName(a.Name(), 4096, shm.RefCount)
				if !assert.NoError(t, err) {
					return
				}
				b.Bytes()[0]++
				assert.NoError(t, b.Release())
			}
		}()
	}
	wg.Wait()
	assert.Equal(t, int32(1), a.Refs())
	require.NoError(t, a.Release())
}

// helperWriteByName maps the segment named in argv, writes its pid into
// it and exits without closing: the kernel unmaps, but its reference is
// the parent's to account for.
func helperWriteByName() int {
	a, err := shm.OpenName(os.Args[1], 4096, shm.RefCount)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	copy(a.Bytes(), strconv.Itoa(os.Getpid()))
	if err := a.Release(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func TestCrossProcessByName(t *testing.T) {
	leakcheck.Check(t)
	a, err := shm.Create(4096, shm.RefCount)
	require.NoError(t, err)
	defer a.Release()
	cmd, err := reexec.Command(context.Background(), "write-by-name", a.Name())
	require.NoError(t, err)
	require.NoError(t, cmd.Run())
	assert.Equal(t, strconv.Itoa(cmd.Process.Pid), string(a.Bytes()[:len(strconv.Itoa(cmd.Process.Pid))]))
	assert.Equal(t, int32(1), a.Refs(), "the child's Close gave its reference back")
}

// helperProduceNamedAndDie sends, over the socket it inherits as
// descriptor 3, a block of a named pool segment (its name, segment size,
// offset and generation, and the message's ticket), then is killed
// holding it.
func helperProduceNamedAndDie() int {
	shm.EnableNamedPool()
	b, err := shm.NamedPool().Alloc(4 << 10)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	copy(b.Bytes(), "orphan")
	tk, err := b.Ticket()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	msg := fmt.Sprintf("%s %d %d %d", b.Segment().Name(), b.Segment().Size(), b.Offset(), b.Gen())
	if err := unix.Sendmsg(3, []byte(msg), unix.UnixRights(tk.FD()), nil, 0); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	tk.Done()
	_ = unix.Kill(os.Getpid(), unix.SIGKILL)
	select {}
}

// The last holder of a killed producer's named segment can be a message
// nobody reads. The receiver that let go of the segment while that message
// held it looks again by name, and removes the name once the message is
// dropped.
func TestOrphanedNamedSegmentIsRemoved(t *testing.T) {
	leakcheck.Check(t)
	name, unread := orphanHeldByAnUnreadMessage(t)
	require.NoError(t, unix.Close(unread[0]))
	require.NoError(t, unix.Close(unread[1])) // the message is dropped unread
	assert.Eventually(t, func() bool { return !inDir(name) }, 5*time.Second, 10*time.Millisecond,
		"the receiver looked again and removed the name")
}

// A watched name found held at a look is looked at again, on the watch's
// own timer: the message that holds a killed producer's named segment
// may be dropped only after the receiver's first looks, and the name
// goes then, with nothing else in the process to wake the watch.
func TestOrphanedNamedSegmentIsLookedAtUntilItGoes(t *testing.T) {
	leakcheck.Check(t)
	name, unread := orphanHeldByAnUnreadMessage(t)
	require.Eventually(t, func() bool { return shm.OrphanLooked(name) }, 5*time.Second, time.Millisecond,
		"the receiver looks at the name once it let go of it")
	assert.True(t, inDir(name), "the look found the message's hold")

	require.NoError(t, unix.Close(unread[0]))
	require.NoError(t, unix.Close(unread[1])) // the message is dropped unread, after the look
	assert.Eventually(t, func() bool { return !inDir(name) }, 5*time.Second, 10*time.Millisecond,
		"the receiver looked again and removed the name")
}

// orphanHeldByAnUnreadMessage has a producer send a block of its named
// segment and die; this process, the receiver, attaches and lets go of
// the block after a copy of the message went into a socket nobody reads,
// and unmaps the segment. It returns the segment's name, which the unread
// message keeps, and that socket pair, which the caller closes.
func orphanHeldByAnUnreadMessage(t *testing.T) (string, [2]int) {
	t.Helper()
	ref := blockOfAKilledProducer(t)
	// A copy of the message goes into a socket nobody reads.
	unread, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	require.NoError(t, unix.Sendmsg(unread[0], []byte("m"), unix.UnixRights(ref.Ticket), nil, 0))

	r, err := shm.Attach(ref)
	require.NoError(t, err)
	require.NoError(t, unix.Close(ref.Ticket))
	assert.Equal(t, "orphan", string(r.Bytes()[:6]))
	require.NoError(t, r.Release())
	shm.Trim() // unmaps it; the unread message still holds the block
	assert.True(t, inDir(ref.Seg.Name), "a segment a message holds keeps its name")
	return ref.Seg.Name, [2]int{unread[0], unread[1]}
}

// blockOfAKilledProducer has a producer send a block of its named segment
// and die, and returns the block as the message names it, with the
// message's descriptor, which the caller closes.
func blockOfAKilledProducer(t *testing.T) shm.BlockRef {
	t.Helper()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(pair[0])
	theirs := os.NewFile(uintptr(pair[1]), "producer")
	cmd, err := reexec.Command(context.Background(), "produce-named-and-die")
	require.NoError(t, err)
	cmd.ExtraFiles = []*os.File{theirs}
	require.NoError(t, cmd.Start())
	require.NoError(t, theirs.Close())
	buf, oob := make([]byte, 512), make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := unix.Recvmsg(pair[0], buf, oob, unix.MSG_CMSG_CLOEXEC)
	require.NoError(t, err)
	var ticket int
	{
		cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		require.NoError(t, err)
		require.Len(t, cmsgs, 1)
		fds, err := unix.ParseUnixRights(&cmsgs[0])
		require.NoError(t, err)
		require.Len(t, fds, 1)
		ticket = fds[0]
	}
	var name string
	var segSize, off int64
	var gen uint64
	_, err = fmt.Sscan(string(buf[:n]), &name, &segSize, &off, &gen)
	require.NoError(t, err)
	require.ErrorContains(t, cmd.Wait(), "killed")
	return shm.BlockRef{Seg: shm.SegmentRef{Name: name, Size: segSize}, Offset: off, Size: 4 << 10, Gen: gen, Ticket: ticket}
}

// A received segment whose producer is gone, let go of and attached again
// before its idle check, is in use when the check comes: the check leaves
// it, and its name, alone. Once its block is let go of, the name goes.
func TestOrphanInUseAgainIsKept(t *testing.T) {
	leakcheck.Check(t)
	ref := blockOfAKilledProducer(t)
	resume := shm.HoldIdleChecks(t)
	r, err := shm.Attach(ref)
	require.NoError(t, unix.Close(ref.Ticket))
	require.NoError(t, err)
	require.NoError(t, r.Release()) // its idle check is due
	r, err = shm.Attach(ref)        // and it is in use again, found by its name
	require.NoError(t, err)
	resume()
	time.Sleep(10 * shm.IdleCheckDelay) // the check comes
	if assert.True(t, inDir(ref.Seg.Name), "a segment in use keeps its name") {
		assert.Equal(t, "orphan", string(r.Bytes()[:6]), "and its mapping")
	}
	require.NoError(t, r.Release())
	assert.Eventually(t, func() bool { return !inDir(ref.Seg.Name) }, 5*time.Second, 10*time.Millisecond,
		"the receiver, its last holder, removed the name once it let go of it")
}

// A watched name whose producer lives stays: the producer's own lock is in
// the way. A RefCount segment, which no lock holds, stays too. Once the
// name is gone, its watch ends.
func TestWatchedSegmentOfALiveProducerStays(t *testing.T) {
	leakcheck.Check(t)
	shm.EnableNamedPool()
	b, err := shm.NamedPool().Alloc(4 << 10)
	require.NoError(t, err)
	name := b.Segment().Name()
	counted, err := shm.Create(4096, shm.RefCount)
	require.NoError(t, err)
	defer counted.Release()
	shm.WatchSegmentsOf(os.Getpid())
	require.True(t, shm.WatchingOrphan(name))
	shm.LookAtOrphansNow()
	assert.True(t, inDir(name), "its producer keeps it")
	assert.True(t, shm.WatchingOrphan(name), "and the watch goes on")
	assert.True(t, inDir(counted.Name()), "a segment that counts its holders in its header is not the watch's")

	require.NoError(t, b.Release())
	shm.Trim()
	assert.False(t, inDir(name), "the pool removed it")
	shm.LookAtOrphansNow()
	assert.False(t, shm.WatchingOrphan(name), "the watch of a name that is gone ends")
}

// helperTmpfsFull runs in a private mount namespace: it mounts a 1 MiB
// tmpfs, points TENSORMP_SHM_DIR at it and checks that a named segment
// that does not fit is an ENOSPC error that leaves nothing behind, that a
// descriptor segment (a sealed memfd) does not depend on the directory's
// size, and that a segment that fits can be written to its last byte.
func helperTmpfsFull() int {
	dir := os.Args[1]
	if err := unix.Mount("tensormp-test", dir, "tmpfs", 0, "size=1m,mode=0700"); err != nil {
		fmt.Printf("SKIP mounting tmpfs: %v\n", err)
		return 0
	}
	defer unix.Unmount(dir, 0)
	os.Setenv(shm.EnvDir, dir)

	fail := func(format string, args ...any) int {
		fmt.Printf("FAIL "+format+"\n", args...)
		return 1
	}
	_, err := shm.Create(2<<20, shm.RefCount)
	if !errors.Is(err, shm.ErrNoSpace) || !errors.Is(err, unix.ENOSPC) {
		return fail("Create(2 MiB, RefCount) = %v, want ErrNoSpace wrapping ENOSPC", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		return fail("a failed Create left %d entries", len(entries))
	}
	// A segment that travels by descriptor is a memfd, whatever room the
	// directory has.
	m, err := shm.Create(2<<20, shm.KeepFD|shm.Unlink)
	if err != nil {
		return fail("Create(2 MiB, KeepFD|Unlink) = %v, want a memfd segment", err)
	}
	if m.Flags()&shm.Memfd == 0 || m.Name() != "" {
		return fail("descriptor segment has flags %v and name %q", m.Flags(), m.Name())
	}
	m.Bytes()[2<<20-1] = 1
	if err := unix.Ftruncate(m.FD(), 4096); err == nil {
		return fail("a memfd segment could be shrunk under its mappings")
	}
	dup, err := unix.FcntlInt(uintptr(m.FD()), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fail("dup: %v", err)
	}
	r, err := shm.OpenFD(fd.New(dup), 2<<20, 0)
	if err != nil || r.Bytes()[2<<20-1] != 1 {
		return fail("a receiver cannot map the memfd segment: %v", err)
	}
	_ = r.Release()
	_ = m.Release()
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		return fail("the memfd segment left %d entries", len(entries))
	}
	a, err := shm.Create(640<<10, shm.RefCount)
	if err != nil {
		return fail("Create(640 KiB) = %v", err)
	}
	_, err = shm.Create(640<<10, shm.RefCount)
	if !errors.Is(err, shm.ErrNoSpace) {
		return fail("second Create(640 KiB) = %v, want ErrNoSpace", err)
	}
	b := a.Bytes()
	for i := range b {
		b[i] = byte(i) // no SIGBUS: the pages were reserved
	}
	if err := a.Release(); err != nil {
		return fail("Close = %v", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		return fail("%d entries left after Close", len(entries))
	}
	// A named pool's slab is larger than the directory: its pages are
	// reserved as its slots are handed out, until the directory is full.
	shm.EnableNamedPool()
	p := shm.NamedPool()
	var blocks []*shm.Block
	for {
		b, perr := p.Alloc(16 << 10)
		if perr != nil {
			err = perr
			break
		}
		blocks = append(blocks, b)
	}
	if !errors.Is(err, shm.ErrNoSpace) || len(blocks) < 30 || len(blocks) > 64 {
		return fail("a pool in a 1 MiB directory gave %d blocks of 16 KiB, then %v; want 30 to 64, then ErrNoSpace", len(blocks), err)
	}
	for _, b := range blocks {
		data := b.Bytes()
		for i := range data {
			data[i] = byte(i) // no SIGBUS: each handed-out block has its pages
		}
		if err := b.Release(); err != nil {
			return fail("Release = %v", err)
		}
	}
	// The room the released blocks hold goes to a block of another size.
	other, perr := p.Alloc(128 << 10)
	if perr != nil {
		return fail("a 128 KiB block after releasing the 16 KiB ones: %v", perr)
	}
	clear(other.Bytes())
	if err := other.Release(); err != nil {
		return fail("Release = %v", err)
	}
	p.Trim(0)
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		return fail("%d entries left after the pool's Trim", len(entries))
	}
	fmt.Printf("OK %d pooled blocks, then %v\n", len(blocks), err)
	return 0
}

func TestFullTmpfsIsENOSPC(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small tmpfs in a private mount namespace")
	}
	leakcheck.Check(t)
	dir := t.TempDir()
	cmd, err := reexec.Command(context.Background(), "tmpfs-full", dir)
	require.NoError(t, err)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	out, err := cmd.Output()
	if errors.Is(err, syscall.EPERM) {
		t.Skipf("cannot make a private mount namespace here: %v", err)
	}
	require.NoError(t, err, "helper output: %s", out)
	if s := string(out); len(s) > 4 && s[:4] == "SKIP" {
		t.Skip(s)
	}
	assert.Contains(t, string(out), "OK")
	t.Log(string(out))
}

func BenchmarkCreate(b *testing.B) {
	for _, size := range []int64{4 << 10, 64 << 20} {
		for _, mode := range []struct {
			name  string
			flags shm.Flags
		}{
			{"file_descriptor", shm.KeepFD | shm.Unlink},
			{"file_system", shm.RefCount},
		} {
			b.Run(fmt.Sprintf("%s/%dKiB", mode.name, size>>10), func(b *testing.B) {
				b.SetBytes(size)
				b.ReportAllocs()
				for b.Loop() {
					a, err := shm.Create(size, mode.flags)
					if err != nil {
						b.Fatal(err)
					}
					if err := a.Release(); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// FuzzParseName: whatever ParseName accepts is exactly the name its parts
// spell, so no path, suffix or second form slips through.
func FuzzParseName(f *testing.F) {
	for _, s := range []string{
		shm.NamePrefix + "abc_123_0123456789abcdef",
		shm.NamePrefix + "abc_lock",
		shm.NamePrefix + "abc_0123_0123456789abcdef",
		shm.NamePrefix + "abc_1_0123456789abcdef/../x",
		"../" + shm.NamePrefix + "abc_lock",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		n, ok := shm.ParseName(name)
		if !ok {
			return
		}
		if n.Lock {
			require.Equal(t, shm.LockName(n.Session), name)
			return
		}
		require.Greater(t, n.Pid, 0)
		want := fmt.Sprintf("%s%s_%d_", shm.NamePrefix, n.Session, n.Pid)
		require.True(t, strings.HasPrefix(name, want) && len(name) == len(want)+16, "%q parsed as %+v", name, n)
		require.NotContains(t, name, "/")
	})
}

// The public names are the implementation's: a segment made through
// either is named, found and flagged alike.
func TestPublicNamesAreTheImplementations(t *testing.T) {
	assert.Equal(t, shm.DefaultDir, mmapalloc.DefaultDir)
	assert.Equal(t, shm.EnvDir, mmapalloc.EnvDir)
	assert.Equal(t, shm.EnvSession, mmapalloc.EnvSession)
	assert.Equal(t, shm.EnvCache, mmapalloc.EnvCache)
	assert.Equal(t, shm.NamePrefix, mmapalloc.NamePrefix)
	for pub, impl := range map[mmapalloc.Flags]shm.Flags{
		mmapalloc.SharedMem: shm.SharedMem,
		mmapalloc.Exclusive: shm.Exclusive,
		mmapalloc.NoCreate:  shm.NoCreate,
		mmapalloc.KeepFD:    shm.KeepFD,
		mmapalloc.FromFD:    shm.FromFD,
		mmapalloc.Unlink:    shm.Unlink,
		mmapalloc.RefCount:  shm.RefCount,
		mmapalloc.Memfd:     shm.Memfd,
	} {
		assert.Equal(t, uint32(impl), uint32(pub), "%v", impl)
		assert.Equal(t, impl.String(), pub.String())
	}
}

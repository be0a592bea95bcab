//go:build linux

package mp

import (
	"bytes"
	"context"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/tensormp/tensormp/internal/fd"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/internal/sock"
)

// foreignKinds make descriptors of every kind but a queue's or a pipe's
// socket, each owned by the caller.
var foreignKinds = []struct {
	name string
	make func(t testing.TB) int
}{
	{"memfd", func(t testing.TB) int {
		fd, err := unix.MemfdCreate("foreign", unix.MFD_CLOEXEC)
		require.NoError(t, err)
		return fd
	}},
	{"pipe", func(t testing.TB) int {
		var p [2]int
		require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
		require.NoError(t, unix.Close(p[1]))
		return p[0]
	}},
	{"udp", func(t testing.TB) int { return socket(t, unix.AF_INET, unix.SOCK_DGRAM) }},
	{"tcp", func(t testing.TB) int { return socket(t, unix.AF_INET, unix.SOCK_STREAM) }},
	{"unix stream", func(t testing.TB) int { return socket(t, unix.AF_UNIX, unix.SOCK_STREAM) }},
	{"unix datagram", func(t testing.TB) int { return socket(t, unix.AF_UNIX, unix.SOCK_DGRAM) }},
	// A queue's type of socket, of another family: only the check of
	// the socket's domain tells it from a queue's.
	{"vsock seqpacket", func(t testing.TB) int { return socket(t, unix.AF_VSOCK, unix.SOCK_SEQPACKET) }},
	{"eventfd", func(t testing.TB) int {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		require.NoError(t, err)
		return fd
	}},
	{"directory", func(t testing.TB) int {
		fd, err := unix.Open(t.TempDir(), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		require.NoError(t, err)
		return fd
	}},
}

func socket(t testing.TB, domain, typ int) int {
	fd, err := unix.Socket(domain, typ|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	return fd
}

// extMsg is a message whose value is one extension of type ext whose
// payload is the descriptor indexes idx, followed by tail.
func extMsg(t testing.TB, ext int8, tail []byte, idx ...int) []byte {
	var payload []byte
	for _, i := range idx {
		payload = binary.LittleEndian.AppendUint32(payload, uint32(i))
	}
	payload = append(payload, tail...)
	var b bytes.Buffer
	enc := msgpack.NewEncoder(&b)
	require.NoError(t, enc.EncodeExtHeader(ext, len(payload)))
	b.Write(payload)
	return b.Bytes()
}

// seqpacket returns the two ends of a new SOCK_SEQPACKET pair, raw.
func seqpacket(t testing.TB) [2]int {
	p, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	return [2]int{p[0], p[1]}
}

// placesEnds returns the ends of a real places pipe of one place.
func placesEnds(t testing.TB) [2]int {
	p, err := sock.NewPlaces(1)
	require.NoError(t, err)
	defer p.Close()
	r, w, err := p.Dup()
	require.NoError(t, err)
	rr, err := r.Disown()
	require.NoError(t, err)
	rw, err := w.Disown()
	require.NoError(t, err)
	return [2]int{rr, rw}
}

// A queue or a pipe whose descriptors are not what they must be fails to
// decode, whatever the target, and every descriptor the message brought
// is closed.
func TestForeignDescriptorsAreNoQueueOrPipe(t *testing.T) {
	leakcheck.Check(t)
	const (
		notSocket = "is not a queue's or pipe's socket (AF_UNIX, SOCK_SEQPACKET)"
		notPlaces = "are not the two ends of its places pipe"
	)
	capacity := binary.LittleEndian.AppendUint32(nil, 4)
	targets := []struct {
		name string
		new  func() any
	}{
		{"typed", nil},
		{"any", func() any { return new(any) }},
		{"field", func() any { return new(struct{ X any }) }},
	}
	for _, kind := range foreignKinds {
		for _, msg := range []struct {
			name  string
			ext   int8
			typed func() any
			tail  []byte
			slots string // s: a real socket, f: the foreign one, r, w: a real places pipe's ends
			want  string
		}{
			{"pipe", pipeExt, func() any { return new(*Pipe) }, nil, "f", notSocket},
			{"queue in", queueExt, func() any { return new(*Queue) }, nil, "fs", notSocket},
			{"queue out", queueExt, func() any { return new(*Queue) }, nil, "sf", notSocket},
			{"queue places read end", queueExt, func() any { return new(*Queue) }, capacity, "ssfw", notPlaces},
			{"queue places write end", queueExt, func() any { return new(*Queue) }, capacity, "ssrf", notPlaces},
		} {
			for _, target := range targets {
				t.Run(kind.name+"/"+msg.name+"/"+target.name, func(t *testing.T) {
					base := leakcheck.Count()
					places := placesEnds(t)
					var fds []int
					for _, slot := range msg.slots {
						switch slot {
						case 's':
							p := seqpacket(t)
							require.NoError(t, unix.Close(p[1]))
							fds = append(fds, p[0])
						case 'f':
							fds = append(fds, kind.make(t))
						case 'r':
							fds = append(fds, places[0])
							places[0] = -1
						case 'w':
							fds = append(fds, places[1])
							places[1] = -1
						}
					}
					for _, p := range places {
						if p >= 0 {
							require.NoError(t, unix.Close(p))
						}
					}
					idx := make([]int, len(fds))
					for i := range idx {
						idx[i] = i
					}
					data := extMsg(t, msg.ext, msg.tail, idx...)
					if target.name == "field" {
						data = append([]byte{0x81, 0xa1, 'X'}, data...)
					}
					v := msg.typed()
					if target.new != nil {
						v = target.new()
					}
					err := decode(data, fd.NewSet(fds), v)
					require.Error(t, err, "%d descriptors decoded as %T", len(fds), v)
					assert.Contains(t, err.Error(), msg.want)
					assert.ErrorIs(t, err, ErrMalformed)
					assert.Equal(t, base, leakcheck.Count(), "descriptors open after the failed decode")
				})
			}
		}
	}
}

// A decode that fails after it made a queue or a pipe of the message's
// descriptors closes them too: the caller gets nothing to close.
func TestFailedDecodeClosesTheQueuesItMade(t *testing.T) {
	leakcheck.Check(t)
	for _, c := range []struct {
		name string
		v    func() any
		tail func(t testing.TB) ([]byte, []int) // the rest of the value, after a good queue and pipe
	}{
		{"a foreign pipe", func() any { return new(any) }, func(t testing.TB) ([]byte, []int) {
			return extMsg(t, pipeExt, nil, 3), []int{foreignKinds[0].make(t)}
		}},
		{"a string for an int", func() any {
			return new(struct {
				Q *Queue
				P *Pipe
				N int
			})
		}, func(t testing.TB) ([]byte, []int) {
			return []byte{0xa1, 'x'}, nil
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			base := leakcheck.Count()
			q, p := seqpacket(t), seqpacket(t)
			require.NoError(t, unix.Close(p[1]))
			fds := []int{q[0], q[1], p[0]}
			tail, more := c.tail(t)
			fds = append(fds, more...)
			data := []byte{0x93}
			if _, ok := c.v().(*any); !ok {
				data = []byte{0x83, 0xa1, 'Q'}
			}
			data = append(data, extMsg(t, queueExt, nil, 0, 1)...)
			if data[0] == 0x83 {
				data = append(data, 0xa1, 'P')
			}
			data = append(data, extMsg(t, pipeExt, nil, 2)...)
			if data[0] == 0x83 {
				data = append(data, 0xa1, 'N')
			}
			data = append(data, tail...)
			require.Error(t, decode(data, fd.NewSet(fds), c.v()))
			assert.Equal(t, base, leakcheck.Count(), "descriptors open after the failed decode")
		})
	}
}

// A queue decoded into an interface is a *Queue, whose Close releases
// every descriptor the message brought.
func TestQueueDecodedIntoAny(t *testing.T) {
	leakcheck.Check(t)
	base := leakcheck.Count()
	s := seqpacket(t)
	r := placesEnds(t)
	var v any
	require.NoError(t, decode(extMsg(t, queueExt, binary.LittleEndian.AppendUint32(nil, 1), 0, 1, 2, 3), fd.NewSet([]int{s[0], s[1], r[0], r[1]}), &v))
	q, ok := v.(*Queue)
	require.True(t, ok, "decoded as %T", v)
	assert.Equal(t, 1, q.Cap())
	require.NoError(t, q.Close())
	assert.Equal(t, base, leakcheck.Count())
}

// A foreign descriptor sent for a queue, over a real connection, fails
// that Get alone: the connection goes on, and nothing stays open.
func TestForeignQueueOverAConnection(t *testing.T) {
	leakcheck.Check(t)
	a, b, err := NewPipe()
	require.NoError(t, err)
	defer a.Close()
	defer b.Close()
	ctx := context.Background()
	// Each end takes its lane's role at its first use, through a
	// descriptor of its own, kept until Close.
	require.NoError(t, a.Send(ctx, "warm"))
	var warm string
	require.NoError(t, b.Recv(ctx, &warm))
	base := leakcheck.Count()
	for range 5 {
		m1, m2 := foreignKinds[0].make(t), foreignKinds[0].make(t)
		require.NoError(t, a.c.Send(ctx, extMsg(t, queueExt, nil, 0, 1), []int{m1, m2}))
		_, _ = unix.Close(m1), unix.Close(m2) // sent: the message holds its own
		var q *Queue
		err := b.Recv(ctx, &q)
		require.ErrorContains(t, err, "is not a queue's or pipe's socket")
		require.ErrorIs(t, err, ErrMalformed)
		assert.Nil(t, q)
	}
	assert.Equal(t, base, leakcheck.Count(), "descriptors open after five foreign queues")
	require.NoError(t, a.Send(ctx, "still here"))
	var s string
	require.NoError(t, b.Recv(ctx, &s))
	assert.Equal(t, "still here", s)
}

// FuzzDecodeQueueAndPipe decodes arbitrary bytes with descriptors of
// every kind: whatever the input, no panic, and every descriptor is
// either a decoded queue's or pipe's, released by its Close, or closed.
func FuzzDecodeQueueAndPipe(f *testing.F) {
	capacity := binary.LittleEndian.AppendUint32(nil, 2)
	f.Add(extMsg(f, pipeExt, nil, 0), []byte{kindSocket})
	f.Add(extMsg(f, queueExt, nil, 0, 1), []byte{kindSocket, kindSocket})
	f.Add(extMsg(f, queueExt, capacity, 0, 1, 2, 3), []byte{kindSocket, kindSocket, kindPlacesRead, kindPlacesWrite})
	f.Add(append([]byte{0x92}, append(extMsg(f, pipeExt, nil, 0), extMsg(f, pipeExt, nil, 0)...)...), []byte{kindSocket})
	for i := range foreignKinds {
		k := byte(kindForeign + i)
		f.Add(extMsg(f, pipeExt, nil, 0), []byte{k})
		f.Add(extMsg(f, queueExt, nil, 0, 1), []byte{kindSocket, k})
		f.Add(extMsg(f, queueExt, capacity, 0, 1, 2, 3), []byte{kindSocket, kindSocket, k, kindPlacesWrite})
		f.Add(extMsg(f, queueExt, capacity, 0, 1, 2, 3), []byte{kindSocket, kindSocket, kindPlacesRead, k})
	}
	warm := seqpacket(f) // the poller's descriptors, made before the count
	_, _ = unix.Close(warm[0]), unix.Close(warm[1])
	base := leakcheck.Count()

	f.Fuzz(func(t *testing.T, data []byte, kinds []byte) {
		if len(kinds) > 8 {
			kinds = kinds[:8]
		}
		places := placesEnds(t)
		var fds []int
		for _, k := range kinds {
			switch k = k % byte(kindForeign+len(foreignKinds)); k {
			case kindSocket:
				p := seqpacket(t)
				require.NoError(t, unix.Close(p[1]))
				fds = append(fds, p[0])
			case kindPlacesRead, kindPlacesWrite:
				d, err := unix.Dup(places[k-kindPlacesRead])
				require.NoError(t, err)
				fds = append(fds, d)
			default:
				fds = append(fds, foreignKinds[k-kindForeign].make(t))
			}
		}
		_, _ = unix.Close(places[0]), unix.Close(places[1])
		var v any
		if err := decode(data, fd.NewSet(fds), &v); err == nil {
			leakcheck.Free(v)
		}
		if n := leakcheck.Count(); n != base {
			t.Fatalf("descriptors: %d before, %d after", base, n)
		}
	})
}

// The kinds of descriptor FuzzDecodeQueueAndPipe gives a message.
const (
	kindSocket = iota
	kindPlacesRead
	kindPlacesWrite
	kindForeign // and foreignKinds after it
)

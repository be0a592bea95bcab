package shm

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"unsafe"

	"github.com/tensormp/tensormp/internal/fd"
)

// Flags are mmapalloc.Flags, whose documentation says what each does;
// this package's tests check that the values are the same. Callers pass
// KeepFD, Unlink and RefCount; this package sets the others itself, and
// sparse is the pools' own.
type Flags uint32

const (
	sharedMem Flags = 1 << iota
	exclusive
	noCreate
	KeepFD
	fromFD
	Unlink
	RefCount
	memfd
	// sparse: Create sizes the file without reserving its pages (with
	// KeepFD, not RefCount); its owner reserves each range with
	// Allocation.Reserve before anyone writes it. A pool's slabs are made
	// so: their memory is taken as their slots are first used.
	sparse
)

var flagNames = []string{"SharedMem", "Exclusive", "NoCreate", "KeepFD", "FromFD", "Unlink", "RefCount", "Memfd", "Sparse"}

func (f Flags) String() string {
	if f == 0 {
		return "0"
	}
	var parts []string
	for i, n := range flagNames {
		if f&(1<<i) != 0 {
			parts = append(parts, n)
		}
	}
	if rest := f &^ (1<<len(flagNames) - 1); rest != 0 {
		parts = append(parts, fmt.Sprintf("%#x", uint32(rest)))
	}
	return strings.Join(parts, "|")
}

// headerSize is the size of the reference-count header that RefCount
// segments carry in front of their data.
const headerSize = 64

const (
	headerMagic   = 0x53504d54 // "TMPS" little-endian
	headerVersion = 1
)

// header is the layout of the first headerSize bytes of a RefCount
// segment. refs is only touched with atomic operations: every process that
// maps the segment shares it.
type header struct {
	magic   uint32
	version uint32
	refs    atomic.Int32
	_       int32
	size    int64
	_       [headerSize - 24]byte
}

var _ [headerSize - unsafe.Sizeof(header{})]byte // header fills headerSize exactly

// Names in the environment and in the shared-memory directory; package
// mmapalloc exports them all.
const (
	// EnvSession names the environment variable that carries the
	// session id from a parent to the processes it starts.
	EnvSession = "TENSORMP_SESSION"
	// NamePrefix starts every segment name tensormp makes.
	NamePrefix = "tensormp_"
	// envDir names the environment variable that overrides the
	// directory segments live in.
	envDir = "TENSORMP_SHM_DIR"
	// defaultDir is where segments live unless TENSORMP_SHM_DIR says
	// otherwise; it is where glibc's shm_open puts them.
	defaultDir = "/dev/shm"
)

// Dir returns the directory segments are created in and opened from.
func Dir() string {
	if d := os.Getenv(envDir); d != "" {
		return d
	}
	return defaultDir
}

// Session returns this process's session id: inherited from
// TENSORMP_SESSION when a parent set it, else made at first use. It is
// part of every segment name, so that a session's segments can be found
// and removed together.
func Session() string { return session() }

// SessionPrefix returns the prefix of every segment name of this session.
func SessionPrefix() string { return sessionPrefix() }

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails on Linux
	return hex.EncodeToString(b)
}

func newName() string {
	return fmt.Sprintf("%s%s_%d_%s", NamePrefix, Session(), os.Getpid(), randomHex(8))
}

func validSession(s string) bool {
	if s == "" || len(s) > 32 {
		return false
	}
	for _, c := range s {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z') {
			return false
		}
	}
	return true
}

// Name is a name tensormp gives to an entry of the shared-memory
// directory: a segment, tensormp_<session>_<pid>_<16 hex digits>, or a
// session's lock, tensormp_<session>_lock.
type Name struct {
	Session string
	Pid     int  // the process that made the segment; 0 for a lock
	Lock    bool // the session's lock
}

// ParseName parses an entry's whole name; ok is false for anything
// tensormp did not name (a path, "..", another program's file, a name
// with more after it). It is the one place that knows the grammar.
func ParseName(name string) (n Name, ok bool) {
	rest, ok := strings.CutPrefix(name, NamePrefix)
	if !ok || len(name) > 96 {
		return Name{}, false
	}
	session, rest, ok := strings.Cut(rest, "_")
	if !ok || !validSession(session) {
		return Name{}, false
	}
	if rest == "lock" {
		return Name{Session: session, Lock: true}, true
	}
	pid, rnd, ok := strings.Cut(rest, "_")
	if !ok || pid == "" || len(pid) > 10 || pid[0] == '0' || len(rnd) != 16 {
		return Name{}, false
	}
	for _, c := range pid {
		if c < '0' || c > '9' {
			return Name{}, false
		}
		n.Pid = n.Pid*10 + int(c-'0')
	}
	for _, c := range rnd {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return Name{}, false
		}
	}
	n.Session = session
	return n, true
}

// validName reports whether name is a segment name tensormp made (see
// ParseName). Anything else is refused before it reaches the file
// system.
func validName(name string) bool {
	n, ok := ParseName(name)
	return ok && !n.Lock
}

// LockName returns the name of session's lock.
func LockName(session string) string { return NamePrefix + session + "_lock" }

// ID identifies a segment's file within this machine: device and inode.
// Two descriptors of one segment have the same ID.
type ID struct {
	Dev, Ino uint64
}

// Allocation is one mapping of a shared segment. It owns the mapping, the
// descriptor when KeepFD is set, and, for RefCount segments, one reference;
// Release gives all three back exactly once. An Allocation may be used from
// several goroutines; its Bytes are invalid after Release.
type Allocation struct {
	mapping []byte // the whole mapping, header included
	data    []byte // the caller's bytes
	own     *fd.FD // the kept descriptor (KeepFD)
	path    string // "" for a segment opened from a bare descriptor
	flags   Flags
	id      ID

	closed     atomic.Bool
	refDropped atomic.Bool // the RefCount reference was given back
}

// Bytes returns the segment's data (after the header of a RefCount
// segment). The slice aliases the shared mapping: writes are seen by every
// process that maps the segment. It is nil after Release.
func (a *Allocation) Bytes() []byte {
	if a.closed.Load() {
		return nil
	}
	return a.data
}

// Size returns the number of data bytes.
func (a *Allocation) Size() int64 { return int64(len(a.data)) }

// Name returns the segment's name in Dir, or "" for one opened from a bare
// descriptor. A name that was unlinked is still reported.
func (a *Allocation) Name() string {
	if a.path == "" {
		return ""
	}
	return a.path[strings.LastIndexByte(a.path, '/')+1:]
}

// FD returns the descriptor the Allocation keeps (KeepFD), or -1. The
// descriptor stays owned by the Allocation and is closed by its Release: use
// the number only while the Allocation is surely open, and lend it with
// LendFD to pass it to another process.
func (a *Allocation) FD() int {
	if a.closed.Load() {
		return -1
	}
	return a.own.Num()
}

// fd is the kept descriptor's number for this package's system calls,
// made while the Allocation is open: FD without its check.
func (a *Allocation) fd() int { return a.own.Num() }

// LendFD lends the kept descriptor, to a message that passes it to
// another process: the number stays open, and the same file, until
// ReturnFD, whatever Release does meanwhile.
func (a *Allocation) LendFD() (int, error) {
	if a.own == nil || a.closed.Load() {
		return -1, ErrClosed
	}
	return a.own.Lend()
}

// ReturnFD ends a LendFD.
func (a *Allocation) ReturnFD() {
	if a.own != nil {
		_ = a.own.Return()
	}
}

// Flags returns the flags the Allocation was made with.
func (a *Allocation) Flags() Flags { return a.flags }

// Sealed reports whether no holder of the segment can resize it under the
// others' mappings: a memfd, sealed when it was made or checked when it
// was received (OpenFD), is; a named segment is not.
func (a *Allocation) Sealed() bool { return a.flags&(memfd|fromFD) != 0 }

// ID returns the device and inode of the segment's file.
func (a *Allocation) ID() ID { return a.id }

// Refs returns the reference count of a RefCount segment: how many
// mappings across all processes hold it. It is 0 for other segments.
func (a *Allocation) Refs() int32 {
	if a.flags&RefCount == 0 || a.closed.Load() {
		return 0
	}
	var n int32
	_ = Guard(func() { n = a.hdr().refs.Load() })
	return n
}

func (a *Allocation) hdr() *header {
	return (*header)(unsafe.Pointer(&a.mapping[0]))
}

func (a *Allocation) String() string {
	return fmt.Sprintf("segment %s (%d bytes, %v)", a.where(), len(a.data), a.flags)
}

// where names the segment for an error: its path, or its descriptor.
func (a *Allocation) where() string {
	if a.path == "" {
		return fmt.Sprintf("fd %d", a.fd())
	}
	return a.path
}

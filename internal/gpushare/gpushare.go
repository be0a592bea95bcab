// Package gpushare is how package reduction sends and receives package
// cuda's device memory without cuda exporting its plumbing: cuda registers
// a Sharer when it is initialised, and reduction asks for it. A program
// without cuda has none, and no device memory to send either.
package gpushare

import (
	"errors"
	"sync/atomic"

	"github.com/tensormp/tensormp/internal/shm"
	"github.com/tensormp/tensormp/tensor"
)

// Slab describes a buffer in a device slab to another process: its block,
// whose ticket holds it in flight and whose segment names the slab, and
// the slab's descriptor, which stays the sender's runtime's.
type Slab struct {
	Device int
	Block  *shm.Block
	MemFD  int
}

// Handle describes a buffer by legacy CUDA IPC: the allocation's IPC
// handle, where the buffer starts in it, an interprocess event that marks
// the work done on it before sending, and a token. The token is a block of
// shared memory that every process using the allocation holds: the
// producer frees the allocation only when no other process, and no
// message in flight, holds the token, so the memory lives exactly as long
// as some consumer uses it.
type Handle struct {
	Device int
	Mem    [64]byte // the driver's CUipcMemHandle
	Event  [64]byte // the driver's CUipcEventHandle
	Offset int64    // from the allocation's start to the buffer's
	Size   int64
	// Token is the token block: the sender's in Export, the receiver's
	// own (attached from the message's ticket) in Import.
	Token *shm.Block
	// Ticket, from Export, holds the token for the message: send its
	// descriptor, then call Done (or Discard if it is never sent).
	Ticket *shm.Ticket
}

// A Sharer sends and receives the device buffers of the process's
// runtime.
type Sharer interface {
	// Share describes b, a buffer in a device slab, once the work
	// queued on its device so far is done. inSlab is false for a buffer
	// that is not in a slab: it travels by Export.
	Share(b tensor.Buffer) (sh Slab, inSlab bool, err error)
	// Export describes b by IPC handle and takes a ticket on its token
	// for the message (Handle.Ticket).
	Export(b tensor.Buffer) (Handle, error)
	// Import opens a buffer another process exported; the buffer takes
	// over h.Token.
	Import(h Handle) (tensor.Buffer, error)
	// ImportBlock returns the buffer of size bytes that blk, a block of
	// a device slab attached from a message's ticket (or by the slab's
	// identity, for a lane's message), holds on device dev; the buffer
	// takes blk over. memFD is the message's descriptor
	// of the slab, which stays the caller's: the slab is imported from
	// it if it is not mapped yet, and must be the one mapped if it is.
	// A block that a lane named by the slab's identity alone has none
	// (-1): its slab must be mapped already.
	ImportBlock(dev int, blk *shm.Block, size int64, memFD int) (tensor.Buffer, error)
	// SameSlab checks that memFD, a message's descriptor of the slab
	// that b, a buffer of this process in a device slab, lies in, is of
	// that slab's allocation.
	SameSlab(b tensor.Buffer, memFD int) error
	// UUID returns the UUID of the device this process calls dev.
	UUID(dev int) ([16]byte, error)
	// Ordinal returns this process's ordinal of the device named uuid,
	// or an error if this process does not see it.
	Ordinal(uuid [16]byte) (int, error)
}

var registered atomic.Pointer[Sharer]

// Register makes s the process's Sharer.
func Register(s Sharer) { registered.Store(&s) }

// ErrForeign is returned by a Sharer for a device buffer of another
// backend than its own.
var ErrForeign = errors.New("not a CUDA allocation")

// ErrNoSharer is returned by Get in a program without package cuda.
var ErrNoSharer = errors.New("device memory needs package cuda, which this program does not include")

// Get returns the process's Sharer.
func Get() (Sharer, error) {
	if s := registered.Load(); s != nil {
		return *s, nil
	}
	return nil, ErrNoSharer
}

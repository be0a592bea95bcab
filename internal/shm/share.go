package shm

// A Lease is what a message holds of the memory it names until it is
// sent: a ticket, or a segment's lent descriptor.
type Lease interface {
	Done()    // the message was sent
	Discard() // it never will be
}

// Handle says how another process finds shared memory of this package:
// what a message names of it.
type Handle struct {
	Name    string // the segment's name when it travels by name (file_system), else ""
	ID      ID     // the segment's file, when it travels by descriptor
	Size    int64  // the memory's size in bytes
	Segment int64  // the size of a block's segment; 0 for a whole segment
	Offset  int64  // a block's offset in its segment; -1 for a whole segment
	Gen     uint64 // a block's generation
	// FD is the descriptor the message carries, or -1; it stays open
	// until Lease is done.
	FD int
	// Lease holds FD, and a block, until the message is sent; nil when
	// the message holds nothing of its own for this memory.
	Lease Lease
	Block *Block // the block, or nil for a whole segment
}

// Shared is shared memory of this package that can travel to another
// process: a Block or an Allocation.
type Shared interface {
	// Share describes the memory for a message. pinned is a ticket the
	// message carries already, or nil: a block it covers travels with
	// it, and the Handle has no lease of its own.
	Share(pinned *Ticket) (Handle, error)
}

// Share describes b by its segment and its slot, with the ticket that
// holds it in flight: pinned, when it covers b, else a new one, which is
// then the Handle's lease.
func (b *Block) Share(pinned *Ticket) (Handle, error) {
	tk, lease := pinned, Lease(nil)
	if !pinned.Covers(b) {
		t, err := b.Ticket()
		if err != nil {
			return Handle{}, err
		}
		tk, lease = t, t
	}
	seg := b.Segment()
	h := Handle{Size: b.Size(), Segment: seg.Size(), Offset: b.Offset(), Gen: b.Gen(), FD: tk.FD(), Lease: lease, Block: b}
	if b.Named() {
		h.Name = seg.Name()
	} else {
		h.ID = seg.ID()
	}
	return h, nil
}

// Share describes a by name (RefCount), or by its descriptor, lent to the
// message until the lease is done.
func (a *Allocation) Share(*Ticket) (Handle, error) {
	h := Handle{Size: a.Size(), Offset: -1, FD: -1}
	if a.flags&RefCount != 0 {
		h.Name = a.Name()
		return h, nil
	}
	fd, err := a.LendFD()
	if err != nil {
		return Handle{}, err
	}
	h.ID, h.FD, h.Lease = a.id, fd, lentFD{a}
	return h, nil
}

// lentFD is an Allocation's descriptor lent to a message.
type lentFD struct{ a *Allocation }

func (l lentFD) Done()    { l.a.ReturnFD() }
func (l lentFD) Discard() { l.a.ReturnFD() }

// Package mmapalloc creates, opens and maps the shared-memory segments
// that hold shared tensors, and says what tensormp's shared memory
// promises: who holds it, who removes it, and what a peer can do to it.
//
// # Segments
//
// A named segment is a file in the shared-memory directory (Dir:
// $TENSORMP_SHM_DIR, default /dev/shm) named
// tensormp_<session>_<pid>_<random>. Create opens it with
// O_EXCL|O_NOFOLLOW, mode 0600, reserves its pages with fallocate so a full
// directory is an ErrNoSpace error rather than a later SIGBUS, and maps it.
// The Flags, after torch's MapAllocator, choose between the two sharing
// strategies:
//
//   - file_descriptor: Create(n, KeepFD|Unlink) makes a memfd, which has no
//     name at all and is not limited by the directory's size, sealed
//     against shrinking and growing; receivers map it with OpenFD, which
//     refuses a descriptor of an unsealed file (ErrUnsealed).
//   - file_system: Create(n, RefCount) keeps the name and starts the file
//     with a 64-byte header counting the mappings of it in all processes;
//     receivers map it with OpenName, and the last Release unlinks it.
//
// # Pools and blocks
//
// Shared tensors live in blocks, pieces of segments that each process
// pools and recycles (package tensor allocates them; Trim gives the unused
// ones back). Who holds a block is kept by the kernel, not
// in shared memory: a receiver's hold is a read lock on the block's lock
// byte through an open file description of the segment that is the
// receiver's own; a message's hold is a ticket, a lock through a
// description whose descriptor travels with the message; a producer counts
// its own storages itself. The kernel drops a description's locks when its
// last descriptor closes: when the process holding it dies, SIGKILL
// included, and when a message carrying it is dropped unread. A producer
// reuses a block once no description but its own holds it. A named
// segment is removed by its pool, or, once its producer is gone, by the
// last process to let go of it; a process that lets go of one that a
// message or a dying producer still holds looks again by name for a
// minute, and removes it once nobody holds anything.
//
// # What a peer can and cannot do
//
// A process that receives a block maps the whole segment read-write: it is
// trusted with the data it was given, and a buggy one can overwrite any
// block's data in that segment. It cannot change who owns what by writing
// memory: no ownership state lies in the data's address range (the slot
// table is in pages of its own, before the data, and read-only in
// receivers), and the holds are the kernel's. It cannot drop another
// process's hold (that lives on a description it has no descriptor of),
// cannot make a holder's mapping fault by resizing a file_descriptor
// segment (sealed), and cannot make a receiver map a file tensormp did not
// make. What a hostile peer can do: write the slot table of a segment it
// maps through a mapping of its own; drop the holds of messages sent with
// a ticket descriptor it was given, so that their blocks may be recycled
// while in flight (their receivers then get ErrStaleBlock, unless the
// peer also rewrote the generation); keep a ticket descriptor open, which
// keeps its sender's blocks from being reused while it lives; send, for a
// block of a segment its receiver maps already, a ticket of another file
// (the receiver takes it for the segment's without a look), so that
// the block is held by nothing until the receiver's own lock takes over,
// milliseconds later; and, under file_system, truncate a named segment it
// can open, which makes the mappings of it fault. What it cannot do, with
// any descriptor of a segment a process made, any name, slot table or
// header it writes: make that process hold a block of its own pool that
// the pool has free or hands out while the hold lasts. The process looks
// at its pool's own record of the slot before its hold and after it.
//
// Ownership: an Allocation owns its mapping, its descriptor (KeepFD) and
// its reference (RefCount), and Release gives each back exactly once. OpenFD
// takes ownership of the descriptor it is given, also when it fails. Names
// and sizes from other processes are checked (ValidName, fstat, the slot
// table) before a segment is mapped.
//
// Segments are Linux only; elsewhere the package builds and its functions
// return ErrUnsupported.
package mmapalloc

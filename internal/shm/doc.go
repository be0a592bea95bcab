// Package shm implements package mmapalloc's segments, and the pools,
// blocks and tickets through which packages tensor, reduction, mp and cuda
// share memory: what they need of each other stays here, out of
// mmapalloc's public surface. mmapalloc's documentation says what the
// whole promises; this package's types say how.
//
// A Pool hands out Blocks, pieces of pooled segments, and recycles them
// (see Block for the layout). A receiver's hold on a block is a read lock
// on the block's lock byte through an open file description of its own
// (AttachBlock, AttachMappedBlock); a message's hold is a Ticket, whose
// descriptor is the Ticket's until Done or Discard. A Block holds its slot
// until Release. A segment let go of while others may still hold it is
// watched by name until nobody does (orphans.go).
//
// Segments are Linux only; elsewhere the package builds and its functions
// return ErrUnsupported.
package shm

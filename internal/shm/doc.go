// Package shm implements package mmapalloc's segments, and the pools,
// blocks and tickets through which packages tensor, reduction, mp and cuda
// share memory: what they need of each other stays here, out of
// mmapalloc's public surface. mmapalloc's documentation says what the
// whole promises; this package's types say how.
//
// A Pool hands out Blocks, pieces of pooled segments, and recycles them
// (see Block for the layout). A receiver's hold on a block is a read lock
// on the block's lock byte through an open file description of its own
// (Attach); a message's hold is a Ticket, whose descriptor is the
// Ticket's until Done or Discard. A Block holds its slot until Release. A
// segment let go of while others may still hold it is watched by name
// until nobody does (orphans.go). The process's tables, pools and queues
// are declared in state.go, with the order in which their locks are
// taken.
//
// Errors are *Error, which names the operation and what it was done to,
// or wrap one of the sentinels; they name no package, and the package a
// user calls says where they came from.
//
// Segments are Linux only; elsewhere the package builds and its functions
// return ErrUnsupported.
package shm

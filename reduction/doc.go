// Package reduction turns tensors into what crosses a process boundary and
// back: Reduce gives a tensor's Meta (versioned msgpack metadata) and the
// descriptors that travel with it, Rebuild maps them again in the
// receiving process. Marshal and Unmarshal do the same for any
// msgpack-encodable value with tensors anywhere inside it.
//
// Sending shares a tensor's storage in place if it is not shared yet (see
// tensor.ShareMemory); a shared one is never copied. A pooled block travels
// as its segment's ticket descriptor, which holds the block while the
// message is in flight (see package mmapalloc), and, under
// file_system, the segment's name, which the receiver opens; an empty
// tensor travels as metadata alone. Names of another session are refused.
// On a lane (package mp's Pipe and Queue) a block whose segment the
// reader maps is named by identity alone, without a descriptor: the
// reader holds it by its own lock on the block's slot, taken before the
// generation is checked, or, for a block it made, takes it back from its
// pool (see openBlock). The Meta of such a block on the CPU, of a tensor
// without a LoD, travels there in a compact binary form (see compactTag
// and compactable), which only lanes carry and which is checked as any
// Meta is; a device slab's block named so travels in msgpack.
//
// Ownership: descriptors returned by Reduce and Marshal are the caller's,
// to send and close (closing one unsent drops the holds it stood for).
// Encoder.Encode lends its descriptors until Done (sent) or Discard (never
// sent). Rebuild borrows its descriptors; Decode owns its descriptors: a
// ticket is kept by the process once every block it covers is held, a
// whole segment's descriptor goes to its storage, and the rest are closed.
// Receiving a segment the process already maps returns a tensor on the same
// Storage, through a guarded cache that does not keep storages alive (see
// tensor.StorageRef).
//
// Everything received is checked before use: version, dtype, shape,
// strides and offset against the segment's real size, descriptor indexes,
// names, and that every descriptor a message carries is used.
package reduction

// Package reduction turns tensors into what crosses a process boundary and
// back: Reduce gives a tensor's Meta (versioned msgpack metadata) and the
// descriptors that travel with it, Rebuild maps them again in the
// receiving process. Marshal and Unmarshal do the same for any
// msgpack-encodable value with tensors anywhere inside it.
//
// Sending shares a tensor's storage in place if it is not shared yet (see
// tensor.ShareMemory); a shared one is never copied. Under file_descriptor
// the segment travels as a descriptor, under file_system by name; an empty
// tensor travels as metadata alone.
//
// Ownership: descriptors returned by Reduce and Encode are borrowed from
// the tensors' storages. Rebuild borrows its descriptors and duplicates
// what it keeps; Decode owns its descriptors, hands each used one to the
// storage it maps and closes the rest. Receiving a segment the process
// already maps returns a tensor on the same Storage, through a guarded,
// bounded cache that holds storages weakly.
//
// Everything received is checked before use: version, dtype, shape,
// strides and offset against the segment's real size, descriptor indexes,
// names, and that every descriptor a message carries is used.
package reduction

// Package tensor is tensormp's n-dimensional array: a Storage of bytes on a
// device, viewed through a dtype, a byte offset, a shape and strides.
//
// Views (Narrow, Slice, Transpose, a contiguous Reshape) share their
// Storage. ShareMemory moves a Storage into a shared-memory segment in
// place, so a tensor and all its views become shareable with other
// processes without being rebuilt; package reduction then sends them.
// Elements are read and written without copying through the generic Data,
// At and Set, which check the element type.
//
// New tensors go to a place: the current place of a context with
// In(ctx), an explicit place with On(p), or the process default with the
// package-level constructors (see package device). CPU memory is built in;
// other device types are served by a Backend that their package registers
// (package cuda for GPUs).
//
// Ownership: a Storage owns its memory (segment, device buffer). Release
// gives it back at once, for every tensor on it; a Storage that becomes
// unreachable is released as a safety net, after the garbage collection
// that finds it so.
//
// Shared memory a peer cut short (a truncated file_system segment) makes
// this package's reads and writes return errors wrapping
// mmapalloc.ErrFault; slices from Data fault like any mapping (see Data).
package tensor

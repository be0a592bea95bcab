// Package mmapalloc creates, opens and maps the shared-memory segments
// that hold shared tensors.
//
// A segment is a file in the shared-memory directory (Dir: $TENSORMP_SHM_DIR,
// default /dev/shm) named tensormp_<session>_<pid>_<random>. Create opens it
// with O_EXCL|O_NOFOLLOW, mode 0600, reserves its pages with fallocate so a
// full directory is an ErrNoSpace error rather than a later SIGBUS, and maps
// it. The Flags, after torch's MapAllocator, choose between the two sharing
// strategies:
//
//   - file_descriptor: Create(n, KeepFD|Unlink). The name is removed before
//     Create returns; the segment lives while a descriptor or mapping of it
//     exists anywhere, and receivers map it with OpenFD.
//   - file_system: Create(n, RefCount). The segment keeps its name and starts
//     with a 64-byte header holding an atomic count of the mappings of it in
//     all processes; receivers map it with OpenName, and the last Close
//     unlinks it.
//
// When the directory cannot hold a file_descriptor segment (Docker's 64 MiB
// /dev/shm, say), Create falls back to memfd_create, which that size does
// not limit, and seals the file against shrinking (flag Memfd).
//
// Ownership: an Allocation owns its mapping, its descriptor (KeepFD) and its
// reference (RefCount), and Close releases each exactly once. OpenFD takes
// ownership of the descriptor it is given, also when it fails. Names and
// sizes from other processes are checked (ValidName, fstat) before use.
//
// Segments are Linux only; elsewhere the package builds and its functions
// return ErrUnsupported.
package mmapalloc

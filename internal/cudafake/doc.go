// Package cudafake is a CUDA driver in host memory, for testing what
// package cuda builds on the driver (executors, allocation, sharing
// between processes) on machines without a GPU. It checks what the real
// driver would refuse: work on a thread where no context is current,
// memory used before access to it was given, a descriptor imported that
// is no allocation.
//
// Its virtual memory allocations are sealed memfds: their descriptors
// travel between processes as the real driver's do, and processes that
// import one share its bytes, so that cross-process tests run in CI as
// they would on a GPU. Its legacy IPC handles work within one process
// only.
package cudafake

// Package cudafake is a CUDA driver in host memory, for testing what
// package cuda builds on the driver (executors, allocation, IPC reference
// counts, the limbo) on machines without a GPU. It checks what the real
// driver would refuse: work on a thread where no context is current.
package cudafake

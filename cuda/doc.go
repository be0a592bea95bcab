// Package cuda puts tensors on NVIDIA GPUs and shares them between
// processes as file descriptors, as shared CPU memory is shared.
//
// The driver, libcuda.so.1, is opened with dlopen at run time (cgo, no
// link-time dependency): a machine without it, or a build without cgo,
// builds and tests everything else, and GPU calls return ErrNoDriver.
// Every failed driver call is an *Error naming the call and CUDA's own
// description.
//
// The CUDA current context belongs to an OS thread, so each device has an
// executor that holds the device's primary context and runs the device's
// work on the calling goroutine's thread, locked to it for the call, with
// the context made current there and the thread's previous context put
// back afterwards (a Python thread calling in keeps PyTorch's). Work that
// calls the executor again runs at once.
//
// Importing the package registers the gpu backend of package tensor:
// tensor.On(device.GPU(0)).Zeros(...) allocates on the device, and To moves
// tensors between host and devices.
//
// A device travels between processes as its UUID: ordinals are per
// process (CUDA_VISIBLE_DEVICES), and a receiver maps the UUID to its own
// ordinal, or refuses a tensor of a device it cannot see. Memory is
// mapped for its device and every peer that can access it.
//
// The driver's unmap and release do not wait for the work queued on the
// memory, and work that touches unmapped memory breaks the context for
// good (Error.Sticky), another library's in the process too: a block is
// given back only after the work this process queued on it, a slab is
// unmapped only after every stream of its context is idle, and Write
// returns once its bytes are on the device.
//
// Ownership across processes, where the device exports allocations as
// POSIX file descriptors (FDShared; CUDA 10.2 and newer, most GPUs): buffers are blocks of pooled device slabs (see slab.go), many
// small ones to a slab. A slab's segment, a small sealed memfd of package
// internal/shm, names it and holds its slot table, and the kernel counts who
// holds each block by the locks on that segment, as for a CPU block: a
// process's buffers, each receiver's, each message in flight. A message
// carries the block's ticket and the slab's descriptor; a receiver imports
// and maps a slab once, the first time it is named. The device memory
// lives while any process, or message, holds a descriptor, a handle or a
// mapping of it: a producer may exit first, killed or not, and a killed
// receiver gives everything back. Sending waits for the work queued on the
// device before the buffer is described, so that no interprocess event,
// and no file in /dev/shm, is needed.
//
// Where the device cannot export descriptors (older drivers, some
// virtualised GPUs), the legacy path is chosen at run time: a buffer is an
// allocation of its own, described to other processes by an IPC memory
// handle, an interprocess event and a token, a block of shared memory that
// every process using the allocation holds. Each message holds a
// reference, each consumer's Buffer one; the producer's Release puts an
// allocation still referenced elsewhere in the limbo, and CollectLimbo
// (run on every Release) frees it once nobody else holds it, so the producer
// must outlive its consumers. A consumer opens each handle once per
// process and closes it with its last buffer on it, and waits for the
// producer's work (its event) when it opens it.
//
// Memory another library allocated on the device (a PyTorch tensor handed
// over through DLPack) is never shared as it is: Buffer.CopyIn copies it
// into a Buffer of tensormp's, within the bounds of its allocation, so
// that the other library's allocator keeps sole charge of its own.
//
// On the legacy path the driver keeps a file in /dev/shm for each
// process's interprocess events and removes it when the process's context
// goes. Closing the Default Runtime (tensor.CloseBackends, at a worker's
// exit) gives the contexts back, and also removes this process's files
// when another library in it still holds the context. Those of a process
// that dies first are removed by the tensormp process that learns of its
// death (see package mp).
package cuda

// Package cuda puts tensors on NVIDIA GPUs and shares them between
// processes with CUDA IPC.
//
// The driver, libcuda.so.1, is opened with dlopen at run time (cgo, no
// link-time dependency): a machine without it, or a build without cgo,
// builds and tests everything else, and GPU calls return ErrNoDriver.
// Every failed driver call is an *Error naming the call and CUDA's own
// description.
//
// The CUDA current context belongs to an OS thread, so each device has an
// Executor that holds the device's primary context and runs the device's
// work on the calling goroutine's thread, locked to it for the call, with
// the context made current there and the thread's previous context put
// back afterwards (a Python thread calling in keeps PyTorch's). Work that
// calls the executor again runs at once.
//
// Importing the package registers the gpu backend of package tensor:
// tensor.On(device.GPU(0)).Zeros(...) allocates on the device, and To moves
// tensors between host and devices.
//
// Ownership across processes: a producer's Buffer owns its allocation.
// Export describes it with an IPC memory handle, an interprocess event and
// a token, a block of shared memory whose reference count every process
// shares. Each message holds a reference, each consumer's Buffer one; the
// producer's Free puts an allocation still referenced elsewhere in the
// limbo, and CollectLimbo (run on every Free) frees it once nobody else
// holds it. A consumer opens each handle once per process and closes it
// with its last buffer on it, and waits for the producer's work (its
// event) when it opens it; memory it holds already is not waited for
// again.
//
// Memory another library allocated on the device (a PyTorch tensor handed
// over through DLPack) is never exported as it is: Buffer.CopyIn copies
// it into a Buffer of tensormp's, within the bounds of its allocation, so
// that the other library's allocator keeps sole charge of its own.
//
// The driver keeps a file in /dev/shm for each process's interprocess
// events and removes it when the process's context goes. Closing the
// Default Runtime (tensor.CloseBackends, at a worker's exit) gives the
// contexts back, and also removes this process's files when another
// library in it still holds the context. A killed worker cannot: the
// process that started it with mp.Spawn removes its files after it died
// and before it reaps it, while its pid still names nobody else. Only
// the file of a killed process that no tensormp process started stays
// (a PyTorch process, say).
package cuda

// Command libtensormp is tensormp's C interface, built as a shared library
// for processes in other languages (the Python package in python/ loads it
// through ctypes):
//
//	go build -buildmode=c-shared -o libtensormp.so ./cmd/libtensormp
//
// The build writes libtensormp.h beside the library; it includes dlpack.h
// from this directory. A foreign process reaches Go processes through
// named endpoints (mp.Listen, mp.Dial), sends and receives values over the
// Pipes and Queues they give, and takes tensors as DLPack
// DLManagedTensors, with no copy: a tensor received is the sender's shared
// memory, mapped into this process, or, for a GPU tensor, the sender's
// device memory, a slab imported from the descriptor its message carried
// (by CUDA IPC where the driver cannot export descriptors), mapped here
// (DLPack device kDLCUDA).
//
// Every call returns a status (TENSORMP_OK, or one of the failures below;
// tensormp_statuses gives them by name, for bindings that cannot read
// this header) and, on failure, sets *err to a message the caller frees
// with tensormp_free. Objects are named by handles (int64, never 0): a
// listener, pipe, queue or tensor. The caller owns each handle it is given
// and gives it back with tensormp_close; a DLManagedTensor made by
// tensormp_to_dlpack is given back through its deleter. The memory of a
// tensor is unmapped when its last handle and export are gone; reference
// counting stays on the Go side. When the process exits, however it exits,
// the kernel takes back what it held: nothing is left in /dev/shm. (A
// process that exported GPU memory by CUDA IPC calls tensormp_shutdown
// before it exits: the CUDA driver removes the files it keeps in /dev/shm
// for such exports only when the process gives its contexts back.)
//
// Values travel as JSON text: null, booleans, numbers, strings, arrays and
// objects, with tensormp's objects as {"$tensormp": "tensor" | "queue" |
// "pipe", "h": handle}, byte strings as {"$tensormp": "bytes", "b64": ...}
// and infinities and NaN as {"$tensormp": "float", "v": "inf" | "-inf" |
// "nan"}. A received tensor's object also carries its "dtype", "shape",
// "strides" (in elements) and "device" ("cpu", "gpu:N"); its handle is the
// caller's.
//
// Tensors are shared under the file_descriptor strategy, whatever
// TENSORMP_SHARING_STRATEGY says: file_system segments belong to a session
// of Go processes, and a peer's are refused.
//
// A process that loads the library must not fork after its first call:
// the child of a fork has none of the Go runtime's threads.
package main

import (
	"os"

	"github.com/tensormp/tensormp/internal/reexec"
	"github.com/tensormp/tensormp/mp"
	"github.com/tensormp/tensormp/strategy"
)

func init() {
	// The library serves the process that loaded it: it is never an mp
	// worker or keeper, even when that process inherited the variable
	// that marks one.
	_ = os.Unsetenv(reexec.EnvVar)
	mp.Init()
	// Named file_system segments belong to a session whose keeper is a
	// re-executed child: a foreign process has no such program to start.
	_ = strategy.Set(strategy.FileDescriptor)
}

func main() {}

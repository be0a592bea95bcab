"""tensormp for Python: share tensors with Go processes without copying them.

Pure Python over ctypes: it loads libtensormp.so, tensormp's Go library
built as a shared library, which the package's wheel holds::

    python3 -m pip install ./python    # from the repository; needs Go

It looks for the library in $TENSORMP_LIB, then beside this file, then on
the system's library path.

A Python process reaches a Go process through a named endpoint, as with
torch's multiprocessing.connection: ``dial(address)`` or
``Listener(address).accept()`` give a ``Pipe``; a ``Queue`` can be made
here or received from the Go side inside any value. Values are None,
booleans, numbers, strings, bytes, lists, tuples (sent as lists), dicts
with string keys, and tensors anywhere inside: a ``tensormp.Tensor``, or
any object with ``__dlpack__`` (torch and NumPy arrays).

A tensor received is the sender's shared memory, mapped here:
``torch.from_dlpack(t)`` and ``numpy.from_dlpack(t)`` view it without a
copy, and writes show in every process that holds it. A tensor sent is
shared as it is when its memory is tensormp's (made with ``empty``, or
received); anything else is copied into shared memory once. Memory is
counted on the Go side: it is unmapped here when the last Tensor, torch
tensor or NumPy array on it is gone. Whenever the process exits, the
kernel takes back what it held: nothing is left in /dev/shm.

CUDA tensors travel the same way, in device slabs whose file descriptors
go with the message (by CUDA IPC where the driver cannot export them): a
GPU tensor received is the sender's device memory, which
``torch.from_dlpack(t)`` views on its device (``t.device`` is "cuda:N");
a torch CUDA tensor sent is copied once, on its GPU, into a slab of
tensormp's, unless it is in one already (made with ``empty(...,
device="cuda")``, or received). A sender waits for the work queued on
torch's current stream before each send, so a receiver has nothing to
wait for; after writing to memory another process holds, and before
telling it so in a message without the tensor,
``torch.cuda.synchronize()``. The memory lives while any process holds
it, after its sender has exited. At exit the package gives the GPU
contexts back, so that the CUDA driver removes the files it keeps in
/dev/shm for CUDA IPC exports.

Every failure is a ``tensormp.Error``: ``Timeout`` and ``Closed`` for a
wait that ran out and a closed end, ``InvalidValue`` (also a TypeError and
a ValueError) for a value tensormp cannot send or view, and for a message
from the peer that is not well formed (it is dropped, and the pipe or
queue goes on).

Do not fork a process after it has loaded the library (the child of a
fork has none of the Go runtime's threads): start workers with the
"spawn" method.
"""

from ._errors import Closed, Error, InvalidValue, Timeout
from ._objects import Listener, Pipe, Queue, Tensor, dial, empty, share

__all__ = [
    "Error", "Timeout", "Closed", "InvalidValue", "Tensor", "Queue", "Pipe",
    "Listener", "dial", "empty", "share",
]

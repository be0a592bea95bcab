"""tensormp for Python: share tensors with Go processes without copying them.

Pure Python over ctypes: it loads libtensormp.so, tensormp's Go library
built as a shared library::

    go build -buildmode=c-shared -o python/tensormp/libtensormp.so ./cmd/libtensormp

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

Do not fork a process after it has loaded the library (the child of a
fork has none of the Go runtime's threads): start workers with the
"spawn" method.
"""

import atexit
import base64
import ctypes
import ctypes.util
import json
import math
import os
import sys
import threading
import time

__all__ = [
    "Error", "Timeout", "Closed", "Tensor", "Queue", "Pipe", "Listener",
    "dial", "empty", "share",
]

_OK, _ERROR, _TIMEOUT, _CLOSED = 0, 1, 2, 3
_KEY = "$tensormp"
_SLICE = 0.2  # seconds a call waits before Python looks at its signals


class Error(Exception):
    """A tensormp call failed; the message says what failed on what."""


class Timeout(Error, TimeoutError):
    """The timeout passed first: nothing was sent or taken."""


class Closed(Error, EOFError):
    """The queue, pipe or listener, or the process at its other end, is closed."""


def _find_library():
    path = os.environ.get("TENSORMP_LIB")
    if path:
        return path
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtensormp.so")
    if os.path.exists(here):
        return here
    found = ctypes.util.find_library("tensormp")
    if found:
        return found
    raise ImportError(
        "tensormp: libtensormp.so not found: build it with "
        "'go build -buildmode=c-shared -o python/tensormp/libtensormp.so ./cmd/libtensormp' "
        "or set TENSORMP_LIB")


_lib = ctypes.CDLL(_find_library())

_i64, _p_i64 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
_err = ctypes.POINTER(ctypes.c_char_p)


def _declare(name, *args):
    f = getattr(_lib, name)
    f.argtypes = list(args) + [ctypes.POINTER(ctypes.c_void_p)]
    f.restype = ctypes.c_int
    return f


_listen = _declare("tensormp_listen", ctypes.c_char_p, ctypes.c_uint32, _p_i64)
_accept = _declare("tensormp_accept", _i64, _i64, _p_i64, _p_i64)
_dial = _declare("tensormp_dial", ctypes.c_char_p, _i64, _p_i64)
_queue_new = _declare("tensormp_queue_new", _i64, _p_i64)
_close = _declare("tensormp_close", _i64)
_send = _declare("tensormp_send", _i64, ctypes.c_char_p, _i64)
_recv = _declare("tensormp_recv", _i64, _i64, ctypes.POINTER(ctypes.c_void_p))
_empty = _declare("tensormp_empty", ctypes.c_char_p, _p_i64, ctypes.c_int32, ctypes.c_char_p, _p_i64)
_from_dlpack = _declare("tensormp_from_dlpack", ctypes.c_void_p, ctypes.c_char_p, _p_i64)
_describe = _declare("tensormp_describe", _i64, ctypes.POINTER(ctypes.c_void_p))
_to_dlpack = _declare("tensormp_to_dlpack", _i64, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p))
_shutdown = _declare("tensormp_shutdown")
_free = _lib.tensormp_free
_free.argtypes, _free.restype = [ctypes.c_void_p], None
_deleter = _lib.tensormp_dlpack_deleter
_deleter.argtypes, _deleter.restype = [ctypes.c_void_p], None


def _take_string(p):
    """Returns the C string at p (a c_void_p) and frees it."""
    if not p.value:
        return ""
    try:
        return ctypes.string_at(p.value).decode("utf-8", "replace")
    finally:
        _free(p.value)


def _check(code, err):
    if code == _OK:
        return
    msg = _take_string(err)
    if code == _TIMEOUT:
        raise Timeout(msg)
    if code == _CLOSED:
        raise Closed(msg)
    raise Error(msg)


def _call(f, *args):
    err = ctypes.c_void_p()
    _check(f(*args, ctypes.byref(err)), err)


def _waiting(f, timeout, *args):
    """Calls f(*args, timeout_ms, ...) in slices of _SLICE seconds, so that
    Python handles signals (KeyboardInterrupt) while it waits."""
    end = None if timeout is None else time.monotonic() + max(timeout, 0)
    while True:
        left = _SLICE if end is None else min(_SLICE, max(end - time.monotonic(), 0))
        try:
            return f(int(left * 1000))
        except Timeout:
            if end is not None and time.monotonic() >= end:
                raise


# DLPack capsules, made through the C API ctypes gives.
_DLTENSOR = b"dltensor"
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_SetName = ctypes.pythonapi.PyCapsule_SetName
_PyCapsule_SetName.restype = ctypes.c_int
_PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_USED = b"used_dltensor"


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule):
    # A capsule no consumer took still owns its DLManagedTensor.
    if _PyCapsule_IsValid(capsule, _DLTENSOR):
        _deleter(_PyCapsule_GetPointer(capsule, _DLTENSOR))


_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16",
           "bfloat16", "float32", "float64", "complex64", "complex128")


class _Handle:
    """An object the Go side holds for this process, given back by close()."""

    _h = 0

    def __init__(self, h):
        self._h = h
        self._lock = threading.Lock()

    def _handle(self):
        if not self._h:
            raise Closed(f"{type(self).__name__} is closed")
        return self._h

    def close(self):
        """Gives the object back. Closing twice does nothing."""
        with self._lock:
            h, self._h = self._h, 0
        if h:
            _call(_close, h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass  # at interpreter exit the library may be gone


class Tensor(_Handle):
    """A tensor in tensormp's memory (shared memory, or a GPU's): received,
    or made by ``empty``.

    It is a DLPack producer: ``torch.from_dlpack(t)`` and, on the CPU,
    ``numpy.from_dlpack(t)`` view its memory. ``torch()`` and ``numpy()``
    do the same for every dtype, bool included (which torch 1.13 and
    NumPy 1.24 take through DLPack only as uint8). The memory stays mapped
    while the Tensor or any view made from it lives. ``device`` is "cpu"
    or "cuda:N", as torch writes it.
    """

    def __init__(self, h, dtype, shape, strides, device="cpu"):
        super().__init__(h)
        self.dtype = dtype
        self.shape = tuple(shape)
        self.strides = tuple(strides)  # in elements
        self.device = device

    def __repr__(self):
        return (f"tensormp.Tensor(dtype={self.dtype}, shape={self.shape}, "
                f"strides={self.strides}, device={self.device!r})")

    def __dlpack_device__(self):
        if self.device.startswith("cuda:"):
            return (2, int(self.device[5:]))  # kDLCUDA
        return (1, 0)  # kDLCPU

    def __dlpack__(self, stream=None, _as=None):
        # GPU memory is ready on every stream when it gets here (see the
        # library's tensormp_to_dlpack): stream has nothing to wait for.
        out = ctypes.c_void_p()
        _call(_to_dlpack, self._handle(), _as.encode() if _as else None, ctypes.byref(out))
        try:
            return _PyCapsule_New(out, _DLTENSOR, ctypes.cast(_capsule_destructor, ctypes.c_void_p))
        except BaseException:
            _deleter(out)
            raise

    def torch(self):
        """Returns a torch tensor on this tensor's memory."""
        import torch
        if self.dtype == "bool":
            return torch.from_dlpack(_As(self, "uint8")).view(torch.bool)
        return torch.from_dlpack(self)

    def numpy(self):
        """Returns a writable NumPy array on this tensor's memory
        (numpy.from_dlpack gives a read-only one)."""
        if self.device != "cpu":
            raise TypeError(f"tensormp: a tensor on {self.device} has no NumPy view: use torch()")
        import numpy
        return numpy.asarray(_ArrayView(self))


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_TYPESTR = {"bool": "|b1", "uint8": "|u1", "int8": "|i1", "int16": "<i2",
            "int32": "<i4", "int64": "<i8", "float16": "<f2", "float32": "<f4",
            "float64": "<f8", "complex64": "<c8", "complex128": "<c16"}


class _ArrayView:
    """A tensor's memory as NumPy's array interface, held through a DLPack
    export until NumPy lets go of it."""

    def __init__(self, t):
        if t.dtype not in _TYPESTR:
            raise TypeError(f"tensormp: NumPy has no {t.dtype}")
        out = ctypes.c_void_p()
        _call(_to_dlpack, t._handle(), None, ctypes.byref(out))
        self._m = out.value
        dl = _DLTensor.from_address(self._m)
        item = int(_TYPESTR[t.dtype][2:])
        self.__array_interface__ = {
            "version": 3, "typestr": _TYPESTR[t.dtype], "data": (dl.data, False),
            "shape": t.shape, "strides": tuple(s * item for s in t.strides),
        }

    def __del__(self):
        if self._m:
            _deleter(self._m)
            self._m = None


class _As:
    """A DLPack producer for a Tensor told to consumers as another dtype."""

    def __init__(self, t, dtype):
        self._t, self._dtype = t, dtype

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()

    def __dlpack__(self, stream=None):
        return self._t.__dlpack__(_as=self._dtype)


def empty(shape, dtype="float32", device="cpu"):
    """Returns a tensor of shape and dtype (a name: "float32", ...) in new
    shared memory, not cleared, or, with device "cuda" or "cuda:N", in
    new memory of that GPU, zeroed. Sending it, or a torch tensor or NumPy
    array made on it, shares it in place."""
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(n) for n in shape)
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    out = ctypes.c_int64()
    _call(_empty, str(dtype).encode(), dims, len(shape), str(device).encode(), ctypes.byref(out))
    return _tensor(out.value)


def _tensor(h):
    """Returns a Tensor for handle h, which it then owns."""
    try:
        text = ctypes.c_void_p()
        _call(_describe, h, ctypes.byref(text))
        return _decode(json.loads(_take_string(text)))
    except BaseException:
        _call(_close, h)
        raise


def _dtype_name(obj):
    """The tensormp name of a torch or NumPy dtype, or None."""
    name = str(getattr(obj, "dtype", ""))
    name = name.replace("torch.", "")
    return {"bool_": "bool"}.get(name, name) if name else None


def _on_cuda(obj):
    """Reports whether a DLPack producer's memory is a CUDA device's."""
    device = getattr(obj, "__dlpack_device__", None)
    return device is not None and device()[0] == 2  # kDLCUDA


def share(obj):
    """Returns a Tensor for a torch tensor, NumPy array or any DLPack
    producer: on the same memory when it is tensormp's, else a copy in new
    shared memory (for a CUDA tensor: in new memory of its GPU, made
    after the work queued on torch's current stream)."""
    if isinstance(obj, Tensor):
        return obj
    as_dtype = None
    if _dtype_name(obj) == "bool":
        as_dtype = b"bool"  # DLPack of torch 1.13 and NumPy 1.24 has no bool
        view = getattr(obj, "view")
        try:
            import torch
            obj = view(torch.uint8) if isinstance(obj, torch.Tensor) else view("uint8")
        except ImportError:
            obj = view("uint8")
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"tensormp: a {type(obj).__name__} is not a tensor (no __dlpack__)")
    if _on_cuda(obj):
        # Stream 1 is CUDA's legacy default stream, where the library
        # copies and marks what a receiver waits for: the producer orders
        # it after the work queued on its current stream. (Without a
        # stream, torch orders nothing.)
        capsule = obj.__dlpack__(stream=1)
    else:
        capsule = obj.__dlpack__()
    ptr = _PyCapsule_GetPointer(id(capsule), _DLTENSOR)
    if not ptr:
        raise Error("tensormp: __dlpack__ gave no DLPack tensor")
    # From here the library owns the DLManagedTensor: it calls its deleter.
    _PyCapsule_SetName(capsule, _USED)
    out = ctypes.c_int64()
    _call(_from_dlpack, ptr, as_dtype, ctypes.byref(out))
    return _tensor(out.value)


# Values to and from their JSON form.

def _encode(v, temps, depth=0):
    if depth > 100:
        raise ValueError("tensormp: value nested deeper than 100")
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return {_KEY: "float", "v": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {_KEY: "bytes", "b64": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, (list, tuple)):
        return [_encode(e, temps, depth + 1) for e in v]
    if isinstance(v, dict):
        out = {}
        for k, e in v.items():
            if not isinstance(k, str):
                raise TypeError(f"tensormp: dict key {k!r} is not a string")
            if k == _KEY:
                raise ValueError(f"tensormp: dict key {_KEY!r} is tensormp's own")
            out[k] = _encode(e, temps, depth + 1)
        return out
    if isinstance(v, Tensor):
        if v.device != "cpu":
            _after_torch(v.device)
        return {_KEY: "tensor", "h": v._handle()}
    if isinstance(v, Queue):
        return {_KEY: "queue", "h": v._handle()}
    if isinstance(v, Pipe):
        return {_KEY: "pipe", "h": v._handle()}
    if hasattr(v, "__dlpack__"):
        t = share(v)
        temps.append(t)
        return {_KEY: "tensor", "h": t._handle()}
    raise TypeError(f"tensormp: cannot send a {type(v).__name__}")


def _decode(v):
    if isinstance(v, list):
        return [_decode(e) for e in v]
    if isinstance(v, dict):
        kind = v.get(_KEY)
        if kind is None:
            return {k: _decode(e) for k, e in v.items()}
        if kind == "tensor":
            device = v.get("device", "cpu").replace("gpu:", "cuda:")
            return Tensor(v["h"], v["dtype"], v["shape"], v["strides"], device)
        if kind == "queue":
            return Queue(_handle=v["h"])
        if kind == "pipe":
            return Pipe(v["h"])
        if kind == "bytes":
            return base64.b64decode(v["b64"])
        if kind == "float":
            return float(v["v"])
        raise Error(f"tensormp: unknown object kind {kind!r}")
    return v


def _after_torch(device):
    """Orders the default stream of device, where the library marks what a
    receiver waits for, after the work queued so far on torch's current
    stream, as torch's own __dlpack__ does for a torch tensor sent."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return  # torch queued nothing on this GPU
    current = torch.cuda.current_stream(device)
    default = torch.cuda.default_stream(device)
    if current != default:
        default.wait_stream(current)


def _send_value(h, value, timeout):
    temps = []
    try:
        text = json.dumps(_encode(value, temps), allow_nan=False).encode()
        _waiting(lambda ms: _call(_send, h, text, ms), timeout)
    finally:
        for t in temps:
            t.close()


def _recv_value(h, timeout):
    def once(ms):
        out = ctypes.c_void_p()
        _call(_recv, h, ms, ctypes.byref(out))
        return _take_string(out)
    return _decode(json.loads(_waiting(once, timeout)))


class Queue(_Handle):
    """A queue shared with Go processes (mp.Queue): made here, or received."""

    def __init__(self, capacity=0, _handle=None):
        if _handle is None:
            out = ctypes.c_int64()
            _call(_queue_new, int(capacity), ctypes.byref(out))
            _handle = out.value
        super().__init__(_handle)

    def put(self, value, timeout=None):
        """Puts value, waiting for room at most timeout seconds (None: as long as it takes)."""
        _send_value(self._handle(), value, timeout)

    def get(self, timeout=None):
        """Takes a value, waiting at most timeout seconds (None: as long as it takes)."""
        return _recv_value(self._handle(), timeout)


class Pipe(_Handle):
    """One end of a connection to another process (mp.Pipe)."""

    def send(self, value, timeout=None):
        """Sends value, waiting for room at most timeout seconds."""
        _send_value(self._handle(), value, timeout)

    def recv(self, timeout=None):
        """Receives a value, waiting at most timeout seconds."""
        return _recv_value(self._handle(), timeout)


class Listener(_Handle):
    """Listens on a named endpoint (mp.Listen): a socket file path, or
    "@name" in Linux's abstract namespace. Only processes of this user may
    connect unless mode allows more."""

    def __init__(self, address, mode=0o600):
        out = ctypes.c_int64()
        _call(_listen, os.fsencode(address), mode, ctypes.byref(out))
        super().__init__(out.value)
        self.address = address

    def accept(self, timeout=None):
        """Waits for a process to connect and returns a Pipe to it; its
        process id is the Pipe's peer_pid."""
        def once(ms):
            out, pid = ctypes.c_int64(), ctypes.c_int64()
            _call(_accept, self._handle(), ms, ctypes.byref(out), ctypes.byref(pid))
            p = Pipe(out.value)
            p.peer_pid = pid.value
            return p
        return _waiting(once, timeout)


def dial(address, timeout=None):
    """Connects to a Listener's endpoint (mp.Listen) and returns a Pipe."""
    def once(ms):
        out = ctypes.c_int64()
        _call(_dial, os.fsencode(address), ms, ctypes.byref(out))
        return Pipe(out.value)
    return _waiting(once, timeout)


@atexit.register
def _give_back_gpus():
    try:
        _call(_shutdown)
    except Error:
        pass  # the process is exiting: nothing more to do

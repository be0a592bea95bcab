"""The objects a Python process holds through the library: tensors,
queues, pipes and listeners, each named by a handle it gives back."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any, Optional, Sequence, Tuple, Union

from . import _codec, _dlpack, _lib
from ._errors import Closed, InvalidValue


class _Handle:
    """An object the library holds for this process, given back by close()."""

    _h = 0

    def __init__(self, h: int):
        self._h = h
        self._lock = threading.Lock()

    def _handle(self) -> int:
        if not self._h:
            raise Closed(f"{type(self).__name__} is closed")
        return self._h

    def close(self) -> None:
        """Gives the object back. Closing twice does nothing."""
        with self._lock:
            h, self._h = self._h, 0
        if h:
            _lib.call(_lib.close, h)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
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

    def __init__(self, h: int, dtype: str, shape: Sequence[int], strides: Sequence[int],
                 device: str = "cpu"):
        super().__init__(h)
        self.dtype = dtype
        self.shape: Tuple[int, ...] = tuple(shape)
        self.strides: Tuple[int, ...] = tuple(strides)  # in elements
        self.device = device

    def __repr__(self) -> str:
        return (f"tensormp.Tensor(dtype={self.dtype}, shape={self.shape}, "
                f"strides={self.strides}, device={self.device!r})")

    def __dlpack_device__(self) -> Tuple[int, int]:
        if self.device.startswith("cuda:"):
            return (_dlpack.CUDA, int(self.device[5:]))
        return (_dlpack.CPU, 0)

    def __dlpack__(self, stream: Optional[int] = None, **kwargs: Any) -> Any:
        # GPU memory is ready on every stream when it gets here (see the
        # library's tensormp_to_dlpack): stream has nothing to wait for.
        # Newer consumers pass max_version and friends: the capsule is
        # the unversioned one, which they all accept.
        return _dlpack.capsule(self._handle())

    def torch(self):
        """Returns a torch tensor on this tensor's memory."""
        import torch
        if self.dtype == "bool":
            return torch.from_dlpack(_dlpack.As(self, "uint8")).view(torch.bool)
        return torch.from_dlpack(self)

    def numpy(self):
        """Returns a writable NumPy array on this tensor's memory
        (numpy.from_dlpack gives a read-only one)."""
        if self.device != "cpu":
            raise InvalidValue(f"tensormp: a tensor on {self.device} has no NumPy view: use torch()")
        if self.dtype not in _dlpack.TYPESTR:
            raise InvalidValue(f"tensormp: NumPy has no {self.dtype}")
        import numpy
        return numpy.asarray(_dlpack.ArrayView(self._handle(), self.dtype, self.shape, self.strides))


def empty(shape: Union[int, Sequence[int]], dtype: str = "float32", device: str = "cpu") -> Tensor:
    """Returns a tensor of shape and dtype (a name: "float32", ...) in new
    shared memory, not cleared, or, with device "cuda" or "cuda:N", in
    new memory of that GPU, zeroed. Sending it, or a torch tensor or NumPy
    array made on it, shares it in place."""
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(n) for n in shape)
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    out = ctypes.c_int64()
    _lib.call(_lib.empty, str(dtype).encode(), dims, len(shape), str(device).encode(), ctypes.byref(out))
    return _tensor(out.value)


def _tensor(h: int) -> Tensor:
    """Returns a Tensor for handle h, which it then owns."""
    owner = [h]  # who gives h back on failure: this, until _make takes it

    def make(kind, v):
        owner.clear()
        return _make(kind, v)
    try:
        text = ctypes.c_void_p()
        _lib.call(_lib.describe, h, ctypes.byref(text))
        return _codec.loads(_lib.take_string(text), make)
    except BaseException:
        if owner:
            _lib.call(_lib.close, h)
        raise


def _dtype_name(obj: Any) -> Optional[str]:
    """The tensormp name of a torch or NumPy dtype, or None."""
    name = str(getattr(obj, "dtype", ""))
    name = name.replace("torch.", "")
    return {"bool_": "bool"}.get(name, name) if name else None


def _on_cuda(obj: Any) -> bool:
    """Reports whether a DLPack producer's memory is a CUDA device's."""
    device = getattr(obj, "__dlpack_device__", None)
    return device is not None and device()[0] == _dlpack.CUDA


def share(obj: Any) -> Tensor:
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
        raise InvalidValue(f"tensormp: a {type(obj).__name__} is not a tensor (no __dlpack__)")
    if _on_cuda(obj):
        # Stream 1 is CUDA's legacy default stream, where the library
        # copies and marks what a receiver waits for: the producer orders
        # it after the work queued on its current stream. (Without a
        # stream, torch orders nothing.) torch orders the streams of its
        # current device, so the tensor's device is made current first.
        cap = _dlpack_on_device(obj)
    else:
        cap = obj.__dlpack__()
    # From here the library owns the DLManagedTensor: it calls its deleter.
    ptr = _dlpack.take(cap)
    out = ctypes.c_int64()
    _lib.call(_lib.from_dlpack, ptr, as_dtype, ctypes.byref(out))
    return _tensor(out.value)


def _dlpack_on_device(obj: Any) -> Any:
    """obj.__dlpack__(stream=1), with obj's device torch's current one
    when obj is a torch tensor on another GPU than the current."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.is_cuda:
        with torch.cuda.device(obj.device):
            return obj.__dlpack__(stream=1)
    return obj.__dlpack__(stream=1)


def _wire(v: Any, temps: list) -> Optional[dict]:
    """The JSON object of one of tensormp's objects in a value sent, or of
    a tensor shared for the message (appended to temps); None for
    anything else."""
    if isinstance(v, Tensor):
        if v.device != "cpu":
            _after_torch(v.device)
        return {_codec.KEY: "tensor", "h": v._handle()}
    if isinstance(v, Queue):
        return {_codec.KEY: "queue", "h": v._handle()}
    if isinstance(v, Pipe):
        return {_codec.KEY: "pipe", "h": v._handle()}
    if hasattr(v, "__dlpack__"):
        t = share(v)
        temps.append(t)
        return {_codec.KEY: "tensor", "h": t._handle()}
    return None


def _make(kind: str, v: dict) -> Union[Tensor, "Queue", "Pipe"]:
    """The object for the JSON object v of kind the library gave: the
    handle in it is this process's, which the object then owns."""
    h = v["h"]
    if not isinstance(h, int) or isinstance(h, bool):
        raise TypeError(f"{kind} object's handle {h!r} is not a number")
    try:
        if kind == "tensor":
            device = str(v.get("device", "cpu")).replace("gpu:", "cuda:")
            return Tensor(h, str(v["dtype"]), [int(n) for n in v["shape"]],
                          [int(n) for n in v["strides"]], device)
        if kind == "queue":
            return Queue(_handle=h)
        return Pipe(h)
    except BaseException:
        _lib.call(_lib.close, h)
        raise


def _after_torch(device: str) -> None:
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


def _send_value(h: int, value: Any, timeout: Optional[float]) -> None:
    temps: list = []
    try:
        text = _codec.dumps(value, _wire, temps)
        _lib.waiting(lambda ms: _lib.call(_lib.send, h, text, ms), timeout)
    finally:
        for t in temps:
            t.close()


def _recv_value(h: int, timeout: Optional[float]) -> Any:
    def once(ms):
        out = ctypes.c_void_p()
        _lib.call(_lib.recv, h, ms, ctypes.byref(out))
        return _lib.take_string(out)
    return _codec.loads(_lib.waiting(once, timeout), _make)


class Queue(_Handle):
    """A queue shared with Go processes (mp.Queue): made here, or received."""

    def __init__(self, capacity: int = 0, _handle: Optional[int] = None):
        if _handle is None:
            out = ctypes.c_int64()
            _lib.call(_lib.queue_new, int(capacity), ctypes.byref(out))
            _handle = out.value
        super().__init__(_handle)

    def put(self, value: Any, timeout: Optional[float] = None) -> None:
        """Puts value, waiting for room at most timeout seconds (None: as long as it takes)."""
        _send_value(self._handle(), value, timeout)

    def get(self, timeout: Optional[float] = None) -> Any:
        """Takes a value, waiting at most timeout seconds (None: as long as it takes)."""
        return _recv_value(self._handle(), timeout)


class Pipe(_Handle):
    """One end of a connection to another process (mp.Pipe)."""

    peer_pid: int = 0

    def send(self, value: Any, timeout: Optional[float] = None) -> None:
        """Sends value, waiting for room at most timeout seconds."""
        _send_value(self._handle(), value, timeout)

    def recv(self, timeout: Optional[float] = None) -> Any:
        """Receives a value, waiting at most timeout seconds."""
        return _recv_value(self._handle(), timeout)


class Listener(_Handle):
    """Listens on a named endpoint (mp.Listen): a socket file path, or
    "@name" in Linux's abstract namespace. Only processes of this user may
    connect unless mode allows more."""

    def __init__(self, address: Union[str, bytes, os.PathLike], mode: int = 0o600):
        out = ctypes.c_int64()
        _lib.call(_lib.listen, os.fsencode(address), mode, ctypes.byref(out))
        super().__init__(out.value)
        self.address = address

    def accept(self, timeout: Optional[float] = None) -> Pipe:
        """Waits for a process to connect and returns a Pipe to it; its
        process id is the Pipe's peer_pid."""
        def once(ms):
            out, pid = ctypes.c_int64(), ctypes.c_int64()
            _lib.call(_lib.accept, self._handle(), ms, ctypes.byref(out), ctypes.byref(pid))
            p = Pipe(out.value)
            p.peer_pid = pid.value
            return p
        return _lib.waiting(once, timeout)


def dial(address: Union[str, bytes, os.PathLike], timeout: Optional[float] = None) -> Pipe:
    """Connects to a Listener's endpoint (mp.Listen) and returns a Pipe."""
    def once(ms):
        out = ctypes.c_int64()
        _lib.call(_lib.dial, os.fsencode(address), ms, ctypes.byref(out))
        return Pipe(out.value)
    return _lib.waiting(once, timeout)

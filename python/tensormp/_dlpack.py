"""DLPack capsules, made and taken through the C API ctypes gives, and
NumPy's array interface on a tensor's memory."""

import ctypes

from . import _lib
from ._errors import Error

CPU, CUDA = 1, 2  # DLPack's kDLCPU, kDLCUDA

_DLTENSOR = b"dltensor"
_USED = b"used_dltensor"

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


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule):
    # A capsule no consumer took still owns its DLManagedTensor.
    if _PyCapsule_IsValid(capsule, _DLTENSOR):
        _lib.deleter(_PyCapsule_GetPointer(capsule, _DLTENSOR))


def capsule(h, as_dtype=None):
    """Returns a DLPack capsule viewing the memory of tensor handle h, told
    to consumers as as_dtype (a name) when given."""
    out = ctypes.c_void_p()
    _lib.call(_lib.to_dlpack, h, as_dtype.encode() if as_dtype else None, ctypes.byref(out))
    try:
        return _PyCapsule_New(out, _DLTENSOR, ctypes.cast(_capsule_destructor, ctypes.c_void_p))
    except BaseException:
        _lib.deleter(out)
        raise


def take(cap):
    """Takes the DLManagedTensor out of capsule cap and returns its address:
    from here its owner is the caller, who must see its deleter called."""
    ptr = _PyCapsule_GetPointer(id(cap), _DLTENSOR)
    if not ptr:
        raise Error("tensormp: __dlpack__ gave no DLPack tensor")
    _PyCapsule_SetName(cap, _USED)
    return ptr


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


TYPESTR = {"bool": "|b1", "uint8": "|u1", "int8": "|i1", "int16": "<i2",
           "int32": "<i4", "int64": "<i8", "float16": "<f2", "float32": "<f4",
           "float64": "<f8", "complex64": "<c8", "complex128": "<c16"}


class ArrayView:
    """A CPU tensor's memory as NumPy's array interface, held through a
    DLPack export until NumPy lets go of it."""

    def __init__(self, h, dtype, shape, strides):
        self._m = None
        out = ctypes.c_void_p()
        _lib.call(_lib.to_dlpack, h, None, ctypes.byref(out))
        self._m = out.value
        dl = DLTensor.from_address(self._m)
        item = int(TYPESTR[dtype][2:])
        self.__array_interface__ = {
            "version": 3, "typestr": TYPESTR[dtype], "data": (dl.data, False),
            "shape": shape, "strides": tuple(s * item for s in strides),
        }

    def __del__(self):
        if self._m:
            _lib.deleter(self._m)
            self._m = None


class As:
    """A DLPack producer for a tensor told to consumers as another dtype."""

    def __init__(self, t, dtype):
        self._t, self._dtype = t, dtype

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()

    def __dlpack__(self, stream=None):
        return capsule(self._t._handle(), self._dtype)

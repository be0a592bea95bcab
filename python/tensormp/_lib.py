"""libtensormp.so through ctypes: where it is found, the calls it
exports, and the status codes they return, read from the library."""

import atexit
import ctypes
import ctypes.util
import json
import os
import time

from ._errors import Closed, Error, InvalidValue, Timeout

_SLICE = 0.2  # seconds a call waits before Python looks at its signals


def _find():
    """Returns the path of the library: $TENSORMP_LIB, else the one beside
    this file (where the wheel puts it), else the system's."""
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
        "tensormp: libtensormp.so not found: install the package "
        "('python3 -m pip install ./python' from the repository), or build the "
        "library ('go build -buildmode=c-shared -o python/tensormp/libtensormp.so "
        "./cmd/libtensormp') or set TENSORMP_LIB")


path = _find()
lib = ctypes.CDLL(path)

i64, p_i64 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
_p_void = ctypes.POINTER(ctypes.c_void_p)


def _declare(name, *args):
    f = getattr(lib, name)
    f.argtypes = list(args) + [_p_void]
    f.restype = ctypes.c_int
    return f


listen = _declare("tensormp_listen", ctypes.c_char_p, ctypes.c_uint32, p_i64)
accept = _declare("tensormp_accept", i64, i64, p_i64, p_i64)
dial = _declare("tensormp_dial", ctypes.c_char_p, i64, p_i64)
queue_new = _declare("tensormp_queue_new", i64, p_i64)
close = _declare("tensormp_close", i64)
send = _declare("tensormp_send", i64, ctypes.c_char_p, i64)
recv = _declare("tensormp_recv", i64, i64, _p_void)
empty = _declare("tensormp_empty", ctypes.c_char_p, p_i64, ctypes.c_int32, ctypes.c_char_p, p_i64)
from_dlpack = _declare("tensormp_from_dlpack", ctypes.c_void_p, ctypes.c_char_p, p_i64)
describe = _declare("tensormp_describe", i64, _p_void)
to_dlpack = _declare("tensormp_to_dlpack", i64, ctypes.c_char_p, _p_void)
shutdown = _declare("tensormp_shutdown")
_statuses = _declare("tensormp_statuses", _p_void)
free = lib.tensormp_free
free.argtypes, free.restype = [ctypes.c_void_p], None
deleter = lib.tensormp_dlpack_deleter
deleter.argtypes, deleter.restype = [ctypes.c_void_p], None


def take_string(p):
    """Returns the C string at p (a c_void_p) and frees it."""
    if not p.value:
        return ""
    try:
        return ctypes.string_at(p.value).decode("utf-8", "replace")
    finally:
        free(p.value)


def _read_statuses():
    out, err = ctypes.c_void_p(), ctypes.c_void_p()
    code = _statuses(ctypes.byref(out), ctypes.byref(err))
    text = take_string(out)
    if not text:
        raise ImportError(f"tensormp: {path} gives no status codes ({code}): {take_string(err)}")
    return json.loads(text)


_codes = _read_statuses()
OK = _codes["ok"]
_FAILURES = {_codes["timeout"]: Timeout, _codes["closed"]: Closed,
             _codes["malformed"]: InvalidValue}


def check(code, err):
    """Raises the Error that status code and message err (a c_void_p the
    library set) stand for, unless code is OK."""
    if code == OK:
        return
    raise _FAILURES.get(code, Error)(take_string(err))


def call(f, *args):
    """Calls the library's f with args and a place for its message."""
    err = ctypes.c_void_p()
    check(f(*args, ctypes.byref(err)), err)


def waiting(f, timeout):
    """Calls f(timeout_ms) in slices of _SLICE seconds until it does not
    time out or timeout seconds (None: forever) have passed, so that Python
    handles signals (KeyboardInterrupt) while it waits."""
    end = None if timeout is None else time.monotonic() + max(timeout, 0)
    while True:
        left = _SLICE if end is None else min(_SLICE, max(end - time.monotonic(), 0))
        try:
            return f(int(left * 1000))
        except Timeout:
            if end is not None and time.monotonic() >= end:
                raise


@atexit.register
def _give_back_gpus():
    try:
        call(shutdown)
    except Error:
        pass  # the process is exiting: nothing more to do

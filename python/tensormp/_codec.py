"""Values to and from the JSON text the library carries (see its package
doc): tensormp's objects as {"$tensormp": kind, "h": handle}, bytes in
base64, infinities and NaN by name."""

import base64
import binascii
import json
import math

from ._errors import Error, InvalidValue

KEY = "$tensormp"
MAX_DEPTH = 100


def dumps(value, wire, temps):
    """Returns value's JSON text. wire(v) returns the JSON object of one of
    tensormp's objects, or None for anything else; a tensor it makes for
    the message (a copy of a torch tensor, say) it appends to temps, which
    the caller closes after the send."""
    return json.dumps(_encode(value, wire, temps, 0), allow_nan=False).encode()


def _encode(v, wire, temps, depth):
    if depth > MAX_DEPTH:
        raise InvalidValue(f"tensormp: value nested deeper than {MAX_DEPTH}")
    if v is None or isinstance(v, (bool, str, int)):
        return v
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return {KEY: "float", "v": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {KEY: "bytes", "b64": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, (list, tuple)):
        return [_encode(e, wire, temps, depth + 1) for e in v]
    if isinstance(v, dict):
        out = {}
        for k, e in v.items():
            if not isinstance(k, str):
                raise InvalidValue(f"tensormp: dict key {k!r} is not a string")
            if k == KEY:
                raise InvalidValue(f"tensormp: dict key {KEY!r} is tensormp's own")
            out[k] = _encode(e, wire, temps, depth + 1)
        return out
    obj = wire(v, temps)
    if obj is None:
        raise InvalidValue(f"tensormp: cannot send a {type(v).__name__}")
    return obj


def loads(text, make):
    """Returns the value of JSON text; make(kind, obj) returns the object
    for one of tensormp's ("tensor", "queue", "pipe"). Whatever is wrong
    with text is an InvalidValue."""
    try:
        return _decode(json.loads(text), make)
    except Error:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidValue(f"tensormp: malformed value from the library: {type(e).__name__}: {e}") from None


def _decode(v, make):
    if isinstance(v, list):
        return [_decode(e, make) for e in v]
    if not isinstance(v, dict):
        return v
    kind = v.get(KEY)
    if kind is None:
        return {k: _decode(e, make) for k, e in v.items()}
    if kind == "bytes":
        try:
            return base64.b64decode(v["b64"], validate=True)
        except binascii.Error as e:
            raise InvalidValue(f"tensormp: bytes object: {e}") from None
    if kind == "float":
        if v["v"] not in ("nan", "inf", "-inf"):
            raise InvalidValue(f"tensormp: float object with value {v['v']!r}")
        return float(v["v"])
    if kind in ("tensor", "queue", "pipe"):
        return make(kind, v)
    raise InvalidValue(f"tensormp: unknown object kind {kind!r}")

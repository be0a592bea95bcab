"""The Python side of tests/python_test.go: a PyTorch and NumPy process
that reaches the test's Go process through tensormp's named endpoint
(ENDPOINT) and plays the role named by its first argument. It reports
through the pipe; anything unexpected ends it with a traceback and a
non-zero exit code."""

import os
import signal
import socket
import ctypes
import struct
import sys
import time

import numpy
import torch

import tensormp

TORCH = {"uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
         "int32": torch.int32, "int64": torch.int64, "float16": torch.float16,
         "bfloat16": torch.bfloat16, "float32": torch.float32,
         "float64": torch.float64, "complex64": torch.complex64,
         "complex128": torch.complex128, "bool": torch.bool}


def plain(values):
    """A flat list of JSON numbers: complex values as [re, im] pairs."""
    out = []
    for v in values:
        if isinstance(v, complex):
            out.append([v.real, v.imag])
        else:
            out.append(float(v))
    return out


def settle(x):
    """Waits for the work torch queued on x's GPU: another process reads
    the memory next, outside torch's streams."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def consumer(pipe):
    """Receives tensors, CPU or GPU, views each with torch or NumPy,
    reports what it sees and writes one element in place."""
    while True:
        msg = pipe.recv(timeout=60)
        if msg == "bye":
            return
        t, lib = msg["t"], msg["lib"]
        if lib == "torch":
            x = t.torch() if t.dtype == "bool" else torch.from_dlpack(t)
            values = x.flatten().tolist()
            strides = list(x.stride())
            x[(0,) * x.dim()] = True if t.dtype == "bool" else 42
            settle(x)
            dtype = str(x.dtype).replace("torch.", "")
        else:
            x = t.numpy()  # writable; numpy.from_dlpack's view is read-only
            values = x.flatten().tolist()
            if t.dtype != "bool":  # NumPy 1.24 takes no bool through DLPack
                ro = numpy.from_dlpack(t)
                if ro.flatten().tolist() != values or ro.ctypes.data != x.ctypes.data:
                    raise SystemExit("numpy.from_dlpack sees other memory than Tensor.numpy")
                del ro
            strides = [s // x.itemsize for s in x.strides]
            x[(0,) * x.ndim] = True if t.dtype == "bool" else 42
            dtype = {"bool": "bool"}.get(str(x.dtype), str(x.dtype))
        device = str(x.device) if lib == "torch" else "cpu"
        pipe.send({"values": plain(values), "dtype": dtype, "shape": list(x.shape),
                   "strides": strides, "device": device})
        del x
        t.close()


def producer(pipe):
    """Sends tensors made by torch and NumPy (copied once into tensormp's
    memory), views of them, and tensors born in tensormp's memory (shared
    in place: the Go side's write shows here), on the device the Go side
    names."""
    order = pipe.recv(timeout=60)
    device = order["device"]
    for name in order["dtypes"]:
        base = torch.arange(24).reshape(4, 6) % 100
        if name == "bool":
            base = base % 2 == 1
        else:
            base = base.to(TORCH[name])
        base = base.to(device)
        pipe.send({"dtype": name, "kind": "torch", "t": base}, timeout=60)
        pipe.send({"dtype": name, "kind": "torch-view", "t": base[:, 1::2]}, timeout=60)
        pipe.send({"dtype": name, "kind": "torch-transposed", "t": base.t()}, timeout=60)
        if name != "bfloat16" and device == "cpu":
            a = base.numpy()
            pipe.send({"dtype": name, "kind": "numpy", "t": a}, timeout=60)
            pipe.send({"dtype": name, "kind": "numpy-view", "t": a[::2, ::3]}, timeout=60)
        born = tensormp.empty((4, 6), name, device=device)
        b = born.torch()
        b.copy_(base)
        pipe.send({"dtype": name, "kind": "born", "t": b[1:, 2:]}, timeout=60)
        if pipe.recv(timeout=60) != "wrote":
            raise SystemExit("expected 'wrote'")
        seen = b[1, 2].item()
        pipe.send({"seen": plain([seen])}, timeout=60)
        del b
        born.close()
    pipe.send("end", timeout=60)


def hold(pipe):
    """Holds what it receives, and memory of its own on the device the Go
    side names, until killed."""
    got = pipe.recv(timeout=60)
    views = [torch.from_dlpack(t) for t in got["t"]]
    own = tensormp.empty((1 << 20,), "uint8", device=got["device"])
    mine = own.torch()
    mine.fill_(1)
    settle(mine)
    pipe.send({"holding": len(views), "pid": os.getpid()}, timeout=60)
    pipe.send(own, timeout=60)
    while True:
        time.sleep(1)


def side_stream(pipe):
    """Writes GPU tensors born in tensormp's memory on a side stream behind
    a long wait, and sends each at once, as the Tensor and as a torch
    view: the Go side must see the write."""
    for how in ("tensor", "torch"):
        t = tensormp.empty((1 << 20,), "float32", device="cuda:0")
        x = t.torch()
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(int(1e9))  # about half a second of GPU time
            x.fill_(7)
            pipe.send({"how": how, "t": t if how == "tensor" else x}, timeout=60)
        if pipe.recv(timeout=60) != "seen":
            raise SystemExit("expected 'seen'")
        torch.cuda.synchronize()
        del x
        t.close()


def recorder(report):
    """Returns attempt(name, fn), which calls fn and records in report the
    error it raised."""
    def attempt(name, fn):
        try:
            fn()
        except tensormp.Error as e:
            report[name] = type(e).__name__ + ": " + str(e)
        except Exception as e:
            report[name] = "not a tensormp.Error: " + type(e).__name__ + ": " + str(e)
        else:
            report[name] = "no error"
    return attempt


def increment(pipe):
    """Adds 1 in place to the tensor it receives, to show the library
    still works."""
    x = torch.from_dlpack(pipe.recv(timeout=60))
    x += 1
    settle(x)
    pipe.send("incremented", timeout=60)


def malformed(pipe):
    """Feeds the library bad input and reports, for each, the error it
    raised; then shows the library still works."""
    lib = tensormp._lib.lib
    report = {}
    attempt = recorder(report)

    h = pipe._handle()
    send = lambda text: tensormp._lib.call(tensormp._lib.send, h, text, 1000)
    attempt("not-json", lambda: send(b"{"))
    attempt("text-after", lambda: send(b"1 2"))
    attempt("unknown-handle", lambda: send(b'{"$tensormp": "tensor", "h": 987654}'))
    attempt("handle-not-number", lambda: send(b'{"$tensormp": "tensor", "h": "x"}'))
    attempt("wrong-kind-handle", lambda: send(('{"$tensormp": "tensor", "h": %d}' % h).encode()))
    attempt("unknown-kind", lambda: send(b'{"$tensormp": "bomb"}'))
    attempt("bad-base64", lambda: send(b'{"$tensormp": "bytes", "b64": "%%%"}'))
    attempt("bad-float", lambda: send(b'{"$tensormp": "float", "v": "big"}'))
    attempt("too-deep", lambda: send(b"[" * 200 + b"]" * 200))
    attempt("closed-handle", lambda: (lambda t: (t.close(), pipe.send(t)))(tensormp.empty(4)))
    attempt("bad-dtype", lambda: tensormp.empty((2,), "float8"))
    attempt("negative-shape", lambda: tensormp.empty((2, -1)))
    attempt("overflow-shape", lambda: tensormp.empty((1 << 40, 1 << 40)))
    attempt("too-many-dims", lambda: tensormp.empty((1,) * 65))
    attempt("recv-on-tensor", lambda: (lambda t: tensormp._objects._recv_value(t._handle(), 0.1))(tensormp.empty(1)))
    attempt("close-unknown", lambda: tensormp._lib.call(tensormp._lib.close, 123456789))
    attempt("dlpack-unknown-handle", lambda: tensormp.Tensor(999999, "float32", (1,), (1,)).__dlpack__())
    attempt("dlpack-bad-as", lambda: (lambda t: tensormp._dlpack.capsule(t._handle(), "int8"))(tensormp.empty(4, "float32")))
    attempt("null-dlpack", lambda: tensormp._lib.call(tensormp._lib.from_dlpack, None, None, None))
    attempt("dial-nowhere", lambda: tensormp.dial("/nonexistent/tensormp.sock", timeout=1))
    attempt("not-a-tensor", lambda: pipe.send(object()))
    attempt("dict-key", lambda: pipe.send({1: 2}))
    attempt("own-key", lambda: pipe.send({"$tensormp": "tensor"}))
    attempt("deleter-twice", lambda: lib.tensormp_dlpack_deleter(None))
    attempt("recv-timeout", lambda: pipe.recv(timeout=0.1))
    attempt("peer-closed", peer_closed)
    report["invalid-value-is"] = ",".join(c.__name__ for c in tensormp.InvalidValue.__mro__)
    # Values the library gives Python that are not what it should give.
    decode = lambda text: tensormp._codec.loads(text, tensormp._objects._make)
    attempt("decode-not-json", lambda: decode("{"))
    attempt("decode-no-handle", lambda: decode('{"$tensormp": "tensor"}'))
    attempt("decode-bool-handle", lambda: decode('{"$tensormp": "queue", "h": true}'))
    attempt("decode-bad-bytes", lambda: decode('{"$tensormp": "bytes", "b64": "%%%"}'))
    attempt("decode-bad-float", lambda: decode('{"$tensormp": "float", "v": "big"}'))
    attempt("decode-unknown-kind", lambda: decode('{"$tensormp": "bomb"}'))
    attempt("decode-gives-back", decode_gives_back)
    pipe.send(report, timeout=60)
    increment(pipe)


def hostile(pipe):
    """Receives what a hostile peer sends: the names of the messages to
    come, then those messages, none of them well formed; reports the
    error each raised, then shows the library still works."""
    report = {}
    attempt = recorder(report)
    for name in pipe.recv(timeout=60):
        attempt(name, lambda: pipe.recv(timeout=60))
    pipe.send(report, timeout=60)
    increment(pipe)


def peer_closed():
    """Receives on a pipe whose other end is closed."""
    address = "@tensormp-peer-closed-%d" % os.getpid()
    with tensormp.Listener(address) as listener:
        a = tensormp.dial(address, timeout=10)
        with listener.accept(timeout=10) as b:
            a.close()
            b.recv(timeout=10)


def decode_gives_back():
    """Decodes a tensor object whose handle is real but whose shape is
    malformed: the handle must be given back, which closing it again
    shows."""
    t = tensormp.empty(4)
    h, t._h = t._h, 0
    try:
        tensormp._codec.loads('{"$tensormp": "tensor", "h": %d, "dtype": "float32", '
                              '"shape": "x", "strides": [1]}' % h, tensormp._objects._make)
    except tensormp.Error:
        pass
    tensormp._lib.call(tensormp._lib.close, h)


class _Managed(ctypes.Structure):
    _fields_ = [("dl", tensormp._dlpack.DLTensor), ("ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


def malformed_gpu(pipe):
    """Feeds the library DLPack CUDA tensors that lie about their memory
    and other bad GPU input, reports the errors, then shows the library
    still works."""
    report = {}
    attempt = recorder(report)
    keep = []

    def take(device_type, device_id, data, n):
        m = _Managed()
        shape = (ctypes.c_int64 * 1)(n)
        keep.append(shape)
        m.dl.data, m.dl.device_type, m.dl.device_id = data, device_type, device_id
        m.dl.ndim, m.dl.code, m.dl.bits, m.dl.lanes = 1, 1, 8, 1
        m.dl.shape = shape
        out = ctypes.c_int64()
        tensormp._lib.call(tensormp._lib.from_dlpack, ctypes.addressof(m), None, ctypes.byref(out))
        tensormp._lib.call(tensormp._lib.close, out.value)

    host = ctypes.create_string_buffer(64)
    small = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    attempt("bogus-pointer", lambda: take(2, 0, 0x1000, 16))
    attempt("host-pointer", lambda: take(2, 0, ctypes.addressof(host), 16))
    attempt("past-allocation", lambda: take(2, 0, small.data_ptr(), 64 << 20))
    attempt("no-such-gpu", lambda: take(2, 7, small.data_ptr(), 16))
    attempt("negative-gpu", lambda: take(2, -1, small.data_ptr(), 16))
    attempt("managed", lambda: take(13, 0, small.data_ptr(), 16))
    attempt("numpy-of-gpu", lambda: tensormp.empty(4, device="cuda").numpy())
    attempt("empty-no-such-gpu", lambda: tensormp.empty(4, device="cuda:7"))
    attempt("empty-bad-device", lambda: tensormp.empty(4, device="tpu"))
    pipe.send(report, timeout=60)
    increment(pipe)


def raw(address):
    """Speaks to the endpoint without the library: a frame that lies about
    its descriptors, a well-framed message whose payload claims a queue
    it does not hold, and a message shorter than a frame's header."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(address if address[0] != "@" else "\0" + address[1:])
    header = struct.pack("<BIIQ", 0, 0, 0, 0)  # flags, descriptors, carried, spilled
    with open("/dev/null", "rb") as f:
        socket.send_fds(s, [header + b"\x01"], [f.fileno()])
        header = struct.pack("<BIIQ", 0, 1, 0, 0)
        socket.send_fds(s, [header + b"\xc7\x03\x51abc"], [f.fileno()])
    s.send(b"\x01")
    s.recv(1)  # until the Go side hangs up


def main():
    role = sys.argv[1]
    address = os.environ["ENDPOINT"]
    if role == "raw":
        raw(address)
        return
    with tensormp.dial(address, timeout=30) as pipe:
        {"consumer": consumer, "producer": producer, "hold": hold,
         "malformed": malformed, "malformed-gpu": malformed_gpu,
         "hostile": hostile, "side-stream": side_stream}[role](pipe)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    main()

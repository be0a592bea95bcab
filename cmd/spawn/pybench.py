"""The Python side of spawn bench -python.

  pybench.py echo      dial $ENDPOINT with tensormp and send every tensor
                       received back, viewed through torch.from_dlpack,
                       until told "stop"
  pybench.py torch S N D
                       torch.multiprocessing's own round trip, Python to
                       Python over two Queues, of a shared float32 tensor
                       of S bytes on device D, N times (comma-separated
                       lists); one JSON object per size on stdout. On a
                       GPU the child answers with a word, not the tensor
  pybench.py torchstream N D
                       N new float32 tensors of 4 KiB on device D sent one
                       way through a torch.multiprocessing.Queue to a
                       child that drops them; one JSON object, the rate
"""

import json
import os
import sys
import time

import torch


def echo():
    import tensormp
    with tensormp.dial(os.environ["ENDPOINT"], timeout=30) as pipe:
        last = None  # keeps the last tensor mapped, as torch's child does
        while True:
            v = pipe.recv()
            if isinstance(v, str):
                return
            x = torch.from_dlpack(v)
            pipe.send(x)
            last = (v, x)


def torch_child(qin, qout, ack_only):
    last = None
    while True:
        x = qin.get()
        if x is None:
            return
        last = x
        # torch puts a CUDA tensor received from a process on no Queue
        # back to that process: the child answers with a word instead.
        qout.put(True if ack_only else x)


def torch_roundtrip(sizes, counts, device):
    import torch.multiprocessing as mp
    if device != "cpu":
        mp = mp.get_context("spawn")  # CUDA tensors travel only to spawned children
    qin, qout = mp.Queue(), mp.Queue()
    child = mp.Process(target=torch_child, args=(qin, qout, device != "cpu"))
    child.start()
    try:
        for nbytes, n in zip(sizes, counts):
            x = torch.zeros(nbytes // 4, device=device).share_memory_()
            for _ in range(min(n, 20)):
                qin.put(x)
                qout.get()
            ds = []
            for _ in range(n):
                t0 = time.perf_counter()
                qin.put(x)
                qout.get()
                ds.append(time.perf_counter() - t0)
            ds.sort()
            print(json.dumps({"bytes": nbytes, "p50_us": ds[len(ds) // 2] * 1e6,
                              "p99_us": ds[min(len(ds) - 1, len(ds) * 99 // 100)] * 1e6}), flush=True)
    finally:
        qin.put(None)
        child.join()


def stream_child(qin, qout):
    n = 0
    while True:
        x = qin.get()
        if x is None:
            qout.put(n)
            return
        n += 1
        del x


def torch_stream(n, device):
    import torch.multiprocessing as mp
    if device != "cpu":
        mp = mp.get_context("spawn")
    qin, qout = mp.Queue(), mp.Queue()
    child = mp.Process(target=stream_child, args=(qin, qout))
    child.start()
    try:
        warm = [torch.zeros(1024, device=device) for _ in range(100)]
        for x in warm:
            qin.put(x)
        if device != "cpu":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            qin.put(torch.zeros(1024, device=device))
        qin.put(None)
        got = qout.get()
        dt = time.perf_counter() - t0
        if got != n + len(warm):
            raise RuntimeError(f"the child counted {got} tensors, not {n + len(warm)}")
        print(json.dumps({"bytes": 4096, "per_s": n / dt}), flush=True)
    finally:
        child.join()


if __name__ == "__main__":
    if sys.argv[1] == "echo":
        echo()
    elif sys.argv[1] == "torchstream":
        torch_stream(int(sys.argv[2]), sys.argv[3])
    else:
        torch_roundtrip([int(s) for s in sys.argv[2].split(",")],
                        [int(n) for n in sys.argv[3].split(",")], sys.argv[4])

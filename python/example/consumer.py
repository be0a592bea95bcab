"""Receives a tensor from the Go process at the endpoint in argv[1] and
doubles it in place: the Go process sees the write, nothing was copied."""

import sys

import torch

import tensormp

with tensormp.dial(sys.argv[1], timeout=30) as pipe:
    value = pipe.recv(timeout=30)
    weights = torch.from_dlpack(value["weights"])  # Go's memory, no copy
    print("python: got", tuple(weights.shape), weights.dtype, "at step", value["step"])
    weights *= 2
    pipe.send("doubled")

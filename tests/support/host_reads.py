"""What a device-to-host sync calls from Python, refused: a test that a warm call makes none.

On a GPU each of these Tensor methods reads device memory on the host (a sync). Inside
`no_host_reads()` they raise, on any device, so the CPU suite checks the same code path a GPU
runs. (C++ reads, such as torch.equal's, are not seen here: the GPU tests run CUDA graph capture,
which refuses any sync.)
"""

from __future__ import annotations

import contextlib

import torch

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")


def _refuse(name: str):
    def method(self, *args, **kwargs):
        raise AssertionError(f"Tensor.{name}() in a warm call: a device-to-host sync on a GPU")
    return method


@contextlib.contextmanager
def no_host_reads():
    own = {name: torch.Tensor.__dict__[name] for name in READS if name in torch.Tensor.__dict__}
    try:
        for name in READS:
            setattr(torch.Tensor, name, _refuse(name))
        yield
    finally:
        for name in READS:
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)

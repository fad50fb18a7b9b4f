"""A twin micro-kernel on the hardware, called as the emulator's functions are: the gpu `twins`
tests (tests/gpu/test_gpu_tma.py, test_gpu_stmatrix.py, test_gpu_mbarrier.py) compile the same source
the emulator runs with NVRTC and launch it through CuPy, with torch CUDA tensors for pointers,
NumPy scalars as they are, and bytes (a tensor map's 128) as a struct passed by value."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def require_capability(major: int, minor: int) -> str:
    """The device's arch for NVRTC (sm_XY, or sm_90a for 9.0 when asked), skipping below (major, minor)."""
    have = torch.cuda.get_device_capability()
    if have < (major, minor):
        pytest.skip(f"needs compute capability {major}.{minor} or newer, this GPU has {have[0]}.{have[1]}")
    return f"sm_{have[0]}{have[1]}"


def gpu_function(source: str, name: str, arch: str):
    """`source`'s kernel `name` compiled for `arch`, as a callable (grid, block, args, shared_mem=0)
    that synchronises after the launch."""
    import cupy

    from fagen.kernels.compile import nvrtc_compile
    from fagen.kernels.launch import struct_argument

    cubin, _ = nvrtc_compile(source, arch)
    module = cupy.cuda.function.Module()
    module.load(cubin)
    function = module.get_function(name)

    def converted(value):
        if isinstance(value, torch.Tensor):
            return np.uint64(value.data_ptr())
        if isinstance(value, (bytes, bytearray)):   # a struct by value (a tensor map's 128 bytes)
            return struct_argument(value)
        return value

    def launch(grid, block, args, shared_mem: int = 0):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        torch.cuda.synchronize()
        if shared_mem > 48 * 1024:   # the driver refuses more dynamic shared memory unless the kernel opts in
            function.max_dynamic_shared_size_bytes = shared_mem
        function(grid, block, tuple(converted(a) for a in args), shared_mem=shared_mem)
        torch.cuda.synchronize()

    return launch

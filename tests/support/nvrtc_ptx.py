"""NVRTC for tests that read the PTX of a small source: the wrappers' GPU side."""

from __future__ import annotations

import pytest


def nvrtc_ptx(source: str, arch: str) -> str:
    """The PTX NVRTC makes of `source` for `arch` (compute_XX), with fagen's headers; skipped
    without NVRTC."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    from fagen.kernels.render import include_dir
    from fagen.kernels.compile import cuda_header_dir

    _, program = nvrtc.nvrtcCreateProgram(source.encode(), b"snippet.cu", 0, [], [])
    options = [f"-arch={arch}".encode(), b"-std=c++17", f"-I{include_dir()}".encode(),
               f"-I{cuda_header_dir()}".encode()]
    (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    # Fresh buffers, never `b" " * size`: for size 1 that is CPython's shared b" " object, which
    # NVRTC would overwrite (fagen/kernels/compile.py's `_fetch`).
    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    log = bytearray(size)
    nvrtc.nvrtcGetProgramLog(program, log)
    assert int(status) == 0, bytes(log).decode(errors="replace")
    _, size = nvrtc.nvrtcGetPTXSize(program)
    ptx = bytearray(size)
    nvrtc.nvrtcGetPTX(program, ptx)
    return bytes(ptx).decode(errors="replace")

"""One launcher interface, two backends.

A loaded kernel is called as `fn(grid, block, args, shared_mem=...)`, where
`args` holds, per kernel parameter, a torch tensor (passed as a pointer) or a
NumPy scalar whose type is the parameter's C type. That is CuPy's RawKernel
calling convention, and the CPU emulator (`fagen.emulate`) takes the same.

- CUDA tensors: NVRTC cubin for the device's arch, loaded with CuPy and
  launched on torch's current stream; dynamic shared memory above 48 KB is
  opted in per kernel.
- CPU tensors: the generated source is compiled for the host and run by the
  SIMT emulator; with FAGEN_EMULATE_CHECKED=1, built with AddressSanitizer and
  UBSan and run in a helper process, so an out-of-bounds access to a tensor,
  to the dynamic shared memory or to a per-thread array stops the launch with
  the faulting block and thread named (slower).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Protocol

import numpy as np
import torch

from .codegen import Entry, Source
from .compiler import compile_source

DEFAULT_SHARED_LIMIT = 48 * 1024
_SCALAR_TYPES = {kind: np.dtype(kind).type for kind in ("int32", "uint32", "int64", "uint64", "float32")}
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CHECKED_ENV = "FAGEN_EMULATE_CHECKED"


class KernelFunction(Protocol):
    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None: ...


class LoadedSource:
    """The kernels of one source, loaded for one device."""

    def __init__(self, source: Source, device: torch.device, functions: dict[str, KernelFunction],
                 pointer: Callable[[torch.Tensor], Any]):
        self.source = source
        self.device = device
        self.functions = functions
        self._pointer = pointer

    def args(self, entry: Entry, values: dict[str, Any]) -> tuple:
        """Order and type the arguments of `entry` from a name -> value dict."""
        return tuple(self._pointer(values[p.name]) if p.kind == "tensor" else _SCALAR_TYPES[p.kind](values[p.name])
                     for p in entry.params)

    def launch(self, entry: Entry, grid: tuple, values: dict[str, Any]) -> None:
        if 0 in grid:
            return  # nothing to do (e.g. batch 0); CUDA rejects an empty grid
        self.functions[entry.name](grid, entry.block, self.args(entry, values),
                                   shared_mem=entry.shared_bytes)


# -- CUDA backend ------------------------------------------------------------

def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError("CUDA tensors need CuPy: pip install 'fagen[cuda12]' or 'fagen[cuda13]'") from exc
    return cupy


class _CudaFunction:
    """A CuPy driver function launched on torch's current stream."""

    def __init__(self, function, device_index: int):
        self.function = function
        self.device_index = device_index
        self.shared_opt_in = DEFAULT_SHARED_LIMIT
        self.streams: dict[int, Any] = {}  # torch stream handle -> CuPy wrapper, made once

    def __call__(self, grid, block, args, shared_mem=0):
        cupy = _cupy()
        with cupy.cuda.Device(self.device_index):
            if shared_mem > self.shared_opt_in:
                cupy.cuda.driver.funcSetAttribute(
                    self.function.ptr, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
                self.shared_opt_in = shared_mem
            handle = torch.cuda.current_stream(self.device_index).cuda_stream
            stream = self.streams.get(handle)
            if stream is None:
                stream = self.streams[handle] = cupy.cuda.ExternalStream(handle, self.device_index)
            self.function(grid, block, args, shared_mem=shared_mem, stream=stream)


def arch_of(device: torch.device) -> str:
    """The NVRTC arch of a CUDA device, e.g. sm_90."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _load_cuda(source: Source, device: torch.device) -> LoadedSource:
    cupy = _cupy()
    compiled = compile_source(source, arch_of(device))
    with cupy.cuda.Device(device.index):
        module = cupy.cuda.function.Module()
        module.load(compiled.cubin)
        functions = {e.name: _CudaFunction(module.get_function(e.name), device.index)
                     for e in source.entries}
    return LoadedSource(source, device, functions, pointer=lambda t: np.uint64(t.data_ptr()))


# -- CPU (emulator) backend --------------------------------------------------

def emulate_checked() -> bool:
    """Whether CPU launches use the sanitizer-checked emulator build (FAGEN_EMULATE_CHECKED=1)."""
    value = os.environ.get(CHECKED_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{CHECKED_ENV}={value!r}: expected 0 or 1")
    return value == "1"


def _load_emulated(source: Source, device: torch.device) -> LoadedSource:
    from . import emulate

    module = emulate.load_module(source.code, checked=emulate_checked())
    functions = {e.name: module.get_function(e.name) for e in source.entries}
    return LoadedSource(source, device, functions, pointer=lambda t: t)


# -- cache -------------------------------------------------------------------

_loaded: dict[tuple[str, str], LoadedSource] = {}
_key_locks: dict[tuple[str, str], threading.Lock] = {}
_key_locks_guard = threading.Lock()


def load(source: Source, device: torch.device) -> LoadedSource:
    """Load a source's kernels for a device, once per process.

    Each (source, device) has its own lock, so first loads of different
    variants (seconds of NVRTC or g++) proceed in parallel."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (source.hash, str(device) + (":checked" if device.type == "cpu" and emulate_checked() else ""))
    loaded = _loaded.get(key)
    if loaded is not None:
        return loaded
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"fagen runs on CUDA or CPU tensors, not on {device.type!r}")
    with _key_locks_guard:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _loaded:
            _loaded[key] = (_load_cuda if device.type == "cuda" else _load_emulated)(source, device)
        return _loaded[key]

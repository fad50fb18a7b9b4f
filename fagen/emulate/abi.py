"""The C ABI of an emulated module, without torch (the checked helper process
loads this file on its own, to start fast).

A module exports, per kernel K (see include/fagen_emulate/export.h):
    int fagen_launch_K(const LaunchConfig*, void** args, char* error, unsigned long size)
    const char* fagen_signature_K()     e.g. "pc:f16,p:f32,i32,i64"
and fagen_emulate_kernels() -> "K1,K2", fagen_emulate_abi_version() -> ABI_VERSION.
"""

from __future__ import annotations

import ctypes

import numpy as np

ABI_VERSION = 5
ERROR_BUFFER_BYTES = 16384

SCALAR_TYPES = {
    "b8": (np.bool_, ctypes.c_bool),
    "i8": (np.int8, ctypes.c_int8),
    "u8": (np.uint8, ctypes.c_uint8),
    "i16": (np.int16, ctypes.c_int16),
    "u16": (np.uint16, ctypes.c_uint16),
    "i32": (np.int32, ctypes.c_int32),
    "u32": (np.uint32, ctypes.c_uint32),
    "i64": (np.int64, ctypes.c_int64),
    "u64": (np.uint64, ctypes.c_uint64),
    "f32": (np.float32, ctypes.c_float),
    "f64": (np.float64, ctypes.c_double),
}
# torch dtype names (str(dtype) without "torch.") -> element codes.
DTYPE_CODES = {
    "bool": "b8", "int8": "i8", "uint8": "u8", "int16": "i16", "uint16": "u16", "int32": "i32",
    "uint32": "u32", "int64": "i64", "uint64": "u64", "float16": "f16", "bfloat16": "bf16",
    "float32": "f32", "float64": "f64",
}
CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}
C_NAMES = {
    "b8": "bool", "i8": "signed char", "u8": "unsigned char", "i16": "short", "u16": "unsigned short",
    "i32": "int", "u32": "unsigned int", "i64": "long long", "u64": "unsigned long long",
    "f16": "__half", "bf16": "__nv_bfloat16", "f32": "float", "f64": "double", "void": "void",
    "any": "struct",
}
INTEGER_CODES = {"i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64"}


# InstrumentFlags and TensorFlags (include/fagen_emulate/export.h).
INSTRUMENT_RACECHECK, INSTRUMENT_COUNTERS, INSTRUMENT_LENIENT_WARP = 1, 2, 4
TENSOR_WRITABLE = 1
TENSOR_COUNTERS = ("read_bytes", "written_bytes", "atomic_bytes", "unique_read_bytes", "unique_written_bytes")
LAUNCH_COUNTERS = (
    "blocks", "global_load_requests", "global_load_sectors", "global_store_requests", "global_store_sectors",
    "shared_load_requests", "shared_load_wavefronts", "shared_load_conflicts",
    "shared_store_requests", "shared_store_wavefronts", "shared_store_conflicts",
    "ldmatrix_requests", "ldmatrix_wavefronts", "ldmatrix_conflicts",
    "mma", "barriers", "philox_calls", "cp_async_copies", "cp_async_bytes",
    "proxy_fences",
)


class TensorRange(ctypes.Structure):
    """Mirror of fagen_emu::TensorRange."""

    _fields_ = [("begin", ctypes.c_uint64), ("bytes", ctypes.c_uint64), ("argument", ctypes.c_int32),
                ("element_bytes", ctypes.c_int32), ("flags", ctypes.c_int32), ("reserved", ctypes.c_int32),
                *[(name, ctypes.c_uint64) for name in TENSOR_COUNTERS]]


class LaunchCounters(ctypes.Structure):
    """Mirror of fagen_emu::LaunchCounters."""

    _fields_ = [(name, ctypes.c_uint64) for name in LAUNCH_COUNTERS]


class LaunchConfig(ctypes.Structure):
    """Mirror of fagen_emu::LaunchConfig (include/fagen_emulate/export.h)."""

    _fields_ = [
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("shared_mem_bytes", ctypes.c_uint64),
        ("os_threads", ctypes.c_int32),
        ("schedule", ctypes.c_int32),
        ("instrument", ctypes.c_int32),
        ("block_order", ctypes.c_int32),
        ("tensor_count", ctypes.c_uint32),
        ("tensors", ctypes.POINTER(TensorRange)),
        ("counters", ctypes.POINTER(LaunchCounters)),
        ("seed", ctypes.c_uint64),
        ("block_interleave", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


STRUCT_ALIGNMENT = 64   # a by-value struct parameter's buffer (Parameter.struct)
# The byte offset of the global address in fagen's emulated tensor map (fagen_emulate/tensor_map.h,
# fagen.kernels.tensor_map.LAYOUT): the checked build re-points a map at its copy of the tensor.
TENSOR_MAP_ADDRESS_OFFSET = 8


class ArgumentError(ValueError):
    """An argument does not fit the kernel's parameter."""


def compatible(got: str, wanted: str) -> bool:
    """Exact match, except that signed and unsigned integers of one width mix
    (torch has little uint32 support; an `unsigned*` output is an int32 tensor)."""
    if got == wanted:
        return True
    return got in INTEGER_CODES and wanted in INTEGER_CODES and got[1:] == wanted[1:]


class Parameter:
    """One kernel parameter as the runtime describes it: 'i32', 'pc:f16', ..."""

    def __init__(self, index: int, code: str):
        self.index = index
        self.code = code
        self.is_pointer = code.startswith(("p:", "pc:"))
        self.is_const = code.startswith("pc:")
        self.pointee = code.split(":", 1)[1] if self.is_pointer else None

    @property
    def c_type(self) -> str:
        if self.is_pointer:
            return ("const " if self.is_const else "") + C_NAMES.get(self.pointee, self.pointee) + "*"
        if self.code.startswith("?"):
            return f"a {self.code[1:]}-byte struct"
        return C_NAMES.get(self.code, self.code)

    def where(self, kernel: str) -> str:
        return f"{kernel}: argument {self.index} ({self.c_type})"

    def pointer(self, dtype_code: str | None, address: int | None, kernel: str) -> ctypes.c_void_p:
        """A pointer argument: the element code of the tensor passed (None for a null pointer)."""
        if not self.is_pointer:
            raise ArgumentError(f"{self.where(kernel)} is a scalar: pass "
                                f"np.{np.dtype(SCALAR_TYPES[self.code][0]).name}(...), not a tensor"
                                if self.code in SCALAR_TYPES else f"{self.where(kernel)} is not a pointer")
        if dtype_code is not None and self.pointee in CODE_DTYPES and not compatible(dtype_code, self.pointee):
            raise ArgumentError(f"{self.where(kernel)} takes a torch.{CODE_DTYPES[self.pointee]} tensor, "
                                f"got torch.{CODE_DTYPES.get(dtype_code, dtype_code)}")
        return ctypes.c_void_p(address or None)

    def scalar(self, value, kernel: str):
        if self.is_pointer:
            raise ArgumentError(f"{self.where(kernel)} takes a CPU torch tensor or None, got "
                                f"{type(value).__name__}")
        if self.code.startswith("?") and isinstance(value, (bytes, bytearray)):
            return self.struct(bytes(value), kernel)
        if self.code not in SCALAR_TYPES:
            raise ArgumentError(f"{self.where(kernel)}: the launcher cannot pass a parameter of type {self.code!r}"
                                + (f" from {type(value).__name__}: pass its bytes" if self.code.startswith("?") else ""))
        numpy_type, c_type = SCALAR_TYPES[self.code]
        if not isinstance(value, np.generic) or value.dtype != np.dtype(numpy_type):
            got = type(value).__name__ + (f" ({value.dtype})" if isinstance(value, np.generic) else "")
            name = np.dtype(numpy_type).name
            raise ArgumentError(f"{self.where(kernel)} takes np.{name}, got {got}: pass np.{name}(...) so "
                                f"the C type is explicit")
        return c_type(value.item())


    def struct(self, value: bytes, kernel: str):
        """A struct passed by value (a tensor map's 128 bytes, `const __grid_constant__`): its
        bytes, copied into a buffer aligned as the strictest C type may ask (64: a CUtensorMap),
        since the kernel's thunk reads the parameter in place."""
        size = int(self.code[1:])
        if len(value) != size:
            raise ArgumentError(f"{self.where(kernel)} is a {size}-byte struct, got {len(value)} bytes")
        buffer = (ctypes.c_char * (size + STRUCT_ALIGNMENT))()
        offset = -ctypes.addressof(buffer) % STRUCT_ALIGNMENT
        view = (ctypes.c_char * size).from_buffer(buffer, offset)   # keeps `buffer` alive
        ctypes.memmove(view, value, size)
        return view


def parameters(signature: str) -> list[Parameter]:
    return [Parameter(i, code) for i, code in enumerate(signature.split(",")) if code]


def dim3(value, what: str) -> tuple[int, int, int]:
    """CuPy accepts an int or a 1- to 3-tuple for grid and block; so do we."""
    if isinstance(value, (int, np.integer)):
        value = (int(value),)
    value = tuple(int(v) for v in value)
    if not 1 <= len(value) <= 3 or any(v < 1 or v > 0xFFFFFFFF for v in value):
        raise ArgumentError(f"{what} must be 1 to 3 positive integers, got {value}")
    return value + (1,) * (3 - len(value))


class Library:
    """A loaded emulated module (ctypes), kernel by kernel."""

    def __init__(self, path: str):
        self.path = path
        self._library = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        if self._library.fagen_emulate_abi_version() != ABI_VERSION:
            raise ArgumentError(f"{path}: unexpected emulator ABI version")
        self._library.fagen_emulate_kernels.restype = ctypes.c_char_p

    def kernel_names(self) -> list[str]:
        return [n for n in self._library.fagen_emulate_kernels().decode().split(",") if n]

    def kernel(self, name: str):
        """(launch function, parameters), or None if the module has no such kernel."""
        try:
            launcher = getattr(self._library, f"fagen_launch_{name}")
            signature = getattr(self._library, f"fagen_signature_{name}")
        except AttributeError:
            return None
        launcher.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                             ctypes.c_ulong]
        launcher.restype = ctypes.c_int
        signature.restype = ctypes.c_char_p
        return launcher, parameters(signature().decode())


def launch(launcher, grid, block, shared_mem: int, os_threads: int, schedule: int, values: list,
           instrument: int = 0, tensors=None, counters: LaunchCounters | None = None,
           block_order: int = 0, seed: int = 0, block_interleave: int = 0) -> str | None:
    """Run the grid; None, or the runtime's error message. `values` are ctypes objects, one per
    parameter; with `instrument`, `tensors` is a ctypes array of TensorRange (its counters are
    filled in) and `counters` a LaunchCounters to fill; `block_order` is a BlockOrder; `seed` the random
    schedule's; `block_interleave` a BlockInterleave."""
    config = LaunchConfig()
    config.grid[:] = grid
    config.block[:] = block
    config.shared_mem_bytes = shared_mem
    config.os_threads = os_threads
    config.schedule = schedule
    config.instrument = instrument
    config.block_order = block_order
    config.seed = seed
    config.block_interleave = block_interleave
    if tensors is not None and len(tensors):
        config.tensor_count = len(tensors)
        config.tensors = ctypes.cast(tensors, ctypes.POINTER(TensorRange))
    if counters is not None:
        config.counters = ctypes.pointer(counters)
    pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
    status = launcher(ctypes.byref(config), pointers, error, ERROR_BUFFER_BYTES)
    return error.value.decode(errors="replace") if status != 0 else None

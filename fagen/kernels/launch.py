"""One launcher interface, two backends.

A loaded kernel is called as `fn(grid, block, args, shared_mem=...)`, where
`args` holds, per kernel parameter, a torch tensor (passed as a pointer), a
NumPy scalar whose type is the parameter's C type, or a struct passed by value
(a tensor map: `struct_argument` on a GPU, its bytes on the CPU). That is
CuPy's RawKernel calling convention, and the CPU emulator (`fagen.emulate`)
takes the same.

- CUDA tensors: NVRTC cubin for the device's arch (or, when the installed
  NVRTC predates the GPU, for the newest arch it knows: `compiler.nvrtc_target`),
  loaded with CuPy and launched on torch's current stream; dynamic shared
  memory above 48 KB is opted in per kernel, up to what the driver reports.
- Grids: (row blocks, heads, batch). More than 65535 heads or batch entries
  are launched in chunks (`grid_chunks`), each told its first head and batch.
- CPU tensors: the generated source is compiled for the host and run by the
  SIMT emulator; with FAGEN_EMULATE_CHECKED=1, built with AddressSanitizer and
  UBSan and run in a helper process, so an out-of-bounds access to a tensor,
  to the dynamic shared memory or to a per-thread array stops the launch with
  the faulting block and thread named (slower); with FAGEN_EMULATE_RACECHECK=1
  (or inside `fagen.emulate.collect_counters()`), built instrumented: every
  launch is race-checked (or counted).

The emulator stands above this module (it builds on the kernels' headers), so this module never
imports it: `fagen.emulate` registers itself here when imported (`register_emulator`), and
fagen's package imports it.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch

from .render import Entry, Source
from .compile import compile_source, describe_target, spec_target
from .tensor_map import Swizzle, TensorMapSpec, resolved_box
from ..environment import setting
from ..arch import SMEM_LIMIT_BYTES, base_arch

DEFAULT_SHARED_LIMIT = 48 * 1024
_SCALAR_TYPES = {kind: np.dtype(kind).type for kind in ("int32", "uint32", "int64", "uint64", "float32")}
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CHECKED_ENV = "FAGEN_EMULATE_CHECKED"
RACECHECK_ENV = "FAGEN_EMULATE_RACECHECK"   # 1 or lenient (the emulator reads which: launch_args)
# CUDA's grid limits: gridDim.x up to 2**31 - 1 blocks, gridDim.y and gridDim.z up to 65535.
GRID_X_LIMIT = 2**31 - 1
GRID_YZ_LIMIT = 65535
MAX_STREAMS_PER_FUNCTION = 64  # wrapped torch streams kept per kernel (least recently used go)
# The oldest CuPy whose argument conversion takes `struct_argument`'s form (a size-one NumPy array)
# by value; the extras' floors in pyproject.toml must not admit an older one.
CUPY_STRUCT_BY_VALUE = (10, 0)

logger = logging.getLogger("fagen")


class KernelFunction(Protocol):
    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None: ...


Dim3 = tuple[int, int, int]


def grid_chunks(grid: Dim3, limit: int | None = None) -> Iterator[tuple[Dim3, int, int]]:
    """Split a (x, y, z) grid into launches whose y and z fit CUDA's limit.

    Yields (grid of the launch, offset of its first y, offset of its first z):
    one launch when the grid fits, else ceil(y / limit) * ceil(z / limit)."""
    limit = GRID_YZ_LIMIT if limit is None else limit
    x, y, z = grid
    if x > GRID_X_LIMIT:
        raise ValueError(f"a launch of {x} row blocks exceeds CUDA's gridDim.x limit of {GRID_X_LIMIT}")
    for z0 in range(0, z, limit):
        for y0 in range(0, y, limit):
            yield (x, min(limit, y - y0), min(limit, z - z0)), y0, z0


class BoundLaunch:
    """One kernel's launches (a chunk each, see `grid_chunks`) with every argument converted
    to its C type once, except the per-call ones (tensors, the Philox pair), which a call
    supplies by name. Reused across calls of one shape, this skips re-deriving and
    re-converting twenty-odd scalars per kernel on every call."""

    __slots__ = ("functions", "name", "block", "shared_mem", "chunks", "slots", "passed", "converting")

    def __init__(self, functions: dict, name: str, block: tuple, shared_mem: int,
                 chunks: list[tuple[tuple, list]], slots: list[tuple[int, str, Callable]]):
        self.functions = functions   # looked up at call time, so a replaced function is seen
        self.name = name
        self.block = block
        self.shared_mem = shared_mem
        self.chunks = chunks         # (grid, argument template) per launch
        self.slots = slots           # (position, value name, converter) of the per-call arguments
        # The emulator takes tensors as they are: those slots need no conversion, nor its memo.
        self.passed = [(i, name) for i, name, convert in slots if convert is _as_is]
        self.converting = [slot for slot in slots if slot[2] is not _as_is]

    def __call__(self, values: dict[str, Any], converted: dict[str, Any] | None = None) -> None:
        """Launch with the per-call `values`; `converted` memoizes their C-typed forms across
        the kernels of one call (a tensor's pointer is read once, not once per kernel)."""
        function = self.functions[self.name]
        converted = {} if converted is None else converted
        for grid, template in self.chunks:
            args = template.copy()
            for i, name in self.passed:
                args[i] = values[name]
            for i, name, convert in self.converting:
                value = converted.get(name)
                if value is None:
                    value = converted[name] = convert(values[name])
                args[i] = value
            function(grid, self.block, tuple(args), self.shared_mem)


def struct_argument(data: bytes) -> np.ndarray:
    """A struct passed by value, as CuPy takes one: a 1-element NumPy array of one record, its bytes."""
    # CuPy's argument conversion (`_pointer` in cupy/cuda/function.pyx) passes a NumPy array of
    # size one by value, pointing the driver at its data, in every release from 10.0 through 14.x
    # (CUPY_STRUCT_BY_VALUE). A structured scalar (numpy.void, the record itself) it takes only
    # from 14.0, where any NumPy scalar goes to `_scalar.CScalar`; before 14, `_pointer` knows
    # only the numeric scalar types and raises "TypeError: Unsupported type <class 'numpy.void'>".
    return np.frombuffer(bytes(data), dtype=np.dtype([("bytes", np.uint8, (len(data),))]))


def _mapped(box: tuple, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as its map's box sees it: packed sequences (total, H, d) as one batch entry of all
    their rows, (1, total, H, d) (the kernel adds each sequence's first row to its coordinates)."""
    return tensor.unsqueeze(0) if tensor.dim() == len(box) - 1 else tensor


# A tensor with no elements (no keys at all: seqlen_k = 0, total_k = 0, an empty cache; packed
# sequences with no query) has a map with a zero global dim, which the driver refuses. The kernels
# read nothing through such a map: their sizes (seqlen_k, total_k, the cache's rows, total_q) leave
# them no tile to load, and their guards bound every index by those sizes, never by the map. So it
# is encoded over a placeholder, and the kernel writes what it writes for rows that see no key (O =
# 0, L = +inf or the sink), as the sm80 family's kernels, which take pointers, do. One placeholder
# per (device, dtype, width), kept for the process: a cached driver map may point at it.
_placeholders: dict = {}


def _encoded(box: tuple, tensor: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """The box and the tensor a map of `tensor` (as `_mapped` shapes it) encodes: themselves, or for
    a tensor with no elements the box resolved on its shape (a paged cache's rows follow its page
    size) and a placeholder of one zero row of its width, (1, .., 1, d)."""
    if tensor.numel():
        return box, tensor
    key = (tensor.device, tensor.dtype, tensor.dim(), tensor.shape[-1])
    placeholder = _placeholders.get(key)
    if placeholder is None:
        placeholder = _placeholders[key] = torch.zeros((1,) * (tensor.dim() - 1) + (tensor.shape[-1],),
                                                       dtype=tensor.dtype, device=tensor.device)
    return resolved_box(box, tensor.shape), placeholder


# The driver's maps, by what they encode. A map holds a tensor's address and layout and nothing
# else, so a later tensor at the same address with the same layout takes the same bytes; encoding
# one (checked, then cuTensorMapEncodeTiled) costs ~12 us of Python before the driver's share, and
# an sm90 forward passes four. Bounded: many distinct tensors start it over.
_driver_maps: dict = {}
MAX_DRIVER_MAPS = 1024


def _driver_map(box: tuple, tensor: torch.Tensor, swizzle: Swizzle = Swizzle.B128):
    """A tensor map the driver encodes (cuTensorMapEncodeTiled), passed by value; encoded once per
    (address, shape, strides, dtype, device, box, swizzle)."""
    tensor = _mapped(box, tensor)
    key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device, box, swizzle)
    argument = _driver_maps.get(key)
    if argument is None:
        if len(_driver_maps) >= MAX_DRIVER_MAPS:
            _driver_maps.clear()
        box, tensor = _encoded(box, tensor)
        argument = struct_argument(TensorMapSpec.of_tensor(tensor, box, swizzle=swizzle).driver_bytes(tensor))
        _driver_maps[key] = argument
    return argument


def _emulated_map(box: tuple, tensor: torch.Tensor, swizzle: Swizzle = Swizzle.B128):
    """fagen's own encoding of the same map, which only the emulator's TMA twin reads."""
    box, tensor = _encoded(box, _mapped(box, tensor))
    return TensorMapSpec.of_tensor(tensor, box, swizzle=swizzle).emulated_bytes(tensor)


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    """The emulator's tensor argument: the tensor itself (it reads the pointer and the storage)."""
    return tensor


class LoadedSource:
    """The kernels of one source, loaded for one device."""

    def __init__(self, source: Source, device: torch.device, functions: dict[str, KernelFunction],
                 pointer: Callable[[torch.Tensor], Any], tensor_map: Callable[[tuple, torch.Tensor], Any]):
        self.source = source
        self.device = device
        self.functions = functions
        self._pointer = pointer
        self._tensor_map = tensor_map   # (box, tensor, swizzle=) -> the map as this backend passes it

    def _converter(self, param) -> Callable:
        if param.kind == "tensor":
            return self._pointer
        if param.kind == "tensor_map":
            return functools.partial(self._tensor_map, param.box, swizzle=param.swizzle)
        return _SCALAR_TYPES[param.kind]

    def bind(self, entry: Entry, grid: tuple, values: dict[str, Any],
             per_call: frozenset[str] = frozenset()) -> BoundLaunch:
        """`entry` over `grid` = (row blocks, heads, batch), in as many launches as gridDim.y
        / .z's limit needs (each told its first head and batch), with every argument taken
        from `values` now except tensors and the names in `per_call`."""
        slots = [(i, p.name, self._converter(p)) for i, p in enumerate(entry.params)
                 if p.kind in ("tensor", "tensor_map") or p.name in per_call]
        live = {i for i, _, _ in slots}
        chunks = []
        for chunk, head_offset, batch_offset in ([] if 0 in grid else grid_chunks(grid)):
            chunk_values = {**values, "head_offset": head_offset, "batch_offset": batch_offset}
            template = [None if i in live else self._converter(p)(chunk_values[p.name])
                        for i, p in enumerate(entry.params)]
            chunks.append((chunk, template))
        return BoundLaunch(self.functions, entry.name, entry.block, entry.shared_bytes, chunks, slots)

    def launch(self, entry: Entry, grid: tuple, values: dict[str, Any]) -> None:
        """Launch `entry` once over `grid` (an empty grid launches nothing: CUDA rejects it)."""
        self.bind(entry, grid, values)(values)


# -- CUDA backend ------------------------------------------------------------

def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError("CUDA tensors need CuPy: pip install 'fagen[cuda12]' or 'fagen[cuda13]'") from exc
    return cupy


class _StreamHandle:
    """A raw CUDA stream handle, offered through the CUDA stream protocol."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def wrap_stream(cupy, handle: int, device_index: int):
    """A CuPy stream for torch's stream `handle`: `Stream.from_external` (CuPy 14), else the
    older `ExternalStream`, which CuPy 14 deprecates."""
    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, device_index)


def current_stream_handle(device_index: int) -> int:
    """torch's current CUDA stream on a device, as a raw handle. torch's own raw accessor
    (what Triton uses) skips building a Stream object on every launch."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class _CudaFunction:
    """A CuPy driver function launched on torch's current stream."""

    def __init__(self, function, device_index: int):
        self.function = function
        self.device_index = device_index
        self.shared_opt_in = DEFAULT_SHARED_LIMIT
        # torch stream handle -> CuPy wrapper, bounded: programs may make many short-lived streams.
        self.streams: collections.OrderedDict[int, Any] = collections.OrderedDict()

    def stream_for(self, cupy, handle: int):
        stream = self.streams.get(handle)
        if stream is None:
            stream = self.streams[handle] = wrap_stream(cupy, handle, self.device_index)
            while len(self.streams) > MAX_STREAMS_PER_FUNCTION:
                self.streams.popitem(last=False)
        else:
            self.streams.move_to_end(handle)
        return stream

    def __call__(self, grid, block, args, shared_mem=0):
        cupy = _cupy()
        with cupy.cuda.Device(self.device_index):
            if shared_mem > self.shared_opt_in:
                cupy.cuda.driver.funcSetAttribute(
                    self.function.ptr, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
                self.shared_opt_in = shared_mem
            stream = self.stream_for(cupy, current_stream_handle(self.device_index))
            self.function(grid, block, args, shared_mem=shared_mem, stream=stream)


def arch_of(device: torch.device) -> str:
    """The compute capability of a CUDA device as an arch name, e.g. sm_90."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def shared_limit(device: torch.device) -> int:
    """Shared memory one block may opt in to on this GPU, as its driver reports it (the arch
    table's value where the driver cannot be asked)."""
    return _shared_limit_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _shared_limit_of(index: int) -> int:
    try:
        return int(_cupy().cuda.runtime.getDeviceProperties(index)["sharedMemPerBlockOptin"])
    except Exception:  # noqa: BLE001 - no CuPy: torch's view of the device, then the table
        props = torch.cuda.get_device_properties(index)
        reported = getattr(props, "shared_memory_per_block_optin", None)
        if reported:
            return int(reported)
        return SMEM_LIMIT_BYTES.get(base_arch(arch_of(torch.device("cuda", index))), DEFAULT_SHARED_LIMIT)


def _load_cuda(source: Source, device: torch.device) -> LoadedSource:
    cupy = _cupy()
    device_arch = arch_of(device)
    target = spec_target(source.spec, device_arch)
    logger.info("loading %s for %s on %s: NVRTC target %s", source.spec.name, device,
                torch.cuda.get_device_name(device), describe_target(device_arch, target))
    compiled = compile_source(source, target, shared_limit=shared_limit(device))
    functions = {}
    with cupy.cuda.Device(device.index):
        for unit, cubin in zip(source.units, compiled.cubins, strict=True):   # a module per translation unit
            module = cupy.cuda.function.Module()
            module.load(cubin)
            functions.update({name: _CudaFunction(module.get_function(name), device.index) for name in unit.names})
    return LoadedSource(source, device, functions, pointer=lambda t: np.uint64(t.data_ptr()),
                        tensor_map=_driver_map)


# -- CPU (emulator) backend --------------------------------------------------

def _no_emulator(code: str, *, checked: bool, counters: bool):
    raise RuntimeError("CPU tensors run on fagen's emulator, which registers itself when fagen.emulate "
                       "is imported (`import fagen` does)")


def counters_collected() -> bool:
    """Whether the emulator is collecting counters now (inside `fagen.emulate.collect_counters()`):
    replaced by the emulator's own answer when it registers. Look it up as
    `launch.counters_collected` at call time, not by a name imported once."""
    return False


_load_emulator_module: Callable = _no_emulator


def register_emulator(load_module: Callable, collecting: Callable[[], bool]) -> None:
    """The CPU backend: `load_module(code, checked=, counters=)` builds and loads a source's
    emulated module (its `get_function(name)` gives a kernel function); `collecting()` says
    whether counters are being collected. The functions themselves are kept, so a warm call
    pays no extra frame for the indirection."""
    global _load_emulator_module, counters_collected
    _load_emulator_module, counters_collected = load_module, collecting


def emulate_checked() -> bool:
    """Whether CPU launches use the sanitizer-checked emulator build (FAGEN_EMULATE_CHECKED=1)."""
    value = setting(CHECKED_ENV)
    if value not in ("", "0", "1"):
        raise ValueError(f"{CHECKED_ENV}={value!r}: expected 0 or 1")
    return value == "1"


def emulator_build() -> str:
    """Which emulator build CPU launches use now: "fast", "checked" (FAGEN_EMULATE_CHECKED=1)
    or "instrumented" (FAGEN_EMULATE_RACECHECK set, or counters being collected). Read on
    every CPU call (tests switch builds between calls), so kept to two environment reads."""
    if emulate_checked():
        return "checked"
    if setting(RACECHECK_ENV) not in ("", "0") or counters_collected():
        return "instrumented"
    return "fast"


def _load_emulated(source: Source, device: torch.device) -> LoadedSource:
    build = emulator_build()
    detail = {"fast": "", "checked": ", checked with AddressSanitizer and UBSan",
              "instrumented": ", instrumented (racecheck, counters)"}[build]
    logger.info("loading %s for the CPU emulator%s (a first build runs the host C++ compiler for "
                "seconds; then it is cached)", source.spec.name, detail)
    module = _load_emulator_module(source.code, checked=build == "checked",
                                   counters=build == "instrumented" and counters_collected())
    functions = {e.name: module.get_function(e.name) for e in source.entries}
    for entry in source.entries:  # counter reports name tensors after the kernel's parameters
        if hasattr(functions[entry.name], "parameter_names"):
            functions[entry.name].parameter_names = [p.name for p in entry.params]
    return LoadedSource(source, device, functions, pointer=_as_is, tensor_map=_emulated_map)


# -- cache -------------------------------------------------------------------

_loaded: dict[tuple[str, str], LoadedSource] = {}
_key_locks: dict[tuple[str, str], threading.Lock] = {}
_key_locks_guard = threading.Lock()


# What `emulator_build` reads from the environment (and it reads counters_collected()).
BACKEND_SETTINGS = (CHECKED_ENV, RACECHECK_ENV)


def backend_key(device: torch.device):
    """What decides which loaded kernels serve `device`: the device, and on CPU the emulator
    build (fast, checked or instrumented)."""
    return (device, emulator_build()) if device.type == "cpu" else device


def load(source: Source, device: torch.device) -> LoadedSource:
    """Load a source's kernels for a device, once per process.

    Each (source, device) has its own lock, so first loads of different
    specs (seconds of NVRTC or g++) proceed in parallel."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (source.hash, str(device) + (":" + emulator_build() if device.type == "cpu" else ""))
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

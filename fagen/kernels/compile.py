"""Compile rendered CUDA with NVRTC, for explicit archs, with no GPU needed.

NVRTC is called through NVIDIA's `cuda.bindings.nvrtc` (cuda-bindings 12 or
13), which works without a driver. A spec's source compiles as its translation
units, one per pass (`Source.units`), in parallel threads. Each unit is cached
twice: in memory for the process, and on disk under the user's cache directory,
keyed by the unit's hash, the arch, the NVRTC version and the options. Disk
entries are single JSON files written to a temporary name and renamed into
place, so concurrent builders of the same source both succeed and readers never
see half a file.

Arch-specific targets (sm_90a: wgmma, TMA, setmaxnreg) compile like any other; a
build fails when ptxas reports that it serialises a kernel's wgmma pipeline
(`check_wgmma_pipeline`), since that kernel would be correct but slow.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .render import Source, include_dir
from ..cache_files import cache_dir, write_atomic
from ..arch import DEFAULT_ARCHS, SMEM_LIMIT_BYTES, base_arch
from ..arch_families import family_of

CACHE_FORMAT = 1
MIN_COMPUTE_CAPABILITY = 80  # cp.async and bf16 mma.sync
ARCH_SPECIFIC_FROM = 90  # NVRTC 12.9 refuses sm_80a ... sm_89a; sm_90a and newer `a` forms compile
ARCH_ENV = "FAGEN_ARCH"


logger = logging.getLogger("fagen")


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message carries its log."""


@dataclass(frozen=True)
class ResourceReport:
    """What ptxas says one kernel uses on one arch."""

    kernel: str
    arch: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    static_shared_bytes: int
    barriers: int = 0

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


@dataclass
class CompiledKernel:
    """A source compiled for one arch: a cubin per translation unit (`Source.units`, in their
    order; for a compute_XY target, their PTX, which the driver compiles), ptxas's report of every
    kernel, and how it was obtained."""

    arch: str
    cubins: tuple[bytes, ...]
    log: str
    resources: dict[str, ResourceReport]
    nvrtc_version: str
    compile_seconds: float       # what the call waited for NVRTC: its units compile in parallel
    cache: str = field(default="miss")  # "miss" (any unit compiled), "disk" or "memory"
    unit_seconds: tuple[float, ...] = ()  # NVRTC's seconds for each unit, when it was compiled


# -- toolchain discovery ---------------------------------------------------

def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CompileError(
            "NVRTC is not available: install fagen with the cuda12 or cuda13 extra "
            "(pip install 'fagen[cuda12]')") from exc
    return nvrtc


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    err, major, minor = _nvrtc().nvrtcVersion()
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=1)
def cuda_header_dir() -> Path:
    """Directory holding cuda_fp16.h for NVRTC (the CUDA runtime headers)."""
    candidates = []
    try:
        import cuda.pathfinder as pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            candidates.append(Path(found))
    except Exception:  # noqa: BLE001 - pathfinder is optional; fall through to CUDA_HOME
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for path in candidates:
        if (path / "cuda_fp16.h").is_file():
            return path
    raise CompileError(
        "cannot find cuda_fp16.h for NVRTC: install nvidia-cuda-runtime-cu12 (the cuda12 extra) "
        "or set CUDA_HOME")


def parse_archs(text: str) -> list[str]:
    """'sm_80,sm_90' -> ['sm_80', 'sm_90'] with a clear error for unknown archs."""
    archs = [a.strip() for a in text.split(",") if a.strip()]
    if not archs:
        raise ValueError("empty arch list; expected e.g. sm_80,sm_90")
    for arch in archs:
        if base_arch(arch) not in SMEM_LIMIT_BYTES or not arch.startswith("sm_"):
            raise ValueError(f"unknown arch {arch!r}; known archs: {', '.join(SMEM_LIMIT_BYTES)} "
                             f"(and their sm_XXa forms)")
    return archs


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    """The compute capabilities the installed NVRTC compiles for, e.g. (75, 80, ..., 121)."""
    result = _nvrtc().nvrtcGetSupportedArchs()
    return tuple(sorted(int(a) for a in result[1]))


def nvrtc_target(device_arch: str, supported: tuple[int, ...] | None = None, *,
                 arch_specific: bool = False) -> str:
    """What to compile for a GPU of `device_arch` (e.g. sm_121).

    The device's own arch when NVRTC knows it; else the newest arch NVRTC
    supports that is not newer than the device. A cubin runs only on GPUs of
    its own major version, so when that arch's major differs the target is
    its PTX form (compute_XY), which the driver compiles for the device.

    `arch_specific` is for a family built on instructions that exist only on
    one compute capability (the Hopper family's wgmma, TMA and setmaxnreg need
    sm_90a): the target is then the device's own arch-specific form, `sm_XYa`,
    whose cubin runs on that compute capability alone, so there is no older or
    PTX fallback. NVRTC 12.9 has `a` forms from sm_90 on. Which devices such a
    family supports is the family's to decide (wgmma is on 9.0 only); the
    default, False, is the mma.sync family's target for every GPU, sm_90 included.
    """
    number = int(base_arch(device_arch).removeprefix("sm_"))
    if number < MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"fagen's kernels need compute capability 8.0 or newer (cp.async, bf16 "
                         f"tensor cores); this GPU is {device_arch}")
    supported = supported_archs() if supported is None else supported
    if arch_specific:
        return _arch_specific_target(device_arch, number, supported)
    older = [a for a in supported if MIN_COMPUTE_CAPABILITY <= a <= number]
    if not older:
        raise CompileError(f"NVRTC {nvrtc_version()} cannot compile for {device_arch} or any older "
                           f"arch from sm_80 (it supports {', '.join(map(str, supported))})")
    best = max(older)
    if best == number:
        return f"sm_{number}"
    return f"sm_{best}" if best // 10 == number // 10 else f"compute_{best}"


def spec_target(spec, device_arch: str) -> str:
    """The NVRTC target a spec's kernels compile for on a GPU of `device_arch`: the arch-specific
    form for the sm90 family (its wgmma, TMA and setmaxnreg exist only in sm_90a), else
    `nvrtc_target`'s. What `launch` loads and the GPU check's precompile builds."""
    return nvrtc_target(device_arch, arch_specific=family_of(spec).arch_specific)


def _arch_specific_target(device_arch: str, number: int, supported: tuple[int, ...]) -> str:
    if number < ARCH_SPECIFIC_FROM:
        raise ValueError(f"{device_arch} has no arch-specific target (sm_XYa exists from "
                         f"sm_{ARCH_SPECIFIC_FROM} on)")
    if number not in supported:
        raise CompileError(f"NVRTC {nvrtc_version()} cannot compile for sm_{number}a, and an "
                           f"arch-specific cubin runs only on its own compute capability (NVRTC "
                           f"supports {', '.join(map(str, supported))})")
    return f"sm_{number}a"


def describe_target(device_arch: str, target: str) -> str:
    """One line for logs and summaries: which arch NVRTC compiles for, and why."""
    if target == device_arch:
        return f"{target} (NVRTC {nvrtc_version()})"
    if target == device_arch + "a":
        return f"{target} (NVRTC {nvrtc_version()}; arch-specific: the cubin runs on this compute capability only)"
    form = "PTX, compiled for the GPU by the driver" if target.startswith("compute_") else "cubin"
    return (f"{target} ({form}): the newest arch NVRTC {nvrtc_version()} supports that is not "
            f"newer than this {device_arch} GPU")


def gpu_arch() -> str | None:
    """The visible GPU's arch (sm_XY), or None without one."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:  # noqa: BLE001 - no torch CUDA: no GPU
        pass
    return None


def default_archs() -> list[str]:
    """The NVRTC target for the visible GPU (`nvrtc_target`), else $FAGEN_ARCH, else sm_80 and sm_90."""
    device_arch = gpu_arch()
    if device_arch is not None:
        return [nvrtc_target(device_arch)]
    if os.environ.get(ARCH_ENV):
        return parse_archs(os.environ[ARCH_ENV])
    return list(DEFAULT_ARCHS)


# -- ptxas report ----------------------------------------------------------

_ENTRY_RE = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str, arch: str) -> dict[str, ResourceReport]:
    """Per-kernel registers, spills, stack and static shared memory from `ptxas -v`."""
    reports: dict[str, ResourceReport] = {}
    kernel, values = None, {}
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            kernel, values = m.group(1), {}
        elif kernel and (m := _FRAME_RE.search(line)):
            values.update(stack=int(m.group(1)), stores=int(m.group(2)), loads=int(m.group(3)))
        elif kernel and (m := _USED_RE.search(line)):
            reports[kernel] = ResourceReport(
                kernel=kernel, arch=arch, registers=int(m.group(1)),
                spill_store_bytes=values.get("stores", 0), spill_load_bytes=values.get("loads", 0),
                stack_bytes=values.get("stack", 0), static_shared_bytes=int(m.group(3) or 0),
                barriers=int(m.group(2) or 0))
            kernel = None
    return reports


# ptxas numbers its wgmma pipeline diagnostics C7510-C7520 (NVRTC 12.9 and ptxas 13.0 alike) and
# prints them as "info" lines into NVRTC's program log, with or without --ptxas-options=-v; the
# compile still succeeds. Each says the GPU would not overlap the kernel's GEMMs as written:
# "wgmma.mma_async instructions are serialized due to ..." (code touching accumulator or input
# registers inside a pipeline stage, a call inside the pipeline, too few registers, ...), or that
# ptxas injected a warpgroup.wait / warpgroup.arrive because code touches accumulator registers
# between a wgmma's issue and its wait. The kernel is still correct, only slow, which no test would
# notice. The phrase is matched too, in case a later ptxas renumbers its notes.
_WGMMA_PIPELINE_RE = re.compile(r"\(C75(?:1\d|20)\)|wgmma\.mma_async instructions are serialized")
_FUNCTION_RE = re.compile(r"function '(\w+)'")


def wgmma_serialisation(log: str) -> list[str]:
    """ptxas's lines in `log` saying it serialises a kernel's wgmma pipeline; empty for a clean
    build (and always for the mma.sync family, which has no wgmma)."""
    return [line.strip() for line in log.splitlines() if _WGMMA_PIPELINE_RE.search(line)]


def check_wgmma_pipeline(log: str, what: str, arch: str) -> None:
    """Raise CompileError naming the kernels ptxas serialised wgmma in, with ptxas's own lines."""
    lines = wgmma_serialisation(log)
    if not lines:
        return
    kernels = sorted({m.group(1) for line in lines if (m := _FUNCTION_RE.search(line))})
    raise CompileError(
        f"ptxas serialises the wgmma pipeline of {', '.join(kernels) or what} ({what}, {arch}): the GPU "
        f"would run its GEMMs one at a time. ptxas says:\n" + "\n".join(f"  {line}" for line in lines))


# -- NVRTC -----------------------------------------------------------------

def nvrtc_options(arch: str) -> list[str]:
    """-lineinfo maps SASS back to source lines for compute-sanitizer and the profilers; it
    changes no instruction. A compute_XY (PTX) target has no ptxas run to report on."""
    options = [f"-arch={arch}", "-std=c++17", "-lineinfo"]
    if not arch.startswith("compute_"):
        options.append("--ptxas-options=-v")
    return options + [f"-I{include_dir()}", f"-I{cuda_header_dir()}"]


def _check(result, what: str, prog=None):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        log = _program_log(prog) if prog is not None else ""
        raise CompileError(f"NVRTC {what} failed ({err}):\n{log}")
    return result


def _fetch(size_call, fetch_call, prog, what: str) -> bytes:
    """An NVRTC output (log, cubin, PTX) copied out of a fresh mutable buffer.

    Never `b" " * size`: for size 1 that is CPython's one shared b" " object,
    and NVRTC writing its NUL there would change every b" " in the process."""
    _, size = _check(size_call(prog), f"{what} size")
    buffer = bytearray(size)
    _check(fetch_call(prog, buffer), f"get {what}")
    return bytes(buffer)


def _program_log(prog) -> str:
    nvrtc = _nvrtc()
    raw = _fetch(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, prog, "log")
    return raw.rstrip(b"\x00").decode(errors="replace")


def nvrtc_compile(code: str, arch: str, filename: str = "kernel.cu") -> tuple[bytes, str]:
    """Compile `code` for `arch`. Returns (image, log): a cubin for sm_XY, NUL-terminated
    PTX for compute_XY (what the driver's module loader takes)."""
    nvrtc = _nvrtc()
    _, prog = _check(nvrtc.nvrtcCreateProgram(code.encode(), filename.encode(), 0, [], []), "create")
    try:
        opts = [o.encode() for o in nvrtc_options(arch)]
        _check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), f"compile for {arch}", prog)
        log = _program_log(prog)
        if arch.startswith("compute_"):
            return _fetch(nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX, prog, "PTX"), log
        return _fetch(nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, prog, "cubin"), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# -- caches ----------------------------------------------------------------

_memory_cache: dict[str, CompiledKernel] = {}
_memory_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def headers_digest() -> str:
    """Hash of the static headers every source includes: editing one must miss the cache."""
    digest = hashlib.sha256()
    for path in sorted(include_dir().rglob("*.cuh")):
        digest.update(path.relative_to(include_dir()).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_key(source_hash: str, arch: str) -> str:
    # Every option but the include paths (their contents are in headers_digest).
    options = [o for o in nvrtc_options(arch) if not o.startswith("-I")]
    parts = [str(CACHE_FORMAT), source_hash, headers_digest(), arch, nvrtc_version(), " ".join(options)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _cache_path(key: str) -> Path:
    return cache_dir() / "cubin" / f"{key}.json"


def _read_disk(path: Path) -> CompiledKernel | None:
    try:
        data = json.loads(path.read_text())
        resources = {k: ResourceReport(**v) for k, v in data["resources"].items()}
        return CompiledKernel(arch=data["arch"], cubins=(base64.b64decode(data["cubin"]),), log=data["log"],
                              resources=resources, nvrtc_version=data["nvrtc_version"],
                              compile_seconds=data["compile_seconds"], cache="disk",
                              unit_seconds=(data["compile_seconds"],))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"ignoring corrupt fagen cache entry {path}: {exc}", stacklevel=3)
        return None


def _write_disk(path: Path, kernel: CompiledKernel) -> None:
    """One unit's entry: its one cubin."""
    (cubin,) = kernel.cubins
    data = {"arch": kernel.arch, "cubin": base64.b64encode(cubin).decode(), "log": kernel.log,
            "resources": {k: asdict(v) for k, v in kernel.resources.items()},
            "nvrtc_version": kernel.nvrtc_version, "compile_seconds": kernel.compile_seconds}
    write_atomic(path, json.dumps(data).encode())


def compile_source(source: Source | str, arch: str, *, use_cache: bool = True,
                   shared_limit: int | None = None) -> CompiledKernel:
    """Compile a rendered source for one arch through the memory and disk caches, an entry per
    translation unit (`Source.units`: its passes); the units the caches lack compile in a thread
    each.

    `shared_limit` is the GPU's own shared memory per block (the driver's
    opt-in limit) when compiling for a device; else the arch table's is used."""
    if isinstance(source, Source):
        # The forward's tiles; launching the backward checks its own.
        source.spec.check_arch(arch, backward=False, shared_limit=shared_limit)
        what, units = source.spec.name, [unit.code for unit in source.units]
    else:
        what, units = "a kernel source", [source]
    start = time.perf_counter()
    parts = [_cached(code, arch) if use_cache else None for code in units]
    missing = [code for code, part in zip(units, parts) if part is None]
    compile_unit = functools.partial(_compile_unit, arch=arch, what=what, use_cache=use_cache)
    if len(missing) > 1:   # a thread per unit to compile: NVRTC releases the GIL
        with ThreadPoolExecutor(len(missing), thread_name_prefix="fagen-nvrtc") as pool:
            fresh = iter(list(pool.map(compile_unit, missing)))
    else:
        fresh = iter([compile_unit(code) for code in missing])
    parts = [part or next(fresh) for part in parts]
    if len(parts) == 1:
        return parts[0]
    cache = next(c for c in ("miss", "disk", "memory") if any(p.cache == c for p in parts))
    return CompiledKernel(arch=arch, cubins=tuple(c for p in parts for c in p.cubins),
                          log="\n".join(p.log for p in parts),
                          resources={k: r for p in parts for k, r in p.resources.items()},
                          nvrtc_version=parts[0].nvrtc_version,
                          compile_seconds=time.perf_counter() - start if cache == "miss" else
                          max(p.compile_seconds for p in parts),
                          cache=cache, unit_seconds=tuple(s for p in parts for s in p.unit_seconds))


def _cached(code: str, arch: str) -> CompiledKernel | None:
    """One translation unit from the memory cache, else from the disk cache (then kept in memory
    too), else None."""
    key = cache_key(hashlib.sha256(code.encode()).hexdigest(), arch)
    with _memory_lock:
        hit = _memory_cache.get(key)
    if hit is not None:
        return CompiledKernel(**{**hit.__dict__, "cache": "memory"})
    hit = _read_disk(_cache_path(key))
    if hit is not None:
        with _memory_lock:
            _memory_cache[key] = hit
    return hit


def _compile_unit(code: str, arch: str, what: str, use_cache: bool) -> CompiledKernel:
    """One translation unit by NVRTC, into the caches unless `use_cache` is False: a
    CompiledKernel of one cubin."""
    key = cache_key(hashlib.sha256(code.encode()).hexdigest(), arch)
    logger.info("compiling %s for %s with NVRTC %s", what, arch, nvrtc_version())
    start = time.perf_counter()
    cubin, nvrtc_log = nvrtc_compile(code, arch)
    check_wgmma_pipeline(nvrtc_log, what, arch)  # before caching: a serialised build is never reused
    seconds = time.perf_counter() - start
    kernel = CompiledKernel(arch=arch, cubins=(cubin,), log=nvrtc_log,
                            resources=parse_ptxas_log(nvrtc_log, arch),
                            nvrtc_version=nvrtc_version(), compile_seconds=seconds, unit_seconds=(seconds,))
    if use_cache:
        try:
            _write_disk(_cache_path(key), kernel)
        except OSError as exc:  # an unwritable cache costs a recompile next process, not this call
            warnings.warn(f"cannot write the fagen kernel cache ({exc}); continuing without it",
                          stacklevel=3)
        with _memory_lock:
            _memory_cache[key] = kernel
    return kernel


def clear_memory_cache() -> None:
    with _memory_lock:
        _memory_cache.clear()

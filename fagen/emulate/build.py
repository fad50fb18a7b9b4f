"""Compile a kernel source with the host C++ compiler against the emulator runtime.

The runtime (fagen/emulate/src/*.cpp) is built once per toolchain and flag
set into a shared library, libfagen-emulate-<fast|checked>-<hash>.so; each
kernel source is compiled into its own shared library that links against it
(found next to it through an $ORIGIN rpath). One runtime for all modules
means one thread pool and one set of fiber stacks however many kernels a
process loads. Both are cached on disk under
`<fagen cache>/emulate/` (`$FAGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/fagen`,
else `~/.cache/fagen`), keyed by a sha256 of everything that affects the
result: the source, the runtime and wrapper headers, the CUDA half/bf16
headers, the flags and the compiler's version. Results are written under a
temporary name and renamed into place, so concurrent builders of the same
source both succeed and nobody loads half a file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..cache_files import cache_dir, process_umask, write_atomic
from .errors import EmulationError

PACKAGE_DIR = Path(__file__).resolve().parent
RUNTIME_INCLUDE_DIR = PACKAGE_DIR / "include"
RUNTIME_SOURCE_DIR = PACKAGE_DIR / "src"
CXX_ENV = "FAGEN_EMULATE_CXX"
EXTRA_FLAGS_ENV = "FAGEN_EMULATE_CXXFLAGS"  # appended to runtime and kernel builds (part of the cache key)

# Both builds: C++17, position independent, only the FAGEN_EXPORT symbols
# visible (each module keeps its own runtime and TLS), and no TLS-wrapper
# calls for `extern thread_local` (the runtime's TLS needs no dynamic init).
COMMON_FLAGS = ("-std=c++17", "-fPIC", "-DFAGEN_EMULATE", "-fvisibility=hidden", "-pthread")
# The runtime (where the emulation time goes: rendezvous, mma, ldmatrix) is
# optimised fully; kernel modules at -O1, which runs them as fast as -O2 here
# (measured: FA-2 forward + backward, d=64) and builds a quarter faster.
RUNTIME_OPT = "-O2"
KERNEL_OPT_ENV = "FAGEN_EMULATE_OPT"
DEFAULT_KERNEL_OPT = "-O1"
KERNEL_OPTS = ("-O0", "-O1", "-O2", "-O3", "-Og")
# The checked build: AddressSanitizer (out-of-bounds global, shared and stack
# accesses) and UndefinedBehaviorSanitizer (e.g. int overflow in index math),
# both fatal at the first report. Run only in a subprocess with libasan
# preloaded (fagen/emulate/checked.py).
CHECKED_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                 "-fno-sanitize-recover=all", "-fno-sanitize=vptr")
# The instrumented build (racecheck and the counters): ThreadSanitizer's
# compiler instrumentation, without its runtime. The compiler calls
# __tsan_read4(address) and the like before every load and store; the
# emulator's runtime defines them (src/instrument.cpp), so the module is linked
# without libtsan. -g lets a report name the .cu line of an access, through
# the inline chain of the helpers (all inlined: FAGEN_EMU_ALWAYS_INLINE).
INSTRUMENT_FLAGS = ("-O1", "-g", "-fsanitize=thread", "-DFAGEN_EMU_ALWAYS_INLINE")
LINK_FLAGS = ("-shared", "-Wl,-z,defs", "-ldl")
RUNTIME_DEFINE = "-DFAGEN_EMU_BUILDING_RUNTIME"


@functools.lru_cache(maxsize=None)
def compiler() -> str:
    name = os.environ.get(CXX_ENV) or "g++"
    path = shutil.which(name)
    if path is None:
        raise EmulationError(f"the emulator needs a C++17 compiler: {name!r} is not on PATH "
                             f"(set {CXX_ENV} to choose another)")
    return path


@functools.lru_cache(maxsize=None)
def compiler_identity(cxx: str) -> str:
    result = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    machine = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, check=False)
    return f"{cxx}|{result.stdout.splitlines()[0] if result.stdout else ''}|{machine.stdout.strip()}"


def is_gcc(cxx: str) -> bool:
    return "clang" not in compiler_identity(cxx).lower()


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> Path:
    """The CUDA toolkit include directory whose cuda_fp16.h compiles in host code."""
    candidates: list[Path] = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    try:
        import cuda.pathfinder as pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            candidates.append(Path(found))
    except Exception:  # noqa: BLE001 - pathfinder is optional; the toolkit paths come first
        pass
    incomplete = []
    for path in candidates:
        if (path / "cuda_fp16.h").is_file():
            # Host compilers also need CUDA's crt/host_defines.h, which the
            # nvidia-cuda-runtime wheel leaves out.
            if (path / "crt" / "host_defines.h").is_file():
                return path
            incomplete.append(str(path))
    tried = ", ".join(str(p) for p in candidates)
    detail = (f"; {', '.join(incomplete)} has cuda_fp16.h but not crt/host_defines.h (a full CUDA "
              f"toolkit include directory is needed)") if incomplete else ""
    raise EmulationError(f"the emulator needs the CUDA headers cuda_fp16.h and cuda_bf16.h: none found in "
                         f"{tried}{detail}. Install the CUDA toolkit or set CUDA_HOME.")


def _templates_include_dir() -> Path:
    from ..kernels.render import include_dir

    return include_dir()


def _cache_root() -> Path:
    return cache_dir() / "emulate"


def _hash_files(digest, files) -> None:
    for path in sorted(files):
        digest.update(str(path.name).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")


@functools.lru_cache(maxsize=None)
def _headers_digest() -> str:
    """Everything a kernel source may include, as one digest (computed once per process)."""
    digest = hashlib.sha256()
    _hash_files(digest, RUNTIME_INCLUDE_DIR.rglob("*.h"))
    _hash_files(digest, _templates_include_dir().rglob("*.cuh"))
    cuda = cuda_include_dir()
    digest.update(str(cuda).encode())
    _hash_files(digest, [cuda / name for name in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h",
                                                  "cuda_bf16.hpp") if (cuda / name).is_file()])
    return digest.hexdigest()


@dataclass(frozen=True)
class Toolchain:
    cxx: str
    flags: tuple[str, ...]
    checked: bool
    include_dirs: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        digest = hashlib.sha256()
        digest.update(compiler_identity(self.cxx).encode())
        digest.update("\0".join(self.flags).encode())
        return digest.hexdigest()


def kernel_opt() -> str:
    opt = os.environ.get(KERNEL_OPT_ENV, DEFAULT_KERNEL_OPT)
    if opt not in KERNEL_OPTS:
        raise EmulationError(f"{KERNEL_OPT_ENV}={opt!r}: expected one of {', '.join(KERNEL_OPTS)}")
    return opt


def toolchain(checked: bool) -> Toolchain:
    """Flags shared by the runtime and kernel builds (the fast build's -O level is added per target)."""
    cxx = compiler()
    flags = [*COMMON_FLAGS, *(CHECKED_FLAGS if checked else ()), *shlex.split(os.environ.get(EXTRA_FLAGS_ENV, ""))]
    if is_gcc(cxx):
        flags.append("-fno-extern-tls-init")
    include_dirs = (str(RUNTIME_INCLUDE_DIR), str(_templates_include_dir()), str(cuda_include_dir()))
    for directory in include_dirs:
        flags += ["-I", directory]
    return Toolchain(cxx=cxx, flags=tuple(flags), checked=checked, include_dirs=include_dirs)


def _run_compiler(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        log = (result.stderr or result.stdout).strip()
        if len(log) > 12000:
            log = log[:12000] + "\n... (compiler output truncated)"
        raise EmulationError(f"compiling {what} for the emulator failed:\n{log}")


def runtime_library(chain: Toolchain) -> Path:
    """The runtime shared library for this toolchain, built once and cached."""
    digest = hashlib.sha256(chain.key.encode())
    sources = sorted(RUNTIME_SOURCE_DIR.glob("*.cpp"))
    _hash_files(digest, sources)
    _hash_files(digest, RUNTIME_SOURCE_DIR.glob("*.h"))
    digest.update(_headers_digest().encode())
    digest.update(RUNTIME_OPT.encode())
    root = _cache_root()
    name = f"libfagen-emulate-{'checked' if chain.checked else 'fast'}-{digest.hexdigest()[:24]}.so"
    final = root / name
    if final.is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="runtime-build-", dir=root))
    try:
        # One compiler per source file, all at once: the cold build is the slow part.
        jobs = []
        for source in sources:
            command = [chain.cxx, *chain.flags, *(() if chain.checked else (RUNTIME_OPT,)), RUNTIME_DEFINE,
                       "-c", str(source), "-o", str(staging / f"{source.stem}.o")]
            jobs.append((source, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                  text=True)))
        failures = []
        for source, process in jobs:
            _, stderr = process.communicate()
            if process.returncode != 0:
                failures.append(f"{source.name}:\n{stderr.strip()}")
        if failures:
            raise EmulationError("compiling the emulator runtime failed:\n" + "\n".join(failures))
        library = staging / name
        objects = [str(staging / f"{s.stem}.o") for s in sources]
        flags = [f for f in chain.flags if not f.startswith("-I") and f not in chain.include_dirs]
        _run_compiler([chain.cxx, *flags, *objects, *LINK_FLAGS, f"-Wl,-soname,{name}", "-o", str(library)],
                      "the emulator runtime")
        os.replace(library, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


@dataclass(frozen=True)
class BuiltModule:
    library: Path
    source: Path
    key: str
    checked: bool
    instrumented: bool = False


def instrument_flags(cxx: str) -> tuple[str, ...]:
    """INSTRUMENT_FLAGS, without function entry/exit hooks (nothing uses them)."""
    entry_exit = ("--param=tsan-instrument-func-entry-exit=0" if is_gcc(cxx)
                  else "-mllvm -tsan-instrument-func-entry-exit=0")
    return (*INSTRUMENT_FLAGS, *shlex.split(entry_exit))


def build(source: str, *, checked: bool = False, instrument: bool = False) -> BuiltModule:
    """Compile `source` (a kernel source starting with #include <fagen/prelude.cuh>) into a .so:
    the fast build, the checked one (sanitizers), or the instrumented one (racecheck, counters)."""
    if checked and instrument:
        raise EmulationError("a module is built either checked (sanitizers) or instrumented (racecheck, "
                             "counters), not both")
    chain = toolchain(checked)
    runtime = runtime_library(chain)
    opt = instrument_flags(chain.cxx) if instrument else (() if checked else (kernel_opt(),))
    digest = hashlib.sha256()
    digest.update(chain.key.encode())
    digest.update(" ".join(opt).encode())
    digest.update(_headers_digest().encode())
    digest.update(runtime.name.encode())
    digest.update(source.encode())
    key = digest.hexdigest()[:32]
    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tag = "checked" if checked else "instrumented" if instrument else "fast"
    library = root / f"{key}-{tag}.so"
    source_path = root / f"{key}.cu"
    if not source_path.is_file():
        write_atomic(source_path, source.encode())
    if not library.is_file():
        _compile_module(chain, opt, source_path, runtime, root, key, library, separate_link=instrument)
        os.chmod(library, 0o777 & ~process_umask())  # as a linker's own output: not mkstemp's 0600
    return BuiltModule(library=library, source=source_path, key=key, checked=checked, instrumented=instrument)


def _compile_module(chain: Toolchain, opt, source_path: Path, runtime: Path, root: Path, key: str, library: Path,
                    separate_link: bool) -> None:
    """Compile and link one kernel module under a temporary name, then rename it into place.
    `separate_link`: the instrumented build compiles with -fsanitize=thread but must not link
    libtsan, so compiling and linking are two steps."""
    fd, tmp = tempfile.mkstemp(prefix=f"{key}-", suffix=".so.tmp", dir=root)
    os.close(fd)
    obj = tmp + ".o"
    try:
        what = f"kernel source {source_path.name}"
        link = [str(runtime), *LINK_FLAGS, "-Wl,-rpath,$ORIGIN", "-o", tmp]
        if separate_link:
            _run_compiler([chain.cxx, *chain.flags, *opt, "-c", "-x", "c++", str(source_path), "-o", obj], what)
            flags = [f for f in chain.flags if not f.startswith("-I") and f not in chain.include_dirs]
            _run_compiler([chain.cxx, *flags, obj, *link], what)
        else:
            _run_compiler([chain.cxx, *chain.flags, *opt, "-x", "c++", str(source_path), "-x", "none", *link], what)
        os.replace(tmp, library)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)

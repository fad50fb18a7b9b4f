"""Load an emulated kernel module and launch its kernels, CuPy-style.

    module = load_module(source)
    fn = module.get_function("my_kernel")
    fn((blocks_x, blocks_y, 1), (128, 1, 1), (q, out, np.int32(n), np.float32(scale)), shared_mem=bytes)

`args` follows the kernel's parameters in order: a CPU torch tensor (or None,
a null pointer) for each pointer, and a NumPy scalar of exactly the
parameter's C type for each scalar (np.int32 for int, np.uint32 for unsigned,
np.int64 for long long, np.uint64 for unsigned long long, np.float32 for
float). The signature is checked before the launch, including the dtype a
pointer points to, since a wrong scalar type silently garbles a GPU launch.

Environment (read at each launch; fagen/emulate/README.md lists the build ones):
    FAGEN_EMULATE_THREADS   OS threads that run blocks in parallel (default: all CPUs)
    FAGEN_EMULATE_SCHEDULE  the order in which a block's threads take turns: "forward"
                            (default) or "reverse" (thread by thread: warps advance in
                            lockstep), "warp-serial" or "warp-serial-reverse" (one warp
                            runs a whole barrier interval before the next), "producer-first"
                            or "consumer-first" (warpgroup 0, or the others, whenever they
                            can run), "random" (a seeded random warp at a time)
    FAGEN_EMULATE_SEED      the random schedule's seed (default 0)
    FAGEN_EMULATE_BLOCK_ORDER "forward" (default) or "reverse": the order blocks are taken
                            in (with one OS thread, the order they run in)
    FAGEN_EMULATE_BLOCK_INTERLEAVE "parallel" (default) or "serial": blocks run concurrently,
                            or one at a time until it exits or parks on a semaphore
                            (deterministic order of the blocks' global writes)
    FAGEN_EMULATE_RACECHECK "1" (or "lenient"): modules are built instrumented and every
                            launch is race-checked (also read by load_module)
    FAGEN_EMULATE_STACK_KB  stack per emulated thread (default 256 KiB, 1 MiB checked)
"""

from __future__ import annotations

import threading

import torch

from . import abi, instrumentation
from .build import BuiltModule, build
from .checked import CheckedModule
from .errors import EmulationError
from .launch_args import (block_interleave, block_order, dim3, dtype_code, os_threads, racecheck_flags, schedule,
                          schedule_seed)


class EmulatedFunction:
    """One kernel of an emulated module: call it like a CuPy RawKernel."""

    def __init__(self, module: "EmulatedModule", name: str, launcher, parameters: list[abi.Parameter]):
        self.module = module
        self.name = name
        self._launcher = launcher
        self.parameters = parameters
        self.parameter_names: list[str] = []  # set by fagen.kernels.launch: counter reports name tensors by them

    def convert(self, args) -> list:
        """ctypes values for `args`, after checking each against its parameter."""
        args = tuple(args)
        if len(args) != len(self.parameters):
            raise EmulationError(f"{self.name} takes {len(self.parameters)} arguments "
                                 f"({', '.join(p.c_type for p in self.parameters)}), got {len(args)}")
        values = []
        try:
            for parameter, value in zip(self.parameters, args):
                if value is None:
                    values.append(parameter.pointer(None, None, self.name))
                elif isinstance(value, torch.Tensor):
                    if value.device.type != "cpu":
                        raise EmulationError(f"{parameter.where(self.name)}: the emulator runs on CPU tensors, "
                                             f"got one on {value.device}")
                    values.append(parameter.pointer(dtype_code(value.dtype), value.data_ptr(), self.name))
                else:
                    values.append(parameter.scalar(value, self.name))
        except abi.ArgumentError as error:
            raise EmulationError(str(error)) from None
        return values

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        grid, block = dim3(grid, "grid"), dim3(block, "block")
        if int(shared_mem) < 0:
            raise EmulationError(f"{self.name}: shared_mem must be >= 0, got {shared_mem}")
        args = tuple(args)
        values = self.convert(args)
        flags = self.module.instrument_flags()
        if not flags:
            error = abi.launch(self._launcher, grid, block, int(shared_mem), os_threads(), schedule(), values,
                               block_order=block_order(), seed=schedule_seed(), block_interleave=block_interleave())
            if error is not None:
                raise EmulationError(error)
            return
        tensors, indices = instrumentation.tensor_ranges(self.parameters, args)
        counters = abi.LaunchCounters()
        error = abi.launch(self._launcher, grid, block, int(shared_mem), os_threads(), schedule(), values,
                           instrument=flags, tensors=tensors, counters=counters, block_order=block_order(),
                           seed=schedule_seed(), block_interleave=block_interleave())
        if error is not None:
            raise instrumentation.launch_error(error, self.module.library_path, self.module.source_path)
        if flags & abi.INSTRUMENT_COUNTERS:
            names = dict(enumerate(self.parameter_names)) if self.parameter_names else {}
            instrumentation.record(instrumentation.report_of(self.name, grid, block, counters, tensors, indices,
                                                             names))

    def __repr__(self) -> str:
        params = ", ".join(p.c_type for p in self.parameters)
        return f"<EmulatedFunction {self.name}({params})>"


class EmulatedModule:
    """A kernel source compiled for the host, loaded into this process."""

    def __init__(self, built: BuiltModule, racecheck: int = 0, counters: bool = False):
        self.built = built
        self.library_path = built.library
        self.source_path = built.source
        self.racecheck = racecheck  # instrument flags asked for at load (FAGEN_EMULATE_RACECHECK adds to them)
        self.counters = counters
        try:
            self._library = abi.Library(str(built.library))
        except abi.ArgumentError as error:
            raise EmulationError(str(error)) from None
        self._functions: dict[str, EmulatedFunction] = {}

    def instrument_flags(self) -> int:
        """What this launch instruments: nothing unless the module is instrumented."""
        if not self.built.instrumented:
            return 0
        flags = self.racecheck | racecheck_flags()
        if self.counters or instrumentation.collecting():
            flags |= abi.INSTRUMENT_COUNTERS
        return flags

    @property
    def kernel_names(self) -> list[str]:
        return self._library.kernel_names()

    def get_function(self, name: str) -> EmulatedFunction:
        if name not in self._functions:
            found = self._library.kernel(name)
            if found is None:
                known = ", ".join(self.kernel_names) or "none"
                raise EmulationError(f"no kernel {name!r} in {self.source_path.name} (kernels with "
                                     f"FAGEN_EXPORT: {known})")
            self._functions[name] = EmulatedFunction(self, name, *found)
        return self._functions[name]


_modules: dict[tuple, object] = {}
_modules_lock = threading.Lock()


def load_module(source: str, *, checked: bool = False, racecheck: bool | None = None, counters: bool = False):
    """Compile (or fetch from the cache) and load a kernel source for the emulator.

    checked=True builds with AddressSanitizer and UBSan and runs every launch
    in a helper process (fagen/emulate/checked.py): slower, but out-of-bounds
    accesses are reported as EmulationError instead of going unnoticed.

    racecheck=True (or FAGEN_EMULATE_RACECHECK=1; None follows it) builds the
    module instrumented and race-checks every launch: a hazard raises RaceError.
    counters=True collects counters for every launch (see
    `fagen.emulate.collect_counters`); an instrumented module also collects
    them inside a collect_counters() block.
    """
    flags = racecheck_flags() if racecheck is None else (abi.INSTRUMENT_RACECHECK if racecheck else 0)
    instrument = bool(flags) or counters
    if checked and instrument:
        raise EmulationError("racecheck and counters need the instrumented build, not the checked one: "
                             "unset FAGEN_EMULATE_CHECKED or FAGEN_EMULATE_RACECHECK")
    built = build(source, checked=checked, instrument=instrument)
    key = (built.library, flags, counters)
    with _modules_lock:
        module = _modules.get(key)
        if module is None:
            module = CheckedModule(built) if checked else EmulatedModule(built, racecheck=flags, counters=counters)
            _modules[key] = module
        return module

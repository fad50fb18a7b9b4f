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
    FAGEN_EMULATE_SCHEDULE  "forward" (default) or "reverse": the order in
                            which a block's threads take turns; running a test
                            both ways exposes a missing barrier in either direction
    FAGEN_EMULATE_STACK_KB  stack per emulated thread (default 256 KiB, 1 MiB checked)
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from . import abi
from .build import BuiltModule, build
from .checked import CheckedModule
from .errors import EmulationError
from .launch_args import dim3, dtype_code, os_threads, schedule


class EmulatedFunction:
    """One kernel of an emulated module: call it like a CuPy RawKernel."""

    def __init__(self, module: "EmulatedModule", name: str, launcher, parameters: list[abi.Parameter]):
        self.module = module
        self.name = name
        self._launcher = launcher
        self.parameters = parameters

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
        values = self.convert(args)
        error = abi.launch(self._launcher, grid, block, int(shared_mem), os_threads(), schedule(), values)
        if error is not None:
            raise EmulationError(error)

    def __repr__(self) -> str:
        params = ", ".join(p.c_type for p in self.parameters)
        return f"<EmulatedFunction {self.name}({params})>"


class EmulatedModule:
    """A kernel source compiled for the host, loaded into this process."""

    def __init__(self, built: BuiltModule):
        self.built = built
        self.library_path = built.library
        self.source_path = built.source
        try:
            self._library = abi.Library(str(built.library))
        except abi.ArgumentError as error:
            raise EmulationError(str(error)) from None
        self._functions: dict[str, EmulatedFunction] = {}

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


_modules: dict[Path, object] = {}
_modules_lock = threading.Lock()


def load_module(source: str, *, checked: bool = False):
    """Compile (or fetch from the cache) and load a kernel source for the emulator.

    checked=True builds with AddressSanitizer and UBSan and runs every launch
    in a helper process (fagen/emulate/checked.py): slower, but out-of-bounds
    accesses are reported as EmulationError instead of going unnoticed.
    """
    built = build(source, checked=checked)
    with _modules_lock:
        module = _modules.get(built.library)
        if module is None:
            if checked:
                module = CheckedModule(built)
            else:
                module = EmulatedModule(built)
            _modules[built.library] = module
        return module

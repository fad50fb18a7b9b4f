"""Run the generated CUDA source on the CPU: a SIMT emulator.

The kernel source itself is compiled with the host C++ compiler against a
small runtime (fagen/emulate/include, fagen/emulate/src) in which every CUDA
thread is a fiber, a block's threads take turns on one OS thread, and barriers,
warp shuffles and the tensor-core / ldmatrix / cp.async wrappers are warp- or
block-wide rendezvous with the PTX ISA's fragment layouts. Faults (a barrier
not reached by every thread, a warp-collective op called by part of a warp,
out-of-bounds accesses in a checked build) raise EmulationError; racecheck's
hazards (an instrumented build) raise RaceError.

    module = load_module(source)                      # cached build of the .so
    module.get_function(name)(grid, block, args, shared_mem=nbytes)

The call is CuPy's RawKernel convention; importing this package registers it as
fagen.kernels.launch's backend for CPU tensors (`import fagen` does).
fagen/emulate/README.md describes the runtime contract.
"""

from .errors import EmulationError, RaceError
from .instrumentation import LaunchReport, collect_counters, collecting as _collecting
from .module import EmulatedFunction, EmulatedModule, load_module
from .poison import assert_written, poison_, unwritten_mask
from ..kernels import launch as _launch

# The launcher (below this package) never imports it: it is told here where CPU tensors' kernels run.
_launch.register_emulator(load_module, _collecting)

__all__ = [
    "EmulationError",
    "EmulatedFunction",
    "EmulatedModule",
    "LaunchReport",
    "RaceError",
    "collect_counters",
    "load_module",
    "poison_",
    "unwritten_mask",
    "assert_written",
]

"""What every emulated launch hands the runtime besides the kernel's own arguments.

The environment's OS thread count, thread schedule, block order and block interleave
(read at each launch), grid and block dimensions, and the dtype codes pointer
parameters are checked against. Shared by in-process launches (module.py) and checked ones in the
helper process (checked.py).
"""

from __future__ import annotations

import os

import torch

from ..kernels.launch import RACECHECK_ENV   # its name: the launcher reads it to pick the build
from . import abi
from .errors import EmulationError

THREADS_ENV = "FAGEN_EMULATE_THREADS"
SCHEDULE_ENV = "FAGEN_EMULATE_SCHEDULE"
# The Schedule enum of include/fagen_emulate/export.h.
SCHEDULES = {"forward": 0, "reverse": 1, "warp-serial": 2, "warp-serial-reverse": 3, "producer-first": 4,
             "consumer-first": 5, "random": 6}
SEED_ENV = "FAGEN_EMULATE_SEED"
BLOCK_ORDER_ENV = "FAGEN_EMULATE_BLOCK_ORDER"
# The BlockOrder enum of include/fagen_emulate/export.h.
BLOCK_ORDERS = {"forward": 0, "reverse": 1}
BLOCK_INTERLEAVE_ENV = "FAGEN_EMULATE_BLOCK_INTERLEAVE"
# The BlockInterleave enum of include/fagen_emulate/export.h.
BLOCK_INTERLEAVES = {"parallel": 0, "serial": 1}
RACECHECK_MODES = {"": 0, "0": 0, "1": abi.INSTRUMENT_RACECHECK,
                   "lenient": abi.INSTRUMENT_RACECHECK | abi.INSTRUMENT_LENIENT_WARP}


def os_threads() -> int:
    text = os.environ.get(THREADS_ENV)
    if not text:
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise EmulationError(f"{THREADS_ENV}={text!r}: expected a positive integer")
    return value


def schedule() -> int:
    text = os.environ.get(SCHEDULE_ENV, "forward")
    if text not in SCHEDULES:
        raise EmulationError(f"{SCHEDULE_ENV}={text!r}: expected one of {', '.join(SCHEDULES)}")
    return SCHEDULES[text]


def schedule_seed() -> int:
    """FAGEN_EMULATE_SEED: the random schedule's seed, an unsigned 64-bit integer (default 0)."""
    text = os.environ.get(SEED_ENV, "0")
    try:
        value = int(text, 0)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise EmulationError(f"{SEED_ENV}={text!r}: expected an integer in [0, 2**64)")
    return value


def block_order() -> int:
    text = os.environ.get(BLOCK_ORDER_ENV, "forward")
    if text not in BLOCK_ORDERS:
        raise EmulationError(f"{BLOCK_ORDER_ENV}={text!r}: expected one of {', '.join(BLOCK_ORDERS)}")
    return BLOCK_ORDERS[text]


def block_interleave() -> int:
    """FAGEN_EMULATE_BLOCK_INTERLEAVE: `parallel` (default: blocks run concurrently on the OS threads)
    or `serial` (one block at a time, until it exits or parks on a semaphore; then the first parked
    block in dispatch order whose awaited value is there, else the next block: the order of global
    writes is a function of the program alone)."""
    text = os.environ.get(BLOCK_INTERLEAVE_ENV, "parallel")
    if text not in BLOCK_INTERLEAVES:
        raise EmulationError(f"{BLOCK_INTERLEAVE_ENV}={text!r}: expected one of {', '.join(BLOCK_INTERLEAVES)}")
    return BLOCK_INTERLEAVES[text]


def dim3(value, what: str) -> tuple[int, int, int]:
    """A grid or block as (x, y, z); the runtime checks them against CUDA's limits."""
    try:
        return abi.dim3(value, what)
    except abi.ArgumentError as error:
        raise EmulationError(str(error)) from None


def dtype_code(dtype: torch.dtype) -> str:
    return abi.DTYPE_CODES.get(str(dtype).removeprefix("torch."), str(dtype))


def racecheck_flags() -> int:
    """FAGEN_EMULATE_RACECHECK as instrument flags: 1 checks; `lenient` also lets warp-collective
    ops order the lanes of a warp (they do not on Volta and later, so the default reports it)."""
    text = os.environ.get(RACECHECK_ENV, "")
    if text not in RACECHECK_MODES:
        raise EmulationError(f"{RACECHECK_ENV}={text!r}: expected 0, 1 or lenient")
    return RACECHECK_MODES[text]

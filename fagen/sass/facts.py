"""Whole-kernel facts from a SASS listing (the static tests' checks): how many tensor-core ops,
how many of them sit inside a loop, ldmatrix and 128-bit global accesses. `report.py` measures the
main loop's steady state instead; both read listings through `listing.parse_listing`.

Also the per-arch resource limits a report is checked against (`ArchLimits`, `limit_problems`):
Hopper's registers per thread, register file, `setmaxnreg` range and shared memory per block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .listing import Instruction, parse_listing


@dataclass(frozen=True)
class SassReport:
    """What the machine code of one kernel does, counted from `cuobjdump -sass`."""

    kernel: str
    tensor_core_ops: int      # HMMA
    tensor_core_in_loop: int  # HMMA inside a backward branch's range (a loop body)
    ldmatrix_ops: int         # LDSM
    global_loads_128: int     # 16-byte global loads, plain (LDG.128) or async to shared (LDGSTS.128)
    global_stores_128: int    # STG.128


def sass_reports(sass: str) -> dict[str, SassReport]:
    """Per-kernel instruction facts from a cubin's SASS listing."""
    return {name: _sass_report(name, instrs) for name, instrs in parse_listing(sass).items()}


def _sass_report(name: str, instrs: list[Instruction]) -> SassReport:
    # A loop body: the range a backward branch jumps over (its target below its own address).
    loops = [(i.target, i.address) for i in instrs if i.base == "BRA" and i.target is not None and i.target < i.address]

    def in_loop(addr):
        return any(start <= addr <= end for start, end in loops)

    hmma = [i.address for i in instrs if i.base == "HMMA"]
    text = [f"{i.opcode} {i.operands}" for i in instrs]
    return SassReport(
        kernel=name,
        tensor_core_ops=len(hmma),
        tensor_core_in_loop=sum(1 for addr in hmma if in_loop(addr)),
        ldmatrix_ops=sum(1 for i in instrs if i.base == "LDSM"),
        global_loads_128=sum(1 for t in text if re.search(r"\bLDG(STS)?\.[A-Z0-9.]*128\b", t)),
        global_stores_128=sum(1 for t in text if re.search(r"\bSTG\.[A-Z0-9.]*128\b", t)),
    )


# -- per-arch resource limits ----------------------------------------------------------------------

# Per-SM resources (CUDA C Programming Guide, "Technical Specifications per Compute Capability"),
# for occupancy (report.occupancy).
SM_LIMITS = {   # arch: (shared bytes per SM usable by blocks, registers, max warps, max blocks)
    "sm_80": (167936, 65536, 64, 32), "sm_86": (102400, 65536, 48, 16), "sm_87": (167936, 65536, 48, 16),
    "sm_89": (102400, 65536, 48, 24), "sm_90": (233472, 65536, 64, 32),
}
SHARED_RESERVED_PER_BLOCK = 1024   # the driver's per-block reservation on sm_80 and later
WARPGROUP_THREADS = 128


@dataclass(frozen=True)
class ArchLimits:
    """Per-thread, per-SM and per-block limits (CUDA C Programming Guide, "Technical Specifications
    per Compute Capability"; PTX ISA, `setmaxnreg`)."""

    arch: str
    registers_per_thread: int
    register_file: int                 # 32-bit registers per SM
    shared_per_block: int              # bytes a block may use (opt-in maximum), dynamic + static
    setmaxnreg: range | None = None    # the counts `setmaxnreg` accepts (None: no setmaxnreg)


# 227 KB a block: sm_90's 228 KB per SM less the driver's 1 KB per-block reservation.
SM90A = ArchLimits("sm_90a", registers_per_thread=255, register_file=64 * 1024, shared_per_block=227 * 1024,
                   setmaxnreg=range(24, 256 + 1, 8))
# sm_90 is the same chip: its limits are sm_90a's (setmaxnreg is sm_90a's only, and an sm_90 cubin has none).
ARCH_LIMITS = {"sm_90": SM90A, "sm_90a": SM90A}


def limit_problems(limits: ArchLimits, *, registers: int | None = None, shared_bytes: int | None = None,
                   setmaxnreg: tuple[int, ...] = (), budgets: tuple[tuple[int, int], ...] = ()) -> list[str]:
    """What a kernel asks beyond `limits`, in words (empty: nothing). `registers` per thread at
    launch, `shared_bytes` per block, every `setmaxnreg` value, and `budgets`: (registers per
    thread, warpgroups) for each setting the block's warpgroups run under at once, whose sum
    must fit the register file."""
    problems = []
    if registers is not None and registers > limits.registers_per_thread:
        problems.append(f"{registers} registers per thread > {limits.registers_per_thread}")
    if shared_bytes is not None and shared_bytes > limits.shared_per_block:
        problems.append(f"{shared_bytes} bytes of shared memory per block > {limits.shared_per_block}")
    for value in setmaxnreg:
        allowed = limits.setmaxnreg
        if allowed is None:
            problems.append(f"setmaxnreg {value} on {limits.arch}, which has none")
        elif value not in allowed:
            problems.append(f"setmaxnreg {value} outside {allowed.start}..{allowed.stop - 1} in steps of "
                            f"{allowed.step}")
    total = sum(value * warpgroups * WARPGROUP_THREADS for value, warpgroups in budgets)
    if total > limits.register_file:
        parts = " + ".join(f"{value} x {warpgroups * WARPGROUP_THREADS}" for value, warpgroups in budgets)
        problems.append(f"register budgets {parts} = {total} > the register file's {limits.register_file}")
    return problems

"""Whole-kernel facts from a SASS listing (the static tests' checks): how many tensor-core ops,
how many of them sit inside a loop, ldmatrix and 128-bit global accesses. `report.py` measures the
main loop's steady state instead; both read listings through `listing.parse_listing`."""

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

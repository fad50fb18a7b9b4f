"""SASS listings: `cuobjdump -sass` text as functions of instructions.

An instruction keeps what the loop analysis needs: its address, its guard predicate
(`@P0`, `@!P1`, `@PT`, `@!PT`), its opcode with modifiers (`HMMA.16816.F32`), the base
opcode (`HMMA`) and, for a direct branch, its target address. The listing comes from
`cuobjdump -sass` (PATH, or the nvidia-cuda-cuobjdump wheel): no GPU needed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_FUNCTION = re.compile(r"Function : (\S+)")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_GUARD = re.compile(r"^@(!?U?P(?:T|\d+))\s+")
_TARGET = re.compile(r"(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)\b")

# Opcodes with a target address in the operand. A CALL also falls through (it returns), but
# ptxas uses `@P CALL.REL.NOINC` as a loop break too, so its target is an edge as well.
TARGETED = frozenset({"BRA", "JMP", "CALL"})
ENDS_PATH = frozenset({"EXIT", "RET", "BRX", "JMX", "KILL", "BPT"})
# A branch with one of these modifiers decides by the warp's state, guard or not, and may fall
# through: BRA.DIV (to ptxas's collective fallback when the warp is not converged, before an
# ELECT or a uniform-datapath instruction), BRA.CONV, and BRA.ANY / .ALL (by a vote).
WARP_CONDITIONAL = frozenset({"DIV", "CONV", "ANY", "ALL"})


@dataclass(frozen=True)
class Instruction:
    address: int
    guard: str | None     # "P0", "!P1", "PT", "!PT" (never executes, still issued), or None
    opcode: str           # with modifiers, e.g. "HMMA.16816.F32"
    operands: str
    target: int | None    # a direct branch's target

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def always(self) -> bool:
        """Executes whenever reached (no guard, or @PT)."""
        return self.guard in (None, "PT")

    @property
    def never(self) -> bool:
        return self.guard == "!PT"

    @property
    def is_branch(self) -> bool:
        return self.target is not None

    @property
    def ends_path(self) -> bool:
        """Control never falls through past it: an unguarded exit, return or branch."""
        if not self.always:
            return False
        if self.base == "BRA":
            return not WARP_CONDITIONAL.intersection(self.opcode.split(".")[1:])
        return self.base in ENDS_PATH or self.base == "JMP"

    @property
    def guard_may_fail(self) -> bool:
        return not self.always

    def __str__(self) -> str:
        guard = f"@{self.guard} " if self.guard else ""
        return f"/*{self.address:04x}*/ {guard}{self.opcode} {self.operands}".rstrip()


def parse_instruction(address: int, text: str) -> Instruction:
    guard = None
    if m := _GUARD.match(text):
        guard, text = m.group(1), text[m.end():]
    opcode, _, operands = text.partition(" ")
    target = None
    if opcode.split(".", 1)[0] in TARGETED and (m := _TARGET.search(operands)):
        target = int(m.group(1), 16)
    return Instruction(address, guard, opcode, operands.strip(), target)


def parse_listing(sass: str) -> dict[str, list[Instruction]]:
    """{function name: its instructions in address order} of a `cuobjdump -sass` listing."""
    functions: dict[str, list[Instruction]] = {}
    current = None
    for line in sass.splitlines():
        if m := _FUNCTION.search(line):
            current = functions.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.search(line)):
            current.append(parse_instruction(int(m.group(1), 16), m.group(2)))
    return functions


class SassError(RuntimeError):
    """cuobjdump is missing, or refused a cubin."""


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH or from the nvidia-cuda-cuobjdump wheel, if installed."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import cuda.pathfinder as pathfinder

        return pathfinder.find_nvidia_binary_utility("cuobjdump")
    except Exception:  # noqa: BLE001 - optional tool
        return None


def disassemble(*cubins: bytes) -> str:
    """SASS text of cubins, one listing after the other (a source's translation units:
    `CompiledKernel.cubins`). Needs cuobjdump and nvdisasm, e.g. from PyPI wheels."""
    tool = find_cuobjdump()
    if tool is None:
        raise SassError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    env = dict(os.environ)
    env["PATH"] = str(Path(tool).parent) + os.pathsep + env.get("PATH", "")
    listings = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, cubin in enumerate(cubins):
            path = Path(tmp) / f"unit{index}.cubin"
            path.write_bytes(cubin)
            result = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, env=env)
            if result.returncode != 0:
                raise SassError(f"cuobjdump failed: {result.stderr.strip()}")
            listings.append(result.stdout)
    return "".join(listings)

"""The roles of a warp-specialised kernel: one loop per role, each read in its steady state.

A warp-specialised Hopper kernel (FlashAttention-3's: one producer warpgroup, two or three
consumer warpgroups) splits its warpgroups by role, and each role runs a loop of its own.
The main loop (report.py) is the consumer's; this module finds the others and reads each
one's steady-state iteration (steady_state.py), and which `setmaxnreg` each role runs under.

**Which loop is which role.**
- consumer: the main loop, the loop with the most tensor work (HMMA, HGMMA) of its own,
  the innermost on a tie (report.py's rule, unchanged).
- producer: a loop that issues loads and mbarrier ops (SYNCS, ARRIVES) with no tensor work
  in it nor in any loop around it. Its loads are its copies into shared memory (UTMALDG,
  LDGSTS) where it has any, else its LDG (a producer that stages through registers).
- writer: a loop that issues bulk writes from shared memory (UBLKRED, UTMASTG, UTMAREDG),
  with no tensor work in it nor around it: FlashAttention-3 backward's dQ writer warp.
Of a role's loops, the innermost ones (no loop nested in it qualifies too): the producer's
per-tile loop nests the per-K/V-block loop, whose iteration is the steady state. Among
several innermost ones, the most of the role's instructions in its body, then the lowest
address. A kernel with no producer loop is not warp-specialised: it has no roles.

**A role's iteration** is found as the main loop's is, with the role's own instructions
(`ROLE_OPCODES`) preferred (steady_state's `prefer`): a load issued by one elected thread
sits behind a branch the cheapest path would skip.

**setmaxnreg.** Each `USETMAXREG` sets the registers per thread of the warpgroups that run
it: TRY_ALLOC raises the count (it retries until the pool has them), DEALLOC lowers it.
A role runs under the setting nearest above its loop's header in the dominator tree (the
last one on every path to the loop); a setting reaches every role whose loop it so governs.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from .cfg import Graph, Loop
from .classes import CLASSES, TENSOR_CLASSES, tensor_equivalents
from .steady_state import Iteration, steady_iteration

SHARED_LOADS = frozenset({"UTMALDG", "LDGSTS"})
REGISTER_LOADS = frozenset({"LDG"})
MBARRIER = frozenset({"SYNCS", "ARRIVES"})
BULK_WRITES = frozenset({"UBLKRED", "UTMASTG", "UTMAREDG"})
# What a role's report names by opcode (its classes lump them into memory and control).
ROLE_WORK = SHARED_LOADS | REGISTER_LOADS | MBARRIER | BULK_WRITES | {"UBLKCP"}
_IMMEDIATE = re.compile(r"(0x[0-9a-fA-F]+|\d+)\s*$")


@dataclass
class RoleLoop:
    """One role's loop: one steady-state iteration of it, per warp."""

    role: str
    loop_address: int
    counts: Counter                     # instruction class -> per iteration
    tensor_ops: float                   # HMMA-equivalents per iteration
    opcodes: Counter = field(default_factory=Counter)
    registers: int | None = None        # the setmaxnreg it runs under, if any

    @property
    def instructions(self) -> int:
        return sum(self.counts.values())

    @property
    def non_tensor(self) -> int:
        return self.instructions - sum(self.counts.get(c, 0) for c in TENSOR_CLASSES)

    @property
    def non_tensor_per_tensor_op(self) -> float | None:
        return self.non_tensor / self.tensor_ops if self.tensor_ops else None

    @property
    def work(self) -> Counter:
        """Its loads, mbarrier ops and bulk writes per iteration, by base opcode."""
        work = Counter()
        for opcode, n in self.opcodes.items():
            if opcode.split(".", 1)[0] in ROLE_WORK:
                work[opcode.split(".", 1)[0]] += n
        return work

    def to_json(self) -> dict:
        return {"loop": f"{self.loop_address:#06x}", "instructions": self.instructions,
                "tensor_ops": self.tensor_ops, "non_tensor_per_tensor_op": self.non_tensor_per_tensor_op,
                "setmaxnreg": self.registers, "work": dict(self.work), **{c: self.counts.get(c, 0) for c in CLASSES}}


@dataclass(frozen=True)
class RegisterSetting:
    """One `USETMAXREG`: the registers per thread after it, and the roles that run under it."""

    address: int
    registers: int
    kind: str                 # "alloc" (TRY_ALLOC: raise) or "dealloc" (lower)
    roles: tuple[str, ...]

    def to_json(self) -> dict:
        return {"address": f"{self.address:#06x}", "registers": self.registers, "kind": self.kind,
                "roles": list(self.roles)}


def _body_instructions(graph: Graph, loop: Loop):
    return (i for b in loop.body for i in graph.blocks[b].instructions if not i.never)


def _holds(graph: Graph, loop: Loop, bases: frozenset[str]) -> int:
    return sum(1 for i in _body_instructions(graph, loop) if i.base in bases)


def _tensor_free(graph: Graph, loop: Loop) -> bool:
    """No tensor work in the loop nor in any loop around it (a copy loop nested in a
    consumer's loop is the consumer's)."""
    while loop is not None:
        if any(tensor_equivalents(i) for i in _body_instructions(graph, loop)):
            return False
        loop = loop.parent
    return True


def _producer_loads(graph: Graph, loop: Loop) -> frozenset[str]:
    """The loads that make this loop a producer's, or nothing."""
    if not _holds(graph, loop, MBARRIER):
        return frozenset()
    return SHARED_LOADS if _holds(graph, loop, SHARED_LOADS) else (
        REGISTER_LOADS if _holds(graph, loop, REGISTER_LOADS) else frozenset())


def _role_loop(graph: Graph, qualifies) -> tuple[Loop, frozenset[str]] | None:
    """The innermost loop `qualifies` (loop -> the role's opcodes, empty if not the role's);
    among several, the most of those opcodes, then the lowest address."""
    found = {loop: ops for loop in graph.loops if _tensor_free(graph, loop) and (ops := qualifies(loop))}
    innermost = [loop for loop in found if not any(child in found for child in _descendants(loop))]
    if not innermost:
        return None
    best = min(innermost, key=lambda loop: (-_holds(graph, loop, found[loop]), graph.blocks[loop.header].start))
    return best, found[best]


def _descendants(loop: Loop):
    for child in loop.children:
        yield child
        yield from _descendants(child)


def _role(graph: Graph, role: str, loop: Loop, iteration: Iteration) -> RoleLoop:
    by_start = {block.start: block for block in graph.blocks}
    opcodes = Counter()
    for start, times in iteration.visits.items():
        for instruction in by_start[start].instructions:
            opcodes[instruction.opcode] += times
    return RoleLoop(role, graph.blocks[loop.header].start, iteration.counts, iteration.tensor_ops, opcodes)


def find_roles(graph: Graph, main: Loop, main_iteration: Iteration) -> dict[str, RoleLoop]:
    """{role: its loop} of a warp-specialised kernel whose main loop is `main`; {} when the
    kernel has no producer loop."""
    producer = _role_loop(graph, lambda loop: _producer_loads(graph, loop))
    if producer is None:
        return {}
    roles = {"consumer": _role(graph, "consumer", main, main_iteration)}
    writer = _role_loop(graph, lambda loop: BULK_WRITES if _holds(graph, loop, BULK_WRITES) else frozenset())
    for role, found in (("producer", producer), ("writer", writer)):
        if found is not None:
            loop, opcodes = found
            roles[role] = _role(graph, role, *_readable_iteration(graph, loop, opcodes))
    return roles


def _readable_iteration(graph: Graph, loop: Loop, opcodes: frozenset[str]) -> tuple[Loop, Iteration]:
    """`loop` and its steady-state iteration; where the walk cannot read it, the loop around it.
    ptxas wraps a uniform-datapath instruction whose operands a warp's lanes may not share (a bulk
    reduction's addresses, say) in a loop of its own (`ELECT` ... `BRA.U.ANY`, once per distinct
    value) whose exit is its only way on: that loop is part of an iteration of the one around it."""
    while True:
        try:
            return loop, steady_iteration(graph, loop, prefer=opcodes)
        except ValueError:
            if loop.parent is None:
                raise
            loop = loop.parent


def register_settings(graph: Graph, roles: dict[str, RoleLoop]) -> list[RegisterSetting]:
    """Every USETMAXREG of the function, with the roles that run under it; each role's
    `registers` is set to its setting's."""
    placed = [(block, i) for block in graph.blocks for i in block.instructions
              if i.base == "USETMAXREG" and not i.never]
    governs: dict[int, list[str]] = {i.address: [] for _, i in placed}
    header_of = {block.start: block.index for block in graph.blocks}
    for role in roles.values():
        header = header_of[role.loop_address]
        above = [(block, i) for block, i in placed if block.index in graph.dominators[header]]
        if not above:
            continue
        # The nearest dominator has the most dominators of its own; in one block, the later one.
        block, nearest = max(above, key=lambda bi: (len(graph.dominators[bi[0].index]), bi[1].address))
        role.registers = _registers(nearest)
        governs[nearest.address].append(role.role)
    return [RegisterSetting(i.address, _registers(i), "dealloc" if "DEALLOC" in i.opcode else "alloc",
                            tuple(governs[i.address])) for _, i in placed]


def _registers(instruction) -> int:
    m = _IMMEDIATE.search(instruction.operands)
    if m is None:
        raise ValueError(f"a setmaxnreg without its register count: {instruction}")
    return int(m.group(1), 0)

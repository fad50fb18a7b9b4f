"""The overlap signature of a warpgroup loop: how many of its exp2 issue while a wgmma is in flight.

FlashAttention-3's point is that the softmax's exponentials run on the MUFU unit while the
tensor cores work on an asynchronous warpgroup GEMM. In SASS that shows as MUFU.EX2
instructions placed between the issue of an HGMMA group and the `WARPGROUP.DEPBAR` that
waits for it. The rule, over one steady-state iteration's instructions in the order they
issue (`steady_state.Iteration.path`):

- **Groups.** ptxas marks `wgmma.commit_group` on the last HGMMA of a group: the one that
  carries the `gsb0` operand. A group is the HGMMAs from the first HGMMA after the previous
  group's `gsb0` (or after the iteration's start) up to and including the next HGMMA with
  `gsb0`. An HGMMA is in flight from its issue; `WARPGROUP.ARRIVE` (wgmma.fence) starts
  nothing by itself.
- **Retiring.** `WARPGROUP.DEPBAR.LE gsb0, N` (wgmma.wait_group N) waits until at most N
  committed groups are pending, the oldest retiring first: `0x0` retires all, `0x1` leaves
  the newest in flight. An open group (HGMMAs whose `gsb0` has not issued yet) is not
  waited for (PTX waits on committed groups only) and stays in flight.
- **In flight.** A MUFU.EX2 is in flight when, as it issues, a committed group is pending or
  an open group holds an HGMMA.
- **Back edges.** What is in flight at the end of an iteration is in flight at the start of
  the next. The steady state starts from the state a long run settles in: starting from
  nothing in flight, the iteration is run again from the state it ends in until the start
  state repeats (MAX_RUNS at most); the run from that state is the one counted.
- Guards: an instruction on the steady-state path is taken as executed unless it is
  `@!PT` (never); the path already chose the full-tile branches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .classes import WARPGROUP_MMA
from .listing import Instruction

MAX_RUNS = 16
_WAIT = re.compile(r"gsb0\s*,\s*(0x[0-9a-fA-F]+|\d+)")


@dataclass(frozen=True)
class Overlap:
    exp2_in_flight: int   # MUFU.EX2 issued while a wgmma group is in flight
    exp2: int             # MUFU.EX2 in the iteration
    groups: int           # wgmma groups committed per iteration
    carried: int          # groups in flight as an iteration starts (carried over the back edge)

    def __str__(self) -> str:
        return f"{self.exp2_in_flight} of {self.exp2} exp2 in flight"

    def to_json(self) -> dict:
        return {"exp2_in_flight": self.exp2_in_flight, "exp2": self.exp2, "groups": self.groups,
                "carried_groups": self.carried}


@dataclass(frozen=True)
class _State:
    pending: int = 0   # committed groups not yet retired
    open: int = 0      # HGMMAs of the group being built (no gsb0 yet)


def _wait_depth(instruction: Instruction) -> int | None:
    """N of a `WARPGROUP.DEPBAR.LE gsb0, N`; None for any other instruction."""
    if instruction.opcode != "WARPGROUP.DEPBAR.LE":
        return None
    m = _WAIT.search(instruction.operands)
    if m is None:
        raise ValueError(f"a warpgroup wait without its group count: {instruction}")
    return int(m.group(1), 0)


def _run(instructions: list[Instruction], state: _State) -> tuple[_State, int, int, int]:
    """One iteration from `state`: the state it ends in, exp2 in flight, exp2, groups committed."""
    pending, open_, in_flight, exp2, groups = state.pending, state.open, 0, 0, 0
    for instruction in instructions:
        if instruction.never:
            continue
        if instruction.base in WARPGROUP_MMA:   # HGMMA, or fp8's QGMMA
            open_ += 1
            if re.search(r"\bgsb0\b", instruction.operands):
                pending, open_, groups = pending + 1, 0, groups + 1
        elif (depth := _wait_depth(instruction)) is not None:
            pending = min(pending, depth)
        elif instruction.opcode.startswith("MUFU.EX2"):
            exp2 += 1
            in_flight += pending > 0 or open_ > 0
    return _State(pending, open_), in_flight, exp2, groups


def exp2_overlap(instructions: list[Instruction]) -> Overlap:
    """The signature of one steady-state iteration (instructions in issue order), with the
    state carried over the back edge as the module's docstring defines it."""
    state, seen = _State(), set()
    for _ in range(MAX_RUNS):
        if state in seen:
            break
        seen.add(state)
        state = _run(instructions, state)[0]
    _, in_flight, exp2, groups = _run(instructions, state)
    return Overlap(in_flight, exp2, groups, state.pending + (state.open > 0))

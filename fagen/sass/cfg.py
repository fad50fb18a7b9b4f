"""The control-flow graph of one SASS function, its dominators and its natural loops.

Basic blocks start at the function's first instruction, at every branch target and after
every branch or path end. A natural loop is a back edge u -> h (h dominates u) with every
block that reaches u without passing through h; back edges with one header are one loop.
Loops nest by their bodies. A backward branch is not necessarily a loop: ptxas places
cold blocks (the next tile's copy, a mask) at lower addresses and jumps back to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .listing import Instruction


@dataclass
class Block:
    index: int
    instructions: list[Instruction]
    successors: list[int] = field(default_factory=list)
    predecessors: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.instructions[0].address


@dataclass(eq=False)   # loops are compared (and hashed) by identity
class Loop:
    header: int                 # block index
    latches: frozenset[int]     # sources of the back edges
    body: frozenset[int]        # blocks, the header and nested loops' blocks included
    parent: "Loop | None" = None
    children: list["Loop"] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1


@dataclass
class Graph:
    blocks: list[Block]
    dominators: list[frozenset[int]]
    loops: list[Loop]           # outermost first within each nest, by header address

    def loop_of_header(self, block: int) -> Loop | None:
        return next((loop for loop in self.loops if loop.header == block), None)


def _leaders(instructions: list[Instruction]) -> list[int]:
    addresses = {i.address for i in instructions}
    leaders = {instructions[0].address}
    for position, instruction in enumerate(instructions):
        ends = instruction.is_branch or instruction.base in ("EXIT", "RET", "BRX", "JMX")
        if instruction.is_branch and instruction.target in addresses and not instruction.never:
            leaders.add(instruction.target)
        if ends and position + 1 < len(instructions):
            leaders.add(instructions[position + 1].address)
    return sorted(leaders)


def build_blocks(instructions: list[Instruction]) -> list[Block]:
    leaders = _leaders(instructions)
    index_of = {address: n for n, address in enumerate(leaders)}
    blocks: list[Block] = []
    current: list[Instruction] = []
    for instruction in instructions:
        if instruction.address in index_of and current:
            blocks.append(Block(len(blocks), current))
            current = []
        current.append(instruction)
    if current:
        blocks.append(Block(len(blocks), current))
    for block in blocks:
        last = block.instructions[-1]
        falls_through = not last.ends_path
        if last.is_branch and not last.never and last.target in index_of:
            block.successors.append(index_of[last.target])
        if falls_through and block.index + 1 < len(blocks):
            block.successors.append(block.index + 1)
        block.successors = list(dict.fromkeys(block.successors))
    for block in blocks:
        for successor in block.successors:
            blocks[successor].predecessors.append(block.index)
    return blocks


def _reachable(blocks: list[Block]) -> list[int]:
    seen, order, stack = set(), [], [0]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(reversed(blocks[node].successors))
    return order


def dominators(blocks: list[Block]) -> list[frozenset[int]]:
    """dom[b]: the blocks on every path from the entry to b (unreachable blocks: all)."""
    reachable = _reachable(blocks)
    every = frozenset(reachable)
    dom = [every] * len(blocks)
    dom[0] = frozenset({0})
    changed = True
    while changed:
        changed = False
        for node in reachable[1:]:
            preds = [dom[p] for p in blocks[node].predecessors if p in every]
            new = frozenset({node}) | (frozenset.intersection(*preds) if preds else frozenset())
            if new != dom[node]:
                dom[node], changed = new, True
    return dom


def natural_loops(blocks: list[Block], dom: list[frozenset[int]]) -> list[Loop]:
    back_edges: dict[int, set[int]] = {}
    for block in blocks:
        for successor in block.successors:
            if successor in dom[block.index]:
                back_edges.setdefault(successor, set()).add(block.index)
    loops = []
    for header, latches in sorted(back_edges.items()):
        body, stack = {header}, list(latches)
        while stack:
            node = stack.pop()
            if node not in body:
                body.add(node)
                stack.extend(blocks[node].predecessors)
        loops.append(Loop(header, frozenset(latches), frozenset(body)))
    for loop in loops:   # the parent is the smallest loop strictly containing this one
        outer = [o for o in loops if o is not loop and loop.body < o.body]
        if outer:
            loop.parent = min(outer, key=lambda o: len(o.body))
            loop.parent.children.append(loop)
    return sorted(loops, key=lambda loop: (loop.depth, blocks[loop.header].start))


def build_graph(instructions: list[Instruction]) -> Graph:
    blocks = build_blocks(instructions)
    dom = dominators(blocks)
    return Graph(blocks, dom, natural_loops(blocks, dom))

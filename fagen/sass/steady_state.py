"""One steady-state iteration of a loop: which blocks it executes, and how often.

Inside a loop the paths differ: a tile that needs its mask applied, the last (ragged) tile,
the copy loop's remainder, the last iteration that prefetches nothing. The steady state is
an iteration in the middle of a long sequence, on full tiles. It is found as a path
through the loop's body, from its header to a back edge, with each nested loop collapsed
into one node that runs t times: a copy loop (one with LDGSTS) as often as step 1 needs
(1 <= t <= MAX_TRIPS), a loop with HMMA as often as `expected_hmma` needs (below), any
other loop once. The path is chosen in this order:

1. the path copies at least what one iteration must copy (`expected_ldgsts`, the tile
   bytes that the kernel's geometry says an iteration moves, in 16-byte LDGSTS per
   thread), and as closely as possible: so the next tile's prefetch is taken (with
   whatever copies ptxas predicated into the same block) and inner copy loops run at
   their trip counts;
2. then the most tensor-core work (HMMA-equivalents, `classes.tensor_equivalents`): the full
   matmul work of the iteration;
3. then the most copies done by the most unrolled nested loops (each trip of a nested copy
   loop weighs its LDGSTS per trip, squared), then the most copy loops entered: a copy
   loop whose trip count ptxas does not know gets a remainder (the trip count modulo the
   unroll factor, peeled or as a loop of one chunk per trip) in front of its unrolled
   body and a test that skips the body; on full tiles every tensor's copy body runs and
   no remainder is taken;
4. then the most stores and atomics (a full tile's guarded stores and atomics are all
   done). Loads are not counted: a mask that reads a captured tensor (document ids) reads it
   on partial tiles only, and the steady state is a full tile;
5. then the fewest instructions: no mask, no tail path.

Without an expected copy count, step 1 is left out. Nested loops' own iterations are
found the same way. A nested loop that holds HMMA (a loop over tasks with a run-time
trip count) runs as often as makes the iteration's HMMA `expected_hmma`, when that is
given (the kernel's own mma count per iteration); otherwise once.

A role's loop in a warp-specialised kernel (roles.py) names its own work, `prefer` (opcode
bases: a producer's loads): before step 2, the path issues as many of them as it can, so an
elected thread's guarded loads are taken; nested loops are read with the same preference.
Without `prefer` nothing changes. The iteration also keeps its blocks in the order they run
(`path`, nested loops repeated per trip): the overlap signature (overlap.py) reads it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .cfg import Graph, Loop
from .classes import classify, tensor_equivalents

MAX_TRIPS = 64
# Ranking keys carried in the counts, removed from the result: copies done by nested loops
# weighted by their loop's unrolling, copy loops entered, and the preferred opcodes issued.
NESTED_LDGSTS, COPY_LOOPS, STORES, TENSOR = "_nested_ldgsts", "_copy_loops", "_stores", "_tensor"
PREFERRED = "_preferred"
RANKING_KEYS = (NESTED_LDGSTS, COPY_LOOPS, STORES, TENSOR, PREFERRED)
# What step 4 counts: writes to memory, plain or atomic (shared, global, bulk).
STORE_OPCODES = frozenset({"STG", "ST", "STS", "STSM", "RED", "REDG", "REDAS", "ATOM", "ATOMG", "ATOMS", "UTMASTG"})


@dataclass(frozen=True)
class Iteration:
    counts: Counter   # instruction class -> instructions per iteration (per thread, i.e. per warp)
    visits: Counter   # block start address -> times the iteration runs it (nested loops included)
    trips: dict       # nested loop header address -> its trip count
    stores: int = 0   # its stores and atomics (step 4 of a loop that nests it)
    tensor_ops: float = 0.0   # its tensor-core work in HMMA-equivalents (classes.tensor_equivalents)
    path: tuple = ()          # block start addresses in the order the iteration runs them
    preferred: int = 0        # its instructions among `prefer`'s opcodes

    @property
    def instructions(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class _Path:
    counts: Counter
    visits: Counter
    trips: dict
    order: tuple = ()

    def then(self, other: "_Path") -> "_Path":
        return _Path(self.counts + other.counts, self.visits + other.visits, {**self.trips, **other.trips},
                     self.order + other.order)


def _rank(counts: Counter) -> tuple:
    """Steps 2-5 of the order above (smaller is better), a role's preferred opcodes first."""
    instructions = sum(v for k, v in counts.items() if k not in RANKING_KEYS)
    return (-counts[PREFERRED], -counts[TENSOR], -counts[NESTED_LDGSTS], -counts[COPY_LOOPS], -counts[STORES],
            instructions)


def steady_iteration(graph: Graph, loop: Loop, expected_ldgsts: int | None = None,
                     expected_hmma: int | None = None, prefer: frozenset[str] = frozenset()) -> Iteration:
    fixed = {child.header: 1 for child in loop.children if _holds_hmma(graph, child)}
    first = _best_path(graph, loop, expected_ldgsts, fixed, prefer)
    if expected_hmma is None or not fixed:
        return first
    inner = sum(steady_iteration(graph, child, prefer=prefer).tensor_ops
                for child in loop.children if child.header in fixed)
    outer = first.tensor_ops - inner
    trips = max(1, round((expected_hmma - outer) / inner)) if inner else 1
    return _best_path(graph, loop, expected_ldgsts, {header: trips for header in fixed}, prefer)


def _holds_hmma(graph: Graph, loop: Loop) -> bool:
    return any(tensor_equivalents(i) for b in loop.body for i in graph.blocks[b].instructions)


def _unit_map(loop: Loop) -> dict[int, object]:
    """Block -> the node it belongs to in this loop's DAG: itself, or the child loop holding it."""
    unit: dict[int, object] = {b: b for b in loop.body}
    for child in loop.children:
        for b in child.body:
            unit[b] = child
    return unit


def _topological(nodes, edges) -> list:
    order, seen = [], set()
    for root in nodes:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(edges.get(root, ())))]
        while stack:
            current, successors = stack[-1]
            for nxt in successors:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, iter(edges.get(nxt, ()))))
                    break
            else:
                stack.pop()
                order.append(current)
    return order[::-1]


def _dag(graph: Graph, loop: Loop):
    """The loop's body as a DAG of units (blocks, and nested loops as single nodes): its edges
    without the back edges, and the units that end an iteration (the latches)."""
    unit = _unit_map(loop)
    edges: dict[object, list] = {}
    latch_units = set()
    for b in loop.body:
        for s in graph.blocks[b].successors:
            if s not in loop.body:
                continue
            if s == loop.header and b in loop.latches:
                latch_units.add(unit[b])
            elif unit[b] is not unit[s] and unit[s] is not unit[loop.header]:
                edges.setdefault(unit[b], []).append(unit[s])
    return unit, edges, latch_units


def _best_path(graph: Graph, loop: Loop, expected_ldgsts: int | None, fixed_trips: dict[int, int],
               prefer: frozenset[str]) -> Iteration:
    unit, edges, latch_units = _dag(graph, loop)
    nodes = list(dict.fromkeys(unit.values()))
    order = _topological(nodes, edges)
    position = {node: n for n, node in enumerate(order)}
    inner_cache: dict[int, Iteration] = {}
    options_cache: dict[object, list[_Path]] = {}

    def options(node) -> list[_Path]:
        if node not in options_cache:
            options_cache[node] = _options(node)
        return options_cache[node]

    def _options(node) -> list[_Path]:
        if not isinstance(node, Loop):
            start = graph.blocks[node].start
            instructions = graph.blocks[node].instructions
            counts = Counter(classify(i) for i in instructions)
            counts[STORES] = sum(1 for i in instructions if i.base in STORE_OPCODES and not i.never)
            counts[TENSOR] = sum(tensor_equivalents(i) for i in instructions)
            counts[PREFERRED] = sum(1 for i in instructions if i.base in prefer and not i.never)
            return [_Path(counts, Counter({start: 1}), {}, (start,))]
        if node.header not in inner_cache:
            inner_cache[node.header] = steady_iteration(graph, node, prefer=prefer)
        inner = inner_cache[node.header]
        if node.header in fixed_trips:
            trip_counts = [fixed_trips[node.header]]
        elif inner.counts["LDGSTS"]:   # a copy loop: as often as the iteration's copies need
            trip_counts = range(1, MAX_TRIPS + 1)
        else:                          # nothing to pin its trip count: once
            trip_counts = [1]
        start, paths = graph.blocks[node.header].start, []
        for t in trip_counts:
            counts = Counter({k: v * t for k, v in inner.counts.items()})
            per_trip = inner.counts["LDGSTS"]
            counts[NESTED_LDGSTS], counts[COPY_LOOPS] = t * per_trip * per_trip, 1 if per_trip else 0
            counts[STORES], counts[TENSOR] = t * inner.stores, t * inner.tensor_ops
            counts[PREFERRED] = t * inner.preferred
            paths.append(_Path(counts, Counter({k: v * t for k, v in inner.visits.items()}),
                               {start: t, **inner.trips}, inner.path * t))
        return paths

    def bucket(path: _Path) -> int:
        return path.counts["LDGSTS"] if expected_ldgsts is not None else 0

    def keep(slot: dict[int, _Path], path: _Path) -> None:
        old = slot.get(bucket(path))
        if old is None or _rank(path.counts) < _rank(old.counts):
            slot[bucket(path)] = path

    # best[node][LDGSTS bucket]: the best path from the header through `node` (inclusive).
    best: dict[object, dict[int, _Path]] = {node: {} for node in nodes}
    header = unit[loop.header]
    for path in options(header):
        keep(best[header], path)
    for node in order:
        for nxt in edges.get(node, ()):
            if position[nxt] <= position[node]:
                continue   # an edge that would close a cycle (irreducible flow): not a path
            for path in list(best[node].values()):
                for more in options(nxt):
                    keep(best[nxt], path.then(more))
    finals = [path for node in latch_units for path in best[node].values()]
    if not finals:
        raise ValueError(f"loop at {graph.blocks[loop.header].start:#x}: no path from its header to a back edge")

    def final_key(path: _Path):
        c = path.counts
        if expected_ldgsts is None:
            return (-c["LDGSTS"], *_rank(c))
        return (c["LDGSTS"] < expected_ldgsts, abs(c["LDGSTS"] - expected_ldgsts), *_rank(c))

    chosen = min(finals, key=final_key)
    counts = Counter({k: v for k, v in chosen.counts.items() if k not in RANKING_KEYS and v})
    return Iteration(counts, chosen.visits, chosen.trips, chosen.counts[STORES], chosen.counts[TENSOR],
                     chosen.order, chosen.counts[PREFERRED])

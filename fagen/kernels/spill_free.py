"""Tiles that do not spill: a spec with custom mods whose kernels spill registers on an arch
gets smaller tiles, chosen automatically and said once.

A custom score_mod or mask_mod costs registers per element (its loads, its derivative, its
captured tensors' gradients), so at the tiles that suit a plain spec it can spill: local-memory
traffic inside the main loop. `spill_free(spec, arch)` compiles the spec (through the compile
cache: loading it compiles the same source anyway) and, for each pass that spills, tries that
pass's next tiles:

- the forward: more warps over the same rows (fewer rows per warp, fewer accumulators per
  thread), then half the rows; the sm90 family's (whose warpgroups and rows are fixed): fewer keys
  per K/V tile (`Spec.sm90_block_n`), 16 at a time;
- the backward: fewer keys per thread block (`Spec.bwd_block_n`'s choices).

The first candidate that does not spill wins; where none is free, the one that spills least, and
the warning says so. The built-in variants never take this path: their tiles are checked
spill-free by the static tests.
"""

from __future__ import annotations

import functools
import logging
from typing import Iterator

from ..arch_families import family_of
from ..spec import Spec
from ..tile_shapes import backward_block_n_choices
from .compile import compile_source
from .render import source_for

logger = logging.getLogger("fagen")


def spilled_bytes(spec: Spec, arch: str) -> dict[str, int]:
    """Bytes each kernel role of `spec` spills on `arch` ("forward", "backward"), 0 for none."""
    source = source_for(spec)
    resources = compile_source(source, arch).resources
    kernels = source.kernels
    roles = {"forward": [kernels.forward], "backward": [kernels.bwd_main, kernels.bwd_dq]}
    return {role: sum(resources[e.name].spill_bytes for e in entries if e is not None and e.name in resources)
            for role, entries in roles.items()}


def _legal(make) -> Spec | None:
    try:
        return make()
    except ValueError:   # a shape the spec refuses (warps past the rows, a block below the mma)
        return None


def forward_candidates(spec: Spec) -> Iterator[Spec]:
    """Forward tiles with fewer accumulators per thread, in the order tried (its family's rule,
    `Family.narrower`)."""
    for make in family_of(spec).narrower(spec):
        yield _legal(make)


def backward_candidates(spec: Spec) -> Iterator[Spec]:
    """Backward tiles with fewer keys per block, in the order tried."""
    for block_n in backward_block_n_choices(spec.head_dim):
        if block_n < spec.bwd_block_n:
            yield _legal(lambda: spec.replace(bwd_block_n=block_n))


def _refit(spec: Spec, spilled: int, arch: str, role: str, candidates) -> Spec:
    """The first of `candidates` whose `role` does not spill, else the one that spills least
    (`spec` itself, spilling `spilled` bytes there, if none spills less)."""
    best, best_bytes = spec, spilled
    for candidate in candidates:
        if candidate is None or best_bytes == 0:
            continue
        spilled = spilled_bytes(candidate, arch)[role]
        if spilled < best_bytes:
            best, best_bytes = candidate, spilled
    return best


@functools.lru_cache(maxsize=256)
def spill_free(spec: Spec, arch: str) -> Spec:
    """`spec` with tiles that do not spill on `arch`: itself when it does not spill or has no
    custom mod; else the forward's and the backward's first spill-free (or least-spilling)
    candidates. Logged once per spec and arch (the result is cached)."""
    if spec.score_mod is None and spec.mask_mod is None:
        return spec
    before = spilled_bytes(spec, arch)
    if not any(before.values()):
        return spec
    chosen = spec
    if before["forward"]:
        chosen = _refit(chosen, before["forward"], arch, "forward", forward_candidates(chosen))
    if before["backward"]:   # the forward's new tiles may have moved the backward's spills
        chosen = _refit(chosen, spilled_bytes(chosen, arch)["backward"], arch, "backward",
                        backward_candidates(chosen))
    after = spilled_bytes(chosen, arch)
    spilled = ", ".join(f"{role} {n} B" for role, n in before.items() if n)
    tiles = _tiles(chosen)
    if any(after.values()):
        left = ", ".join(f"{role} {n} B" for role, n in after.items() if n)
        logger.warning("fagen: %s spills registers on %s (%s) at its tiles; no smaller tiles are spill-free: "
                       "it runs with %s, which still spill %s", spec.name, arch, spilled, tiles, left)
    else:
        logger.info("fagen: %s spills registers on %s (%s) at its tiles; it runs with %s instead, which do not",
                    spec.name, arch, spilled, tiles)
    return chosen


def _tiles(spec: Spec) -> str:
    return family_of(spec).tiles_text(spec)

"""The passes every family shares: decoding's split-KV combine and cache append (templates/
combine.cu.j2, cache_update.cu.j2: plain CUDA, no tensor-core instruction)."""

from __future__ import annotations

from ..params import GRID_OFFSETS, cache_update_params, combine_params
from ..passes import Entry, Pass, entry

COMBINE_WARPS = 4   # the split-KV combine kernel: one warp per query row
CACHE_UPDATE_THREADS = 64   # the KV cache update kernel: a head's features, one per thread


def _combine_entries(spec, debug: bool) -> dict:
    return {"combine": entry(spec, "combine", combine_params(spec), 32 * COMBINE_WARPS, COMBINE_WARPS, "q", 0),
            "cache_update": Entry(f"{spec.name}_cache_update", cache_update_params(spec) + GRID_OFFSETS,
                                  CACHE_UPDATE_THREADS, 1, "q", 0)}


COMBINE = Pass(("combine.cu.j2", "cache_update.cu.j2"), _combine_entries)

"""Render a Spec into CUDA source with Jinja.

`render(spec)` is deterministic: equal specs give byte-identical source, and
the source's hash is part of every cache key downstream. The templates live in
the top-level `templates/` directory (shipped inside the wheel as
`fagen/templates`); what does not vary with the spec lives in plain CUDA
headers under `templates/include/fagen/`.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2

from ..arch_families import sm90_tiles
from ..spec import Spec
from ..variants.cuda import variant_code
from .params import (ELEM_CTYPE, GRID_OFFSETS, VARLEN_K_ROWS, VARLEN_Q_ROWS, VARLEN_ROW_WORKSPACES, VARLEN_STATS,
                     Param, backward_params, cache_update_params, combine_params, forward_params, sm90_forward_params,
                     varlen_params)


def template_dir() -> Path:
    """The templates/ directory: inside the installed package, else the source tree."""
    package = Path(__file__).resolve().parents[1]   # fagen/
    packaged = package / "templates"
    if packaged.is_dir():
        return packaged
    return package.parent / "templates"


def include_dir() -> Path:
    """Directory to pass as -I so that `#include <fagen/...>` finds the static headers."""
    return template_dir() / "include"

@dataclass(frozen=True)
class Entry:
    """One `extern "C" __global__` kernel in a rendered source."""

    name: str
    params: tuple[Param, ...]
    threads: int               # threads per block (x dimension)
    rows_per_block: int | None  # rows of `rows_from` one block covers, or None: one block per batch*head
    rows_from: str             # "q" (query rows) or "k" (key rows)
    shared_bytes: int          # dynamic shared memory per block
    slices: int = 1            # blocks per row block (the sm90 forward's column slices of O: Sm90Tiles.slices)

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        """(row blocks x slices, heads, batch). Heads or a batch past gridDim.y / .z's 65535 are
        launched in chunks (`launch.grid_chunks`, the kernels' `GRID_OFFSETS`)."""
        rows = seqlen_q if self.rows_from == "q" else seqlen_k
        blocks = 1 if self.rows_per_block is None else math.ceil(rows / self.rows_per_block)
        return (blocks * self.slices, heads, batch)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)


@dataclass(frozen=True)
class Entries:
    """The kernels of one spec, by role."""

    forward: Entry
    bwd_preprocess: Entry | None  # None for kv_cache specs, which are forward only
    bwd_main: Entry | None
    bwd_dq: Entry | None          # deterministic specs: the dQ pass without atomics
    bwd_dq_convert: Entry | None  # other specs: fp32 atomics accumulator -> dQ
    combine: Entry | None = None  # kv_cache specs (forward only, no backward): merges split-KV partials
    cache_update: Entry | None = None  # kv_cache specs: appends new keys / values (and rotary) in place

    @property
    def all(self) -> tuple[Entry, ...]:
        return tuple(e for e in (self.forward, self.bwd_preprocess, self.bwd_main, self.bwd_dq,
                                 self.bwd_dq_convert, self.combine, self.cache_update)
                     if e is not None)


@dataclass(frozen=True)
class Source:
    """A rendered translation unit and what is needed to launch it."""

    spec: Spec
    code: str
    kernels: Entries

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self.kernels.all

    @functools.cached_property
    def hash(self) -> str:
        return hashlib.sha256(self.code.encode()).hexdigest()



@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )

FORWARD_TEMPLATES = {1: "fwd_v1.cu.j2", 2: "fwd_v2.cu.j2", "sm90": "hopper_fwd.cu.j2"}
COMBINE_WARPS = 4   # the split-KV combine kernel: one warp per query row
CACHE_UPDATE_THREADS = 64   # the KV cache update kernel: a head's features, one per thread

def kernel_entries(spec: Spec, debug: bool = False) -> Entries:
    """The kernels a spec's source defines, with their signatures and geometry.

    Pure Python: generated op modules call this to launch a committed .cu file
    without rendering any template.
    """
    bwd = spec.backward_tiles
    params = backward_params(spec, debug)
    name = spec.name

    def entry(role, params, threads, rows, rows_from, smem, slices=1):
        if spec.kv_cache:   # k and v are a cache (sm80: cache_views; sm90: KeySource), never a packed sequence
            params = tuple(replace(p, name=p.name + "_cache") if p.name in ("k", "v") else p for p in params)
        params = tuple(varlen_params(list(params))) if spec.varlen else params
        return Entry(f"{name}_{role}", params + GRID_OFFSETS, threads, rows, rows_from, smem, slices)

    def sm90_forward():   # FlashAttention-3's design: one producer, two consumer warpgroups
        tiles = sm90_tiles(spec)
        return entry("fwd", sm90_forward_params(spec), tiles.threads, tiles.block_m, "q", tiles.shared_bytes,
                     tiles.slices)

    if spec.kv_cache:
        # Decoding: the forward (one block per query tile and key split), the split-KV combine and
        # the cache update. Packed queries over a paged cache (varlen) run the forward alone.
        if spec.arch_family == "sm90":
            forward = sm90_forward()
        else:
            forward = entry("fwd", forward_params(spec, debug), spec.threads, spec.block_m, "q",
                            spec.shared_layout.total_bytes)
        if spec.varlen:
            return Entries(forward, None, None, None, None)
        return Entries(forward, None, None, None, None,
                       combine=entry("combine", combine_params(spec), 32 * COMBINE_WARPS, COMBINE_WARPS, "q", 0),
                       cache_update=Entry(f"{name}_cache_update", cache_update_params(spec) + GRID_OFFSETS,
                                          CACHE_UPDATE_THREADS, 1, "q", 0))
    if spec.arch_family == "sm90":
        forward = sm90_forward()
    else:
        forward = entry("fwd", forward_params(spec, debug), spec.threads,
                        spec.block_m if spec.version == 2 else None, "q", spec.shared_layout.total_bytes)
    return Entries(
        forward=forward,
        bwd_preprocess=entry("bwd_preprocess", params["bwd_preprocess"], 128, bwd.block_m, "q", 0),
        bwd_main=entry("bwd", params["bwd_main"], bwd.threads, bwd.block_n, "k",
                       spec.backward_layout.total_bytes),
        bwd_dq=entry("bwd_dq", params["bwd_dq"], 2 * bwd.block_m * spec.column_split, bwd.block_m, "q",
                     spec.dq_layout.total_bytes) if spec.deterministic else None,
        bwd_dq_convert=None if spec.deterministic else
        entry("bwd_dq_convert", params["bwd_dq_convert"], 128, bwd.block_m, "q", 0),
    )


def render(spec: Spec, debug: bool = False) -> Source:
    """Render every kernel of `spec` (forward and backward) into one translation unit.

    `debug` adds instrumentation for tests: the forward kernel records how many
    K/V tiles each thread block visits (`tiles_visited`), and with dropout the
    forward and backward kernels write the keep mask they used (`keep_mask`).
    """
    entries = kernel_entries(spec, debug)
    code = environment().get_template("translation_unit.cu.j2").render(
        spec=spec,
        entries=entries,
        forward_template=FORWARD_TEMPLATES["sm90" if spec.arch_family == "sm90" else spec.version],
        sm90=sm90_tiles(spec) if spec.arch_family == "sm90" else None,
        layout=spec.shared_layout,
        bwd=spec.backward_tiles,
        bwd_layout=spec.backward_layout,
        dq_layout=spec.dq_layout,
        head_dim_pad=spec.head_dim_pad,
        row_tiles=spec.block_m // (16 * spec.num_warps),
        elem_ctype=ELEM_CTYPE[spec.dtype],
        debug=debug,
        variant=variant_code(spec),
        varlen={"q_rows": VARLEN_Q_ROWS, "k_rows": VARLEN_K_ROWS, "stats": VARLEN_STATS,
                "row_workspaces": VARLEN_ROW_WORKSPACES},
    )
    return Source(spec=spec, code=code, kernels=entries)


@functools.lru_cache(maxsize=512)
def source_for(spec: Spec) -> Source:
    """`render(spec)`, once per process: the ops and the tuner share these renders (the
    compiled kernels are cached further down, by `launch` and `compiler`)."""
    return render(spec)

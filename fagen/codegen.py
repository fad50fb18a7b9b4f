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
from dataclasses import dataclass
from pathlib import Path

import jinja2

from .spec import Spec
from .variants.cuda import variant_code

ELEM_CTYPE = {"fp16": "__half", "bf16": "__nv_bfloat16"}


def template_dir() -> Path:
    """The templates/ directory: inside the installed package, else the source tree."""
    packaged = Path(__file__).resolve().parent / "templates"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "templates"


def include_dir() -> Path:
    """Directory to pass as -I so that `#include <fagen/...>` finds the static headers."""
    return template_dir() / "include"


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its C type, name, and how the launcher passes it."""

    name: str
    ctype: str
    kind: str  # "tensor" (a device pointer) or a NumPy scalar type name: "int32", "float32", ...


@dataclass(frozen=True)
class Entry:
    """One `extern "C" __global__` kernel in a rendered source."""

    name: str
    params: tuple[Param, ...]
    threads: int               # threads per block (x dimension)
    rows_per_block: int | None  # rows of `rows_from` one block covers, or None: one block per batch*head
    rows_from: str             # "q" (query rows) or "k" (key rows)
    shared_bytes: int          # dynamic shared memory per block

    def grid(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int = 0) -> tuple[int, int, int]:
        """(row blocks, heads, batch). Heads or a batch past gridDim.y / .z's 65535 are
        launched in chunks (`launch.grid_chunks`, the kernels' `GRID_OFFSETS`)."""
        rows = seqlen_q if self.rows_from == "q" else seqlen_k
        blocks = 1 if self.rows_per_block is None else math.ceil(rows / self.rows_per_block)
        return (blocks, heads, batch)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)


@dataclass(frozen=True)
class Entries:
    """The kernels of one variant, by role."""

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


def _strides(*tensors: str) -> list[Param]:
    return [Param(f"{t}_stride_{axis}", "long long", "int64") for t in tensors for axis in ("b", "n", "h")]


def _tensor(name: str, ctype: str, const: bool = False) -> Param:
    return Param(name, f"{'const ' if const else ''}{ctype}* __restrict__", "tensor")


def _stats(spec: Spec, const: bool) -> list[Param]:
    names = ("lse",) if spec.version == 2 else ("row_max", "row_sum")
    if not const and spec.version == 1:
        names = ("row_max_out", "row_sum_out")
    return [_tensor(n, "float", const) for n in names]


def _sizes(spec: Spec) -> list[Param]:
    params = [_tensor("seqlens_k", "int", const=True)] if spec.key_padding else []
    return params + [Param(n, "int", "int32") for n in ("heads", "kv_heads", "seqlen_q", "seqlen_k")]


def _dropout(spec: Spec) -> list[Param]:
    if not spec.dropout:
        return []
    offsets = [Param("row_offset", "int", "int32"), Param("col_offset", "int", "int32")] if spec.coord_offsets else []
    return [Param("seed", "unsigned long long", "uint64"), Param("philox_offset", "unsigned int", "uint32"),
            Param("keep_threshold", "unsigned int", "uint32"), Param("keep_scale", "float", "float32")] + offsets


def forward_params(spec: Spec, debug: bool = False) -> tuple[Param, ...]:
    elem = ELEM_CTYPE[spec.dtype]
    params = [_tensor(n, elem, const=True) for n in ("q", "k", "v")] + [_tensor("out", elem)]
    params += _stats(spec, const=False)
    if spec.version == 1:
        params.append(_tensor("o_accum", "float"))  # FA-1 keeps O in HBM between steps
    params += _sizes(spec) + _strides("q", "k", "v", "o")
    params.append(Param("softmax_scale_log2", "float", "float32"))
    if spec.has_mods:   # variant scores are scaled before their score_mod
        params.append(Param("softmax_scale", "float", "float32"))
    params += _dropout(spec) + _variant(spec) + _kv_cache(spec)
    return tuple(params + _debug(spec, debug, "tiles_visited"))


def _kv_cache(spec: Spec) -> list[Param]:
    """Decoding against a KV cache (Spec.kv_cache): where each batch entry's keys live, and the
    split-KV partials. k and v arrive as `k_cache` / `v_cache` (macros.j2 `cache_views`)."""
    if spec.kv_cache is None:
        return []
    if spec.kv_cache == "paged":   # key j of entry b: page block_table[b][j / page_size], row j % page_size
        rows = [_tensor("block_table", "int", const=True), Param("block_table_stride", "int", "int32"),
                Param("page_size", "int", "int32")]
    else:                          # entry b reads cache entry cache_batch[b] from row cache_start[b] on
        rows = [_tensor("cache_batch", "int", const=True), _tensor("cache_start", "int", const=True)]
    group = [Param("pack_group", "int", "int32")] if spec.pack_gqa else []   # query heads per K/V head
    return rows + [Param("k_cache_stride_b", "long long", "int64"), Param("v_cache_stride_b", "long long", "int64"),
                   Param("num_splits", "int", "int32"), _tensor("o_partial", "float"), _tensor("lse_partial", "float"),
                   *group]


def cache_update_params(spec: Spec) -> tuple[Param, ...]:
    """The KV cache update kernel's: new keys / values appended in place, rotary on them and q."""
    elem = ELEM_CTYPE[spec.dtype]
    rows = ([_tensor("block_table", "int", const=True), Param("block_table_stride", "int", "int32"),
             Param("page_size", "int", "int32")] if spec.kv_cache == "paged"
            else [_tensor("cache_batch", "int", const=True)])
    ints = ("rotary_dim", "rotary_interleaved", "q_positions_step", "new_tokens", "seqlen_q", "heads", "kv_heads")
    return (_tensor("q", elem, const=True), _tensor("k_new", elem, const=True), _tensor("v_new", elem, const=True),
            _tensor("q_rot", elem), _tensor("k_cache", elem), _tensor("v_cache", elem),
            _tensor("cache_seqlens", "int", const=True), *rows, _tensor("rotary_cos", elem, const=True),
            _tensor("rotary_sin", elem, const=True), *(Param(n, "int", "int32") for n in ints),
            *_strides("q", "kn", "vn", "qr", "k", "v"))


def combine_params(spec: Spec) -> tuple[Param, ...]:
    """The split-KV combine kernel's: fp32 partials (B, H, Nq, splits[, d]) in, O and L out."""
    return (_tensor("o_partial", "float", const=True), _tensor("lse_partial", "float", const=True),
            _tensor("out", ELEM_CTYPE[spec.dtype]), _tensor("lse", "float"), Param("heads", "int", "int32"),
            Param("seqlen_q", "int", "int32"), Param("num_splits", "int", "int32"), *_strides("o"))


def _variant(spec: Spec, grads: bool = False) -> list[Param]:
    """A variant's run-time values (fagen/variants), and with `grads` the backward's buffers
    for the gradients of captured tensors."""
    code = variant_code(spec)
    if code is None:
        return []
    params = [Param(*p) for p in code.params]
    return params + ([Param(*p) for p in code.grad_params] if grads else [])


def _debug(spec: Spec, debug: bool, *counters: str) -> list[Param]:
    """Test instrumentation: counters, and the dropout keep mask a kernel used."""
    if not debug:
        return []
    params = [_tensor(name, "int") for name in counters]
    if spec.dropout:
        params.append(_tensor("keep_mask", "unsigned char"))
    return params


def backward_params(spec: Spec, debug: bool = False) -> dict[str, tuple[Param, ...]]:
    elem = ELEM_CTYPE[spec.dtype]
    scales = [Param("softmax_scale", "float", "float32"), Param("softmax_scale_log2", "float", "float32")]
    dq_accum = [] if spec.deterministic else [_tensor("dq_accum", "float")]
    # The preprocess kernel turns the forward's statistics into lse_log2 (and D) for the
    # others, in rows padded to whole backward Q blocks.
    inputs = [_tensor(n, elem, const=True) for n in ("q", "k", "v", "dout")]
    inputs += [_tensor("lse_log2", "float", const=True), _tensor("delta", "float", const=True)]
    params = {
        "bwd_preprocess": [_tensor("out", elem, const=True), _tensor("dout", elem, const=True)]
                          + _stats(spec, const=True) + [_tensor("delta", "float"), _tensor("lse_log2", "float")]
                          + dq_accum + [Param("heads", "int", "int32"), Param("seqlen_q", "int", "int32")]
                          + _strides("o", "do"),
        "bwd_main": inputs + dq_accum + [_tensor("dk_out", elem), _tensor("dv_out", elem)] + _sizes(spec)
                    + _strides("q", "k", "v", "do", "dk", "dv") + scales + _dropout(spec)
                    + _variant(spec, grads=True) + _debug(spec, debug),
    }
    if spec.deterministic:
        params["bwd_dq"] = (inputs + [_tensor("dq", elem)] + _sizes(spec)
                            + _strides("q", "k", "v", "do", "dq") + scales + _dropout(spec) + _variant(spec))
    else:
        params["bwd_dq_convert"] = [_tensor("dq_accum", "float", const=True), _tensor("dq", elem),
                                    Param("heads", "int", "int32"), Param("seqlen_q", "int", "int32")] \
                                   + _strides("dq") + [Param("softmax_scale", "float", "float32")]
    return {role: tuple(p) for role, p in params.items()}


# Packed sequences (Spec.varlen): these kernel parameters arrive as `<name>_packed` and each
# kernel views its sequence through a local `<name>` (macros.j2 `varlen_views`), so that the
# templates index as for a padded batch. Q-side rows start at cu_seqlens_q[b], K-side rows at
# cu_seqlens_k[b]; statistics and workspaces are (B, H, max_seqlen_q[, d]) slots.
VARLEN_Q_ROWS = {"q": "q", "out": "o", "dout": "do", "dq": "dq"}
VARLEN_K_ROWS = {"k": "k", "v": "v", "dk_out": "dk", "dv_out": "dv"}
VARLEN_STATS = ("lse", "row_max", "row_sum", "row_max_out", "row_sum_out")
VARLEN_ROW_WORKSPACES = ("o_accum", "dq_accum")      # (B, H, max_seqlen_q, d)
VARLEN_PADDED = ("delta", "lse_log2")                # (B, H, padded max_seqlen_q)
VARLEN_PACKED = (*VARLEN_Q_ROWS, *VARLEN_K_ROWS, *VARLEN_STATS, *VARLEN_ROW_WORKSPACES, *VARLEN_PADDED)


def _varlen_params(params: list[Param]) -> list[Param]:
    """A kernel's parameters for packed sequences: data as `_packed`, the max lengths, cu_seqlens."""
    out = []
    for p in params:
        if p.name in VARLEN_PACKED:
            out.append(Param(p.name + "_packed", p.ctype, p.kind))
        elif p.name in ("seqlen_q", "seqlen_k"):
            side = p.name[-1]
            out += [_tensor(f"cu_seqlens_{side}", "int", const=True), Param("max_" + p.name, p.ctype, p.kind)]
        else:
            out.append(p)
    return out


FORWARD_TEMPLATES = {1: "fwd_v1.cu.j2", 2: "fwd_v2.cu.j2"}
COMBINE_WARPS = 4   # the split-KV combine kernel: one warp per query row
CACHE_UPDATE_THREADS = 64   # the KV cache update kernel: a head's features, one per thread

# Every kernel's last two parameters: the first head and batch of its launch. gridDim.y
# (heads) and gridDim.z (batch) stop at 65535, so `launch` splits larger grids into
# chunks and passes each chunk's offsets; the kernels add them to blockIdx.y and .z.
GRID_OFFSETS = (Param("head_offset", "int", "int32"), Param("batch_offset", "int", "int32"))


def kernel_entries(spec: Spec, debug: bool = False) -> Entries:
    """The kernels a spec's source defines, with their signatures and geometry.

    Pure Python: generated op modules call this to launch a committed .cu file
    without rendering any template.
    """
    bwd = spec.backward_tiles
    params = backward_params(spec, debug)
    name = spec.name

    def entry(role, params, threads, rows, rows_from, smem):
        if spec.kv_cache:   # k and v are a cache, read through cache_views, never a packed sequence
            params = tuple(Param(p.name + "_cache", p.ctype, p.kind) if p.name in ("k", "v") else p for p in params)
        params = tuple(_varlen_params(list(params))) if spec.varlen else params
        return Entry(f"{name}_{role}", params + GRID_OFFSETS, threads, rows, rows_from, smem)

    if spec.kv_cache:
        # Decoding: the forward (one block per query tile and key split), the split-KV combine and
        # the cache update. Packed queries over a paged cache (varlen) run the forward alone.
        forward = entry("fwd", forward_params(spec, debug), spec.threads, spec.block_m, "q",
                        spec.shared_layout.total_bytes)
        if spec.varlen:
            return Entries(forward, None, None, None, None)
        return Entries(forward, None, None, None, None,
                       combine=entry("combine", combine_params(spec), 32 * COMBINE_WARPS, COMBINE_WARPS, "q", 0),
                       cache_update=Entry(f"{name}_cache_update", cache_update_params(spec) + GRID_OFFSETS,
                                          CACHE_UPDATE_THREADS, 1, "q", 0))
    return Entries(
        forward=entry("fwd", forward_params(spec, debug), spec.threads,
                      spec.block_m if spec.version == 2 else None, "q", spec.shared_layout.total_bytes),
        bwd_preprocess=entry("bwd_preprocess", params["bwd_preprocess"], 128, bwd.block_m, "q", 0),
        bwd_main=entry("bwd", params["bwd_main"], bwd.threads, bwd.block_n, "k",
                       spec.backward_layout.total_bytes),
        bwd_dq=entry("bwd_dq", params["bwd_dq"], 2 * bwd.block_m, bwd.block_m, "q",
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
    code = environment().get_template("variant.cu.j2").render(
        spec=spec,
        entries=entries,
        forward_template=FORWARD_TEMPLATES[spec.version],
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

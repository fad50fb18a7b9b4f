"""Run a rendered spec's kernels on tensors: the forward pass and the backward pass.

This is where tensors become kernel arguments: outputs and workspaces are
allocated, strides and scales filled in, and the kernels of `render.Entries`
launched in order through `launch`. Inputs are assumed valid; `ops` checks them.
Shapes: q (B, Nq, H, d), k and v (B, Nk, Hk, d); statistics (B, H, Nq) fp32.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from . import launch
from .params import VARLEN_PACKED, variant_arguments
from .render import Source
from ..errors import assert_lazily
from ..variants.cuda import variant_code

LOG2E = 1.4426950408889634


def _empty(*shape, dtype, device) -> torch.Tensor:
    """Every buffer a kernel writes is allocated here (tests poison them through it)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def new_output(like: torch.Tensor) -> torch.Tensor:
    """An output of `like`'s shape and dtype, for a caller that hands the kernels a view of it."""
    return _empty(*like.shape, dtype=like.dtype, device=like.device)


_unused_buffers: dict[torch.device, torch.Tensor] = {}


def _unused(device: torch.device) -> torch.Tensor:
    """A 0-element fp32 tensor for an argument the kernels never touch in this launch (an
    unsplit step's split-KV partials): one per device, not an allocation per call (it has no
    memory, so a CUDA graph that captured it holds nothing of it)."""
    buffer = _unused_buffers.get(device)
    if buffer is None:
        buffer = _unused_buffers[device] = torch.empty(0, dtype=torch.float32, device=device)
    return buffer


def _strides_of(values: dict, **tensors) -> None:
    for name, t in tensors.items():
        if t.dim() == 3:   # packed sequences (total, H, d): the kernels offset rows by cu_seqlens
            values.update({f"{name}_stride_b": 0, f"{name}_stride_n": t.stride(0), f"{name}_stride_h": t.stride(1)})
            continue
        values.update({f"{name}_stride_b": t.stride(0), f"{name}_stride_n": t.stride(1),
                       f"{name}_stride_h": t.stride(2)})


def _geometry(q, k, varlen):
    """(batch, seqlen_q, heads, head_dim, seqlen_k, kv_heads); for packed sequences (`varlen` =
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)) the lengths are the maxima."""
    if varlen is None:
        return (*q.shape, k.shape[1], k.shape[2])
    cu_q, _, max_q, max_k = varlen
    return cu_q.shape[0] - 1, max_q, q.shape[1], q.shape[2], max_k, k.shape[1]


def _packed(tensors: dict, varlen) -> dict:
    """Packed sequences: renames the data tensors to their parameters (`<name>_packed`), adds
    cu_seqlens and the error flag of the kernels' guard (raised after the launches: `_run`), and
    returns the scalar arguments (the max lengths, the packed totals) to bind."""
    if varlen is None:
        return {}
    for name in VARLEN_PACKED:
        if name in tensors:
            tensors[name + "_packed"] = tensors.pop(name)
    tensors.update(cu_seqlens_q=varlen[0], cu_seqlens_k=varlen[1])
    if "error_flag" not in tensors:   # decoding's forward brings its own, raised by its caller
        tensors["error_flag"] = error_flag(varlen[0].device)
        paged = "block_table" in tensors
        tensors[REFUSAL] = PACKED_REFUSED.format("cu_seqlens_q, cu_seqlens_k or block_table" if paged else
                                                 "cu_seqlens_q or cu_seqlens_k", "; a page outside the cache" * paged)
    k_rows = tensors.get("k_packed")
    return {"max_seqlen_q": varlen[2], "max_seqlen_k": varlen[3], "total_q": tensors["q_packed"].shape[0],
            "total_k": 0 if k_rows is None else k_rows.shape[0]}


# -- the guards' error flag -------------------------------------------------------------------
# Index values (cu_seqlens, cache_seqlens, cache_batch_idx, cache_leftpad, block tables) are
# not read on the host by default: that would be a device sync per call. The kernels check them
# instead (the guards of macros.j2 and cache_update.cu.j2): a value that would reach outside a
# tensor is refused, nothing read or written there, and the int32 flag set (an atomic: refusing
# blocks run in no defined order; macros.j2 flag_refusal); the call raises from the flag lazily (torch._assert_async: on a GPU an
# asynchronous device-side assert, on the CPU at once). FAGEN_CHECK_VALUES=1 checks the values
# on the host first, with exact messages.

REFUSAL = "refusal message"   # a `tensors` entry that is no kernel parameter: what _run raises
PACKED_REFUSED = ("an index value is out of range in {} (a sequence outside the packed rows, or longer than "
                  "max_seqlen_q / max_seqlen_k{})")
CHECK_HINT = ("; the kernels refused it, nothing outside the tensors was read or written. "
              "FAGEN_CHECK_VALUES=1 checks the values before the launch and names the entry")


def error_flag(device: torch.device) -> torch.Tensor:
    """A call's error flag, int32 (1,) zero: the guards set it, `raise_flagged` reads it lazily."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def raise_flagged(flag: torch.Tensor, message: str) -> None:
    """Raise `message` (an InputError, + CHECK_HINT) if a guard set `flag`, without a device
    sync: torch._assert_async, at once on the CPU, asynchronously on a GPU (a device-side
    assert that surfaces at the next synchronizing call)."""
    assert_lazily(flag.logical_not(), f"fagen: {message}{CHECK_HINT}")   # one op: flag is (1,)


def keep_threshold(dropout_p: float) -> int:
    """A Philox word keeps its element iff it is below floor((1 - p) * 2**32) (fagen/philox.cuh).

    Computed here, not taken from fagen.reference, so that the oracle's own
    version checks this one instead of sharing its bugs. p must be in (0, 1).
    """
    if not 0.0 < dropout_p < 1.0:
        raise ValueError(f"dropout needs 0 < dropout_p < 1, got {dropout_p}")
    return int((1 - Fraction(dropout_p)) * 2**32)  # exact: int() floors a positive Fraction


def dropout_args(dropout_p: float, seed: int, philox_offset: int) -> dict:
    """The kernel arguments that make Philox dropout replay exactly (fagen/philox.cuh)."""
    return {"seed": seed, "philox_offset": philox_offset, "keep_threshold": keep_threshold(dropout_p),
            "keep_scale": 1.0 / (1.0 - dropout_p)}


# Bound launches per call signature (source, backend, shapes, strides, scale, dropout p):
# a warm call of a seen shape only allocates its outputs and passes the tensors.
_plans: dict[tuple, list[launch.BoundLaunch]] = {}
MAX_PLANS = 1024
# Drawn anew for every dropout call; and a shard's dropout coordinates (Spec.coord_offsets).
PER_CALL_SCALARS = frozenset({"seed", "philox_offset", "row_offset", "col_offset"})


class Launches:
    """A caller's hold on the bound launches of one call signature: a caller that has keyed the
    call itself (a decoding step's plan, `ops.kvcache`) passes one, and its warm calls skip
    building this module's launch-plan key (shapes, strides, backend) and looking it up."""

    __slots__ = ("plan",)

    def __init__(self):
        self.plan: list[launch.BoundLaunch] | None = None


def _planned(plan_key, build, debug, held: Launches | None = None) -> list[launch.BoundLaunch]:
    """The bound launches of `plan_key` (a callable giving the key, called only when `held` has
    none yet), built by `build()` on a miss. Debug renders take instrumentation tensors and
    are never remembered."""
    if held is not None and held.plan is not None:
        return held.plan
    key = None if debug else plan_key()
    plan = None if debug else _plans.get(key)
    if plan is None:
        plan = build()
        if not debug:
            if len(_plans) >= MAX_PLANS:  # many distinct shapes: start over, stay bounded
                _plans.clear()
            _plans[key] = plan
    if held is not None and not debug:
        held.plan = plan
    return plan


def _run(plan_key, build, tensors: dict, debug, after_first=None, held: Launches | None = None) -> None:
    """Run the bound launches of `plan_key` (`_planned`) with `tensors`, then raise from the
    guards' flag where the call owns one (REFUSAL)."""
    plan = _planned(plan_key, build, debug, held)
    converted: dict = {}
    for index, bound in enumerate(plan):
        bound(tensors, converted)
        if index == 0 and after_first is not None:
            after_first()
    if REFUSAL in tensors:
        raise_flagged(tensors["error_flag"], tensors[REFUSAL])


def sequence_rows(varlen) -> torch.Tensor:
    """Packed sequences: which rows of each (B, max_seqlen_q) statistics slot hold a query, (B, 1, max)."""
    cu_q, _, max_q, _ = varlen
    lengths = (cu_q[1:] - cu_q[:-1]).view(-1, 1, 1)
    return torch.arange(max_q, device=cu_q.device).view(1, 1, -1) < lengths


def lse_from_stats(row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """FlashAttention-1's (m, l) as L = m + log l, with +inf for rows that saw no key (l = 0):
    the one place L is built from (m, l)."""
    return torch.where(row_sum > 0, row_max + torch.log(row_sum), torch.full_like(row_max, math.inf))


def lse_of(stats, version: int) -> torch.Tensor:
    """A forward's L: FA-2's own, or FA-1's (m, l) turned into it."""
    return stats[0] if version == 2 else lse_from_stats(*stats)


def sink_gradient(sinks: torch.Tensor, stats, version: int, delta_minus_dlse: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d sink_h = -sum over (b, i) of P_sink (D - dL), with P_sink = exp(sink_h - L): the sink
    is a key whose value row is zero, so its dS is P_sink (0 - (D - dL)). `rows` masks the slots
    of packed sequences that hold no query."""
    lse = lse_of(stats, version)
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    terms = p_sink * delta_minus_dlse
    if rows is not None:
        terms = torch.where(rows, terms, torch.zeros_like(terms))
    return -terms.sum(dim=(0, 2)).to(sinks.dtype)


def _split_variant(spec, variant: dict | None) -> tuple[dict, tuple]:
    """A variant's kernel arguments (params.variant_arguments) as per-call tensors, and its
    scalars as a hashable part of the launch plan's key (scalars are bound into the plan)."""
    if not variant:   # plain attention: the hot path of most calls
        return {}, ()
    variant = variant_arguments(spec, variant)
    tensors = {n: x for n, x in variant.items() if isinstance(x, torch.Tensor)}
    scalars = tuple(sorted((n, x) for n, x in variant.items() if not isinstance(x, torch.Tensor)))
    return tensors, scalars


def forward(source: Source, q, k, v, *, softmax_scale=None, seqlens_k=None, dropout_p=0.0,
            seed=0, philox_offset=0, debug=None, variant=None, varlen=None, coord_offsets=(0, 0)):
    """Launch `source`'s forward kernel. Returns (out, stats) where stats is
    (lse,) for version 2 and (m, l) for version 1. `variant` holds a variant's run-time
    arguments by kernel parameter name (`variant_arguments`). With `varlen` = (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k), q is (total_q, H, d) and k, v (total_k, Hk, d),
    and the statistics are (B, H, max_seqlen_q) with each sequence's rows first."""
    spec = source.spec
    batch, seqlen_q, heads, head_dim, seqlen_k, kv_heads = _geometry(q, k, varlen)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    out = _empty(*q.shape, dtype=q.dtype, device=q.device)
    stat_names = ("lse",) if spec.version == 2 else ("row_max_out", "row_sum_out")
    stats = [_empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device) for _ in stat_names]
    variant_tensors, variant_scalars = _split_variant(spec, variant)
    tensors = {"q": q, "k": k, "v": v, "out": out, "seqlens_k": seqlens_k, "seed": seed,
               "philox_offset": philox_offset, "row_offset": coord_offsets[0], "col_offset": coord_offsets[1],
               **dict(zip(stat_names, stats)), **variant_tensors, **(debug or {})}
    if spec.version == 1:
        tensors["o_accum"] = _empty(batch, heads, seqlen_q, head_dim, dtype=torch.float32, device=q.device)

    def build():
        values = {**tensors, **dict(variant_scalars), "heads": heads, "kv_heads": kv_heads, "seqlen_q": seqlen_q,
                  "seqlen_k": seqlen_k, "softmax_scale": scale, "softmax_scale_log2": scale * LOG2E}
        values.update(varlen_scalars)
        _strides_of(values, q=q, k=k, v=v, o=out)
        if spec.dropout:
            values.update(dropout_args(dropout_p, seed, philox_offset))
        entry = source.kernels.forward
        return [launch.load(source, q.device).bind(entry, entry.grid(batch, heads, seqlen_q, seqlen_k), values,
                                                   PER_CALL_SCALARS)]

    def key():
        return ("fwd", source.hash, launch.backend_key(q.device), q.shape, k.shape, q.stride(), k.stride(),
                v.stride(), scale, dropout_p, variant_scalars, None if varlen is None else varlen[2:])
    varlen_scalars = _packed(tensors, varlen)
    _run(key, build, tensors, debug)
    return out, tuple(stats)


def backward(source: Source, q, k, v, out, stats, dout, *, softmax_scale=None, seqlens_k=None,
             dropout_args=None, debug=None, variant=None, dlse=None, extras=None, varlen=None, coord_offsets=(0, 0)):
    """Launch `source`'s backward kernels. Returns (dq, dk, dv) in q's dtype.

    dK and dV are computed per query head; with GQA/MQA the query heads that
    share a K/V head are summed here (in fp32). `dlse` (B, H, Nq), the gradient of the
    returned L, enters as D - dL (dS = P (dP - (D - dL))). With `extras` (a dict), a
    variant's other gradients are filled in: "dsinks" (H,) and, per captured tensor whose
    gradient the kernel accumulates, "<name>_grad" (fp32, the tensor's shape).
    """
    spec, kernels = source.spec, source.kernels
    batch, seqlen_q, heads, head_dim, seqlen_k, kv_heads = _geometry(q, k, varlen)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    device = q.device
    f32 = dict(dtype=torch.float32, device=device)
    dq = _empty(*q.shape, dtype=q.dtype, device=device)
    dk = _empty(*k.shape[:-2], heads, head_dim, dtype=q.dtype, device=device)
    dv = _empty(*k.shape[:-2], heads, head_dim, dtype=q.dtype, device=device)
    drop = dropout_args or {}
    variant_tensors, variant_scalars = _split_variant(spec, variant)
    # D and the statistic in log2 units, written by the preprocess kernel in rows padded to
    # whole backward Q blocks (the main kernel copies them with 16-byte cp.async).
    block_m = kernels.bwd_preprocess.rows_per_block   # the backward's Q block (spec.backward_tiles.block_m)
    padded_rows = -(-seqlen_q // block_m) * block_m
    tensors = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "dq": dq, "dk_out": dk, "dv_out": dv,
               "delta": _empty(batch, heads, padded_rows, **f32),
               "lse_log2": _empty(batch, heads, padded_rows, **f32), "seqlens_k": seqlens_k,
               "seed": drop.get("seed", 0), "philox_offset": drop.get("philox_offset", 0),
               "row_offset": coord_offsets[0], "col_offset": coord_offsets[1], **variant_tensors,
               **(debug or {})}
    grads = {}
    if variant:
        for name, _, _ in variant_code(spec).grad_params:   # captured tensors' gradients, by atomics
            grads[name] = torch.zeros(variant_tensors[name[:-len("_grad")]].shape, **f32)
        tensors.update(grads)
    if spec.version == 2:
        tensors["lse"] = stats[0]
    else:
        tensors["row_max"], tensors["row_sum"] = stats
    if not spec.deterministic:
        tensors["dq_accum"] = _empty(batch, heads, seqlen_q, head_dim, **f32)

    def build():
        if device.type == "cuda":  # the compile checked only the forward's shared memory
            spec.check_arch(launch.arch_of(device), shared_limit=launch.shared_limit(device))
        values = {**tensors, **drop, **dict(variant_scalars), "heads": heads, "kv_heads": kv_heads,
                  "seqlen_q": seqlen_q,
                  "seqlen_k": seqlen_k, "softmax_scale": scale, "softmax_scale_log2": scale * LOG2E}
        values.update(varlen_scalars)
        _strides_of(values, q=q, k=k, v=v, o=out, do=dout, dq=dq, dk=dk, dv=dv)
        loaded = launch.load(source, device)
        return [loaded.bind(entry, entry.grid(batch, heads, seqlen_q, seqlen_k), values, PER_CALL_SCALARS)
                for entry in (kernels.bwd_preprocess, kernels.bwd_main, kernels.bwd_dq or kernels.bwd_dq_convert)]

    keep = (drop.get("keep_threshold"), drop.get("keep_scale"))
    def key():
        return ("bwd", source.hash, launch.backend_key(device), q.shape, k.shape, q.stride(), k.stride(),
                v.stride(), out.stride(), dout.stride(), scale, keep, variant_scalars,
                None if varlen is None else varlen[2:])
    delta = tensors["delta"]
    varlen_scalars = _packed(tensors, varlen)

    def subtract_dlse():   # after the preprocess kernel: D - dL for every row
        delta[:, :, :seqlen_q] -= dlse.to(torch.float32)

    _run(key, build, tensors, debug, after_first=None if dlse is None else subtract_dlse)
    if extras is not None:
        extras.update(grads)
        if spec.sinks:
            extras["dsinks"] = sink_gradient(variant_tensors["sinks"], stats, spec.version, delta[:, :, :seqlen_q],
                                             None if varlen is None else sequence_rows(varlen))
    if heads != kv_heads:
        group = heads // kv_heads
        dk = dk.view(*k.shape[:-2], kv_heads, group, head_dim).float().sum(-2).to(q.dtype)
        dv = dv.view(*k.shape[:-2], kv_heads, group, head_dim).float().sum(-2).to(q.dtype)
    return dq, dk, dv


DECODE_REFUSED = "an index value is out of range in cache_seqlens, cache_batch_idx, cache_leftpad or block_table"


def _flagged(tensors: dict, flag, device) -> None:
    """A decoding launch's error flag: the caller's (one flag for a whole step, raised by the
    caller after its last launch), else its own, raised by `_run` after the launch."""
    if flag is None:
        flag = error_flag(device)
        tensors[REFUSAL] = DECODE_REFUSED
    tensors["error_flag"] = flag


def forward_kv_cache(source: Source, q, k_cache, v_cache, seqlens_k, *, seqlen_k: int, cache_rows=None,
                     block_table=None, num_splits: int = 1, softmax_scale=None, variant=None, varlen=None,
                     pack_group: int | None = None, flag=None, out=None, held: Launches | None = None):
    """Launch a kv_cache spec's forward over the cache, and with num_splits > 1 its combine kernel.

    q (B, Nq, H, d); seqlens_k (B,) int32, each entry's keys; seqlen_k bounds them (the cache's
    capacity). A contiguous cache (B_cache, N_cache, Hk, d) takes cache_rows = (cache_batch,
    cache_start), int32 (B,): the cache entry and first row of each batch entry; a paged one
    (pages, page_size, Hk, d) takes block_table (B, max_pages) int32. Returns (out, lse (B, H, Nq)).
    With `varlen` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) q is packed (total_q,
    H, d), the cache paged, seqlens_k unused and L (B, H, max_seqlen_q) slots; no splits.
    A Spec.pack_gqa source takes q packed (B, Nq * group, Hk, d) and pack_group = group.
    The guards refuse index values that reach outside the cache and set `flag` (int32 (1,),
    `error_flag`); without one the call makes its own and raises from it (`raise_flagged`).
    `out`, q's shape, is where the output goes (any strides; a packed step's is a view of the
    caller's unpacked output), else a new tensor. `held` (`Launches`): see `_planned`.
    """
    batch, seqlen_q, heads, head_dim = _geometry(q, q, varlen)[:4]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    f32 = dict(dtype=torch.float32, device=q.device)
    out = _empty(*q.shape, dtype=q.dtype, device=q.device) if out is None else out
    lse = _empty(batch, heads, seqlen_q, **f32)
    split = num_splits > 1   # the partials are (B, H, Nq, splits[, d]); unsplit launches never touch them
    variant_tensors, variant_scalars = _split_variant(source.spec, variant)
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "out": out, "lse": lse, "seqlens_k": seqlens_k,
               "o_partial": _empty(batch, heads, seqlen_q, num_splits, head_dim, **f32) if split else _unused(q.device),
               "lse_partial": _empty(batch, heads, seqlen_q, num_splits, **f32) if split else _unused(q.device),
               **variant_tensors}
    if block_table is not None:
        tensors["block_table"] = block_table
    else:
        tensors["cache_batch"], tensors["cache_start"] = cache_rows
    if varlen is None or flag is not None:   # else _packed makes it, naming cu_seqlens in its message
        _flagged(tensors, flag, q.device)

    def build():
        values = {**tensors, **dict(variant_scalars), "heads": heads, "kv_heads": k_cache.shape[2],
                  "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "softmax_scale": scale,
                  "softmax_scale_log2": scale * LOG2E, "num_splits": num_splits, "cache_entries": k_cache.shape[0],
                  "k_cache_stride_b": k_cache.stride(0), "v_cache_stride_b": v_cache.stride(0)}
        if pack_group is not None:
            values["pack_group"] = pack_group
        values.update(varlen_scalars)
        _strides_of(values, q=q, k=k_cache, v=v_cache, o=out)
        values.update(k_stride_b=0, v_stride_b=0)   # each entry's keys come from cache_views
        if block_table is not None:
            values.update(block_table_stride=block_table.stride(0), page_size=k_cache.shape[1])
        loaded, entries = launch.load(source, q.device), source.kernels
        blocks = -(-seqlen_q // entries.forward.rows_per_block)
        plan = [loaded.bind(entries.forward, (blocks * num_splits, heads, batch), values, PER_CALL_SCALARS)]
        if split:
            plan.append(loaded.bind(entries.combine, entries.combine.grid(batch, heads, seqlen_q), values))
        return plan

    def key():
        return ("kvcache", source.hash, launch.backend_key(q.device), q.shape, k_cache.shape, q.stride(),
                out.stride(), k_cache.stride(), v_cache.stride(), scale, num_splits, seqlen_k, variant_scalars,
                None if block_table is None else block_table.shape, None if varlen is None else varlen[2:],
                pack_group)

    varlen_scalars = _packed(tensors, varlen)
    _run(key, build, tensors, None, held=held)
    return out, lse


def update_kv_cache(source: Source, q, k_cache, v_cache, k_new, v_new, cache_seqlens, *, cache_batch=None,
                    cache_start=None, block_table=None, rotary=None, q_positions_step: bool = False, flag=None,
                    held: Launches | None = None):
    """Append k_new, v_new (B, N_new, Hk, d) to a kv_cache spec's cache in place at rows
    cache_seqlens[b] + t (contiguous: of cache entry cache_batch[b]; paged: through block_table),
    rotating the keys with rotary = (cos, sin, interleaved). Returns q, or with rotary a rotated
    copy (at row cache_seqlens[b] + i with q_positions_step, else at cache_seqlens[b]).
    The guard checks every entry's rows (and a contiguous cache's cache_start, 0 by default)
    before any is written: one value out of range refuses the whole append and sets `flag`
    (as forward_kv_cache's). `held` (`Launches`): see `_planned`."""
    batch, seqlen_q, heads, _ = q.shape
    cos, sin, interleaved = rotary or (None, None, False)
    q_rot = q if rotary is None else _empty(*q.shape, dtype=q.dtype, device=q.device)
    nothing = torch.empty(0, dtype=q.dtype, device=q.device) if cos is None else None
    tensors = {"q": q, "k_new": k_new, "v_new": v_new, "q_rot": q_rot, "k_cache": k_cache, "v_cache": v_cache,
               "cache_seqlens": cache_seqlens, "rotary_cos": nothing if cos is None else cos,
               "rotary_sin": nothing if sin is None else sin}
    if block_table is not None:
        tensors["block_table"] = block_table
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        tensors["cache_batch"] = cache_batch
        tensors["cache_start"] = torch.zeros_like(cache_seqlens) if cache_start is None else cache_start
        capacity = k_cache.shape[1]
    _flagged(tensors, flag, q.device)
    rotary_dim = 0 if cos is None else 2 * cos.shape[1]

    def build():
        values = {**tensors, "rotary_dim": rotary_dim, "rotary_interleaved": int(interleaved),
                  "q_positions_step": int(q_positions_step), "new_tokens": k_new.shape[1], "seqlen_q": seqlen_q,
                  "heads": heads, "kv_heads": k_cache.shape[2], "batch_size": batch, "capacity": capacity,
                  "cache_entries": k_cache.shape[0]}
        _strides_of(values, q=q, kn=k_new, vn=v_new, qr=q_rot, k=k_cache, v=v_cache)
        if block_table is not None:
            values.update(block_table_stride=block_table.stride(0), page_size=k_cache.shape[1])
        tokens = max(k_new.shape[1], seqlen_q if rotary_dim else 0)
        entry = source.kernels.cache_update
        return [launch.load(source, q.device).bind(entry, (tokens, heads, batch), values)]

    def key():
        return ("cache_update", source.hash, launch.backend_key(q.device), q.shape, q.stride(), k_new.shape,
                k_new.stride(), v_new.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(), rotary_dim,
                interleaved, q_positions_step, None if block_table is None else block_table.shape)

    _run(key, build, tensors, None, held=held)
    # The kernel wrote the caches through raw pointers: bump their version counters as torch's
    # own in-place ops do, so that autograd refuses a backward that saved their old values.
    torch.autograd.graph.increment_version((k_cache, v_cache))
    return q_rot

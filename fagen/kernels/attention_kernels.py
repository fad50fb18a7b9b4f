"""Run a rendered spec's kernels on tensors: the forward pass and the backward pass.

This is where tensors become kernel arguments: outputs and workspaces are
allocated, strides and scales filled in, and the kernels of `render.Entries`
launched in order through `launch`. Inputs are assumed valid; `ops` checks them.
Shapes: q (B, Nq, H, d), k and v (B, Nk, Hk, d); statistics (B, H, Nq) fp32.
"""

from __future__ import annotations

import math
import operator
from fractions import Fraction

import torch

from ..dtypes import TORCH_DTYPE
from . import exact_sum, fp8_operands, launch
from .params import VARLEN_PACKED, variant_arguments
from .render import Source
from ..errors import InputError, assert_lazily
from ..variants.cuda import variant_code

LOG2E = 1.4426950408889634


# Every buffer a kernel writes is allocated through `_empty(*shape, dtype=, device=)`: tests poison
# the buffers by replacing it. It is torch.empty itself, not a wrapper: a warm training step
# allocates eight buffers, and a Python frame each shows in benchmarks/call_overhead.py.
_empty = torch.empty


def new_buffer(*shape, dtype, device) -> torch.Tensor:
    """A buffer a kernel writes, for callers outside this module (through `_empty`)."""
    return _empty(*shape, dtype=dtype, device=device)


def new_output(like: torch.Tensor) -> torch.Tensor:
    """An output of `like`'s shape and dtype (through `_empty`)."""
    return _empty(*like.shape, dtype=like.dtype, device=like.device)


_unused_buffers: dict[tuple, torch.Tensor] = {}


def unused(device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """A 0-element tensor for an argument the kernels never touch in this launch (an unsplit
    step's split-KV partials, an append's rotary tables without rotary): one per device and
    dtype, not an allocation per call (it has no memory, so a CUDA graph that captured it holds
    nothing of it)."""
    buffer = _unused_buffers.get((device, dtype))
    if buffer is None:
        buffer = _unused_buffers[(device, dtype)] = torch.empty(0, dtype=dtype, device=device)
    return buffer


def strides_of(values: dict, **tensors) -> None:
    for name, t in tensors.items():
        if t.dim() == 3:   # packed sequences (total, H, d): the kernels offset rows by cu_seqlens
            values.update({f"{name}_stride_b": 0, f"{name}_stride_n": t.stride(0), f"{name}_stride_h": t.stride(1)})
            continue
        values.update({f"{name}_stride_b": t.stride(0), f"{name}_stride_n": t.stride(1),
                       f"{name}_stride_h": t.stride(2)})


def geometry(q, k, varlen):
    """(batch, seqlen_q, heads, head_dim, seqlen_k, kv_heads); for packed sequences (`varlen` =
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)) the lengths are the maxima."""
    if varlen is None:
        return (*q.shape, k.shape[1], k.shape[2])
    cu_q, _, max_q, max_k = varlen
    return cu_q.shape[0] - 1, max_q, q.shape[1], q.shape[2], max_k, k.shape[1]


def varlen_key(varlen):
    """What a plan bakes in of packed sequences (`varlen`): the batch (cu_seqlens_q's length: the
    grid and the statistics) and the max lengths; None for dense calls."""
    return None if varlen is None else (varlen[0].shape[0], varlen[2], varlen[3])


def packed_scalars(q, k, varlen) -> dict:
    """Packed sequences' scalar arguments: the max lengths and the packed totals (k None: no
    packed keys, as in decoding over a paged cache)."""
    if varlen is None:
        return {}
    return {"max_seqlen_q": varlen[2], "max_seqlen_k": varlen[3], "total_q": q.shape[0],
            "total_k": 0 if k is None else k.shape[0]}


def packed_tensors(tensors: dict, varlen) -> None:
    """Packed sequences: renames the data tensors to their parameters (`<name>_packed`), adds
    cu_seqlens and the error flag of the kernels' guard (raised after the launches:
    `_raise_refused`)."""
    if varlen is None:
        return
    for name in VARLEN_PACKED:
        if name in tensors:
            tensors[name + "_packed"] = tensors.pop(name)
    tensors.update(cu_seqlens_q=varlen[0], cu_seqlens_k=varlen[1])
    if "error_flag" not in tensors:   # decoding's forward brings its own, raised by its caller
        tensors["error_flag"] = error_flag(varlen[0].device)
        paged = "block_table" in tensors
        tensors[REFUSAL] = PACKED_REFUSED.format("cu_seqlens_q, cu_seqlens_k or block_table" if paged else
                                                 "cu_seqlens_q or cu_seqlens_k", PAGED_REFUSED * paged)


def packed_sequences(tensors: dict, varlen) -> dict:
    """`packed_tensors`, and returns `packed_scalars` of the packed q and k in `tensors`."""
    packed_tensors(tensors, varlen)
    if varlen is None:
        return {}
    return packed_scalars(tensors["q_packed"], tensors.get("k_packed"), varlen)


# -- the guards' error flag -------------------------------------------------------------------
# Index values (cu_seqlens, cache_seqlens, cache_batch_idx, cache_leftpad, block tables) are
# not read on the host by default: that would be a device sync per call. The kernels check them
# instead (the guards of macros.j2 and cache_update.cu.j2): a value that would reach outside a
# tensor is refused, nothing read or written there, and the int32 flag set (an atomic: refusing
# blocks run in no defined order; macros.j2 flag_refusal); the call raises from the flag lazily
# (torch._assert_async: on a GPU an asynchronous device-side assert, on the CPU at once).
# FAGEN_CHECK_VALUES=1 checks the values on the host first, with exact messages.

REFUSAL = "refusal message"   # a `tensors` entry that is no kernel parameter: what launch_planned raises
PACKED_REFUSED = ("an index value is out of range in {} (a sequence outside the packed rows, or longer than "
                  "max_seqlen_q / max_seqlen_k{})")
PAGED_REFUSED = "; more keys than the sequence's row of block_table has pages for, or a page outside the cache"
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


# Per call signature (source, backend, shapes, strides, scale, dropout p): the attention passes'
# `Plan`s, the kv cache's bound launches. A warm call of a seen shape only allocates its outputs
# and passes the tensors.
_plans: dict[tuple, Plan | list[launch.BoundLaunch]] = {}
MAX_PLANS = 1024
# Drawn anew for every dropout call; and a shard's dropout coordinates (Spec.coord_offsets).
PER_CALL_SCALARS = frozenset({"seed", "philox_offset", "row_offset", "col_offset"})
# What a call without values of its own passes for them (and for seqlens_k): in every plan, so
# that such a call (dense.DenseCall's) only adds q, k and v.
CALL_DEFAULTS = {"seqlens_k": None, "seed": 0, "philox_offset": 0, "row_offset": 0, "col_offset": 0}


def _planned(key, plans: dict | None, build, *args):
    """The plan kept under `key` in `plans` (None: this module's table), built by `build(*args)` on
    a miss and kept. A key of None (a debug render, which takes instrumentation tensors) is built
    every time and never kept. (`build` and its arguments, not a closure: a closure makes every
    variable it captures a cell in the caller, which a warm call pays for.)"""
    plans = _plans if plans is None else plans
    plan = None if key is None else plans.get(key)
    return plan if plan is not None else _remember(plans, key, build(*args))


class Plan:
    """What a warm call of one signature does: allocate its buffers ((kernel parameter name,
    shape, dtype), each through `_empty`), add the call's own tensors, and launch the bound
    kernels. Everything else (geometry, strides, scalars converted to their C types) is derived
    once, when the plan is built. `results` names the buffers the call returns; `fixed` holds
    values that are the same on every call (`unused` tensors), and CALL_DEFAULTS. `group`: a
    backward's query heads per K/V head (its dK and dV are summed over them, `_summed_groups`)."""

    __slots__ = ("launches", "buffers", "results", "fixed", "take_results", "group")

    def __init__(self, launches: list, buffers: list[tuple[str, tuple, torch.dtype]], results: tuple,
                 fixed: dict | None = None, group: int = 1):
        self.launches = launches
        self.buffers = buffers
        self.results = results
        self.fixed = {**CALL_DEFAULTS, **(fixed or {})}
        self.take_results = operator.itemgetter(*results)   # tensors -> the results, in order
        self.group = group

    def allocate(self, device: torch.device) -> dict:
        """The call's tensors by kernel parameter name: its new buffers and the fixed values."""
        tensors = self.fixed.copy()
        empty = _empty   # looked up per call: tests poison buffers by replacing it
        for name, shape, dtype in self.buffers:
            tensors[name] = empty(*shape, dtype=dtype, device=device)
        return tensors


class Memo(dict):
    """A caller's own plans, for a call whose signature (dense.DenseCall's: q, k and v's shapes,
    strides, dtypes, devices and the scalar arguments, with no tensors of its own beyond q, k, v)
    fixes everything in `forward`'s and `backward`'s keys but the kernels, the backend and the
    strides the kernels see (q, k or v copied into alignment: common.aligned_rows; dO's): a warm
    call skips building the full key. The caller keeps one per kernels and backend
    (`launch.backend_key`), so the keys hold only the strides.

    Such a call runs through `Memo.forward` and `Memo.backward`: with its plan kept, they only
    allocate, add the call's tensors and launch (what a plain call needs of `forward` and
    `backward`, whose general path they take to build the plan)."""

    LIMIT = 16

    def forward(self, source: Source, q, k, v, softmax_scale) -> tuple:
        """`forward` of a call with no values of its own: (out, *stats)."""
        plan = self.get(_memo_forward_key(q, k, v))
        if plan is None:
            out, stats = forward(source, q, k, v, softmax_scale=softmax_scale, memo=self)
            return (out, *stats)
        tensors = plan.allocate(q.device)
        tensors["q"], tensors["k"], tensors["v"] = q, k, v
        launch_all(plan.launches, tensors)
        return plan.take_results(tensors)

    def backward(self, source: Source, q, k, v, out, stats, dout, softmax_scale) -> tuple:
        """`backward` of a call with no values of its own and no gradient of L: (dq, dk, dv)."""
        plan = self.get(_memo_backward_key(q, k, v, dout))
        if plan is None:
            return backward(source, q, k, v, out, stats, dout, softmax_scale=softmax_scale, memo=self)
        tensors = plan.allocate(q.device)
        tensors["q"], tensors["k"], tensors["v"], tensors["out"], tensors["dout"] = q, k, v, out, dout
        _add_stats(tensors, stats)
        launch_all(plan.launches, tensors)
        dq, dk, dv = plan.take_results(tensors)
        return (dq, *_summed_groups(dk, dv, plan.group, q.dtype)) if plan.group > 1 else (dq, dk, dv)


def _memo_forward_key(q, k, v) -> tuple:
    return ("fwd", q.stride(), k.stride(), v.stride())


def _memo_backward_key(q, k, v, dout) -> tuple:
    return ("bwd", q.stride(), k.stride(), v.stride(), dout.stride())


def _remember(plans: dict, key, plan: Plan) -> Plan:
    """Keep `plan` under `key` in `plans` (a key of None: a debug render, never kept), bounded:
    many distinct keys start it over."""
    if key is not None:
        if len(plans) >= (Memo.LIMIT if isinstance(plans, Memo) else MAX_PLANS):
            plans.clear()
        plans[key] = plan
    return plan


def _meta(buffer: tuple) -> torch.Tensor:
    """A buffer's layout without memory, for its strides at plan time."""
    _, shape, dtype = buffer
    return torch.empty(shape, dtype=dtype, device="meta")


def _scale(softmax_scale, q) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def launch_all(plan: list[launch.BoundLaunch], tensors: dict, after_first=None) -> None:
    """Launch a call's bound kernels in order with its tensors (each pointer converted once)."""
    converted: dict = {}
    for bound in plan:
        bound(tensors, converted)
        if after_first is not None:
            after_first()
            after_first = None


def launch_planned(plan_key, build, tensors: dict, debug, after_first=None) -> None:
    """Run the bound launches of `plan_key` (`_planned`) with `tensors`, then raise from the
    guards' flag where the call owns one (REFUSAL)."""
    launch_all(_planned(None if debug else plan_key(), None, build), tensors, after_first)
    _raise_refused(tensors)


def _raise_refused(tensors: dict) -> None:
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


def split_variant(spec, variant: dict | None, softmax_scale: float) -> tuple[dict, tuple]:
    """A variant's kernel arguments (params.variant_arguments) as per-call tensors, and its
    scalars as a hashable part of the launch plan's key (scalars are bound into the plan)."""
    if not variant:   # plain attention: the hot path of most calls
        return {}, ()
    variant = variant_arguments(spec, variant, softmax_scale)
    tensors = {n: x for n, x in variant.items() if isinstance(x, torch.Tensor)}
    scalars = tuple(sorted((n, x) for n, x in variant.items() if not isinstance(x, torch.Tensor)))
    return tensors, scalars


def forward(source: Source, q, k, v, *, softmax_scale=None, seqlens_k=None, dropout_p=0.0,
            seed=0, philox_offset=0, debug=None, variant_values=None, varlen=None, coord_offsets=(0, 0), memo=None,
            descales=None):
    """Launch `source`'s forward kernel. Returns (out, stats) where stats is
    (lse,) for version 2 and (m, l) for version 1. `variant_values` holds a variant's run-time
    arguments by kernel parameter name (`variant_arguments`). With `varlen` = (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k), q is (total_q, H, d) and k, v (total_k, Hk, d),
    and the statistics are (B, H, max_seqlen_q) with each sequence's rows first. `memo`: a
    caller's own plans (`Memo`). An 8-bit spec (Spec.fp8) takes e4m3 q, k and v, and `descales`
    {"q_descale": (B, Hk) fp32, ...} (one missing is 1); its O is bf16."""
    variant_tensors, variant_scalars = (split_variant(source.spec, variant_values, _scale(softmax_scale, q))
                                        if variant_values else ({}, ()))
    key = None
    if memo is not None and not debug:
        key = _memo_forward_key(q, k, v)
    elif not debug:
        key = ("fwd", source.hash, launch.backend_key(q.device), q.shape, k.shape, q.stride(), k.stride(),
               v.stride(), _scale(softmax_scale, q), dropout_p, variant_scalars, varlen_key(varlen))
    plan = _planned(key, memo, _forward_plan, source, q, k, v, softmax_scale, dropout_p, variant_scalars, varlen,
                    debug)
    tensors = plan.allocate(q.device)
    out, *stats = plan.take_results(tensors)
    tensors["q"], tensors["k"], tensors["v"] = q, k, v
    if source.spec.fp8:
        tensors.update(fp8_operands.kernel_tensors(source.spec, k, v, descales, varlen))
    _call_values(tensors, seqlens_k, seed, philox_offset, coord_offsets, variant_tensors, debug)
    if varlen is not None:
        packed_tensors(tensors, varlen)
    launch_all(plan.launches, tensors)
    if varlen is not None:
        _raise_refused(tensors)
    return out, tuple(stats)


def _call_values(tensors: dict, seqlens_k, seed, philox_offset, coord_offsets, variant_tensors, debug) -> None:
    """A call's own values over the plan's CALL_DEFAULTS (a plain call has none)."""
    if seqlens_k is not None:
        tensors["seqlens_k"] = seqlens_k
    if seed or philox_offset:
        tensors["seed"], tensors["philox_offset"] = seed, philox_offset
    if coord_offsets[0] or coord_offsets[1]:
        tensors["row_offset"], tensors["col_offset"] = coord_offsets
    if variant_tensors:
        tensors.update(variant_tensors)
    if debug:
        tensors.update(debug)


def _forward_plan(source: Source, q, k, v, softmax_scale, dropout_p, variant_scalars, varlen, debug) -> Plan:
    spec, scale = source.spec, _scale(softmax_scale, q)
    batch, seqlen_q, heads, head_dim, seqlen_k, kv_heads = geometry(q, k, varlen)
    stat_names = ("lse",) if spec.version == 2 else ("row_max_out", "row_sum_out")
    buffers = [("out", (*q.shape[:-1], v.shape[-1]), TORCH_DTYPE[spec.output_dtype])]   # d_v columns
    buffers += [(name, (batch, heads, seqlen_q), torch.float32) for name in stat_names]
    if spec.version == 1:
        buffers.append(("o_accum", (batch, heads, seqlen_q, head_dim), torch.float32))
    values = {**dict(variant_scalars), **packed_scalars(q, k, varlen), "heads": heads, "kv_heads": kv_heads,
              "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "softmax_scale": scale, "softmax_scale_log2": scale * LOG2E}
    strides_of(values, q=q, k=k, v=v, o=_meta(buffers[0]))
    if spec.dropout:
        values.update(dropout_args(dropout_p, 0, 0))   # seed and offset are per call
    values.update(debug or {})
    entry = source.kernels.forward
    bound = launch.load(source, q.device).bind(entry, entry.grid(batch, heads, seqlen_q, seqlen_k), values,
                                               PER_CALL_SCALARS)
    return Plan([bound], buffers, results=("out", *stat_names))


def backward(source: Source, q, k, v, out, stats, dout, *, softmax_scale=None, seqlens_k=None,
             dropout_args=None, debug=None, variant_values=None, dlse=None, extras=None, varlen=None,
             coord_offsets=(0, 0),
             memo=None, descales=None):
    """Launch `source`'s backward kernels. Returns (dq, dk, dv) in q's dtype (bf16 for an 8-bit
    spec, whose q, k and v are e4m3, O and dO e4m3, e5m2 or bf16, widened to bf16 exactly, with
    `descales` {"q_descale": (B, Hk) fp32, ..., "o_descale", "do_descale"}, one missing 1; where the
    spec names dO's 8-bit dtype (Spec.dout_dtype), dout must be in it).

    dK and dV are computed per query head; with GQA/MQA the kernel writes them in fp32 and
    the query heads that share a K/V head are summed here, then rounded once. `dlse` (B, H, Nq), the gradient of the
    returned L, enters as D - dL (dS = P (dP - (D - dL))). With `extras` (a dict), a
    variant's other gradients are filled in: "dsinks" (H,) and, per captured tensor whose
    gradient the kernel accumulates, "<name>_grad" (fp32, the tensor's shape). `memo`: a caller's
    own plans (`Memo`).
    """
    spec = source.spec
    eight_bit = fp8_operands.eight_bit_scores(spec, q, k, v, dout)   # S^T's and dP^T's operands, if 8-bit
    if spec.fp8:   # where dP^T reads the 8-bit V, no kernel reads a widened one: not made
        q, k, out, dout = (fp8_operands.widened(t) for t in (q, k, out, dout))
        v = v if eight_bit else fp8_operands.widened(v)
    drop = dropout_args or {}
    variant_tensors, variant_scalars = (split_variant(spec, variant_values, _scale(softmax_scale, q))
                                        if variant_values else ({}, ()))
    key = None
    if memo is not None and not debug:
        key = _memo_backward_key(q, k, v, dout)
    elif not debug:
        key = ("bwd", source.hash, launch.backend_key(q.device), q.shape, k.shape, q.stride(), k.stride(),
               v.stride(), out.stride(), dout.stride(), _scale(softmax_scale, q), drop.get("keep_threshold"),
               variant_scalars,
               varlen_key(varlen))
    plan = _planned(key, memo, _backward_plan, source, q, k, v, out, dout, softmax_scale, drop, variant_scalars, varlen,
                    debug)
    tensors = plan.allocate(q.device)
    dq, dk, dv = plan.take_results(tensors)
    tensors["q"], tensors["k"], tensors["v"], tensors["out"], tensors["dout"] = q, k, v, out, dout
    if spec.fp8:
        tensors.update(fp8_operands.backward_tensors(k, descales, varlen), **eight_bit)
    _add_stats(tensors, stats)
    grads = _capture_gradients(spec, variant_tensors, q, k, varlen) if variant_values else {}
    _call_values(tensors, seqlens_k, drop.get("seed", 0), drop.get("philox_offset", 0), coord_offsets,
                 {**variant_tensors, **grads} if grads else variant_tensors, debug)
    delta = tensors["delta"]   # (renamed delta_packed for packed sequences)
    if varlen is not None:
        packed_tensors(tensors, varlen)
    launch_all(plan.launches, tensors, after_first=None if dlse is None else _subtract_dlse(delta, dlse))
    if varlen is not None:
        _raise_refused(tensors)
    if extras is not None and variant_values:
        extras.update({n: exact_sum.value(g) for n, g in grads.items()} if spec.deterministic else grads)
        if spec.sinks:
            extras["dsinks"] = sink_gradient(variant_tensors["sinks"], stats, spec.version,
                                             delta[:, :, :stats[0].shape[-1]],
                                             None if varlen is None else sequence_rows(varlen))
    if plan.group > 1:
        dk, dv = _summed_groups(dk, dv, plan.group, q.dtype)
    return dq, dk, dv


def _add_stats(tensors: dict, stats: tuple) -> None:
    """The forward's statistics, as the backward kernels take them: (lse,) for version 2, (m, l)
    for version 1."""
    if len(stats) == 1:
        tensors["lse"] = stats[0]
    else:
        tensors["row_max"], tensors["row_sum"] = stats


def _summed_groups(dk, dv, group: int, dtype) -> tuple:
    """GQA's dK and dV: written per query head in fp32, the heads of each K/V head's group summed,
    then rounded once to q's dtype."""
    *outer, heads, _ = dk.shape
    return tuple(g.view(*outer, heads // group, group, g.shape[-1]).sum(-2).to(dtype) for g in (dk, dv))


def _capture_gradients(spec, variant_tensors: dict, q, k, varlen) -> dict:
    """Zeroed gradients of the captured tensors the backward kernel accumulates: fp32 (float
    atomics), or for a deterministic spec an order-free sum's digits (fagen.kernels.exact_sum),
    whose int64 digits hold the terms of at most exact_sum.MAX_TERMS scores."""
    shapes = {name: variant_tensors[name.removesuffix("_grad")].shape for name, _, _ in variant_code(spec).grad_params}
    if not spec.deterministic:
        return {name: torch.zeros(shape, dtype=torch.float32, device=q.device) for name, shape in shapes.items()}
    batch, rows, keys = ((varlen[0].numel() - 1, varlen[2], varlen[3]) if varlen is not None
                         else (q.shape[0], q.shape[1], k.shape[1]))
    scores = batch * q.shape[-2] * rows * keys   # a bound on the terms one element can take
    if shapes and scores >= exact_sum.MAX_TERMS:
        raise InputError(f"deterministic=True sums a captured tensor's gradient exactly over fewer than "
                         f"2^{exact_sum.MAX_TERMS.bit_length() - 1} scores; "
                         f"this call has {scores} (batch {batch} x heads {q.shape[-2]} x queries {rows} x "
                         f"keys {keys}): split the call, or use deterministic=False")
    return {name: exact_sum.zeros(shape, q.device) for name, shape in shapes.items()}


def _subtract_dlse(delta: torch.Tensor, dlse: torch.Tensor):
    """What runs after the preprocess kernel when L has a gradient: D - dL for every row."""
    def subtract():
        delta[:, :, :dlse.shape[-1]] -= dlse.to(torch.float32)
    return subtract


def _backward_plan(source: Source, q, k, v, out, dout, softmax_scale, drop, variant_scalars, varlen, debug) -> Plan:
    spec, kernels, scale = source.spec, source.kernels, _scale(softmax_scale, q)
    batch, seqlen_q, heads, head_dim, seqlen_k, kv_heads = geometry(q, k, varlen)
    device = q.device
    if device.type == "cuda":  # the compile checked only the forward's shared memory
        spec.check_arch(launch.arch_of(device), shared_limit=launch.shared_limit(device))
    f32 = torch.float32
    # dK and dV per query head; under GQA in fp32, so that a group's heads are summed before the
    # one rounding to q's dtype (as FlashAttention-3 does; FlashAttention-2 rounds every head's).
    grouped = heads != kv_heads
    dk_name, dv_name = ("dk_out_fp32", "dv_out_fp32") if grouped else ("dk_out", "dv_out")
    # D and the statistic in log2 units, written by the preprocess kernel in rows padded to
    # whole backward Q blocks (the main kernel copies them with 16-byte cp.async).
    block_m = kernels.bwd_preprocess.rows_per_block   # the backward's Q block (spec.backward_tiles.block_m)
    padded_rows = -(-seqlen_q // block_m) * block_m
    buffers = [("dq", tuple(q.shape), q.dtype),
               (dk_name, (*k.shape[:-2], heads, head_dim), f32 if grouped else q.dtype),
               (dv_name, (*k.shape[:-2], heads, v.shape[-1]), f32 if grouped else q.dtype),
               ("delta", (batch, heads, padded_rows), f32), ("lse_log2", (batch, heads, padded_rows), f32)]
    taken = {p.name.removesuffix("_packed") for e in kernels.backward for p in e.params}
    if "dq_accum" in taken:   # not where a deterministic dQ has a pass of its own (sm80's)
        buffers.append(("dq_accum", (batch, heads, seqlen_q, head_dim), f32))
    if "dq_blocks" in taken:   # whole query blocks (sm90's): zeroed by the preprocess, padding included
        buffers.append(("dq_blocks", (batch, heads, padded_rows, head_dim), f32))
    if "dq_semaphore" in taken:   # dQ's reductions in a fixed order (sm90's deterministic): zeroed by the preprocess
        buffers.append(("dq_semaphore", (batch, heads, padded_rows), torch.int32))
    unused_ones = ({"dk_out": unused(device, q.dtype), "dv_out": unused(device, q.dtype)} if grouped else
                   {"dk_out_fp32": unused(device), "dv_out_fp32": unused(device)})
    values = {**drop, **dict(variant_scalars), **packed_scalars(q, k, varlen), "heads": heads, "kv_heads": kv_heads,
              "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "softmax_scale": scale, "softmax_scale_log2": scale * LOG2E}
    strides_of(values, q=q, k=k, v=v, o=out, do=dout, dq=_meta(buffers[0]), dk=_meta(buffers[1]),
               dv=_meta(buffers[2]))
    values.update(debug or {})
    loaded = launch.load(source, device)
    launches = [loaded.bind(entry, entry.grid(batch, heads, seqlen_q, seqlen_k), values, PER_CALL_SCALARS)
                for entry in kernels.backward]
    return Plan(launches, buffers, results=("dq", dk_name, dv_name), fixed=unused_ones, group=heads // kv_heads)

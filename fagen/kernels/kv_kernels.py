"""Run a kv_cache spec's kernels on tensors: the append (with rotary) and the attention over the
cache, with its split-KV combine.

Each kernel has three parts here, so that a caller that keys its own calls (a decoding step's
plan, `fagen.ops.kvcache.StepPlan`) can bind once and then only pass tensors:
  - `*_arguments`: a call's tensors by kernel parameter name;
  - `bind_*`: the bound launches (`launch.BoundLaunch`: every scalar and stride converted once)
    for tensors of those shapes and strides;
  - `update_kv_cache` / `forward_kv_cache`: both, for one call, with the launches memoized per
    call signature in `attention_kernels`' plans.
Inputs are assumed valid; `fagen.ops` checks them. The index values (cache_seqlens,
cache_batch_idx, cache_leftpad, block tables) are checked by the kernels' guards, which set
the error flag (`attention_kernels.error_flag`) that the caller raises from lazily.
"""

from __future__ import annotations

import math

import torch

from . import attention_kernels, launch
from .render import Source

DECODE_REFUSED = ("an index value is out of range in cache_seqlens, cache_batch_idx, cache_leftpad or block_table "
                  "(an entry's keys outside the cache or more than its row of block_table has pages for, or a "
                  "page outside the cache)")


def _flagged(tensors: dict, flag, device) -> None:
    """A decoding launch's error flag: the caller's (one flag for a whole step, raised by the
    caller after its last launch), else its own, raised by `attention_kernels.launch_planned` after the launch."""
    if flag is None:
        flag = attention_kernels.error_flag(device)
        tensors[attention_kernels.REFUSAL] = DECODE_REFUSED
    tensors["error_flag"] = flag


def _cache_rows(tensors: dict, cache_rows, block_table) -> None:
    """Where each batch entry's keys live: a paged cache's block table, else a contiguous
    cache's (cache_batch, cache_start), int32 (B,) each."""
    if block_table is not None:
        tensors["block_table"] = block_table
    else:
        tensors["cache_batch"], tensors["cache_start"] = cache_rows


# -- the append -------------------------------------------------------------------------------

def cache_update_arguments(q, q_rot, k_new, v_new, k_cache, v_cache, cache_seqlens, rotary_cos, rotary_sin, flag, *,
                           cache_rows=None, block_table=None, descales=None) -> dict:
    """The cache update kernel's tensors: without rotary, q_rot is q and the tables are
    0-element (`attention_kernels.unused`); an 8-bit cache's `descales` = (k_descale, v_descale)."""
    tensors = {"q": q, "k_new": k_new, "v_new": v_new, "q_rot": q_rot, "k_cache": k_cache, "v_cache": v_cache,
               "cache_seqlens": cache_seqlens, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
               "error_flag": flag}
    _cache_rows(tensors, cache_rows, block_table)
    _descales(tensors, descales)
    return tensors


def _descales(tensors: dict, descales) -> None:
    """An 8-bit cache's (Spec.cache_dtype) k_descale and v_descale, fp32 (B, Hk) each; its caches
    pass as their bytes (the kernels' unsigned char: float8_e4m3fn has no C type of its own)."""
    if descales is not None:
        tensors["k_descale"], tensors["v_descale"] = descales
        for name in ("k_cache", "v_cache"):
            tensors[name] = tensors[name].view(torch.uint8)


def bind_cache_update(source: Source, tensors: dict, *, interleaved: bool,
                      q_positions_step: bool) -> list[launch.BoundLaunch]:
    """The append's launch for `cache_update_arguments` of these shapes and strides: one block
    per (token, head, batch entry)."""
    q, k_new, k_cache, block_table = tensors["q"], tensors["k_new"], tensors["k_cache"], tensors.get("block_table")
    batch, seqlen_q, heads, _ = q.shape
    # Without rotary its tables are attention_kernels.unused: 0 elements.
    rotary_dim = 2 * tensors["rotary_cos"].shape[1] if tensors["rotary_cos"].dim() == 2 else 0
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    values = {**tensors, "rotary_dim": rotary_dim, "rotary_interleaved": int(interleaved),
              "q_positions_step": int(q_positions_step), "new_tokens": k_new.shape[1], "seqlen_q": seqlen_q,
              "heads": heads, "kv_heads": k_cache.shape[2], "batch_size": batch, "capacity": capacity,
              "cache_entries": k_cache.shape[0]}
    attention_kernels.strides_of(values, q=q, kn=k_new, vn=tensors["v_new"], qr=tensors["q_rot"], k=k_cache,
                                 v=tensors["v_cache"])
    if block_table is not None:
        values.update(block_table_stride=block_table.stride(0), page_size=k_cache.shape[1])
    tokens = max(k_new.shape[1], seqlen_q if rotary_dim else 0)
    entry = source.kernels.cache_update
    return [launch.load(source, q.device).bind(entry, (tokens, heads, batch), values)]


def update_kv_cache(source: Source, q, k_cache, v_cache, k_new, v_new, cache_seqlens, *, cache_batch=None,
                    cache_start=None, block_table=None, rotary=None, q_positions_step: bool = False, flag=None,
                    descales=None):
    """Append k_new, v_new (B, N_new, Hk, d) to a kv_cache spec's cache in place at rows
    cache_seqlens[b] + t (contiguous: of cache entry cache_batch[b]; paged: through block_table),
    rotating the keys with rotary = (cos, sin, interleaved). Returns q, or with rotary a rotated
    copy (at row cache_seqlens[b] + i with q_positions_step, else at cache_seqlens[b]).
    The guard checks every entry's rows (and a contiguous cache's cache_start, 0 by default)
    before any is written: one value out of range refuses the whole append and sets `flag`
    (as forward_kv_cache's). An 8-bit cache (Spec.cache_dtype) takes `descales` = (k_descale,
    v_descale), fp32 (B, Hk): each new row is stored as e4m3(x / its descale)."""
    cos, sin, interleaved = rotary or (None, None, False)
    q_rot = q if rotary is None else attention_kernels.new_output(q)
    if block_table is None and cache_start is None:
        cache_start = torch.zeros_like(cache_seqlens)
    nothing = attention_kernels.unused(q.device, q.dtype)
    tensors = cache_update_arguments(q, q_rot, k_new, v_new, k_cache, v_cache, cache_seqlens,
                                     nothing if cos is None else cos, nothing if sin is None else sin, None,
                                     cache_rows=(cache_batch, cache_start), block_table=block_table, descales=descales)
    _flagged(tensors, flag, q.device)

    def key():
        return ("cache_update", source.hash, launch.backend_key(q.device), q.shape, q.stride(), k_new.shape,
                k_new.stride(), v_new.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
                None if cos is None else cos.shape, interleaved, q_positions_step,
                None if block_table is None else block_table.shape)

    attention_kernels.launch_planned(key, lambda: bind_cache_update(source, tensors, interleaved=interleaved,
                                            q_positions_step=q_positions_step), tensors, None)
    # The kernel wrote the caches through raw pointers: bump their version counters as torch's
    # own in-place ops do, so that autograd refuses a backward that saved their old values.
    torch.autograd.graph.increment_version((k_cache, v_cache))
    return q_rot


# -- the attention over the cache ---------------------------------------------------------------

def kv_cache_arguments(q, k_cache, v_cache, out, lse, seqlens_k, o_partial, lse_partial, flag, *, cache_rows=None,
                       block_table=None, variant_tensors=None, descales=None) -> dict:
    """The attention kernel's tensors (the combine kernel takes the same names); `flag` None:
    the caller adds one (`_flagged`, or packed sequences' own in `attention_kernels.packed_sequences`)."""
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "out": out, "lse": lse, "seqlens_k": seqlens_k,
               "o_partial": o_partial, "lse_partial": lse_partial}
    if flag is not None:
        tensors["error_flag"] = flag
    _cache_rows(tensors, cache_rows, block_table)
    if variant_tensors:
        tensors.update(variant_tensors)
    _descales(tensors, descales)
    return tensors


def partials(q, heads: int, seqlen_q: int, num_splits: int, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV's fp32 partial O (B, H, Nq, splits, d_v) and L (B, H, Nq, splits); an unsplit
    launch never touches them (0-element stand-ins)."""
    if num_splits == 1:
        return attention_kernels.unused(q.device), attention_kernels.unused(q.device)
    f32 = {"dtype": torch.float32, "device": q.device}
    return (attention_kernels.new_buffer(q.shape[0], heads, seqlen_q, num_splits, head_dim_v, **f32),
            attention_kernels.new_buffer(q.shape[0], heads, seqlen_q, num_splits, **f32))


def bind_kv_cache(source: Source, tensors: dict, *, batch: int, seqlen_q: int, heads: int, seqlen_k: int,
                  scale: float, num_splits: int, pack_group: int | None, new_tokens: int,
                  scalars: dict) -> list[launch.BoundLaunch]:
    """The attention's launches (and with num_splits > 1 the combine's) for `kv_cache_arguments`
    of these shapes and strides; `scalars` are the variant's and packed sequences' own."""
    q, out = (tensors[name + "_packed"] if name + "_packed" in tensors else tensors[name] for name in ("q", "out"))
    k_cache, v_cache, block_table = tensors["k_cache"], tensors["v_cache"], tensors.get("block_table")
    values = {**tensors, **scalars, "heads": heads, "kv_heads": k_cache.shape[2], "seqlen_q": seqlen_q,
              "seqlen_k": seqlen_k, "softmax_scale": scale, "softmax_scale_log2": scale * attention_kernels.LOG2E,
              "num_splits": num_splits, "new_tokens": new_tokens, "cache_entries": k_cache.shape[0],
              "k_cache_stride_b": k_cache.stride(0),
              "v_cache_stride_b": v_cache.stride(0)}
    if pack_group is not None:
        values["pack_group"] = pack_group
    attention_kernels.strides_of(values, q=q, k=k_cache, v=v_cache, o=out)
    values.update(k_stride_b=0, v_stride_b=0)   # each entry's keys come from cache_views
    if block_table is not None:   # max_pages from the table itself: the guard's bound on an entry's pages
        values.update(block_table_stride=block_table.stride(0), page_size=k_cache.shape[1],
                      max_pages=block_table.shape[1])
    loaded, entries = launch.load(source, q.device), source.kernels
    blocks = -(-seqlen_q // entries.forward.rows_per_block)
    plan = [loaded.bind(entries.forward, (blocks * num_splits * entries.forward.slices, heads, batch), values,
                        attention_kernels.PER_CALL_SCALARS)]
    if num_splits > 1:
        plan.append(loaded.bind(entries.combine, entries.combine.grid(batch, heads, seqlen_q), values))
    return plan


def forward_kv_cache(source: Source, q, k_cache, v_cache, seqlens_k, *, seqlen_k: int, cache_rows=None,
                     block_table=None, num_splits: int = 1, softmax_scale=None, variant_values=None, varlen=None,
                     pack_group: int | None = None, flag=None, new_tokens: int = 0, descales=None):
    """Launch a kv_cache spec's forward over the cache, and with num_splits > 1 its combine kernel.

    q (B, Nq, H, d); seqlens_k (B,) int32 and new_tokens: entry b's keys end at cache row
    seqlens_k[b] + new_tokens (a step's cache_seqlens, and the rows it appended); seqlen_k bounds
    them (the cache's capacity). A contiguous cache (B_cache, N_cache, Hk, d) takes cache_rows =
    (cache_batch, cache_start), int32 (B,): the cache entry and first row of each batch entry (its
    keys are rows cache_start[b] .. that end); a paged one (pages, page_size, Hk, d) takes
    block_table (B, max_pages) int32. Returns (out, lse (B, H, Nq)).
    With `varlen` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) q is packed (total_q,
    H, d), the cache paged, seqlens_k unused and L (B, H, max_seqlen_q) slots; no splits.
    A Spec.pack_gqa source takes q packed (B, Nq * group, Hk, d) and pack_group = group.
    The guards refuse index values that reach outside the cache and set `flag` (int32 (1,),
    `attention_kernels.error_flag`); without one the call makes its own and raises from it
    (`attention_kernels.raise_flagged`). An 8-bit cache (Spec.cache_dtype) takes `descales` =
    (k_descale, v_descale), fp32 (B, Hk): the cached K and V are its e4m3 values times them.
    """
    batch, seqlen_q, heads, head_dim = attention_kernels.geometry(q, q, varlen)[:4]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    head_dim_v = v_cache.shape[-1]
    out = attention_kernels.new_buffer(*q.shape[:-1], head_dim_v, dtype=q.dtype, device=q.device)   # d_v columns
    lse = attention_kernels.new_buffer(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    variant_tensors, variant_scalars = attention_kernels.split_variant(source.spec, variant_values, scale)
    tensors = kv_cache_arguments(q, k_cache, v_cache, out, lse, seqlens_k,
                                 *partials(q, heads, seqlen_q, num_splits, head_dim_v),
                                 None, cache_rows=cache_rows, block_table=block_table, variant_tensors=variant_tensors,
                                 descales=descales)
    # Else attention_kernels.packed_sequences makes it, naming cu_seqlens in its message.
    if varlen is None or flag is not None:
        _flagged(tensors, flag, q.device)
    varlen_scalars = attention_kernels.packed_sequences(tensors, varlen)

    def key():
        return ("kvcache", source.hash, launch.backend_key(q.device), q.shape, k_cache.shape, q.stride(),
                k_cache.stride(), v_cache.stride(), scale, num_splits, new_tokens, seqlen_k, variant_scalars,
                None if block_table is None else block_table.shape, attention_kernels.varlen_key(varlen),
                pack_group)

    def bind():
        return bind_kv_cache(source, tensors, batch=batch, seqlen_q=seqlen_q, heads=heads, seqlen_k=seqlen_k,
                             scale=scale, num_splits=num_splits, pack_group=pack_group, new_tokens=new_tokens,
                             scalars={**dict(variant_scalars), **varlen_scalars})

    attention_kernels.launch_planned(key, bind, tensors, None)
    return out, lse

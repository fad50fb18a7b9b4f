"""`flash_attn_with_kvcache`: one decoding step against a KV cache, flash-attn 2.8's signature.

A step (1) rotates q and the new keys (rotary), (2) appends the new keys and values to the
cache in place at cache_seqlens, and (3) attends over each entry's keys with a kv_cache spec
(Spec.kv_cache): the kernel reads a contiguous cache through cache_batch_idx / cache_leftpad,
or a paged one through block_table, in place. Nq = 1 leaves most of a 64-row tile empty,
so the query heads that share a K/V head are packed into the tile's rows (GQA packing; the
kernel maps each row back to its own query and head), and the keys are split into num_splits
ranges whose fp32 partials a combine kernel merges by L (the identity of fagen.merge_attention),
so that a small batch still fills the GPU.
Forward only, as in flash-attn: inputs that require grad run, and only a backward raises
(fagen.errors.forward_only). Everything is checked before the cache is written; the append bumps
the caches' version counters, as torch's in-place ops do. A head_dim that is not a multiple of 8
runs on padded copies (PaddedHeadDim).
No host sync: the index values (cache_seqlens, cache_batch_idx, cache_leftpad, block_table) are
checked by the kernels' guards, which refuse a value out of range (an append that would leave the
cache is not written at all), and the step raises lazily from their flag (kernels.run
.raise_flagged); FAGEN_CHECK_VALUES=1 checks them on the host first. Under torch.compile the step
is one custom op (fagen::flash_attn_with_kvcache) that declares its writes to the caches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..errors import InputError, InputTypeError, forward_only
from ..kernels import launch
from ..kernels import run as attention_kernels
from ..kernels.render import source_for
from ..kernels.splits import MAX_SPLITS, choose_splits, processor_count
from ..spec import Spec
from .common import HEAD_DIM_MULTIPLE, TORCH_DTYPES, aligned_rows, check_flag
from .kvcache_args import check_kvcache, check_rotary
from .variant_args import variant_call

def decode_spec(head_dim: int, dtype: torch.dtype, causal: bool, page_size: int | None, fields: dict) -> Spec:
    """The kv_cache spec of a step (Spec.for_kv_cache), built once per distinct step: a Spec
    validates itself, which costs more than the rest of a warm call."""
    return _decode_spec(head_dim, TORCH_DTYPES[dtype], causal, page_size, tuple(sorted(fields.items())))


def step_spec(head_dim: int, dtype: torch.dtype, *, seqlen_q: int, heads: int, kv_heads: int, causal: bool,
              page_size: int | None, fields: dict) -> Spec:
    """The spec flash_attn_with_kvcache builds for a step (the GPU check precompiles the same):
    one query sees every key whether causal or not, so causal is dropped there unless ALiBi
    measures distances from the diagonal (flash-attn drops it too); with fewer K/V heads than
    query heads, the query heads of each K/V head share its tiles (GQA packing)."""
    if seqlen_q == 1 and not fields.get("alibi"):
        causal = False
    return decode_spec(head_dim, dtype, causal, page_size, {**fields, "pack_gqa": heads > kv_heads})


@functools.lru_cache(maxsize=256)
def _decode_spec(head_dim: int, dtype: str, causal: bool, page_size: int | None, fields: tuple) -> Spec:
    return Spec.for_kv_cache(head_dim, dtype, causal=causal, page_size=page_size, **dict(fields))


_loaded: set = set()   # (source, device) pairs compiled and loaded once in this process


def _load_before_writing(source, device: torch.device) -> None:
    """Compile and load a step's kernels before the cache is touched, so that a failure there
    leaves it intact (the first call of a spec on a device only: the compile does not depend on
    the emulator build a later call may switch to)."""
    key = (source.hash, device)
    if key not in _loaded:
        launch.load(source, device)
        _loaded.add(key)


def _pack(q, kv_heads: int):
    """GQA packing (Spec.pack_gqa): query i of head kv_head * group + g becomes row i * group + g
    of its K/V head; the kernel maps each row back to its own query and head for every mask,
    window and mod."""
    b, n, h, d = q.shape
    return q.view(b, n, kv_heads, h // kv_heads, d).transpose(2, 3).reshape(b, n * (h // kv_heads), kv_heads, d)


def _unpack(out, lse, shape):
    b, n, h, d = shape
    kv_heads = out.shape[2]
    group = h // kv_heads
    out = out.view(b, n, group, kv_heads, d).transpose(2, 3).reshape(b, n, h, d)
    lse = lse.view(b, kv_heads, n, group).transpose(2, 3).reshape(b, h, n)
    return out, lse


@dataclass
class PaddedHeadDim:
    """A head_dim that is not a multiple of 8 (the kernels' 16-byte rows), handled as flash-attn
    does: the step runs on zero-padded copies of q, the caches and the new keys (zero columns add
    nothing to q k^T; rotary turns only the first rotary_dim columns), then the appended rows are
    copied back into the caller's caches. That copy is the call's only write to them, after
    every kernel has run: a call that fails leaves them as they were."""

    head_dim: int                # the caller's
    k_cache: torch.Tensor        # the caller's caches
    v_cache: torch.Tensor


def _pad_head_dim(t):
    return None if t is None else torch.nn.functional.pad(t, (0, -t.shape[-1] % HEAD_DIM_MULTIPLE))


def _copy_appended(padded: PaddedHeadDim, cache, k_cache, v_cache, block_table, flag) -> None:
    """Rows cache_seqlens[b] .. + N_new of each entry, from the padded caches into the caller's
    (index_put_: it bumps their version counters). Where a guard refused an index (`flag`, on a
    GPU still unraised), the indices are clamped into the cache and each row gets its own old
    value back: nothing changes, and no sync decides it."""
    refused = flag[0] != 0
    rows = (cache.cache_seqlens.long()[:, None] + torch.arange(cache.new_tokens, device=k_cache.device))
    rows = rows.clamp(0, cache.capacity - 1)
    if block_table is None:
        first, second = cache.cache_batch.long()[:, None].expand_as(rows), rows
    else:
        first, second = block_table.long().gather(1, rows // cache.page_size), rows % cache.page_size
    first = first.clamp(0, k_cache.shape[0] - 1)
    for caller, source in ((padded.k_cache, k_cache), (padded.v_cache, v_cache)):
        caller[first, second] = torch.where(refused, caller[first, second], source[first, second, :, :padded.head_dim])


def _result(out, lse, return_lse: bool, padded, cache, k_cache, v_cache, block_table, flag):
    """The step's outputs, after its raise from the guards' flag (at once on the CPU: a padded
    step then leaves the caller's cache as it was)."""
    attention_kernels.raise_flagged(flag, attention_kernels.DECODE_REFUSED)
    if padded is not None:
        if cache.new_tokens:
            _copy_appended(padded, cache, k_cache, v_cache, block_table, flag)
        out = out[..., :padded.head_dim]
    return (out, lse) if return_lse else out


def _check_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise InputError(f"num_splits must be an int in 0..{MAX_SPLITS} (0: chosen from the SM count), "
                         f"got {num_splits!r}")
    return num_splits


def _step(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
          cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
          window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
          return_softmax_lse=False):
    """flash_attn_with_kvcache's eager implementation (the custom op's too)."""
    cache = check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
    check_rotary(q, rotary_cos, rotary_sin, k, cache.capacity, rotary_interleaved)
    rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    num_splits = _check_splits(num_splits)
    causal = check_flag("causal", causal)
    return_softmax_lse = check_flag("return_softmax_lse", return_softmax_lse)
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not softmax_scale > 0):
        raise InputError(f"softmax_scale must be a float > 0 or None, got {softmax_scale!r}")
    padded = None
    if q.shape[-1] % HEAD_DIM_MULTIPLE:   # the step runs on padded copies; the scale keeps the true d
        padded = PaddedHeadDim(q.shape[-1], k_cache, v_cache)
        q, k_cache, v_cache, k, v = (_pad_head_dim(t) for t in (q, k_cache, v_cache, k, v))
        softmax_scale = 1.0 / math.sqrt(padded.head_dim) if softmax_scale is None else softmax_scale
    batch, seqlen_q, heads, head_dim = q.shape
    call = variant_call(q, k_cache, causal=causal, window_size=window_size, softcap=softcap,
                        alibi_slopes=alibi_slopes, sizes=(batch, seqlen_q, heads, cache.capacity))
    spec = step_spec(head_dim, q.dtype, seqlen_q=seqlen_q, heads=heads, kv_heads=k_cache.shape[2], causal=causal,
                     page_size=cache.page_size, fields=call.spec_fields if call else {})
    causal, packed = spec.causal, spec.pack_gqa
    source = source_for(spec)
    _load_before_writing(source, q.device)
    flag = attention_kernels.error_flag(q.device)   # the guards' refusals, raised once by _result
    if k is not None:   # rotary and the append: one kernel, in place
        windowed = bool(call and call.spec_fields.get("window"))
        q = attention_kernels.update_kv_cache(
            source, q, k_cache, v_cache, k, v, cache.cache_seqlens, cache_batch=cache.cache_batch,
            cache_start=cache.cache_start, block_table=None if block_table is None else block_table.contiguous(),
            rotary=None if rotary_cos is None else (rotary_cos.contiguous(), rotary_sin.contiguous(),
                                                    rotary_interleaved),
            q_positions_step=causal or windowed, flag=flag)
    if batch == 0 or seqlen_q == 0 or heads == 0:
        out = torch.zeros_like(q)
        lse = torch.full((batch, heads, seqlen_q), math.inf, device=q.device)
        return _result(out, lse, return_softmax_lse, padded, cache, k_cache, v_cache, block_table, flag)
    keys = (cache.cache_seqlens + cache.new_tokens - cache.cache_start).to(torch.int32)
    shape, kv_heads = q.shape, k_cache.shape[2]
    q_kernel = _pack(q, kv_heads) if packed else aligned_rows(q)
    if num_splits == 0:
        row_blocks = batch * q_kernel.shape[2] * -(-q_kernel.shape[1] // spec.block_m)
        key_tiles = -(-cache.capacity // spec.block_n)
        num_splits = choose_splits(row_blocks, key_tiles, processor_count(q.device))
    out, lse = attention_kernels.forward_kv_cache(
        source, q_kernel, k_cache, v_cache, keys, seqlen_k=cache.capacity,
        cache_rows=None if block_table is not None else (cache.cache_batch, cache.cache_start),
        block_table=None if block_table is None else block_table.contiguous(), num_splits=num_splits,
        softmax_scale=softmax_scale, variant=call.values if call else None,
        pack_group=heads // kv_heads if packed else None, flag=flag)
    if packed:
        out, lse = _unpack(out, lse, shape)
    return _result(out, lse, return_softmax_lse, padded, cache, k_cache, v_cache, block_table, flag)


@forward_only("flash_attn_with_kvcache")
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q against a KV cache, after appending k and v to it in place (flash-attn 2.8).

    q (B, Nq, H, d); k_cache, v_cache (B_cache, N_cache, Hk, d), or with block_table (B,
    max_pages) int32 a paged cache (num_pages, page_size, Hk, d) with page_size any multiple of
    16; k, v (B, N_new, Hk, d) are rotated (k only) and written at rows cache_seqlens[b] ..
    + N_new; cache_seqlens (int or int32 (B,)) counts each entry's keys before the append;
    cache_batch_idx (B,) picks each entry's cache row, cache_leftpad (B,) its first key.
    rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2) rotate q and k at their absolute cache
    positions (q at cache_seqlens + i when causal or windowed, else all at cache_seqlens),
    interleaved or not. Causal is bottom-right aligned to each entry's keys; window_size,
    softcap and alibi_slopes as in flash_attn_func. num_splits = 0 picks the split-KV count from
    the SM count. Returns out (B, Nq, H, d), and with return_softmax_lse also L (B, H, Nq).
    Any d up to 256: one that is not a multiple of 8 is zero-padded as flash-attn does.
    """
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits)
    if torch.compiler.is_compiling():
        return _traced_step(*args, check_flag("return_softmax_lse", return_softmax_lse))
    return _step(*args, return_softmax_lse)


# -- torch.compile: the step as one custom op ---------------------------------------------------

def _traced_step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                 num_splits, return_softmax_lse: bool):
    """The op's arguments in its schema's types (flags as Python bools, the window as two ints,
    an int cache_seqlens apart from a tensor one); every other check runs in the op, eagerly."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise InputTypeError(f"under torch.compile, window_size must be a pair of Python ints, got {window_size!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise InputError(f"softcap must be a float >= 0 (0: off), got {softcap!r}")
    seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    out, lse = _step_op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_tensor,
                        None if seqlens_tensor is not None else cache_seqlens, cache_batch_idx, cache_leftpad,
                        block_table, None if softmax_scale is None else float(softmax_scale),
                        check_flag("causal", causal), int(window_size[0]), int(window_size[1]), float(softcap),
                        check_flag("rotary_interleaved", rotary_interleaved), alibi_slopes, _check_splits(num_splits))
    return (out, lse) if return_softmax_lse else out


@torch.library.custom_op("fagen::flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _step_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
             v: torch.Tensor | None, rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
             cache_seqlens: torch.Tensor | None, cache_seqlens_int: int | None, cache_batch_idx: torch.Tensor | None,
             cache_leftpad: torch.Tensor | None, block_table: torch.Tensor | None, softmax_scale: float | None,
             causal: bool, window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
             alibi_slopes: torch.Tensor | None, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step (the eager implementation), declared to write k_cache and v_cache: functionalization
    and the version counters see the append. Returns fresh contiguous (out, L)."""
    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    out, lse = _step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, cache_leftpad,
                     block_table, softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved,
                     alibi_slopes, num_splits, True)
    return out.contiguous(), lse.contiguous()


@_step_op.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int, cache_batch_idx,
      cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
      alibi_slopes, num_splits):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)

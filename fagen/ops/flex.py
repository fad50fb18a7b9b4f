"""`fagen.flex_attention`: FlexAttention's signature and (B, H, N, d) layout on fagen's kernels.

FlexAttention's mods are fagen's: `score_mod(score, b, h, q_idx, kv_idx)` gets the scaled
score (scale * q.k) and `mask_mod(b, h, q_idx, kv_idx)` keeps True, with absolute indices and h
the query head, in both; they are traced into the kernels (fagen.variants), and the kernels
take transposed views of query, key and value (no copy). What a call carries over:

- a `torch.nn.attention.flex_attention.BlockMask` gives its mask_mod and its lengths
  (seq_lengths, which must be query's and key's, as FlexAttention requires); its block tables
  are not read: fagen derives its own tile classes from the mask_mod. A BlockMask made from
  block tables alone (BlockMask.from_kv_blocks without a mask_mod, whose mask_mod is then
  noop_mask) is the exception: its blocks are the mask, loaded from block_mask.to_dense();
- FlexAttention's and_masks, or_masks and noop_mask work as mods;
- enable_gqa=True lets query's heads be a multiple of key's (query head h reads key head
  h // (Hq / Hkv)); without it they must be equal, as FlexAttention requires;
- return_lse=True (or return_aux=AuxRequest(lse=True)) also returns the logsumexp (B, H, Nq),
  fp32, natural log, differentiable; rows that see no key give out 0 and lse -inf, as
  FlexAttention does;
- kernel_options tune FlexAttention's Triton kernels: fagen picks its own tiles and ignores them.

fp16 or bf16 inputs; key shares head_dim and batch with query, value its batch, heads and keys
with key (its head dim, d_v, may be smaller than query's). Errors name FlexAttention's arguments
(query, key, value, block_mask, scale).
"""

from __future__ import annotations

import functools

import torch

from ..errors import InputError, InputTypeError
from .common import TORCH_LAYOUT, check_flag, check_inputs, check_scale
from .dense import flash_attn_func
from .fp8 import FP8, is_fp8

LARGE_BLOCK = 1 << 30   # FlexAttention's block size of a BlockMask that masks nothing (one block)


def _check_heads(query, key, enable_gqa) -> None:
    heads, kv_heads = query.shape[1], key.shape[1]
    if not check_flag("enable_gqa", enable_gqa) and heads != kv_heads:
        raise InputError(f"query has {heads} heads and key {kv_heads}: pass enable_gqa=True for grouped-query "
                         "attention (FlexAttention's rule)")


def _block_table_mod(block_mask, batch: int, heads: int):
    """A mask_mod that keeps the blocks `block_mask` lists (its dense block table)."""
    table = block_mask.to_dense()   # (B or 1, H or 1, q blocks, kv blocks)
    if table.dim() != 4 or table.shape[0] not in (1, batch) or table.shape[1] not in (1, heads):
        raise InputError(f"block_mask's block table has shape {tuple(table.shape)}; FlexAttention's "
                         f"(batch or 1, heads or 1, q blocks, kv blocks) = ({batch} or 1, {heads} or 1, ...) is needed")
    q_block, kv_block = block_mask.BLOCK_SIZE
    # A partial of a module function, not a closure: torch.compile reads a partial's arguments
    # made inside the compiled region (fagen.variants.free_values); the tuple is structure.
    return functools.partial(_kept_block, table, (q_block, kv_block, table.shape[0] > 1, table.shape[1] > 1))


def _kept_block(table, layout, b, h, q_idx, kv_idx):
    q_block, kv_block, whole_batch, whole_heads = layout
    return table[b if whole_batch else 0, h if whole_heads else 0, q_idx // q_block, kv_idx // kv_block] != 0


def _block_mask_mod(block_mask, query, key):
    """The mask_mod a BlockMask stands for (None: it masks nothing), its lengths checked."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, noop_mask
    except ImportError:   # torch < 2.5: no FlexAttention, so no BlockMask could be made
        raise InputTypeError("block_mask needs torch.nn.attention.flex_attention (torch >= 2.5)") from None
    if not isinstance(block_mask, BlockMask):
        raise InputTypeError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask or None, got "
                             f"{type(block_mask).__name__}")
    if tuple(block_mask.BLOCK_SIZE) == (LARGE_BLOCK, LARGE_BLOCK) and block_mask.mask_mod is noop_mask:
        return None   # FlexAttention's own "no mask": one block over everything
    lengths = (query.shape[2], key.shape[2])
    if tuple(block_mask.seq_lengths) != lengths:
        raise InputError(f"block_mask was made for (seqlen_q, seqlen_k) = {tuple(block_mask.seq_lengths)}, got "
                         f"query's and key's {lengths}: make one for these lengths "
                         f"(create_block_mask(mask_mod, B, H, {lengths[0]}, {lengths[1]}))")
    if block_mask.mask_mod is noop_mask:
        return _block_table_mod(block_mask, query.shape[0], query.shape[1])
    return block_mask.mask_mod


def _lse_wanted(return_lse, return_aux) -> bool:
    if return_aux is None:
        return check_flag("return_lse", return_lse)
    if check_flag("return_lse", return_lse):
        raise InputError("pass return_lse or return_aux, not both (FlexAttention refuses the pair too)")
    if getattr(return_aux, "max_scores", False):
        raise InputError("return_aux: fagen returns lse only, not max_scores")
    return bool(getattr(return_aux, "lse", False))


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """FlexAttention on fagen's kernels (see the module doc). query (B, H, Nq, d), key and value
    (B, Hk, Nk, d). Returns out (B, H, Nq, d) in query's dtype, with autograd; with
    return_lse, (out, lse); with return_aux, (out, AuxOutput(lse=..., max_scores=None)).
    float8_e4m3fn query, key and value run the fp8 forward (ops/fp8.py) with descales of 1, which
    FlexAttention's signature has no place for (fagen.flash_attn_func takes them); out is bf16."""
    check_inputs(query, key, value, names=("query", "key", "value"), dims=TORCH_LAYOUT,
                 dtypes=(FP8,) if is_fp8(query) else None)
    _check_heads(query, key, enable_gqa)
    scale = check_scale("scale", scale, query.shape[-1])
    want_lse = _lse_wanted(return_lse, return_aux)
    mask_mod = None if block_mask is None else _block_mask_mod(block_mask, query, key)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, lse = flash_attn_func(q, k, v, softmax_scale=scale, score_mod=score_mod, mask_mod=mask_mod,
                               return_lse=True)
    out = out.transpose(1, 2)
    lse = torch.where(lse == float("inf"), float("-inf"), lse) if want_lse else None   # fagen's +inf, Flex's -inf
    if return_aux is not None:   # (out, aux) whatever it asks for, as FlexAttention returns
        from torch.nn.attention.flex_attention import AuxOutput
        return out, AuxOutput(lse=lse, max_scores=None)
    return (out, lse) if want_lse else out

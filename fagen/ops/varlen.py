"""`flash_attn_varlen_func`: packed sequences (cu_seqlens), flash-attn 2.8's signature, and packed
queries over a paged K/V cache (block_table). Its arguments are checked in varlen_args."""

from __future__ import annotations

import torch

from ..dtypes import DTYPE_NAME
from ..errors import InputError, run_forward_only
from ..kernels import kv_kernels
from ..kernels.render import source_for
from . import autograd
from .call import decoding_spec, options_for, values_of
from .common import (aligned_rows, check_flag, check_options, device_shared_limit, padded_head_dim,
                     padded_width, philox_state)
from .fp8 import FP8, check_descales_for, fp8_varlen_attention, is_fp8
from .variant_args import variant_call
from .varlen_args import check_varlen, packed_lse


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, return_lse=False,
                           sinks=None, score_mod=None, mask_mod=None, version=2, q_descale=None, k_descale=None,
                           v_descale=None):
    """Exact attention over packed sequences, flash-attn 2.8's signature and conventions.

    q (total_q, H, d), k and v (total_k, Hk, d) hold B sequences back to back; cu_seqlens_q
    and cu_seqlens_k (int32, (B + 1,)) give where each starts; max_seqlen_q / max_seqlen_k bound
    their lengths. One launch covers every sequence (tiles past a sequence's end exit at once);
    zero-length sequences are legal. causal is bottom-right aligned per sequence, and every
    variant (window, softcap, ALiBi, sinks, score_mod with q_idx / kv_idx counted within the
    sequence, mask_mod) applies per sequence; dropout keys on each sequence's own (b, h, row,
    col). Returns out (total_q, H, d); with return_lse also L (H, total_q), differentiable;
    return_attn_probs=True returns (out, L, None). float8_e4m3fn q, k and v take FlashAttention-3's
    fp8 form, as flash_attn_func's (q_descale, k_descale, v_descale: fp32 (B, Hk), a row per
    sequence; O in bf16; no block_table, dropout or gradients).
    """
    return_attn_probs = check_flag("return_attn_probs", return_attn_probs)
    eight_bit = is_fp8(q)
    cu_q, cu_k, table = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                     dtypes=(FP8,) if eight_bit else None)
    check_descales_for(q, q_descale, k_descale, v_descale)
    dropout_p, softmax_scale, causal, return_lse, deterministic = check_options(
        dropout_p, softmax_scale, causal, return_lse, deterministic, version, q.shape[-1])
    batch, heads = cu_q.numel() - 1, q.shape[1]
    call = variant_call(q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks, score_mod=score_mod, mask_mod=mask_mod,
                        sizes=(batch, max_seqlen_q, heads, max_seqlen_k))
    varlen = (cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    if eight_bit:
        if table is not None or version != 2:
            raise InputError("float8_e4m3fn packed sequences run the fp8 forward (version=2) on packed k and v, not "
                             "through a block_table")
        out, slots = fp8_varlen_attention(q, k, v, varlen, softmax_scale=softmax_scale, causal=causal,
                                          dropout_p=dropout_p, call=call,
                                          descales={"q_descale": q_descale, "k_descale": k_descale,
                                                    "v_descale": v_descale})
        return _varlen_result(out, slots, cu_q, q.shape[0], v.shape[-1], return_lse, return_attn_probs)
    if table is not None:
        out, slots = _varlen_paged_run(call, q, k, v, varlen, table, dropout_p, softmax_scale, causal, version)
        return _varlen_result(out, slots, cu_q, q.shape[0], v.shape[-1], return_lse, return_attn_probs)
    q, k, v, head_dim = padded_head_dim(q, k, v)
    options = options_for(q, version=version, causal=causal, key_padding=False, dropout=dropout_p > 0,
                          deterministic=deterministic, varlen=True, variant_fields=call.spec_fields if call else None,
                          variant_kinds=call.kinds if call else None, v=v)
    values = values_of(options, seqlens_k=None, rng=philox_state(dropout_p, q.device), varlen=varlen,
                       softmax_scale=softmax_scale, dropout_p=dropout_p, variant_values=call.values if call else None)
    out, slots = autograd.run(options, q, k, v, values)
    return _varlen_result(out, slots, cu_q, q.shape[0], head_dim, return_lse, return_attn_probs)


def _varlen_result(out, slots, cu_q, total_q: int, head_dim: int, return_lse: bool, return_attn_probs: bool):
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    if not (return_lse or return_attn_probs):
        return out
    lse = packed_lse(slots, cu_q, total_q)
    return (out, lse, None) if return_attn_probs else (out, lse)


@torch.compiler.disable
def _varlen_paged_run(call, q, k, v, varlen, table, dropout_p, softmax_scale, causal, version):
    """Packed queries over a paged K/V cache: forward only, as in flash-attn (its backward does not
    take a block table). Inputs that require grad still run, as in flash-attn: only a backward
    raises. A head_dim that is not a multiple of 8 reads a zero-padded copy of the cache, as
    flash-attn does (softmax_scale comes from the true d: check_options)."""
    if dropout_p > 0 or version != 2:
        raise InputError(f"flash_attn_varlen_func with a block_table runs FlashAttention-2 without dropout; got "
                         f"dropout_p={dropout_p}, version={version}")
    head_dim, head_dim_v = padded_width(q.shape[2]), padded_width(v.shape[-1])
    fields = {**(call.spec_fields if call else {}), **({"head_dim_v": head_dim_v} if head_dim_v != head_dim else {})}
    # sm90 where asked, or proven on this Hopper GPU; refused: sinks (the decoding kernels take none)
    spec = decoding_spec(head_dim, DTYPE_NAME[q.dtype], causal, k.shape[1], fields, q.device,
                         shared_limit=device_shared_limit(q.device), varlen=True, refusal="with a block_table, ")

    def run():
        q_kernel, k_cache, v_cache, _ = padded_head_dim(q, k, v)
        return kv_kernels.forward_kv_cache(source_for(spec), aligned_rows(q_kernel), k_cache, v_cache, None,
                                                  seqlen_k=varlen[3], block_table=table, softmax_scale=softmax_scale,
                                                  variant_values=call.values if call else None,
                                                  varlen=varlen)
    return run_forward_only("flash_attn_varlen_func with a block_table", run, (q, k, v))

"""flash-attn 2.8's packed entry points: `flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func`,
`flash_attn_varlen_qkvpacked_func` and `flash_attn_varlen_kvpacked_func`.

qkv (B, N, 3, H, d) and kv (B, Nk, 2, Hk, d), or their packed-sequence forms (total, 3, H, d)
and (total_k, 2, Hk, d), are split with `unbind` into views that reach flash_attn_func /
flash_attn_varlen_func: no copy when the strides allow it (d a multiple of 8 and the tensor
16-byte aligned, as a contiguous qkv is; otherwise aligned_rows copies, as for any q, k, v).
The gradient flows back into the packed tensor (unbind's backward stacks dq, dk, dv into one
tensor of its shape). fagen's extras (return_lse, sinks, score_mod, mask_mod, version) are
keyword-only, as in flash_attn_func. Errors name the packed argument (qkv, kv).
"""

from __future__ import annotations

import re

from ..errors import InputError, InputTypeError
from ..spec import MAX_HEAD_DIM
from .common import check_dense_tensor, check_half_rows
from .dense import flash_attn_func
from .varlen import flash_attn_varlen_func

ONE_LENGTH_TABLE = re.compile(r"\b(cu_seqlens|max_seqlen)_[qk]\b")   # both are the one of qkv's call


def _unpack(name: str, t, parts: int, dims: tuple[str, ...]):
    """`t` checked as a packed tensor whose axis -3 holds `parts` tensors; returns them as views."""
    check_dense_tensor(name, t)
    if t.dim() != len(dims) or t.shape[-3] != parts:
        raise InputError(f"{name} must have shape ({', '.join(dims)}) with {dims[-3]} = {parts}, got shape "
                         f"{tuple(t.shape)}")
    check_half_rows(name, t)
    if not 1 <= t.shape[-1] <= MAX_HEAD_DIM:
        raise InputError(f"head_dim ({name}.shape[-1]) must be from 1 to {MAX_HEAD_DIM}, got {t.shape[-1]}")
    return t.unbind(t.dim() - 3)


def _check_q_kv(q, kv, batched: bool) -> None:
    """What flash_attn_func would check between q and k, said of kv (the argument passed)."""
    check_dense_tensor("q", q)
    if q.dtype != kv.dtype:
        raise InputTypeError(f"q and kv must share a dtype, got q {q.dtype} and kv {kv.dtype}")
    if q.device != kv.device:
        raise InputError(f"q and kv must be on one device, got q {q.device} and kv {kv.device}")
    if q.dim() != kv.dim() - 1:
        return   # q's own shape error comes from flash_attn_func, in q's name
    if batched and q.shape[0] != kv.shape[0]:
        raise InputError(f"q and kv must have the same batch size, got {q.shape[0]} and {kv.shape[0]}")
    if q.shape[-1] != kv.shape[-1]:
        raise InputError(f"q and kv must have the same head_dim, got {q.shape[-1]} and {kv.shape[-1]}")
    heads, kv_heads = q.shape[-2], kv.shape[-2]
    if kv_heads == 0 or heads % kv_heads:
        raise InputError(f"q's number of heads ({heads}) must be a multiple of kv's ({kv_heads})")


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              return_lse=False, sinks=None, score_mod=None, mask_mod=None, version=2):
    """flash_attn_func on qkv (B, N, 3, H, d): returns out (B, N, H, d), and with
    return_attn_probs (out, L, None) as flash_attn_func does."""
    q, k, v = _unpack("qkv", qkv, 3, ("batch", "seqlen", "3", "heads", "head_dim"))
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_lse=return_lse, sinks=sinks,
                           score_mod=score_mod, mask_mod=mask_mod, version=version)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             seqlens_k=None, return_lse=False, sinks=None, score_mod=None, mask_mod=None,
                             version=2):
    """flash_attn_func on q (B, Nq, H, d) and kv (B, Nk, 2, Hk, d), H a multiple of Hk."""
    k, v = _unpack("kv", kv, 2, ("batch", "seqlen_k", "2", "kv_heads", "head_dim"))
    _check_q_kv(q, kv, batched=True)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, seqlens_k=seqlens_k, return_lse=return_lse,
                           sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, version=version)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, return_lse=False, sinks=None, score_mod=None,
                                     mask_mod=None, version=2):
    """flash_attn_varlen_func on qkv (total, 3, H, d), one cu_seqlens and max_seqlen for queries
    and keys: returns out (total, H, d), and L (H, total) with return_lse / return_attn_probs."""
    q, k, v = _unpack("qkv", qkv, 3, ("total", "3", "heads", "head_dim"))
    try:
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                      return_attn_probs, return_lse=return_lse, sinks=sinks, score_mod=score_mod,
                                      mask_mod=mask_mod, version=version)
    except (InputError, InputTypeError) as exc:   # its checks name cu_seqlens_q / _k: say what was passed
        message = ONE_LENGTH_TABLE.sub(r"\1", str(exc))
        raise type(exc)(re.sub(r"\b(\w+) (?:or|and) \1\b", r"\1", message)) from None   # "x or x": x


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    return_lse=False, sinks=None, score_mod=None, mask_mod=None, version=2):
    """flash_attn_varlen_func on q (total_q, H, d) and kv (total_k, 2, Hk, d)."""
    k, v = _unpack("kv", kv, 2, ("total_k", "2", "kv_heads", "head_dim"))
    _check_q_kv(q, kv, batched=False)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, return_lse=return_lse, sinks=sinks, score_mod=score_mod,
                                  mask_mod=mask_mod, version=version)

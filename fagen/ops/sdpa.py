"""`fagen.sdpa`: PyTorch's `scaled_dot_product_attention` signature and semantics on fagen's kernels.

query (B, H, Nq, d), key and value (B, Hk, Nk, d) (PyTorch's layout; fagen's kernels take
transposed views, no copy). SDPA's conventions, where they differ from flash-attn's:

- `is_causal` is top-left aligned: query i sees keys j <= i, whatever Nq and Nk (flash-attn,
  and fagen's `causal`, align bottom-right). Nq == Nk runs fagen's causal kernel; otherwise the
  mask is the mask_mod q_idx >= kv_idx (linear, so whole tiles are still skipped).
- `attn_mask` broadcasts to (B, H, Nq, Nk). A boolean mask keeps True. One that only cuts
  each batch entry's keys at a length (True up to it, False after, the same for every head
  and query) runs as key padding; any other boolean mask becomes a mask_mod that loads it,
  and a float mask is added to the scores as a score_mod (its gradient, when it requires one,
  is accumulated by the backward kernel). Broadcast dimensions are never materialised.
- `enable_gqa=False` needs H == Hk, as SDPA does; True lets H be a multiple of Hk.

Rows that see no key give 0 (SDPA gives NaN there). Errors name the argument.
"""

from __future__ import annotations

import torch

from ..errors import InputError, InputTypeError
from .common import TORCH_LAYOUT, check_flag, check_inputs, check_scale
from .dense import flash_attn_func


def _check_layout(query, key, value, enable_gqa) -> None:
    """query, key and value checked in SDPA's layout and names (flash_attn_func, which checks
    them again as transposed views, would speak of q, k and v)."""
    check_inputs(query, key, value, names=("query", "key", "value"), dims=TORCH_LAYOUT)
    heads, kv_heads = query.shape[1], key.shape[1]
    if not check_flag("enable_gqa", enable_gqa) and heads != kv_heads:
        raise InputError(f"query has {heads} heads and key {kv_heads}: pass enable_gqa=True for grouped-query "
                         "attention (SDPA's rule)")


def _broadcast_dims(mask: torch.Tensor, shape: tuple) -> list[int]:
    """The dims of (B, H, Nq, Nk) that `mask` varies along; raises if it does not broadcast."""
    if mask.dim() > 4:
        raise InputError(f"attn_mask must broadcast to (batch, heads, seqlen_q, seqlen_k) = {shape}, got "
                         f"shape {tuple(mask.shape)}")
    padded = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    for size, full in zip(padded, shape):
        if size not in (1, full):
            raise InputError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (batch, heads, "
                             f"seqlen_q, seqlen_k) = {shape}")
    return [axis for axis, size in enumerate(padded) if size != 1]


def _key_lengths(mask: torch.Tensor, keep: list[int], shape: tuple) -> torch.Tensor | None:
    """Each batch entry's key count when a boolean mask is key padding (True for a prefix of
    the keys, the same for every head and query), else None. Reads the mask (one sync)."""
    if not set(keep) <= {0, 3} or 3 not in keep:
        return None
    rows = mask.reshape(-1, mask.shape[-1]).expand(shape[0], shape[3]) if 0 not in keep else \
        mask.reshape(shape[0], shape[3])
    lengths = rows.sum(-1, dtype=torch.int32)
    prefix = torch.arange(shape[3], device=mask.device) < lengths[:, None]
    return lengths if torch.equal(prefix, rows) else None


def _mask_mods(attn_mask, shape: tuple, device) -> dict:
    """flash_attn_func arguments that apply `attn_mask`: seqlens_k, a mask_mod or a score_mod."""
    if not isinstance(attn_mask, torch.Tensor):
        raise InputTypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.layout != torch.strided:
        raise InputTypeError(f"attn_mask must be a dense (torch.strided) tensor, got layout {attn_mask.layout}: pass "
                             "attn_mask.to_dense()")
    if attn_mask.device != device:
        raise InputError(f"attn_mask must be on query's device {device}, got {attn_mask.device}")
    keep = _broadcast_dims(attn_mask, shape)
    padded = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    compact = padded.reshape([shape[axis] for axis in keep])   # broadcast dims dropped, no copy
    if attn_mask.dtype == torch.bool:
        lengths = _key_lengths(padded, keep, shape)
        if lengths is not None:
            return {"seqlens_k": lengths}

        def mask_mod(b, h, q_idx, kv_idx):
            return compact[tuple((b, h, q_idx, kv_idx)[axis] for axis in keep)]

        return {"mask_mod": mask_mod}
    if not attn_mask.is_floating_point():
        raise InputTypeError(f"attn_mask must be boolean (True keeps) or floating (added to the scores), got "
                             f"{attn_mask.dtype}")
    bias = compact.float() if attn_mask.dtype != torch.float32 else compact

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[tuple((b, h, q_idx, kv_idx)[axis] for axis in keep)]

    return {"score_mod": score_mod}


def _top_left(mods: dict) -> dict:
    """SDPA's top-left causal as a mask_mod, joined with the mask's own mask_mod if it has one."""
    inner = mods.pop("mask_mod", None)
    if inner is None:
        mods["mask_mod"] = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    else:
        mods["mask_mod"] = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & inner(b, h, q_idx, kv_idx)
    return mods


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`torch.nn.functional.scaled_dot_product_attention` on fagen's kernels (see the module doc).

    Returns (B, H, Nq, d) in query's dtype, with autograd. fp16 or bf16 inputs."""
    _check_layout(query, key, value, enable_gqa)
    is_causal = check_flag("is_causal", is_causal)
    scale = check_scale("scale", scale, query.shape[-1])
    batch, heads, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    if is_causal and attn_mask is not None:
        raise InputError("pass attn_mask or is_causal, not both (SDPA refuses the pair too)")
    mods = {} if attn_mask is None else _mask_mods(attn_mask, (batch, heads, seqlen_q, seqlen_k), query.device)
    causal = is_causal and seqlen_q == seqlen_k   # top-left = bottom-right when the lengths are equal
    if is_causal and not causal:
        mods = _top_left(mods)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=causal, **mods)
    return out.transpose(1, 2)

"""`fagen.sdpa`: PyTorch's `scaled_dot_product_attention` signature and semantics on fagen's kernels.

query (B, H, Nq, d), key and value (B, Hk, Nk, d) (PyTorch's layout; fagen's kernels take
transposed views, no copy). SDPA's other shapes work too: (..., H, N, d) with any number of
leading batch dims (flattened into one: a view where the strides allow), (H, N, d) and (N, d);
query, key and value then share their leading dims (fagen does not broadcast them against each
other). SDPA's conventions, where they differ from flash-attn's:

- `is_causal` is top-left aligned: query i sees keys j <= i, whatever Nq and Nk (flash-attn,
  and fagen's `causal`, align bottom-right). Nq == Nk runs fagen's causal kernel; otherwise the
  mask is the mask_mod q_idx >= kv_idx (linear, so whole tiles are still skipped).
- `attn_mask` broadcasts to (..., H, Nq, Nk). A boolean mask keeps True. One that only cuts
  each batch entry's keys at a length (True up to it, False after, the same for every head
  and query) runs as key padding; any other boolean mask becomes a mask_mod that loads it,
  and a float mask is added to the scores as a score_mod (its gradient, when it requires one,
  is accumulated by the backward kernel). Broadcast dimensions are never materialised.
- `enable_gqa=False` needs H == Hk, as SDPA does; True lets H be a multiple of Hk.

Rows that see no key give 0 (SDPA gives NaN there). Errors name the argument.
"""

from __future__ import annotations

import functools

import torch

from ..errors import InputError, InputTypeError
from .common import TORCH_LAYOUT, check_dense_tensor, check_flag, check_inputs, check_scale
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
    """The dims of `shape` ((B, H, Nq, Nk), or SDPA's (..., Nq, Nk)) that `mask` varies along;
    raises if it does not broadcast."""
    dims = "(batch, heads, seqlen_q, seqlen_k)" if len(shape) == 4 else "(..., seqlen_q, seqlen_k)"
    if mask.dim() > len(shape):
        raise InputError(f"attn_mask must broadcast to {dims} = {shape}, got shape {tuple(mask.shape)}")
    padded = (1,) * (len(shape) - mask.dim()) + tuple(mask.shape)
    for size, full in zip(padded, shape):
        if size not in (1, full):
            raise InputError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {dims} = {shape}")
    return [axis for axis, size in enumerate(padded) if size != 1]


def _key_lengths(mask: torch.Tensor, keep: list[int], shape: tuple) -> torch.Tensor | None:
    """Each batch entry's key count when a boolean mask is key padding (True for a prefix of
    the keys, the same for every head and query), else None. Reads the mask (one sync), so not
    under torch.compile, where such a mask runs as the mask_mod (the same result)."""
    if not set(keep) <= {0, 3} or 3 not in keep or torch.compiler.is_compiling():
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
    keep = tuple(_broadcast_dims(attn_mask, shape))   # a tuple: the mods' structure (free_values)
    padded = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    compact = padded.reshape([shape[axis] for axis in keep])   # broadcast dims dropped, no copy
    if attn_mask.dtype == torch.bool:
        lengths = _key_lengths(padded, keep, shape)
        if lengths is not None:
            return {"seqlens_k": lengths}
        return {"mask_mod": functools.partial(_mask_entry, compact, keep)}
    if not attn_mask.is_floating_point():
        raise InputTypeError(f"attn_mask must be boolean (True keeps) or floating (added to the scores), got "
                             f"{attn_mask.dtype}")
    bias = compact.float() if attn_mask.dtype != torch.float32 else compact
    return {"score_mod": functools.partial(_add_mask_entry, bias, keep)}


# The mods are partials of module functions, not closures: torch.compile reads a partial's
# arguments made inside the compiled region, but not a closure's cells (variants.free_values).

def _mask_entry(mask, keep, b, h, q_idx, kv_idx):
    return mask[tuple((b, h, q_idx, kv_idx)[axis] for axis in keep)]


def _add_mask_entry(bias, keep, score, b, h, q_idx, kv_idx):
    return score + bias[tuple((b, h, q_idx, kv_idx)[axis] for axis in keep)]


def _top_left_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _top_left_and(inner, b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & inner(b, h, q_idx, kv_idx)


def _top_left(mods: dict) -> dict:
    """SDPA's top-left causal as a mask_mod, joined with the mask's own mask_mod if it has one."""
    inner = mods.pop("mask_mod", None)
    mods["mask_mod"] = _top_left_causal if inner is None else functools.partial(_top_left_and, inner)
    return mods


def _leading_dims(query, key, value) -> tuple:
    """SDPA's (..., H, N, d) inputs checked for what fagen needs of their dims; returns the dims
    before H (the batch dims flattened into one)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_dense_tensor(name, t)
        if t.dim() < 2:
            raise InputError(f"{name} must have at least 2 dims (..., seqlen, head_dim), got shape {tuple(t.shape)}")
    if not query.dim() == key.dim() == value.dim():
        raise InputError(f"query, key and value must have the same number of dims (..., heads, seqlen, head_dim), "
                         f"got {query.dim()}, {key.dim()} and {value.dim()}: fagen does not broadcast them")
    lead = tuple(query.shape[:-3])
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape[:-3]) != lead:
            raise InputError(f"{name}'s leading (batch) dims {tuple(t.shape[:-3])} must equal query's {lead} "
                             f"(shapes (..., heads, seqlen, head_dim)); fagen does not broadcast them")
    return lead


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., H, N, d) as (B, H, N, d): a view where the strides allow (always below 4 dims)."""
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t.flatten(0, t.dim() - 4)


def _mask_4d(mask, lead: tuple, shape: tuple):
    """attn_mask, checked against SDPA's (..., H, Nq, Nk) `shape`, with the leading dims that it
    has collapsed into one: a view when it varies along none of them (only a mask that varies
    along some but not all of them is expanded over the rest)."""
    if not isinstance(mask, torch.Tensor) or mask.layout != torch.strided:
        return mask   # the 4-D checks say what is wrong
    _broadcast_dims(mask, shape)
    if mask.dim() <= 3:
        return mask   # (H, Nq, Nk) broadcasts over the flattened batch as it is
    own = tuple(mask.shape[-3:])
    if all(size == 1 for size in mask.shape[:-3]):
        return mask.reshape(own)
    padded = mask.reshape((1,) * (len(shape) - mask.dim()) + tuple(mask.shape))
    return padded.expand(*lead, *own).reshape(-1, *own)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`torch.nn.functional.scaled_dot_product_attention` on fagen's kernels (see the module doc).

    Returns (..., H, Nq, d) in query's dtype, with autograd. fp16 or bf16 inputs."""
    if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return _sdpa_4d(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    lead = _leading_dims(query, key, value)
    attn_mask = _mask_4d(attn_mask, lead, (*query.shape[:-1], key.shape[-2]))
    out = _sdpa_4d(_as_4d(query), _as_4d(key), _as_4d(value), attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out.reshape(*query.shape[:-1], out.shape[-1])


def _sdpa_4d(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
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

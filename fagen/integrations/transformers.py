"""fagen as a Hugging Face transformers attention implementation: `attn_implementation="fagen"`.

    import fagen.integrations.transformers            # registers "fagen" (register() is idempotent)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fagen")
    model.set_attn_implementation("fagen")             # or switch a loaded model

`register()` installs `attention_forward` in transformers' `AttentionInterface` and, in its
`AttentionMaskInterface`, transformers' own flash-attention mask function: the model then
builds no N x N mask for fagen, only the (B, N) padding mask (or None when nothing is
padded), exactly as for flash-attention.

`attention_forward(module, query, key, value, attention_mask, ...)` takes what transformers'
attention layers pass (query (B, H, N, d), key and value (B, Hk, N, d)) and runs:

- GQA through fagen's own H % Hk support (`module.num_key_value_groups` needs no repeat),
  `scaling`, `dropout` (fagen's Philox dropout), `is_causal` (or `module.is_causal`);
- `sliding_window` W as flash-attn's window (W - 1, W - 1), which with causal is the W keys up
  to the query, as transformers' eager mask; `softcap`; gpt-oss's sinks `s_aux`, with gradient;
- a (B, N) padding mask (left padding, as `generate` uses, or right padding) by unpadding to
  `flash_attn_varlen_func` and padding the output back (padded query rows give 0);
- packed sequences: `cu_seq_lens_q` / `cu_seq_lens_k` / `max_length_q` / `max_length_k`, or
  `position_ids` that restart at 0 (padding-free training), through `flash_attn_varlen_func`.

fp32 activations run as transformers' flash_attention_2 runs them: cast to the autocast dtype
(fp32 master weights under `torch.autocast(device, dtype=torch.bfloat16)`, the usual mixed
precision), else to the model's half dtype; the output comes back in that dtype.

A mask it cannot honour (a 4-D mask, a float mask) raises a `ValueError` naming what to use
instead: it never drops a mask silently. Nothing else in fagen imports this module.
"""

from __future__ import annotations

import torch

from ..ops import flash_attn_func, flash_attn_varlen_func

NAME = "fagen"


def register() -> None:
    """Register "fagen" with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def _variant(sliding_window, softcap, s_aux, key_length: int) -> dict:
    variant = {}
    if sliding_window is not None and key_length > sliding_window:   # a window over every key changes nothing
        variant["window_size"] = (sliding_window - 1, sliding_window - 1)
    if softcap:
        variant["softcap"] = float(softcap)
    if s_aux is not None:
        variant["sinks"] = s_aux.float()   # fp32 logits per head; the gradient flows back through .float()
    return variant


def _check_mask(attention_mask) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or \
            attention_mask.dtype not in (torch.bool, torch.int32, torch.int64):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"attn_implementation='fagen' takes the (batch, seqlen) padding mask that transformers' flash-attention "
            f"mask function builds, got {shape} "
            f"{getattr(attention_mask, 'dtype', '')}: an arbitrary (4-D or float) mask cannot run on fagen's "
            f"kernels; pass a 2-D padding mask, express the mask as fagen.flash_attn_func(mask_mod=...), or use "
            f"attn_implementation='sdpa' or 'eager' for this model")


def _packed_from_position_ids(position_ids, batch: int):
    """(cu_seqlens, max_len) when position_ids (1, N) restart at 0 inside the row (sequences
    packed padding-free), else None."""
    if position_ids is None or batch != 1 or position_ids.dim() != 2:
        return None
    positions = position_ids[0]
    starts = (positions == 0).nonzero().flatten()
    if starts.numel() <= 1:
        return None
    total = positions.numel()
    bounds = torch.cat([starts, torch.tensor([total], device=starts.device)]).to(torch.int32)
    if int(bounds[0]) != 0:
        return None
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def _unpad(x: torch.Tensor, mask: torch.Tensor):
    """x (B, N, H, d) and its (B, N) mask -> the kept rows (total, H, d), their flat indices,
    cu_seqlens and the longest row's count."""
    lengths = mask.sum(-1, dtype=torch.int32)
    indices = mask.flatten().nonzero().flatten()
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:])[indices], indices, cu, int(lengths.max()) if lengths.numel() else 0


def _padded_varlen(q, k, v, mask, causal, args):
    """Attention of a padded batch as packed sequences: unpad, flash_attn_varlen_func, pad back."""
    mask = mask.bool()
    q_rows, q_index, cu_q, max_q = _unpad(q, mask[:, -q.shape[1]:])   # queries are the last N positions
    k_rows, k_index, cu_k, max_k = _unpad(k, mask)
    v_rows = v.reshape(-1, *v.shape[2:])[k_index]
    out_rows = flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k, causal=causal, **args)
    out = out_rows.new_zeros(q.shape[0] * q.shape[1], *out_rows.shape[1:])
    out = out.index_put((q_index,), out_rows)
    return out.view(*q.shape[:2], *out_rows.shape[1:])


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, causal, args):
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    out = flash_attn_varlen_func(*flat, cu_q, cu_k, int(max_q), int(max_k), causal=causal, **args)
    return out.view(*q.shape[:2], *out.shape[1:])


def _target_dtype(query: torch.Tensor, module) -> torch.dtype | None:
    """The dtype fp32 activations run in, as transformers' flash_attention_2 picks it
    (`get_target_dtype`): under autocast, autocast's (fp32 master weights: rotary embeddings
    promote q and k back to fp32); for a quantized model, its config's dtype; else the dtype
    of the model's Linear weights (fp32 layer norms in a half model, as PEFT leaves them)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "_is_quantized"):
        return config.dtype
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    return None if linear is None else linear.weight.dtype


def _half(query, key, value, module):
    """query, key and value in the dtype fagen's kernels run: fp32 ones cast to _target_dtype."""
    if query.dtype != torch.float32:
        return query, key, value
    target = _target_dtype(query, module)
    if target not in (torch.float16, torch.bfloat16):
        raise TypeError(f"attn_implementation='fagen' runs in float16 or bfloat16; this layer's query is "
                        f"{query.dtype} and its weights {target}, without autocast: load the model in bfloat16 or "
                        f"float16 (dtype=...), run it under torch.autocast(device_type, dtype=torch.bfloat16), "
                        f"or use attn_implementation='sdpa' or 'eager'")
    return query.to(target), key.to(target), value.to(target)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function interface on fagen (see the module doc). Returns
    (attn_output (B, N, H, d), None): fagen never forms the attention weights. fp32 inputs
    run in the autocast (or the model's half) dtype and the output comes back in it, as with
    transformers' flash_attention_2."""
    _check_mask(attention_mask)
    query, key, value = _half(query, key, value, module)
    if kwargs.get("position_bias") is not None:   # T5-style additive biases: a dense mask by another name
        raise ValueError("attn_implementation='fagen' cannot add a position_bias tensor; express it as "
                         "fagen.flash_attn_func(score_mod=...) or use attn_implementation='sdpa' or 'eager'")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))   # flash-attn's layout, views
    args = {"dropout_p": float(dropout), "softmax_scale": scaling,
            **_variant(sliding_window, softcap, s_aux, k.shape[1])}
    if attention_mask is not None:
        return _padded_varlen(q, k, v, attention_mask, causal, args), None
    varlen = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(x is not None for x in varlen):
        return _packed(q, k, v, *varlen, causal, args), None
    packed = _packed_from_position_ids(kwargs.get("position_ids"), q.shape[0])
    if packed is not None:
        cu, longest = packed
        return _packed(q, k, v, cu, cu, longest, longest, causal, args), None
    return flash_attn_func(q, k, v, causal=causal, **args), None


register()

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
- a (B, N) padding mask (left padding, as `generate` uses, or right padding, or any other) by
  unpadding to `flash_attn_varlen_func` and padding the output back (padded query rows give 0);
- packed sequences: `cu_seq_lens_q` / `cu_seq_lens_k` / `max_length_q` / `max_length_k`, or
  `position_ids` that restart at 0 (padding-free training), through `flash_attn_varlen_func`.

No device-to-host sync per layer: the unpadding has fixed shapes (`torch.nonzero_static`; the
padding rows become sequences of their own that see no key), and the bounds the kernels need
come from shapes. Packing read from `position_ids` costs one sync per position_ids tensor (its
first layer; the result is kept for the others), as the values decide the sequences' count.

fp32 activations run as transformers' flash_attention_2 runs them: cast to the autocast dtype
(fp32 master weights under `torch.autocast(device, dtype=torch.bfloat16)`, the usual mixed
precision), else to the model's half dtype; the output comes back in that dtype.

A mask it cannot honour (a 4-D mask, a float mask) raises a `ValueError` naming what to use
instead: it never drops a mask silently. Nothing else in fagen imports this module.
"""

from __future__ import annotations

import weakref

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


_position_packing: dict[int, tuple] = {}   # id(position_ids) -> (weakref, _version, (cu, longest) or None)
MAX_POSITION_PACKINGS = 64


def _packed_from_position_ids(position_ids, q):
    """(cu_seqlens, max_len) when position_ids (1, N) restart at 0 inside the row (sequences
    packed padding-free), else None. Reading them is a sync: done once per position_ids tensor
    (every layer of a forward passes the same one), never for one query (a decoding step)."""
    if position_ids is None or q.shape[0] != 1 or position_ids.dim() != 2 or q.shape[1] == 1:
        return None
    kept = _position_packing.get(id(position_ids))
    if kept is not None and kept[0]() is position_ids and kept[1] == position_ids._version:
        return kept[2]
    packing = _read_packing(position_ids[0])
    if len(_position_packing) >= MAX_POSITION_PACKINGS:
        _position_packing.clear()
    _position_packing[id(position_ids)] = (weakref.ref(position_ids), position_ids._version, packing)
    return packing


def _read_packing(positions):
    starts = (positions == 0).nonzero().flatten()   # the one sync
    if starts.numel() <= 1:
        return None
    total = positions.numel()
    bounds = torch.cat([starts, torch.tensor([total], device=starts.device)]).to(torch.int32)
    if int(bounds[0]) != 0:
        return None
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def _unpad(x: torch.Tensor, mask: torch.Tensor):
    """x (B, N, H, d) and its (B, N) bool mask -> (B * N, H, d) rows: the kept ones first, in
    order, then filler; each row's flat index (B * N for filler); the kept count per batch row.
    Fixed shapes (nonzero_static): no sync."""
    batch, length = mask.shape
    index = torch.nonzero_static(mask.flatten(), size=batch * length, fill_value=batch * length).flatten()
    valid = index.clamp(max=batch * length - 1)
    return x[valid // length, valid % length], index, mask.sum(-1, dtype=torch.int32)


def _padded_sequences(kept_q, kept_k, nq: int, nk: int):
    """cu_seqlens over the unpadded rows, 3B sequences: batch row b's kept queries against its
    kept keys (sequence b, as flash-attn numbers it: its dropout mask too), then each row's filler
    queries against no key (they see nothing), then each row's filler keys for no query."""
    none = torch.zeros_like(kept_q)
    cu_q = torch.cat([kept_q, nq - kept_q, none]).cumsum(0, dtype=torch.int32)
    cu_k = torch.cat([kept_k, none, nk - kept_k]).cumsum(0, dtype=torch.int32)
    return torch.nn.functional.pad(cu_q, (1, 0)), torch.nn.functional.pad(cu_k, (1, 0))


def _padded_varlen(q, k, v, mask, causal, args):
    """Attention of a padded batch as packed sequences: unpad, flash_attn_varlen_func, pad back."""
    mask = mask.bool()
    nq, nk = q.shape[1], k.shape[1]
    q_rows, q_index, kept_q = _unpad(q, mask[:, -nq:])   # queries are the last N positions
    k_rows, _, kept_k = _unpad(k, mask)
    v_rows = _unpad(v, mask)[0]
    cu_q, cu_k = _padded_sequences(kept_q, kept_k, nq, nk)
    out_rows = flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_q, cu_k, nq, nk, causal=causal, **args)
    out = out_rows.new_zeros(q.shape[0] * nq + 1, *out_rows.shape[1:])   # + a row the filler lands in
    out = out.index_put((q_index,), out_rows)[:-1]
    return out.view(*q.shape[:2], *out_rows.shape[1:])


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, causal, args):
    """Packed sequences in one batch row. A max length given as a tensor is not read (a sync):
    the row's length bounds it."""
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    max_q = max_q if isinstance(max_q, int) else flat[0].shape[0]
    max_k = max_k if isinstance(max_k, int) else flat[1].shape[0]
    out = flash_attn_varlen_func(*flat, cu_q, cu_k, max_q, max_k, causal=causal, **args)
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
    packed = _packed_from_position_ids(kwargs.get("position_ids"), q)
    if packed is not None:
        cu, longest = packed
        return _packed(q, k, v, cu, cu, longest, longest, causal, args), None
    return flash_attn_func(q, k, v, causal=causal, **args), None


register()

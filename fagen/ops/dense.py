"""The ops users call: `flash_attn_func` (flash-attn's layout) and `attention`
(PyTorch's layout), with autograd and torch.compile support.

Each call checks its inputs (every error names the argument and what was expected), turns its
arguments into call options and values (call.py: the one place a Spec is built from a call) and
runs the one autograd path of every attention call (autograd.py): the custom ops
`fagen::attention_fwd` / `fagen::attention_bwd` when torch.compile traces it, so a call with any
variant (window, softcap, ALiBi, sinks, score_mod / mask_mod with their captured tensors),
dropout or seqlens_k traces without a graph break; a torch.autograd.Function eagerly. Kernels
are rendered and compiled once per process and launched through CuPy (CUDA tensors) or the SIMT
emulator (CPU tensors).

Empty problems are defined, not errors: batch = 0 or Nq = 0 gives empty
outputs; Nk = 0 (no keys at all) gives O = 0, L = +inf and zero gradients,
the same as any row that sees no key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dtypes import DTYPE_NAME
from ..errors import InputError
from ..kernels import sources as generated_sources
from ..kernels.attention_kernels import Memo
from ..spec import Spec, check_dropout_p
from . import autograd
from .call import CallOptions, CallValues, kernels_state, options_for, values_of
from .common import (HEAD_DIM_MULTIPLE, check_flag, check_inputs, check_options, padded_head_dim,
                     philox_state, strides_aligned)
from .fp8 import check_descales_for, fp8_attention, is_fp8
from .variant_args import variant_call


@dataclass
class DenseCall:
    """A call's checked options and values (call.py), what `_checked_call` derives from its
    arguments. A call without tensors of its own beyond q, k, v (no seqlens_k, dropout or
    variant) derives them from its `_signature` alone, so a warm call with a seen signature
    reuses them and skips the checks."""

    options: CallOptions
    values: CallValues
    head_dim_v: int      # v's, the caller's (the kernels' is padded to a multiple of 8)
    return_lse: bool
    reusable: bool
    padded: bool         # q's or v's head dim is not a multiple of 8: padded on the way in, O sliced
    cuda: bool = False   # on a CUDA device (else the CPU: the emulator)
    strides_aligned: bool = False   # q, k and v's (common.strides_aligned), for a reusable unpadded call
    prepared: tuple | None = None   # a reusable call's (call.kernels_state, autograd.Prepared)

    def run(self, q, k, v):
        if self.padded:
            q, k, v, _ = padded_head_dim(q, k, v)
        # Asked here, not passed in: dynamo may trace this frame on its own (after a graph break
        # in a caller), where the caller's answer is not this frame's.
        traced = torch.compiler.is_compiling()   # the custom ops then take the options and values alone
        prepared = self._prepared(q, k) if self.reusable and not traced else None
        # A reusable call's strides are its signature's: only the pointers' alignment is new.
        aligned = self.strides_aligned and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16
        out, lse = autograd.run(self.options, q, k, v, self.values, prepared, aligned)
        if self.padded:
            out = out[..., :self.head_dim_v]
        return (out, lse) if self.return_lse else out

    def _prepared(self, q, k) -> autograd.Prepared:
        """The call's kernels, arguments and launch plans (attention_kernels.Memo), kept with its signature
        until a new tuning result or another kernel family asked for."""
        generation = kernels_state(self.cuda)   # the memo's keys hold neither kernels nor backend
        if self.prepared is None or self.prepared[0] != generation:
            self.prepared = (generation, autograd.Prepared(self.options, q, k, self.values, memo=Memo()))
        return self.prepared[1]


def _checked_call(q, k, v, dropout_p, softmax_scale, causal, seqlens_k, return_lse, deterministic, version,
                  module_source, variant) -> DenseCall:
    check_inputs(q, k, v, seqlens_k)
    dropout_p, softmax_scale, causal, return_lse, deterministic = check_options(
        dropout_p, softmax_scale, causal, return_lse, deterministic, version, q.shape[-1])  # the true d's scale
    call = variant_call(q, k, causal=causal, **variant) if variant else None
    if seqlens_k is not None:
        seqlens_k = seqlens_k.contiguous()  # the kernels index it as a plain array
    options = options_for(q, version=version, causal=causal, key_padding=seqlens_k is not None, dropout=dropout_p > 0,
                          deterministic=deterministic, variant_fields=call.spec_fields if call else None,
                          variant_kinds=call.kinds if call else None, module_source=module_source, v=v)
    values = values_of(options, seqlens_k=seqlens_k, rng=philox_state(dropout_p, q.device), varlen=None,
                       softmax_scale=softmax_scale, dropout_p=dropout_p, variant_values=call.values if call else None)
    reusable = call is None and seqlens_k is None and dropout_p == 0
    padded = bool(q.shape[-1] % HEAD_DIM_MULTIPLE or v.shape[-1] % HEAD_DIM_MULTIPLE)
    eager = not torch.compiler.is_compiling()   # traced calls check alignment in the custom ops
    return DenseCall(options, values, v.shape[-1], return_lse, reusable, padded, cuda=q.device.type == "cuda",
                     strides_aligned=eager and reusable and not padded and all(strides_aligned(t) for t in (q, k, v)))


# Checked calls by signature (`_signature`); bounded: many distinct shapes start it over.
_calls: dict[tuple, DenseCall] = {}
MAX_CALLS = 4096
_SCALARS = frozenset((int, float, bool, str, type(None)))


def _signature(q, k, v, scalars: tuple) -> tuple | None:
    """Everything the checks read of a call without tensors of its own: q, k and v's shapes,
    strides, dtypes and devices, and the other arguments with their types (causal=1 is refused
    where causal=True is not). None where there is anything else. (Not under torch.compile,
    which traces the checks: the caller asks.)"""
    tensor, strided = torch.Tensor, torch.strided
    if not (type(q) is tensor and type(k) is tensor and type(v) is tensor
            and q.layout == strided and k.layout == strided and v.layout == strided):
        return None
    types = tuple(map(type, scalars))
    if not _SCALARS.issuperset(types):
        return None
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            v.shape, v.stride(), v.dtype, v.device, types, scalars)


def _attention(q, k, v, dropout_p, softmax_scale, causal, seqlens_k, return_lse, deterministic, version,
               module_source, variant=None):
    key = None
    if variant is None and seqlens_k is None and not torch.compiler.is_compiling():
        key = _signature(q, k, v, (dropout_p, softmax_scale, causal, return_lse, deterministic, version, module_source))
    call = None if key is None else _calls.get(key)
    if call is None:
        call = _checked_call(q, k, v, dropout_p, softmax_scale, causal, seqlens_k, return_lse, deterministic, version,
                             module_source, variant)
        if key is not None and call.reusable:
            if len(_calls) >= MAX_CALLS:
                _calls.clear()
            _calls[key] = call
    return call.run(q, k, v)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, seqlens_k=None,
                    return_lse=False, sinks=None, score_mod=None, mask_mod=None, version=2, q_descale=None,
                    k_descale=None, v_descale=None):
    """Exact attention, flash-attn 2.8's signature and conventions (fagen's extras keyword-only).

    q (B, Nq, H, d); k, v (B, Nk, Hk, d) with H % Hk == 0 (GQA/MQA); fp16 or
    bf16, last dim contiguous; d up to 256 (a d that is not a multiple of 8
    is zero-padded on the way in and sliced on the way out, as flash-attn
    does; the default scale still uses the true d). Returns out (B, Nq, H, d);
    with return_lse, (out, L) with L = logsumexp of each row's scores (B, H, Nq), fp32,
    natural log, +inf for rows that see no key, and differentiable (its gradient enters the
    backward as dS = P (dP - (D - dL))); return_attn_probs=True returns (out, L, None), as
    there is no probability matrix to return. causal (a bool) aligns bottom-right when
    Nq != Nk; window_size=(left, right) lets query i see keys i + Nk - Nq - left ..
    i + Nk - Nq + right (-1: unbounded; causal sets right = 0); softcap > 0 applies
    c tanh(s / c) to the scaled scores; alibi_slopes (H,) or (B, H) fp32 adds
    -slope |i + Nk - Nq - j|; sinks (H,) fp32 logits join every row's softmax denominator
    (and get gradients); score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx,
    kv_idx) are FlexAttention-style functions traced into the kernel (fagen.variants);
    seqlens_k (int32, (B,)) masks each batch entry's keys past its length (Nk in the
    alignments is then the entry's own length); dropout_p uses Philox seeded from torch's
    generator, also with every variant; deterministic=True makes the backward pass
    bit-reproducible (no atomics); version=1 runs FlashAttention-1.

    float8_e4m3fn q, k and v take FlashAttention-3's fp8 form (fagen.ops.fp8): q_descale, k_descale
    and v_descale, fp32 (B, Hk) or None (1), the real tensors being the e4m3 ones times them; O in
    bf16; d 64, 128, 192 or 256, on compute capability 9.0 (or the CPU's emulator); no dropout, no gradients.
    """
    return_attn_probs = check_flag("return_attn_probs", return_attn_probs)
    # The common call: no variant to check (a window given as an array or a tensor is checked as one).
    plain = isinstance(window_size, tuple) and window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None \
        and sinks is None and score_mod is None and mask_mod is None
    variant = None if plain else dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                      sinks=sinks, score_mod=score_mod, mask_mod=mask_mod)
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if is_fp8(q):
        if version != 2:
            raise InputError(f"version must be 2 for float8_e4m3fn inputs (the fp8 forward is FlashAttention-2's "
                             f"algorithm in FlashAttention-3's form), got {version!r}")
        result = fp8_attention(q, k, v, softmax_scale=softmax_scale, causal=causal, seqlens_k=seqlens_k,
                               return_lse=check_flag("return_lse", return_lse) or return_attn_probs,
                               dropout_p=dropout_p, deterministic=deterministic, variant=variant, descales=descales)
        return (*result, None) if return_attn_probs else result
    check_descales_for(q, q_descale, k_descale, v_descale)
    result = _attention(q, k, v, dropout_p, softmax_scale, causal, seqlens_k,
                        check_flag("return_lse", return_lse) or return_attn_probs,
                        deterministic, version, "", variant)
    return (*result, None) if return_attn_probs else result


def attention(q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, seqlens_k=None, return_lse=False, sinks=None, score_mod=None, mask_mod=None,
              deterministic=False, version=2, q_descale=None, k_descale=None, v_descale=None):
    """Like `flash_attn_func`, in PyTorch's layout: q (B, H, Nq, d), k and v (B, Hk, Nk, d)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise InputError(f"{name} must have 4 dims (batch, heads, seqlen, head_dim), got shape "
                             f"{tuple(t.shape)}")
    result = flash_attn_func(*(t.transpose(1, 2) if isinstance(t, torch.Tensor) else t for t in (q, k, v)),
                             dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                             seqlens_k=seqlens_k, return_lse=return_lse, sinks=sinks, score_mod=score_mod,
                             mask_mod=mask_mod, version=version, q_descale=q_descale, k_descale=k_descale,
                             v_descale=v_descale)
    if return_lse:
        return result[0].transpose(1, 2), result[1]
    return result.transpose(1, 2)


def run_generated(spec: Spec, source_path, sha256: str, q, k, v, *, softmax_scale=None,
                  seqlens_k=None, dropout_p=0.0, return_lse=False):
    """Entry point of the op modules `fagen build` writes: a fixed spec and its own .cu file."""
    if spec.has_mods:
        raise InputError(f"{spec.name} is a variant: its op module cannot pass the variant's arguments yet; "
                         f"call fagen.flash_attn_func with window_size/softcap/alibi_slopes/sinks instead")
    if DTYPE_NAME.get(getattr(q, "dtype", None)) != spec.dtype or getattr(q, "shape", (0,))[-1] != spec.head_dim:
        raise InputError(f"{spec.name} takes {spec.dtype} inputs with head_dim {spec.head_dim}, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} with shape {tuple(getattr(q, 'shape', ()))}")
    if (seqlens_k is not None) != spec.key_padding:
        raise InputError(f"{spec.name} {'needs' if spec.key_padding else 'takes no'} seqlens_k")
    if (check_dropout_p(dropout_p) > 0) != spec.dropout:
        raise InputError(f"{spec.name} was built {'with' if spec.dropout else 'without'} dropout; "
                         f"dropout_p must be {'> 0' if spec.dropout else '0'}, got {dropout_p}")
    return _attention(q, k, v, dropout_p, softmax_scale, spec.causal, seqlens_k, return_lse, spec.deterministic,
                      spec.version, generated_sources.module_source(spec, source_path, sha256))

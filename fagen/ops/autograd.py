"""Attention with a variant (window, softcap, ALiBi, sinks, score_mod, mask_mod), or over packed
sequences: the autograd function behind `flash_attn_func` when a call has a variant, and behind
`flash_attn_varlen_func`.

The forward saves O and the statistics, never P; the backward kernels recompute P from
s' = score_mod(tau S) and multiply dS by ds'/d(tau S). The returned L takes part in
autograd: its gradient dL enters as D - dL. Sinks and the floating tensors a score_mod
captures (when they require grad) are autograd inputs too: the sink's gradient is
-sum P_sink (D - dL), a captured tensor's is accumulated by the backward kernel in fp32.
Variant calls run eagerly: under torch.compile they are a graph break.
"""

from __future__ import annotations

import torch

from ..kernels import run as attention_kernels
from ..kernels.render import Source
from .variant_args import VariantCall


class VariantAttention(torch.autograd.Function):
    """Inputs: q, k, v, the call's fixed parts (one tuple), then the tensors that receive
    gradients (sinks, captured tensors). Outputs: O and L."""

    @staticmethod
    def forward(ctx, q, k, v, fixed, *grad_tensors):
        source, call, seqlens_k, rng, dropout_p, softmax_scale, varlen = fixed
        seed, offset = (0, 0) if rng is None else (int(rng[0]), int(rng[1]))
        out, stats = attention_kernels.forward(source, q, k, v, softmax_scale=softmax_scale, seqlens_k=seqlens_k,
                                               dropout_p=dropout_p, seed=seed, philox_offset=offset,
                                               variant=call.values if call else None, varlen=varlen)
        lse = attention_kernels.lse_of(stats, source.spec.version)
        ctx.save_for_backward(q, k, v, out, *stats)
        ctx.fixed = fixed
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, *stats = ctx.saved_tensors
        source, call, seqlens_k, rng, dropout_p, softmax_scale, varlen = ctx.fixed
        if dout is None:
            dout = torch.zeros_like(out)
        drop = None if rng is None else attention_kernels.dropout_args(dropout_p, int(rng[0]), int(rng[1]))
        extras: dict = {}
        dq, dk, dv = attention_kernels.backward(source, q, k, v, out, tuple(stats), dout.contiguous(),
                                                softmax_scale=softmax_scale, seqlens_k=seqlens_k,
                                                dropout_args=drop, variant=call.values if call else None, dlse=dlse,
                                                extras=extras, varlen=varlen)
        grads = []
        for tensor, name in zip(call.grad_tensors if call else (), call.grad_names if call else ()):
            grads.append(extras[name].to(tensor.dtype) if name in extras else None)
        return (dq, dk, dv, None, *grads)


def run(source: Source, call: VariantCall | None, q, k, v, seqlens_k, rng, dropout_p: float, softmax_scale: float,
        varlen=None):
    """(out, lse) of a variant call (or, with `varlen`, of packed sequences, variant or not), with
    autograd when any input requires grad. For packed sequences L is (B, H, max_seqlen_q)."""
    fixed = (source, call, seqlens_k, rng, dropout_p, softmax_scale, varlen)
    return VariantAttention.apply(q, k, v, fixed, *(call.grad_tensors if call else ()))

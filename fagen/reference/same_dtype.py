"""Attention computed by plain PyTorch in the inputs' own dtype (fp16 or bf16).

This is the yardstick of FlashAttention-2's tolerance rule: a kernel's error
against the float64 oracle may be at most 2x (output) or 3x (gradients) the
error of this implementation against the same oracle. Like flash-attn's
`attention_ref(upcast=False)`, the matmuls run in the low-precision dtype and
softmax returns it; rows that see no key give 0. Gradients come from autograd.
"""

from __future__ import annotations

import torch

from .problem import make_problem


def attention_same_dtype(q, k, v, dout, *, softmax_scale=None, causal=False, seqlens_k=None,
                         dropout_p=0.0, keep_mask=None):
    """Returns (out, dq, dk, dv) in q's dtype, shaped like q, k, v."""
    prob = make_problem(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(1, 2) for t in leaves)  # (B, heads, N, d)
    kh = kh.repeat_interleave(prob.group, dim=1)
    vh = vh.repeat_interleave(prob.group, dim=1)
    visible = prob.visible_all()  # (B, 1, Nq, Nk)
    scores = (qh @ kh.transpose(-1, -2)) * prob.scale
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~visible.any(-1, keepdim=True), 0.0)
    z = prob.dropout_factor_all()
    if z is not None:
        probs = probs * z.to(probs.dtype)
    out = (probs @ vh).transpose(1, 2)
    out.backward(dout.to(out.dtype))
    return (out.detach(), *(t.grad for t in leaves))

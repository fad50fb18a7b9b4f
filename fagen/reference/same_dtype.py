"""Attention computed by plain PyTorch in the inputs' own dtype (fp16 or bf16).

This is the yardstick of FlashAttention-2's tolerance rule: a kernel's error
against the float64 oracle may be at most 2x (output) or 3x (gradients) the
error of this implementation against the same oracle. Like flash-attn's
`attention_ref(upcast=False)`, the matmuls run in the low-precision dtype and
softmax returns it; rows that see no key give 0. Gradients come from autograd.

The variants (see `problem`) run in the same dtype: softcap c tanh(S / c),
the ALiBi bias (computed in fp32 from the fp32 slopes, then cast), score_mod
(its result cast back to the dtype), then the masks; sinks by concatenating a
sink column to the scores before the softmax and dropping it after.
"""

from __future__ import annotations

import torch

from .problem import check_gradient_args, make_problem


def attention_same_dtype(q, k, v, dout, *, softmax_scale=None, causal=False, seqlens_k=None,
                         dropout_p=0.0, keep_mask=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, score_mod=None, mask_mod=None, sinks=None,
                         dlse=None, captures=(), return_extra=False):
    """Returns (out, dq, dk, dv) in q's dtype, shaped like q, k, v.

    With return_extra=True returns (out, dq, dk, dv, extra), extra a dict:
      "lse"       (B, H, Nq) in q's dtype (+inf on rows that see no key and
                  have no sink; it includes the sink term)
      "dsinks"    the gradient of sinks (H,) in sinks' dtype, or None
      "captures"  [gradient of each tensor in `captures`], in that order
    `captures` and `dlse` (an upstream gradient for lse, (B, H, Nq); none
    when None) mean what they mean for `attention_gradients`.
    """
    prob = make_problem(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)
    B, H, Nq = prob.batch, prob.heads, prob.nq
    captures = check_gradient_args(dlse, captures, (B, H, Nq))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    with torch.enable_grad():
        qh, kh, vh = (t.transpose(1, 2) for t in leaves)  # (B, heads, N, d)
        kh = kh.repeat_interleave(prob.group, dim=1)
        vh = vh.repeat_interleave(prob.group, dim=1)
        visible = prob.visible_all()  # (B, 1, Nq, Nk); (B, H, Nq, Nk) with a mask_mod
        scores = (qh @ kh.transpose(-1, -2)) * prob.scale
        if prob.has_score_mods:
            scores = prob.modify_scores(scores)
        scores = scores.masked_fill(~visible, float("-inf"))
        empty = ~visible.any(-1, keepdim=True)  # rows that see no key
        if sink_leaf is None:
            probs = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
            logits = scores
        else:
            sink = sink_leaf.to(scores.dtype).view(1, H, 1, 1).expand(B, H, Nq, 1)
            logits = torch.cat([scores, sink], dim=-1)
            probs = torch.softmax(logits, dim=-1)[..., :-1]
        z = prob.dropout_factor_all()
        if z is not None:
            probs = probs * z.to(probs.dtype)
        out = (probs @ vh).transpose(1, 2)
        lse = None
        if return_extra or dlse is not None:
            lse = _lse(logits, empty if sink_leaf is None else None)
        if not return_extra and dlse is None:
            out.backward(dout.to(out.dtype))
            return (out.detach(), *(t.grad for t in leaves))
        outputs, upstream = [out], [dout.to(out.dtype)]
        if dlse is not None:
            outputs.append(lse)
            upstream.append(dlse.to(lse.dtype))
        inputs = leaves + ([sink_leaf] if sink_leaf is not None else []) + captures
        grads = torch.autograd.grad(outputs, inputs, upstream, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
    dq, dk, dv = grads[:3]
    if not return_extra:
        return out.detach(), dq, dk, dv
    extra = {"lse": lse.detach(), "dsinks": None if sink_leaf is None else grads[3],
             "captures": grads[3 + (sink_leaf is not None):]}
    return out.detach(), dq, dk, dv, extra


def _lse(logits: torch.Tensor, empty: torch.Tensor | None) -> torch.Tensor:
    """logsumexp over the last axis, (B, H, Nq); +inf where `empty` (rows with
    no key and no sink), written so that autograd there gives 0, not NaN."""
    if empty is None:
        return torch.logsumexp(logits, dim=-1)
    safe = logits.masked_fill(empty, 0.0)
    lse = torch.logsumexp(safe, dim=-1)
    empty = empty.squeeze(-1).expand_as(lse)
    return torch.where(empty, torch.full_like(lse, float("inf")), lse)

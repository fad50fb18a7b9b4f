"""Standard attention from its closed forms, in float64: the oracle.

Forward:  S = tau Q K^T (masked entries -inf), P = softmax(S) row-wise,
          O = (P * Z) V with Z = keep / (1 - p) under dropout.
Backward: dV = (P * Z)^T dO, dP = (dO V^T) * Z, D_i = sum_j P_ij dP_ij,
          dS = P * (dP - D 1^T), dQ = tau dS K, dK = tau dS^T Q.
Under GQA the gradients of the query heads that share a kv head are summed.

Variants (flash-attn 2.8's semantics, see `problem`; Nk is seqlens_k[b] under
key padding). The score of query i, key j, head h, batch b is built in order
  S0 = tau q_i . k_j
  S1 = c tanh(S0 / c)                          softcap c > 0
  S2 = S1 - slope[b, h] |i + Nk - Nq - j|      alibi_slopes
  S  = score_mod(S2, b, h, i, j)               score_mod
  S  = -inf unless visible                     padding AND causal AND window AND mask_mod
and the softmax may carry a sink logit s_h (sinks) with no value row:
  L_i = log(sum_j exp S_ij + exp s_h),  P_ij = exp(S_ij - L_i).
A row that sees no key has O = 0 and L = +inf, or L = s_h with a sink.
The returned lse L includes the sink.

With an upstream gradient dL for lse as well as dO for O (the kernels'
backward), the gradient of the final score is
  dS = P * (dP - (D - dL) 1^T),   D_i = sum_j P_ij dP_ij = rowsum(dO * O),
and the sink, a key with dP = 0, gets dS_sink = -P_sink (D - dL), so
  d s_h = -sum_{b,i} exp(s_h - L_bhi) (D_bhi - dL_bhi).
dS then flows back through score_mod (its Jacobian), ALiBi (identity) and
softcap (times 1 - tanh^2(S0 / c)) to S0 = tau Q K^T. `attention_gradients`
computes all of it with torch autograd on `attention_forward`.

Two flash-attn 2.8 details this oracle does not copy, on purpose:
  * its causal ALiBi kernel adds +slope * j instead of -slope |i + Nk - Nq - j|;
    the two differ by slope (i + Nk - Nq) per row, so O and every gradient
    agree but the kernel's lse is larger by that much;
  * its Python API turns a window side >= the (padded) Nk into -1; for the
    right side this widens the window when Nq > Nk + right + 1.

`attention_forward` is written with differentiable torch ops only, so a test
can hold `attention_backward` against torch autograd. Both return float64
whatever the input dtype. Rows that see no key follow `empty_rows`.
"""

from __future__ import annotations

import torch

from .empty_rows import lse_from_stats, safe_max, safe_reciprocal
from .problem import F64, Problem, check_gradient_args, make_problem, to_query_layout


def attention_forward(q, k, v, *, softmax_scale=None, causal=False, seqlens_k=None,
                      dropout_p=0.0, keep_mask=None, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, score_mod=None, mask_mod=None, sinks=None):
    """Returns (out (B, Nq, H, d), lse (B, H, Nq)), both float64.

    Both are differentiable (torch autograd) in q, k, v, sinks and whatever
    tensors score_mod captures. lse includes the sink term when sinks is given.
    """
    prob = make_problem(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)
    probs, m, l = _probabilities(prob)
    out = _dropped(probs, prob) @ _expand_kv(prob.v, prob)
    return to_query_layout(out), lse_from_stats(m, l)


def attention_backward(q, k, v, out, dout, *, softmax_scale=None, causal=False, seqlens_k=None,
                       dropout_p=0.0, keep_mask=None):
    """Returns (dq (B, Nq, H, d), dk, dv (B, Nk, Hk, d)), all float64.

    `out` is part of the signature so that it matches the kernels', which
    need it for D = rowsum(dO * O). The closed form here takes D from its
    definition, D_i = sum_j P_ij dP_ij, and so does not read `out`: the
    oracle stays exact even when handed a kernel's rounded output.
    """
    prob = make_problem(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask)
    expected = (prob.batch, prob.nq, prob.heads, prob.head_dim_v)
    for name, t in (("out", out), ("dout", dout)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
    do = dout.to(torch.float64).transpose(1, 2)
    k_full, v_full = _expand_kv(prob.k, prob), _expand_kv(prob.v, prob)
    probs, _, _ = _probabilities(prob)
    z = prob.dropout_factor_all()

    dv_full = _dropped(probs, prob).transpose(-1, -2) @ do
    dp = do @ v_full.transpose(-1, -2)
    if z is not None:
        dp = dp * z
    delta = (probs * dp).sum(-1, keepdim=True)
    ds = probs * (dp - delta)
    dq = prob.scale * ds @ k_full
    dk_full = prob.scale * ds.transpose(-1, -2) @ prob.q
    return (to_query_layout(dq), to_query_layout(_sum_groups(dk_full, prob)),
            to_query_layout(_sum_groups(dv_full, prob)))


def attention_gradients(q, k, v, dout, *, dlse=None, captures=(), softmax_scale=None, causal=False,
                        seqlens_k=None, dropout_p=0.0, keep_mask=None, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, score_mod=None, mask_mod=None, sinks=None):
    """Every gradient of `attention_forward`, by torch autograd in float64.

    The loss is <out, dout> + <lse, dlse> (dlse (B, H, Nq), zeros when None).
    Returns a dict:
      "dq", "dk", "dv"  float64, shaped like q, k, v
      "dsinks"          float64 (H,), only when sinks is given
      "captures"        [gradient of each tensor in `captures`], in that order
      "out", "lse"      the forward's results (detached), float64
    `captures` names the tensors score_mod closes over whose gradients are
    wanted: pass the very tensors the closure indexes (not copies); each must
    require grad (a float64 one gives a float64 gradient). A capture the loss
    does not reach gets a zero gradient. Rows that see no key contribute
    exactly 0 (their P is 0; a +inf lse passes no gradient).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-D tensor (batch, seq, heads, head_dim)")
    B, Nq, H, _ = q.shape
    expected = (B, Nq, H, v.shape[-1]) if isinstance(v, torch.Tensor) else tuple(q.shape)   # O's: d_v wide
    if not isinstance(dout, torch.Tensor) or tuple(dout.shape) != expected:
        raise ValueError(f"dout must be a tensor of shape {expected}")
    captures = check_gradient_args(dlse, captures, (B, H, Nq))
    leaves = [t.detach().to(F64).clone().requires_grad_() if isinstance(t, torch.Tensor) else t
              for t in (q, k, v)]
    sink_leaf = sinks
    if isinstance(sinks, torch.Tensor) and sinks.is_floating_point():
        sink_leaf = sinks.detach().to(F64).clone().requires_grad_()
    with torch.enable_grad():
        out, lse = attention_forward(*leaves, softmax_scale=softmax_scale, causal=causal,
                                     seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask,
                                     window_size=window_size, softcap=softcap,
                                     alibi_slopes=alibi_slopes, score_mod=score_mod,
                                     mask_mod=mask_mod, sinks=sink_leaf)
        outputs, upstream = [out], [dout.to(F64)]
        if dlse is not None:
            outputs.append(lse)
            upstream.append(dlse.to(F64))
        inputs = leaves + ([sink_leaf] if sinks is not None else []) + captures
        grads = torch.autograd.grad(outputs, inputs, upstream, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
    result = {"dq": grads[0], "dk": grads[1], "dv": grads[2],
              "captures": grads[3 + (sinks is not None):],
              "out": out.detach(), "lse": lse.detach()}
    if sinks is not None:
        result["dsinks"] = grads[3]
    return result


def _probabilities(prob: Problem):
    """P (B, H, Nq, Nk) with the row statistics m and l (B, H, Nq).

    With sinks, m is the max over the row's scores and its sink, and l
    includes exp(sink - m); P has no sink column (the sink has no value row).
    """
    scores = prob.scale * prob.q @ _expand_kv(prob.k, prob).transpose(-1, -2)
    if prob.has_score_mods:
        scores = prob.modify_scores(scores)
    scores = scores.masked_fill(~prob.visible_all(), float("-inf"))
    # softmax is shift-invariant, so m carries no gradient.
    m = scores.amax(-1).detach()
    if prob.sinks is not None:
        sink = prob.sinks.view(1, -1, 1)  # (1, H, 1)
        m = torch.maximum(m, sink.detach())
    unnormalized = torch.exp(scores - safe_max(m).unsqueeze(-1))
    l = unnormalized.sum(-1)
    if prob.sinks is not None:
        l = l + torch.exp(sink - safe_max(m))
    return unnormalized * safe_reciprocal(l).unsqueeze(-1), m, l


def _dropped(probs: torch.Tensor, prob: Problem) -> torch.Tensor:
    z = prob.dropout_factor_all()
    return probs if z is None else probs * z


def _expand_kv(x: torch.Tensor, prob: Problem) -> torch.Tensor:
    """(B, Hk, N, d) -> (B, H, N, d): query head h reads kv head h // group."""
    return x.repeat_interleave(prob.group, dim=1)


def _sum_groups(x: torch.Tensor, prob: Problem) -> torch.Tensor:
    """(B, H, N, d) -> (B, Hk, N, d): sum the query heads that share a kv head."""
    B, _, N, d = x.shape
    return x.reshape(B, prob.kv_heads, prob.group, N, d).sum(2)


def row_statistics(q, k, *, softmax_scale=None, causal=False, seqlens_k=None):
    """(m, l) of the full rows, (B, H, Nq) each: what FlashAttention-1 must store."""
    v = torch.zeros_like(k)
    prob = make_problem(q, k, v, softmax_scale=softmax_scale, causal=causal, seqlens_k=seqlens_k)
    _, m, l = _probabilities(prob)
    return m, l

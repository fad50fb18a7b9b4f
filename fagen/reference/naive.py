"""Standard attention from its closed forms, in float64: the oracle.

Forward:  S = tau Q K^T (masked entries -inf), P = softmax(S) row-wise,
          O = (P * Z) V with Z = keep / (1 - p) under dropout.
Backward: dV = (P * Z)^T dO, dP = (dO V^T) * Z, D_i = sum_j P_ij dP_ij,
          dS = P * (dP - D 1^T), dQ = tau dS K, dK = tau dS^T Q.
Under GQA the gradients of the query heads that share a kv head are summed.

`attention_forward` is written with differentiable torch ops only, so a test
can hold `attention_backward` against torch autograd. Both return float64
whatever the input dtype. Rows that see no key follow `empty_rows`.
"""

from __future__ import annotations

import torch

from .empty_rows import lse_from_stats, safe_max, safe_reciprocal
from .problem import Problem, make_problem, to_query_layout


def attention_forward(q, k, v, *, softmax_scale=None, causal=False, seqlens_k=None,
                      dropout_p=0.0, keep_mask=None):
    """Returns (out (B, Nq, H, d), lse (B, H, Nq)), both float64."""
    prob = make_problem(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask)
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
    expected = (prob.batch, prob.nq, prob.heads, prob.head_dim)
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


def _probabilities(prob: Problem):
    """P (B, H, Nq, Nk) with the row statistics m and l (B, H, Nq)."""
    scores = prob.scale * prob.q @ _expand_kv(prob.k, prob).transpose(-1, -2)
    scores = scores.masked_fill(~prob.visible_all(), float("-inf"))
    # softmax is shift-invariant, so m carries no gradient.
    m = scores.amax(-1).detach()
    unnormalized = torch.exp(scores - safe_max(m).unsqueeze(-1))
    l = unnormalized.sum(-1)
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

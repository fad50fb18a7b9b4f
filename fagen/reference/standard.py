"""Standard attention with its HBM traffic counted: the FlashAttention-1
paper's Algorithm 0, the baseline of its IO analysis.

S and P are materialized in HBM, so the traffic is Theta(N d + N^2) whatever
the on-chip memory size: Q, K, V and O once each, S and P twice each.
"""

from __future__ import annotations

import torch

from .empty_rows import safe_max, safe_reciprocal
from .problem import make_problem, to_query_layout
from .tiling import dropped, head_major_hbm, masked_scores


def standard_forward(q, k, v, *, softmax_scale=None, causal=False, seqlens_k=None,
                     dropout_p=0.0, keep_mask=None):
    """Returns (out (B, Nq, H, d) float64, io: IOCount)."""
    prob = make_problem(q, k, v, softmax_scale=softmax_scale, causal=causal, seqlens_k=seqlens_k,
                        dropout_p=dropout_p, keep_mask=keep_mask)
    B, H, Nq, d = prob.q.shape
    Nk = prob.nk
    hbm = head_major_hbm(prob)
    hbm.allocate("S", (B, H, Nq, Nk))
    hbm.allocate("P", (B, H, Nq, Nk))
    hbm.allocate("O", (B, H, Nq, d))
    rows, cols = range(Nq), range(Nk)
    for b in range(B):
        for h in range(H):
            kvh = prob.kv_head(h)
            # Line 1: load Q, K, compute S = tau Q K^T (masked), write S.
            scores = masked_scores(prob, b, rows, cols, hbm.load("Q", b, h, rows), hbm.load("K", b, kvh, cols))
            hbm.store("S", b, h, rows, scores)
            # Line 2: read S, compute P = softmax(S), write P.
            scores = hbm.load("S", b, h, rows)
            m = scores.amax(dim=1, keepdim=True)
            unnormalized = torch.exp(scores - safe_max(m))
            probs = unnormalized * safe_reciprocal(unnormalized.sum(dim=1, keepdim=True))
            hbm.store("P", b, h, rows, dropped(probs, prob, b, h, rows, cols))
            # Line 3: read P and V, compute O = P V, write O.
            out = hbm.load("P", b, h, rows) @ hbm.load("V", b, kvh, cols)
            hbm.store("O", b, h, rows, out)
    return to_query_layout(hbm["O"]), hbm.io

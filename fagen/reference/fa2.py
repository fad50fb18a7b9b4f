"""FlashAttention-2 as an executable specification (Dao 2023).

Forward: Algorithm 1: Q blocks in the outer loop; O, l and m stay on chip
while K/V blocks stream past; O is kept unscaled and divided by l once at the
end; only O and L = m + log l are written.
Backward: Algorithm 2: a pre-pass writes D = rowsum(dO * O); then K/V blocks
in the outer loop, Q blocks inner; P_ij = exp(S_ij - L_i); dQ_i is added into
HBM (an atomic add on the GPU), dK_j, dV_j accumulate on chip.

Each (batch, head) pair runs the loops on 2-D tiles as the paper writes
them; tile sizes come from the Spec (B_r = block_m, B_c = block_n). Blocks with
no visible entry are skipped (causal block skipping, key-padding bound).
Rows that see no key follow fagen.reference.empty_rows (L = +inf there).
"""

from __future__ import annotations

import torch

from fagen.spec import Spec

from .empty_rows import EMPTY_ROW_MAX, lse_from_stats, safe_max, safe_reciprocal
from .hbm import blocks
from .problem import to_query_layout
from .tiling import dropped, head_major_hbm, masked_scores, tiled_problem, to_head_major


def fa2_forward(q, k, v, spec: Spec, *, softmax_scale=None, causal=None, seqlens_k=None,
                dropout_p=0.0, keep_mask=None, window_size=(-1, -1)):
    """Returns (out (B, Nq, H, d), lse (B, H, Nq), io: IOCount), float64."""
    prob = tiled_problem(q, k, v, spec, softmax_scale=softmax_scale, causal=causal,
                         seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask,
                         window_size=window_size)
    B, H, Nq, d = prob.q.shape
    hbm = head_major_hbm(prob)
    hbm.allocate("O", (B, H, Nq, d))
    hbm.allocate("L", (B, H, Nq))
    for b in range(B):
        for h in range(H):
            kvh = prob.kv_head(h)
            for rows in blocks(Nq, spec.block_m):  # line 3
                q_i = hbm.load("Q", b, h, rows)  # line 4
                # Line 5: on-chip state.
                o_acc = torch.zeros(len(rows), d, dtype=torch.float64)
                l_i = torch.zeros(len(rows), dtype=torch.float64)
                m_i = torch.full((len(rows),), EMPTY_ROW_MAX, dtype=torch.float64)
                for cols in blocks(prob.nk, spec.block_n):  # line 6
                    if prob.block_is_masked(b, rows, cols):
                        continue  # causal block skipping / key-padding loop bound
                    k_j = hbm.load("K", b, kvh, cols)  # line 7
                    v_j = hbm.load("V", b, kvh, cols)
                    s_ij = masked_scores(prob, b, rows, cols, q_i, k_j)  # line 8 (+ scale, mask)
                    # Line 9. A row still empty after this tile keeps m = -inf, and
                    # safe_max makes its P~ = exp(-inf - 0) = 0 rather than NaN.
                    m_new = torch.maximum(m_i, s_ij.amax(dim=1))
                    p_tile = torch.exp(s_ij - safe_max(m_new).unsqueeze(1))
                    rescale = torch.exp(m_i - safe_max(m_new))
                    l_i = rescale * l_i + p_tile.sum(dim=1)
                    # Line 10: unscaled accumulator; dropout hits P~ V, never l.
                    o_acc = rescale.unsqueeze(1) * o_acc + dropped(p_tile, prob, b, h, rows, cols) @ v_j
                    m_i = m_new
                hbm.store("O", b, h, rows, safe_reciprocal(l_i).unsqueeze(1) * o_acc)  # lines 12, 14
                hbm.store("L", b, h, rows, lse_from_stats(m_i, l_i))  # lines 13, 15
    return to_query_layout(hbm["O"]), hbm["L"].clone(), hbm.io


def fa2_backward(q, k, v, out, dout, lse, spec: Spec, *, softmax_scale=None, causal=None,
                 seqlens_k=None, dropout_p=0.0, keep_mask=None, window_size=(-1, -1)):
    """Returns (dq (B, Nq, H, d), dk, dv (B, Nk, Hk, d), io: IOCount), float64.

    lse is the forward's L (B, H, Nq), +inf on rows that see no key.
    """
    prob = tiled_problem(q, k, v, spec, softmax_scale=softmax_scale, causal=causal,
                         seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask,
                         window_size=window_size)
    B, H, Nq, d = prob.q.shape
    Hk, Nk = prob.kv_heads, prob.nk
    hbm = head_major_hbm(prob, O=to_head_major(out), dO=to_head_major(dout), L=lse)
    hbm.allocate("D", (B, H, Nq))
    hbm.allocate("dQ", (B, H, Nq, d))
    hbm.allocate("dK", (B, Hk, Nk, d))
    hbm.allocate("dV", (B, Hk, Nk, d))
    zeros = lambda n: torch.zeros(n, d, dtype=torch.float64)  # noqa: E731
    for b in range(B):
        for h in range(H):
            hbm.store("dQ", b, h, range(Nq), zeros(Nq))  # line 3
            for rows in blocks(Nq, spec.block_m):  # line 4: the D pre-pass
                d_i = (hbm.load("dO", b, h, rows) * hbm.load("O", b, h, rows)).sum(dim=1)
                hbm.store("D", b, h, rows, d_i)
        if prob.group > 1:  # GQA: query heads add into shared dK, dV, so start them at 0
            for kvh in range(Hk):
                hbm.store("dK", b, kvh, range(Nk), zeros(Nk))
                hbm.store("dV", b, kvh, range(Nk), zeros(Nk))
    for b in range(B):
        for h in range(H):
            kvh = prob.kv_head(h)
            for cols in blocks(Nk, spec.block_n):  # line 5
                dk_j, dv_j = zeros(len(cols)), zeros(len(cols))  # line 7
                # A block no row sees is never loaded; line 18 still writes its zero dK_j, dV_j.
                if not prob.block_is_masked(b, range(Nq), cols):
                    k_j = hbm.load("K", b, kvh, cols)  # line 6
                    v_j = hbm.load("V", b, kvh, cols)
                    for rows in blocks(Nq, spec.block_m):  # line 8
                        if prob.block_is_masked(b, rows, cols):
                            continue
                        # Line 9 (O_i is listed there but only D_i is needed).
                        q_i = hbm.load("Q", b, h, rows)
                        do_i = hbm.load("dO", b, h, rows)
                        l_i = hbm.load("L", b, h, rows)
                        d_i = hbm.load("D", b, h, rows)
                        s_ij = masked_scores(prob, b, rows, cols, q_i, k_j)  # line 10
                        # Line 11: P from L alone; L = +inf makes a keyless row's P exactly 0.
                        p_ij = torch.exp(s_ij - l_i.unsqueeze(1))
                        dv_j = dv_j + dropped(p_ij, prob, b, h, rows, cols).T @ do_i  # line 12
                        dp_ij = dropped(do_i @ v_j.T, prob, b, h, rows, cols)  # line 13
                        ds_ij = p_ij * (dp_ij - d_i.unsqueeze(1))  # line 14
                        hbm.accumulate("dQ", b, h, rows, prob.scale * ds_ij @ k_j)  # line 15
                        dk_j = dk_j + prob.scale * ds_ij.T @ q_i  # line 16
                write = hbm.store if prob.group == 1 else hbm.accumulate  # line 18
                write("dK", b, kvh, cols, dk_j)
                write("dV", b, kvh, cols, dv_j)
    return (to_query_layout(hbm["dQ"]), to_query_layout(hbm["dK"]), to_query_layout(hbm["dV"]),
            hbm.io)

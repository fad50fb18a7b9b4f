"""FlashAttention-1 as an executable specification (Dao et al. 2022).

Forward: Algorithm 1 (with Algorithm 2's masking and dropout): K/V blocks in
the outer loop, Q blocks in the inner loop; O, l and m live in HBM and are
read, updated and written back at every step.
Backward: Algorithm 4: P_ij is recomputed from (m, l); D_i = rowsum(dO_i * O_i);
dK_j, dV_j accumulate on chip per K/V block; dQ_i accumulates in HBM.

Each (batch, head) pair is one "thread block" that runs the loops below on
2-D tiles, exactly as written in the paper; only the tile sizes come from
the Spec (B_r = block_m, B_c = block_n). Blocks with no visible entry are
skipped (causal block skipping and the key-padding loop bound), which is
exact because such a block contributes nothing (see fagen.identities).
Rows that see no key follow fagen.reference.empty_rows.
"""

from __future__ import annotations

import torch

from fagen.spec import Spec

from .empty_rows import EMPTY_ROW_MAX, safe_max, safe_reciprocal
from .hbm import blocks
from .problem import to_query_layout
from .tiling import dropped, head_major_hbm, masked_scores, tiled_problem, to_head_major


def fa1_forward(q, k, v, spec: Spec, *, softmax_scale=None, causal=None, seqlens_k=None,
                dropout_p=0.0, keep_mask=None, window_size=(-1, -1)):
    """Returns (out (B, Nq, H, d), m (B, H, Nq), l (B, H, Nq), io: IOCount), float64."""
    prob = tiled_problem(q, k, v, spec, softmax_scale=softmax_scale, causal=causal,
                         seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask,
                         window_size=window_size)
    B, H, Nq, d = prob.q.shape
    hbm = head_major_hbm(prob)
    hbm.allocate("O", (B, H, Nq, d))
    hbm.allocate("l", (B, H, Nq))
    hbm.allocate("m", (B, H, Nq))
    all_rows = range(Nq)
    for b in range(B):
        for h in range(H):
            kvh = prob.kv_head(h)
            # Line 2: initialize O = 0, l = 0, m = -inf in HBM.
            hbm.store("O", b, h, all_rows, torch.zeros(Nq, d, dtype=torch.float64))
            hbm.store("l", b, h, all_rows, torch.zeros(Nq, dtype=torch.float64))
            hbm.store("m", b, h, all_rows, torch.full((Nq,), EMPTY_ROW_MAX, dtype=torch.float64))
            for cols in blocks(prob.nk, spec.block_n):  # line 5
                if prob.block_is_masked(b, all_rows, cols):
                    continue  # no row sees this K/V block: it is never loaded
                k_j = hbm.load("K", b, kvh, cols)  # line 6
                v_j = hbm.load("V", b, kvh, cols)
                for rows in blocks(Nq, spec.block_m):  # line 7
                    if prob.block_is_masked(b, rows, cols):
                        continue  # causal block skipping
                    q_i = hbm.load("Q", b, h, rows)  # line 8
                    o_i = hbm.load("O", b, h, rows)
                    l_i = hbm.load("l", b, h, rows)
                    m_i = hbm.load("m", b, h, rows)
                    s_ij = masked_scores(prob, b, rows, cols, q_i, k_j)  # lines 9 (Alg. 2: scale, mask)
                    # Line 10: tile statistics. An all-masked tile row has m~ = -inf,
                    # P~ = exp(-inf - 0) = 0 and l~ = 0 (safe_max keeps it NaN-free).
                    m_tile = s_ij.amax(dim=1)
                    p_tile = torch.exp(s_ij - safe_max(m_tile).unsqueeze(1))
                    l_tile = p_tile.sum(dim=1)
                    # Line 11: merged statistics.
                    m_new = torch.maximum(m_i, m_tile)
                    old_weight = torch.exp(m_i - safe_max(m_new))
                    tile_weight = torch.exp(m_tile - safe_max(m_new))
                    l_new = old_weight * l_i + tile_weight * l_tile
                    # Line 12 (Alg. 2, line 15: P~ dropped; l keeps the undropped sum).
                    p_dropped = dropped(p_tile, prob, b, h, rows, cols)
                    o_new = safe_reciprocal(l_new).unsqueeze(1) * (
                        (l_i * old_weight).unsqueeze(1) * o_i
                        + tile_weight.unsqueeze(1) * (p_dropped @ v_j))
                    hbm.store("O", b, h, rows, o_new)
                    hbm.store("l", b, h, rows, l_new)  # line 13
                    hbm.store("m", b, h, rows, m_new)
    return to_query_layout(hbm["O"]), hbm["m"].clone(), hbm["l"].clone(), hbm.io


def fa1_backward(q, k, v, out, dout, m, l, spec: Spec, *, softmax_scale=None, causal=None,
                 seqlens_k=None, dropout_p=0.0, keep_mask=None, window_size=(-1, -1)):
    """Returns (dq (B, Nq, H, d), dk, dv (B, Nk, Hk, d), io: IOCount), float64.

    m and l are the forward's statistics (B, H, Nq), as `fa1_forward` returns them.
    """
    prob = tiled_problem(q, k, v, spec, softmax_scale=softmax_scale, causal=causal,
                         seqlens_k=seqlens_k, dropout_p=dropout_p, keep_mask=keep_mask,
                         window_size=window_size)
    B, H, Nq, d = prob.q.shape
    Hk, Nk = prob.kv_heads, prob.nk
    hbm = head_major_hbm(prob, O=to_head_major(out), dO=to_head_major(dout), m=m, l=l)
    hbm.allocate("dQ", (B, H, Nq, d))
    hbm.allocate("dK", (B, Hk, Nk, d))
    hbm.allocate("dV", (B, Hk, Nk, d))
    zeros = lambda n: torch.zeros(n, d, dtype=torch.float64)  # noqa: E731
    # Line 5: initialize dQ, dK, dV = 0 in HBM.
    for b in range(B):
        for h in range(H):
            hbm.store("dQ", b, h, range(Nq), zeros(Nq))
        for kvh in range(Hk):
            hbm.store("dK", b, kvh, range(Nk), zeros(Nk))
            hbm.store("dV", b, kvh, range(Nk), zeros(Nk))
    for b in range(B):
        for h in range(H):
            kvh = prob.kv_head(h)
            for cols in blocks(Nk, spec.block_n):  # line 6
                if prob.block_is_masked(b, range(Nq), cols):
                    continue  # dK_j = dV_j = 0, already in HBM
                k_j = hbm.load("K", b, kvh, cols)  # line 7
                v_j = hbm.load("V", b, kvh, cols)
                dk_j = zeros(len(cols))  # line 8
                dv_j = zeros(len(cols))
                for rows in blocks(Nq, spec.block_m):  # line 9
                    if prob.block_is_masked(b, rows, cols):
                        continue
                    q_i = hbm.load("Q", b, h, rows)  # line 10
                    o_i = hbm.load("O", b, h, rows)
                    do_i = hbm.load("dO", b, h, rows)
                    dq_i = hbm.load("dQ", b, h, rows)
                    l_i = hbm.load("l", b, h, rows)
                    m_i = hbm.load("m", b, h, rows)
                    s_ij = masked_scores(prob, b, rows, cols, q_i, k_j)  # lines 11-12
                    # Line 13: P_ij = diag(l_i)^-1 exp(S_ij - m_i); 0 on rows that see no key.
                    p_ij = safe_reciprocal(l_i).unsqueeze(1) * torch.exp(s_ij - safe_max(m_i).unsqueeze(1))
                    p_dropped = dropped(p_ij, prob, b, h, rows, cols)  # lines 14-15
                    dv_j = dv_j + p_dropped.T @ do_i  # line 16
                    dp_dropped = do_i @ v_j.T  # line 17
                    dp_ij = dropped(dp_dropped, prob, b, h, rows, cols)  # line 18
                    d_i = (do_i * o_i).sum(dim=1)  # line 19
                    ds_ij = p_ij * (dp_ij - d_i.unsqueeze(1))  # line 20
                    hbm.store("dQ", b, h, rows, dq_i + prob.scale * ds_ij @ k_j)  # line 21
                    dk_j = dk_j + prob.scale * ds_ij.T @ q_i  # line 22
                # Line 24. Under GQA several query heads add into one kv head's dK, dV.
                write = hbm.store if prob.group == 1 else hbm.accumulate
                write("dK", b, kvh, cols, dk_j)
                write("dV", b, kvh, cols, dv_j)
    return (to_query_layout(hbm["dQ"]), to_query_layout(hbm["dK"]), to_query_layout(hbm["dV"]),
            hbm.io)

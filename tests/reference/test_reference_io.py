"""HBM traffic of the tiled specifications: exact counts, and the
FlashAttention-1 paper's scaling (Theorem 2): Theta(N^2 d^2 / M) accesses for
the tiled forward versus Theta(N d + N^2) for standard attention."""

from __future__ import annotations

import math

import pytest

from fagen.reference import fa1_forward, fa2_forward, standard_forward
from fagen.spec import Spec
from reference_cases import make_inputs

D = 16


def fa1_io(N: int, M: int, d: int = D) -> int:
    q, k, v, _ = make_inputs(B=1, Nq=N, Nk=N, H=1, Hk=1, d=d)
    return fa1_forward(q, k, v, Spec.from_sram(M, d))[3].total


def standard_io(N: int, d: int = D) -> int:
    q, k, v, _ = make_inputs(B=1, Nq=N, Nk=N, H=1, Hk=1, d=d)
    return standard_forward(q, k, v)[1].total


@pytest.mark.parametrize("Nq, Nk, bm, bn", [(40, 40, 16, 16), (33, 70, 32, 16), (64, 20, 16, 48)])
def test_fa1_forward_counts_match_algorithm_1(Nq, Nk, bm, bn):
    B, H, d = 2, 2, 8
    q, k, v, _ = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=1, d=d)
    io = fa1_forward(q, k, v, Spec(head_dim=d, block_m=bm, block_n=bn, num_warps=1))[3]
    Tc = math.ceil(Nk / bn)
    programs = B * H
    # K_j, V_j once per outer step; Q_i, O_i, l_i, m_i once per (i, j).
    assert io.reads == {"Q": programs * Tc * Nq * d, "K": programs * Nk * d, "V": programs * Nk * d,
                        "O": programs * Tc * Nq * d, "l": programs * Tc * Nq, "m": programs * Tc * Nq}
    # Line 2 initializes O, l, m; every (i, j) writes them back.
    assert io.writes["O"] == programs * (Tc + 1) * Nq * d
    assert io.writes["l"] == io.writes["m"] == programs * (Tc + 1) * Nq
    assert io.writes["Q"] == io.writes["K"] == io.writes["V"] == 0


def test_fa2_forward_reads_q_once_and_writes_only_o_and_lse():
    B, H, Nq, Nk, d, bm, bn = 1, 2, 50, 30, 8, 16, 16
    q, k, v, _ = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=H, d=d)
    io = fa2_forward(q, k, v, Spec(head_dim=d, block_m=bm, block_n=bn, num_warps=1))[2]
    Tr = math.ceil(Nq / bm)
    assert io.reads == {"Q": B * H * Nq * d, "K": B * H * Tr * Nk * d, "V": B * H * Tr * Nk * d,
                        "O": 0, "L": 0}
    assert io.writes == {"Q": 0, "K": 0, "V": 0, "O": B * H * Nq * d, "L": B * H * Nq}


def test_standard_attention_counts_match_algorithm_0():
    N, d = 24, 8
    q, k, v, _ = make_inputs(B=1, Nq=N, Nk=N, H=1, Hk=1, d=d)
    io = standard_forward(q, k, v)[1]
    assert io.reads == {"Q": N * d, "K": N * d, "V": N * d, "S": N * N, "P": N * N, "O": 0}
    assert io.writes == {"Q": 0, "K": 0, "V": 0, "S": N * N, "P": N * N, "O": N * d}


def test_fa1_traffic_scales_as_n2_d2_over_m_and_standard_as_nd_plus_n2():
    Ns = (128, 256, 512)
    Ms = (1024, 2048, 4096)  # B_c = M / 4d = 16, 32, 64 with d = 16; B_r = d
    # Theorem 2's regime is d <= M <= N d; past it one K/V pass covers everything.
    grid = [(N, M) for N in Ns for M in Ms if D <= M <= N * D]
    fa1 = {(N, M): fa1_io(N, M) for N, M in grid}
    std = {N: standard_io(N) for N in Ns}
    fa1_ratio = [fa1[N, M] / (N * N * D * D / M) for N, M in grid]
    std_ratio = [std[N] / (N * D + N * N) for N in Ns]
    # Theta: the count over the predicted order stays within a constant band
    # while N and M vary (the count itself varies over 20x).
    assert max(fa1_ratio) / min(fa1_ratio) < 1.5, fa1_ratio
    assert max(std_ratio) / min(std_ratio) < 1.5, std_ratio
    assert max(fa1.values()) / min(fa1.values()) > 20
    for N, M in grid:
        # Doubling M (bigger K/V blocks, fewer passes over Q and O) nearly halves the traffic ...
        if (N, 2 * M) in fa1:
            assert 1.7 < fa1[N, M] / fa1[N, 2 * M] <= 2.0
        # ... doubling N nearly quadruples it (standard attention too, from its N^2 term) ...
        if (2 * N, M) in fa1:
            assert 3.5 < fa1[2 * N, M] / fa1[N, M] <= 4.0
            assert 3.0 < std[2 * N] / std[N] <= 4.0
        # ... and with M well above d^2 the tiled forward moves less data than standard attention.
        assert fa1[N, M] < std[N]

"""FlashAttention-1 and -2 as tiled specifications equal the closed forms to
1e-12 in float64: ragged sizes, Nq != Nk, rows with no key, dropout, GQA; and
block skipping skips exactly the blocks with no visible entry."""

from __future__ import annotations

import itertools

import pytest
import torch

from fagen.reference import (attention_backward, attention_forward, fa1_backward, fa1_forward,
                             fa2_backward, fa2_forward, row_statistics)
from fagen.reference.hbm import blocks
from fagen.reference.problem import make_problem
from fagen.spec import Spec
from reference_cases import CASES, case_kwargs, make_inputs

TOL = 1e-12
D = 8
# (Nq, Nk, H, Hk, block_m, block_n): ragged, more keys, more queries, GQA, blocks bigger than N.
SHAPES = [
    (37, 37, 2, 2, 16, 16),
    (21, 50, 2, 1, 32, 16),
    (50, 19, 4, 2, 16, 32),
    (9, 12, 2, 2, 64, 64),
]


def spec_for(kwargs: dict, block_m: int, block_n: int, version: int) -> Spec:
    """The kernel variant that can run these run-time arguments."""
    return Spec(head_dim=D, version=version, block_m=block_m, block_n=block_n, num_warps=1,
                mask="causal" if kwargs.get("causal") else "none",
                key_padding="seqlens_k" in kwargs, dropout="keep_mask" in kwargs)


def run_tiled(version, q, k, v, dout, spec, kwargs):
    """(out, lse-or-(m, l), (dq, dk, dv)) of one tiled version."""
    if version == 1:
        out, m, l, _ = fa1_forward(q, k, v, spec, **kwargs)
        grads = fa1_backward(q, k, v, out, dout, m, l, spec, **kwargs)[:3]
        return out, (m, l), grads
    out, lse, _ = fa2_forward(q, k, v, spec, **kwargs)
    grads = fa2_backward(q, k, v, out, dout, lse, spec, **kwargs)[:3]
    return out, lse, grads


def assert_close_with_infs(got, want):
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[torch.isinf(got)], want[torch.isinf(want)])
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=0, atol=TOL)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES)
def test_tiled_equals_closed_forms(case, shape, version):
    Nq, Nk, H, Hk, block_m, block_n = shape
    q, k, v, dout = make_inputs(B=2, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=D, seed=Nq + Nk)
    kwargs = case_kwargs(case, 2, H, Nq, Nk)
    spec = spec_for(kwargs, block_m, block_n, version)
    want_out, want_lse = attention_forward(q, k, v, **kwargs)
    want_grads = attention_backward(q, k, v, want_out, dout, **kwargs)
    out, stats, grads = run_tiled(version, q, k, v, dout, spec, kwargs)
    assert torch.allclose(out, want_out, rtol=0, atol=TOL), (out - want_out).abs().max()
    if version == 1:
        want_m, want_l = row_statistics(q, k, softmax_scale=kwargs.get("softmax_scale"),
                                        causal=kwargs.get("causal", False), seqlens_k=kwargs.get("seqlens_k"))
        assert_close_with_infs(stats[0], want_m)
        assert torch.allclose(stats[1], want_l, rtol=0, atol=TOL)
    else:
        assert_close_with_infs(stats, want_lse)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert g.shape == w.shape, name
        assert not torch.isnan(g).any(), name
        assert torch.allclose(g, w, rtol=0, atol=TOL), (name, (g - w).abs().max())


def test_rows_without_keys_get_the_documented_statistics():
    Nq, Nk = 40, 20  # causal: rows 0..19 see no key
    q, k, v, dout = make_inputs(B=2, Nq=Nq, Nk=Nk, d=D)
    kwargs = {"causal": True, "seqlens_k": torch.tensor([Nk, 0], dtype=torch.int32)}
    v1 = Spec(head_dim=D, version=1, block_m=16, block_n=16, num_warps=1, mask="causal", key_padding=True)
    out, m, l, _ = fa1_forward(q, k, v, v1, **kwargs)
    out2, lse, _ = fa2_forward(q, k, v, v1.replace(version=2), **kwargs)
    for empty in (m[0, :, :20], m[1]):
        assert torch.equal(empty, torch.full_like(empty, float("-inf")))
    assert torch.equal(l[0, :, :20], torch.zeros(2, 20, dtype=torch.float64)) and torch.equal(l[1], torch.zeros_like(l[1]))
    assert torch.equal(lse[1], torch.full_like(lse[1], float("inf")))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out2[1], torch.zeros_like(out2[1]))
    dq, dk, dv, _ = fa2_backward(q, k, v, out2, dout, lse, v1.replace(version=2), **kwargs)
    assert torch.equal(dq[0, :20], torch.zeros_like(dq[0, :20]))
    assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))


@pytest.mark.parametrize("Nq, Nk", [(13, 13), (7, 30), (30, 7), (1, 17), (17, 1)])
def test_block_skip_decision_matches_the_entries(Nq, Nk):
    """block_is_masked (from block bounds, as a kernel decides) is True exactly when
    the block has no visible entry."""
    q, k, v, _ = make_inputs(B=3, Nq=Nq, Nk=Nk, d=4)
    for causal in (False, True):
        lengths = torch.tensor([Nk, 0, Nk // 2], dtype=torch.int32)
        prob = make_problem(q, k, v, causal=causal, seqlens_k=lengths)
        for b, bm, bn in itertools.product(range(3), (1, 4, 16), (1, 3, 16)):
            for rows in blocks(Nq, bm):
                for cols in blocks(Nk, bn):
                    assert prob.block_is_masked(b, rows, cols) == (not prob.visible(b, rows, cols).any())


@pytest.mark.parametrize("version", [1, 2])
def test_causal_skipping_loads_only_blocks_with_visible_entries(version):
    Nq, Nk, bm, bn = 40, 56, 16, 16
    q, k, v, _ = make_inputs(B=1, Nq=Nq, Nk=Nk, H=1, Hk=1, d=D)
    spec = Spec(head_dim=D, version=version, block_m=bm, block_n=bn, num_warps=1, mask="causal")
    io = fa1_forward(q, k, v, spec)[3] if version == 1 else fa2_forward(q, k, v, spec)[2]
    full = (fa1_forward(q, k, v, spec.replace(mask="none"))[3] if version == 1
            else fa2_forward(q, k, v, spec.replace(mask="none"))[2])
    prob = make_problem(q, k, v, causal=True)
    pairs = [(rows, cols) for rows in blocks(Nq, bm) for cols in blocks(Nk, bn)
             if prob.visible(0, rows, cols).any()]
    assert len(pairs) < len(list(blocks(Nq, bm))) * len(list(blocks(Nk, bn))), "the case must skip something"
    if version == 2:  # Q outer: K_j is loaded once per visible (i, j) pair
        assert io.reads["K"] == sum(len(cols) * D for _, cols in pairs)
    else:  # K/V outer: Q_i is loaded once per visible (i, j) pair
        assert io.reads["Q"] == sum(len(rows) * D for rows, _ in pairs)
    assert io.total < full.total


def test_spec_and_arguments_must_agree():
    q, k, v, _ = make_inputs(d=D)
    plain = Spec(head_dim=D, block_m=16, block_n=16, num_warps=1)
    with pytest.raises(ValueError, match="causal"):
        fa2_forward(q, k, v, plain, causal=True)
    with pytest.raises(ValueError, match="key_padding"):
        fa2_forward(q, k, v, plain, seqlens_k=torch.tensor([3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="dropout"):
        fa1_forward(q, k, v, plain, dropout_p=0.1, keep_mask=torch.ones(2, 2, 9, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="head_dim"):
        fa1_forward(q, k, v, plain.replace(head_dim=16))
    # causal=None takes the spec's mask.
    causal_spec = plain.replace(mask="causal")
    assert torch.allclose(fa2_forward(q, k, v, causal_spec)[0], attention_forward(q, k, v, causal=True)[0],
                          rtol=0, atol=TOL)

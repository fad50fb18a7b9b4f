"""The naive closed forms: against a scalar-loop oracle written from the
definitions, against torch autograd, and on rows that see no key."""

from __future__ import annotations

import math

import pytest
import torch

from fagen.reference import (EMPTY_ROW_LSE, attention_backward, attention_forward, lse_from_stats,
                             row_statistics)
from reference_cases import CASES, case_kwargs, make_inputs

TOL = 1e-12
# (Nq, Nk, H, Hk): square, more keys, more queries (causal leaves empty rows), GQA.
SHAPES = [(7, 7, 2, 2), (5, 9, 2, 1), (9, 5, 4, 2)]


def loop_oracle(q, k, v, softmax_scale=None, causal=False, seqlens_k=None, dropout_p=0.0, keep_mask=None):
    """Attention one scalar at a time, straight from the definitions."""
    B, Nq, H, d = q.shape
    Nk, Hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = torch.zeros(B, Nq, H, d, dtype=torch.float64)
    lse = torch.zeros(B, H, Nq, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kvh = h // (H // Hk)
            keys = Nk if seqlens_k is None else int(seqlens_k[b])
            for i in range(Nq):
                # Causal aligns bottom-right to the keys that exist (flash-attn varlen).
                seen = [j for j in range(keys) if not causal or j <= i + keys - Nq]
                if not seen:
                    lse[b, h, i] = math.inf
                    continue
                scores = {j: scale * float(q[b, i, h] @ k[b, j, kvh]) for j in seen}
                top = max(scores.values())
                total = sum(math.exp(s - top) for s in scores.values())
                lse[b, h, i] = top + math.log(total)
                for j in seen:
                    weight = math.exp(scores[j] - top) / total
                    if keep_mask is not None:
                        weight *= float(keep_mask[b, h, i, j]) / (1 - dropout_p)
                    out[b, i, h] += weight * v[b, j, kvh]
    return out, lse


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_scalar_loop(case, shape):
    Nq, Nk, H, Hk = shape
    q, k, v, _ = make_inputs(B=2, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=4)
    kwargs = case_kwargs(case, 2, H, Nq, Nk)
    out, lse = attention_forward(q, k, v, **kwargs)
    want_out, want_lse = loop_oracle(q, k, v, **kwargs)
    assert out.dtype == torch.float64 and out.shape == q.shape
    assert torch.allclose(out, want_out, rtol=0, atol=TOL)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], rtol=0, atol=TOL)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES)
def test_backward_closed_forms_match_autograd(case, shape):
    Nq, Nk, H, Hk = shape
    q, k, v, dout = make_inputs(B=2, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=4, seed=1)
    kwargs = case_kwargs(case, 2, H, Nq, Nk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_forward(*leaves, **kwargs)
    expected = torch.autograd.grad(out, leaves, dout)
    got = attention_backward(q, k, v, out.detach(), dout, **kwargs)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert g.shape == e.shape, name
        assert torch.isfinite(e).all(), f"autograd {name} is not finite"
        assert torch.allclose(g, e, rtol=0, atol=TOL), (name, (g - e).abs().max())


def test_rows_without_keys_give_zero_output_and_exact_zero_gradients():
    # Causal with Nq > Nk: rows 0..3 see nothing; batch 1 has no keys at all.
    Nq, Nk = 9, 5
    q, k, v, dout = make_inputs(B=2, Nq=Nq, Nk=Nk, H=2, Hk=2, d=4)
    kwargs = {"causal": True, "seqlens_k": torch.tensor([Nk, 0], dtype=torch.int32)}
    out, lse = attention_forward(q, k, v, **kwargs)
    dq, dk, dv = attention_backward(q, k, v, out, dout, **kwargs)
    empty = torch.zeros(2, Nq, dtype=torch.bool)
    empty[0, : Nq - Nk] = True
    empty[1] = True
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    assert torch.equal(lse.transpose(1, 2)[empty], torch.full_like(lse.transpose(1, 2)[empty], EMPTY_ROW_LSE))
    assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))
    for t in (out, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert (dq[~empty] != 0).any(), "rows with keys must still get gradients"


def test_row_statistics_are_max_and_shifted_sum():
    q, k, _, _ = make_inputs(B=1, Nq=6, Nk=4, H=1, Hk=1, d=4)
    m, l = row_statistics(q, k, causal=True)
    scores = (q[0, :, 0] @ k[0, :, 0].T) / 2.0  # 1/sqrt(4)
    for i in range(6):
        seen = scores[i, : max(0, i - 1)]  # causal: j <= i + 4 - 6
        if seen.numel() == 0:
            assert m[0, 0, i] == -math.inf and l[0, 0, i] == 0
        else:
            assert abs(float(m[0, 0, i] - seen.max())) < TOL
            assert abs(float(l[0, 0, i] - torch.exp(seen - seen.max()).sum())) < TOL
    lse = lse_from_stats(m, l)
    assert torch.isinf(lse[0, 0, :2]).all() and (lse[0, 0, :2] > 0).all()


def test_inputs_of_any_float_dtype_are_computed_in_float64():
    q, k, v, _ = make_inputs()
    out64, _ = attention_forward(q, k, v)
    out32, _ = attention_forward(q.float(), k.float(), v.float())
    assert out32.dtype == torch.float64
    # Same math on float32-rounded inputs: close, but not identical to the float64 inputs' result.
    assert torch.allclose(out32, out64, atol=1e-5) and not torch.equal(out32, out64)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, _ = make_inputs(d=8)
    assert torch.equal(attention_forward(q, k, v)[0], attention_forward(q, k, v, softmax_scale=1 / math.sqrt(8))[0])


@pytest.mark.parametrize("bad, message", [
    ({"seqlens_k": torch.tensor([3, 12], dtype=torch.int32)}, "seqlens_k"),
    ({"seqlens_k": torch.tensor([3.0, 2.0])}, "seqlens_k"),
    ({"dropout_p": 0.5}, "keep_mask"),
    ({"dropout_p": 1.0}, "dropout_p"),
    ({"dropout_p": 0.5, "keep_mask": torch.ones(2, 2, 9, 10, dtype=torch.bool)}, "keep_mask"),
])
def test_bad_arguments_are_rejected_with_a_reason(bad, message):
    q, k, v, _ = make_inputs(Nq=9, Nk=11)
    with pytest.raises(ValueError, match=message):
        attention_forward(q, k, v, **bad)


def test_query_heads_must_be_a_multiple_of_kv_heads():
    q, _, _, _ = make_inputs(H=3)
    _, k, v, _ = make_inputs(Hk=2)
    with pytest.raises(ValueError, match="multiple"):
        attention_forward(q, k, v)

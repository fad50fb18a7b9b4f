"""fagen.reference.same_fp8: the fp8 forward's roundings, the yardstick of its accuracy rule."""

from __future__ import annotations

import pytest
import torch

from fagen.reference import attention_forward
from fagen.reference.same_fp8 import P_EXPONENT, attention_same_fp8, e4m3

B, N, H, HK, D = 2, 192, 4, 2, 64


def quantised(x: torch.Tensor, group: int, top: float = 448.0):
    """x as e4m3 with a descale per (batch, K/V head): the group's largest magnitude at `top`."""
    batch, _, heads, _ = x.shape
    amax = x.abs().amax(dim=(1, 3)).view(batch, heads // group, group).amax(-1)
    descale = amax / top
    return (x / descale.repeat_interleave(group, 1)[:, None, :, None]).to(torch.float8_e4m3fn), descale


def dequantised(x8: torch.Tensor, descale: torch.Tensor, group: int) -> torch.Tensor:
    return x8.double() * descale.double().repeat_interleave(group, 1)[:, None, :, None]


def problem(seed: int, key_scale: float, top: float = 448.0):
    """Quantised q, k, v with their descales, and the float64 oracle on what they stand for
    (a larger key scale: peakier rows, more of P far below its maximum)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, N, h, D, generator=g) for h in (H, HK, HK))
    (q8, qd), (k8, kd), (v8, vd) = (quantised(q, H // HK, top), quantised(k * key_scale, 1, top),
                                    quantised(v, 1, top))
    oracle = attention_forward(dequantised(q8, qd, H // HK), dequantised(k8, kd, 1), dequantised(v8, vd, 1),
                               causal=True)[0]
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd), oracle


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()) ** 2).mean().sqrt().item()


@pytest.mark.parametrize("key_scale", [1.0, 3.0])
def test_p_scaled_by_2_to_the_8_errs_least_and_2_to_the_9_saturates(key_scale):
    """The derivation of P's scale, executed: P~'s largest value is 2^p; up to p = 8 (256) a larger
    p keeps more of P out of e4m3's subnormals and the error does not grow; at p = 9 (512 > 448)
    a row's largest P saturates and the error jumps."""
    tensors, descales, oracle = problem(1, key_scale)
    errors = {p: rmse(attention_same_fp8(*tensors, **descales, causal=True, p_exponent=p), oracle)
              for p in (0, 4, 8, 9)}
    assert P_EXPONENT == 8
    assert errors[8] <= min(errors[0], errors[4]) * (1 + 1e-6), errors
    assert errors[9] > 2 * errors[8], errors


def test_descales_fold_into_the_scores_and_the_output():
    """Doubling q, k and v while halving their descales changes nothing (powers of two are exact;
    quantised to 224 so that the doubled values stay within 448); and against the oracle on the
    tensors they stand for, each element errs by at most what rounding P to e4m3 (a relative 2^-4
    at most: 3 mantissa bits) can do to a weighted mean of V's column, plus bf16's rounding of O."""
    (q8, k8, v8), descales, oracle = problem(2, 1.0, top=224.0)
    out = attention_same_fp8(q8, k8, v8, **descales, causal=True)
    doubled = [(t.float() * 2).to(torch.float8_e4m3fn) for t in (q8, k8, v8)]
    halved = {name: d / 2 for name, d in descales.items()}
    torch.testing.assert_close(attention_same_fp8(*doubled, **halved, causal=True), out, rtol=0, atol=0)
    v_max = dequantised(v8, descales["v_descale"], 1).abs().amax(dim=1, keepdim=True)   # (B, 1, Hk, d)
    bound = 2.0 ** -4 * v_max.repeat_interleave(H // HK, dim=2) + 2.0 ** -8 * oracle.abs()
    assert ((out.double() - oracle).abs() <= bound).all()


def test_e4m3_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([448.0, 460.0, 1e9, -1e9, float("inf"), 0.0, 1.0625, 1.1875, float("nan")])
    got = e4m3(x)
    assert got[:6].tolist() == [448.0, 448.0, 448.0, -448.0, 448.0, 0.0]
    assert got[6:8].tolist() == [1.0, 1.25]   # ties: to the even mantissa (1.0 = m 0; 1.25 = m 2)
    assert torch.isnan(got[8])


def test_rows_that_see_no_key_give_zero():
    (q8, k8, v8), descales, _ = problem(3, 1.0)
    out = attention_same_fp8(q8[:, :8], k8, v8, **descales, window_size=(0, 0), causal=False,
                             mask_mod=lambda b, h, qi, ki: ki > 1000)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("name, fix, message", [
    ("q", lambda t, d: ((t[0].float().bfloat16(), *t[1:]), d), "q must be torch.float8_e4m3fn"),
    ("k_descale", lambda t, d: (t, {**d, "k_descale": d["k_descale"][:1]}), r"k_descale must be \(batch, kv heads\)"),
])
def test_wrong_inputs_are_named(name, fix, message):
    tensors, descales, _ = problem(4, 1.0)
    tensors, descales = fix(tensors, descales)
    with pytest.raises((TypeError, ValueError), match=message):
        attention_same_fp8(*tensors, **descales)

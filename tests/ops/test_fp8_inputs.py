"""fagen.ops.fp8_inputs: q, k, v as e4m3 with descales, and FlashAttention-3's Hadamard rotation."""

from __future__ import annotations

import pytest
import torch

from fagen.ops.fp8_inputs import E4M3_MAX, hadamard_rotation, quantize, quantize_qkv
from fagen.reference import attention_forward
from fagen.reference.same_fp8 import attention_same_fp8


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_the_rotation_is_orthogonal_and_seeded(d):
    r = hadamard_rotation(d, seed=5).double()
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.equal(hadamard_rotation(d, seed=5), hadamard_rotation(d, seed=5))
    assert not torch.equal(hadamard_rotation(d, seed=5), hadamard_rotation(d, seed=6))
    assert (r.abs() > 0).sum() == d * (d & -d)   # dense within each power-of-two block


def test_rotating_q_and_k_leaves_their_scores_unchanged():
    """Up to the rotation's own fp32 rounding (1 / sqrt(d) is not exact): a relative 1e-6."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 16, 4, 128, generator=g).double(), torch.randn(2, 24, 4, 128, generator=g).double()
    r = hadamard_rotation(128, seed=1).double()
    torch.testing.assert_close(torch.einsum("bqhd,bkhd->bhqk", q @ r, k @ r), torch.einsum("bqhd,bkhd->bhqk", q, k),
                               rtol=1e-6, atol=1e-5)


def test_quantize_puts_each_groups_largest_magnitude_at_448_and_rounds_the_rest():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 33, 6, 64, generator=g) * torch.tensor([1, 2, 3, 40, 5, 6]).view(1, 1, 6, 1)
    x8, descale = quantize(x, group=3)
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (2, 2) and descale.dtype == torch.float32
    back = x8.float() * descale.repeat_interleave(3, 1)[:, None, :, None]
    # e4m3: 3 mantissa bits (a relative 2^-4 at most), subnormals spaced 2^-9 times the descale
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * descale.repeat_interleave(3, 1)[:, None, :, None]
    assert ((back - x).abs() <= bound).all()
    amax = x.abs().amax(dim=(1, 3)).view(2, 2, 3).amax(-1)
    torch.testing.assert_close(descale * E4M3_MAX, amax)


def outliers(seed: int, boost: float):
    """Random q, k, v with two channels of q and k `boost` times larger, the FlashAttention-3
    paper's case for incoherent processing; the softmax scale shrunk with them."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 128, h, 128, generator=g) for h in (4, 2, 2))
    q[..., [3, 77]] *= boost
    k[..., [3, 77]] *= boost
    return q, k, v, 128 ** -0.5 / max(1.0, boost / 3)


def model_error(q, k, v, scale, rotate: bool) -> float:
    oracle = attention_forward(q.double(), k.double(), v.double(), causal=True, softmax_scale=scale)[0]
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, rotate=rotate)
    out = attention_same_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, softmax_scale=scale)
    return ((out.double() - oracle) ** 2).mean().sqrt().item()


def test_the_rotation_buys_accuracy_on_outlier_channels():
    """What incoherent processing buys, on the fp8 forward's rounding model: with two channels 30x
    the rest, rotating q and k at least halves the error against the float64 oracle; without
    outliers it costs nothing measurable (within 10%)."""
    q, k, v, scale = outliers(0, 30.0)
    assert model_error(q, k, v, scale, rotate=True) < 0.5 * model_error(q, k, v, scale, rotate=False)
    q, k, v, scale = outliers(1, 1.0)
    assert model_error(q, k, v, scale, rotate=True) < 1.1 * model_error(q, k, v, scale, rotate=False)


@pytest.mark.parametrize("call, message", [
    (lambda x: quantize(x[0]), r"x must be a floating-point \(batch, seqlen, heads, head_dim\) tensor"),
    (lambda x: quantize(x, group=4, name="q"), "q has 6 heads, not a multiple of the group of 4"),
    (lambda x: quantize_qkv(x, x[:, :, :4], x[:, :, :4]), "need H a multiple of Hk"),
    (lambda x: hadamard_rotation(100), "head_dim must be a positive multiple of 8"),
])
def test_wrong_inputs_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 4, 6, 64))

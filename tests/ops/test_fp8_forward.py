"""`fagen.flash_attn_func` and `fagen.attention` with float8_e4m3fn q, k and v (fagen/ops/fp8.py:
FlashAttention-3's fp8 signature), on the CPU's emulator: O in bf16 within the fp8 accuracy rule of the
float64 oracle on the dequantised inputs, L, the descales' defaults, the rotation option end to end,
and every refusal naming the argument; a failed call leaves its inputs as they were."""

from __future__ import annotations

import pytest
import torch

import fagen
from fagen.errors import InputError
from fagen.ops.fp8_inputs import dequantize, quantize_qkv
from fagen.reference import attention_forward
from fagen.reference.same_fp8 import attention_same_fp8
from fp8_cases import FP8_OUTPUT_FACTOR, LSE_TOLERANCE
from kernel_cases import ABS_FLOOR, max_error


def _inputs(d=128, d_v=None, batch=2, nq=130, nk=170, heads=4, kv_heads=2, seed=0, outliers=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, nq, heads, d, generator=g)
    k = torch.randn(batch, nk, kv_heads, d, generator=g)
    v = torch.randn(batch, nk, kv_heads, d_v or d, generator=g)
    if outliers:
        q[..., :2] *= outliers
        k[..., :2] *= outliers
    return q, k, v


def _check_rule(out, lse, q8, k8, v8, qd, kd, vd, **kwargs):
    ref, ref_lse = attention_forward(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), **kwargs)
    same = attention_same_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kwargs)
    assert out.dtype == torch.bfloat16 and out.shape == same.shape
    assert max_error(out, ref) <= FP8_OUTPUT_FACTOR * max_error(same, ref) + ABS_FLOOR
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and max_error(lse[finite], ref_lse[finite]) < LSE_TOLERANCE


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_takes_fa3s_fp8_signature(causal):
    q8, k8, v8, qd, kd, vd = quantize_qkv(*_inputs())
    out, lse = fagen.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                     return_lse=True)
    _check_rule(out, lse, q8, k8, v8, qd, kd, vd, causal=causal)


def test_attention_takes_it_in_pytorchs_layout_and_the_variants_too():
    q8, k8, v8, qd, kd, vd = quantize_qkv(*_inputs(d=256))
    window = (30, 5)
    out = fagen.attention(*(t.transpose(1, 2) for t in (q8, k8, v8)), causal=True, window_size=window,
                          q_descale=qd, k_descale=kd, v_descale=vd)
    flash = fagen.flash_attn_func(q8, k8, v8, causal=True, window_size=window, q_descale=qd, k_descale=kd,
                                  v_descale=vd)
    assert torch.equal(out.transpose(1, 2), flash)
    same = attention_same_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, window_size=window)
    ref, _ = attention_forward(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), causal=True,
                               window_size=window)
    assert max_error(flash, ref) <= FP8_OUTPUT_FACTOR * max_error(same, ref) + ABS_FLOOR


def test_flex_attention_takes_e4m3_inputs_with_descales_of_one_and_a_score_mod():
    """FlexAttention's signature has no descales: fp8 inputs run with 1, and its score_mod (a relative
    bias) and scale reach the fp8 forward as flash_attn_func's."""
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _inputs(d=64, nq=100, nk=100))

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.01 * (q_idx - kv_idx)

    heads_first = [t.transpose(1, 2) for t in (q, k, v)]
    out = fagen.flex_attention(*heads_first, score_mod=bias, scale=0.2, enable_gqa=True)
    flash = fagen.flash_attn_func(q, k, v, score_mod=bias, softmax_scale=0.2)
    assert out.dtype == torch.bfloat16 and torch.equal(out.transpose(1, 2), flash)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_takes_fp8_sequences_as_flash_attn_func_each(causal):
    """Packed e4m3 sequences (one empty, one of a single key) with a descale per (sequence, K/V head):
    each sequence's O and L bit for bit the dense call's on it alone."""
    lengths = [37, 0, 130, 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    q8, k8, v8 = (torch.randn(sum(lengths), h, 64, generator=g).to(torch.float8_e4m3fn) for h in (4, 2, 2))
    qd, kd, vd = (torch.rand(len(lengths), 2, generator=g) + 0.5 for _ in range(3))
    out, lse = fagen.flash_attn_varlen_func(q8, k8, v8, cu, cu, 130, 130, causal=causal, return_lse=True,
                                            q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and lse.shape == (4, sum(lengths))
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if not lengths[b]:
            continue
        dense, dense_lse = fagen.flash_attn_func(q8[rows][None], k8[rows][None], v8[rows][None], causal=causal,
                                                 return_lse=True, q_descale=qd[b:b + 1], k_descale=kd[b:b + 1],
                                                 v_descale=vd[b:b + 1])
        assert torch.equal(out[rows], dense[0]) and torch.equal(lse[:, rows], dense_lse[0]), b


def test_fp8_packed_sequences_refuse_a_block_table_and_stray_descales():
    cu = torch.tensor([0, 20], dtype=torch.int32)
    q, k, v = (torch.randn(20, 2, 64) for _ in range(3))
    with pytest.raises(InputError, match="k_descale given, but q is torch.bfloat16"):
        fagen.flash_attn_varlen_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, cu, 20, 20,
                                     k_descale=torch.ones(1, 2))
    pages = torch.randn(2, 16, 2, 64).to(torch.float8_e4m3fn)
    with pytest.raises(InputError, match="not through a block_table"):
        fagen.flash_attn_varlen_func(q.to(torch.float8_e4m3fn), pages, pages, cu, cu, 20, 20,
                                     block_table=torch.tensor([[0, 1]], dtype=torch.int32))


def test_the_fp8_forward_compiles_without_graph_breaks_and_equals_eager():
    """Under torch.compile the call is one custom op (fagen::fp8_forward): fullgraph, bit for bit eager's."""
    torch._dynamo.reset()
    q8, k8, v8, qd, kd, vd = quantize_qkv(*_inputs(d=64, nq=96, nk=96))

    def call(q, k, v, qd, kd, vd):
        return fagen.flash_attn_func(q, k, v, causal=True, window_size=(40, 0), return_lse=True, q_descale=qd,
                                     k_descale=kd, v_descale=vd)

    explained = torch._dynamo.explain(call)(q8, k8, v8, qd, kd, vd)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(q8, k8, v8, qd, kd, vd)
    eager = call(q8, k8, v8, qd, kd, vd)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


def test_missing_descales_are_one():
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _inputs())
    ones = torch.ones(2, 2)
    assert torch.equal(fagen.flash_attn_func(q, k, v), fagen.flash_attn_func(q, k, v, q_descale=ones, k_descale=ones,
                                                                              v_descale=ones))


def test_the_rotation_keeps_attention_and_cuts_the_error_of_outliers():
    """FlashAttention-3's incoherent processing end to end: q and k rotated (quantize_qkv(rotate=True))
    give the same attention, and on two channels 30x the rest, less error against the float64
    attention of the unquantised inputs than without the rotation."""
    q, k, v = _inputs(outliers=30.0)
    exact, _ = attention_forward(q.double(), k.double(), v.double(), causal=True)
    errors = {}
    for rotate in (False, True):
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, rotate=rotate)
        out = fagen.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
        errors[rotate] = (out.double() - exact).pow(2).mean().sqrt().item()
    assert errors[True] < errors[False] / 2, errors


def _refused(match, *args, **kwargs):
    q8, k8, v8, qd, kd, vd = args or quantize_qkv(*_inputs())
    before = [t.clone() for t in (q8, k8, v8)]
    with pytest.raises((InputError, TypeError), match=match):
        fagen.flash_attn_func(q8, k8, v8, **kwargs)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, (q8, k8, v8)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dropout_p=0.1), "dropout_p must be 0"), (dict(version=1), "version must be 2"),
    (dict(window_size=(1, 2, 3)), "window_size"), (dict(q_descale=torch.ones(2, 2, dtype=torch.float64)), "q_descale must be float32"),
    (dict(v_descale=torch.ones(2, 4)), r"v_descale must be float32 of shape \(batch, kv_heads\) = \(2, 2\)"),
    (dict(k_descale=torch.ones(2, 2, device="meta")), "k_descale must be on q's device")])
def test_what_it_refuses_names_the_argument(kwargs, match):
    _refused(match, **kwargs)


def test_mixed_dtypes_head_dims_and_gradients_are_refused():
    q8, k8, v8, qd, kd, vd = quantize_qkv(*_inputs())
    _refused("so k must be too", q8, k8.bfloat16(), v8, qd, kd, vd)
    q96, k96, v96, *_ = quantize_qkv(*_inputs(d=96))
    _refused("head_dim=96 in e4m3", q96, k96, v96, qd, kd, vd)
    with pytest.raises(InputError, match="q_descale given, but q is torch.bfloat16"):
        fagen.flash_attn_func(*(t.bfloat16() for t in _inputs()), q_descale=qd)
    q8.requires_grad_(True)
    _refused("take no gradients", q8, k8, v8, qd, kd, vd)

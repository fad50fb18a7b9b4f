"""fagen.reference.same_fp8_backward: the fp8 backward's roundings, the yardstick of its accuracy rule."""

from __future__ import annotations

import pytest
import torch

from fagen.ops.fp8_inputs import quantize
from fagen.reference import attention_backward, attention_forward, attention_gradients
from fagen.reference.same_fp8_backward import GEMMS, attention_backward_same_fp8

B, N, H, HK, D = 1, 128, 4, 2, 64
U = 2.0 ** -8   # bf16's unit roundoff: 8 significant bits, so rounding moves x by at most U |x|


def dequantised(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    return x8.double() * descale.double().repeat_interleave(x8.shape[2] // descale.shape[1], 1)[:, None, :, None]


def e5m2(x: torch.Tensor, group: int):
    """x with a descale per group of heads, its largest magnitude at e5m2's 57344."""
    amax = x.abs().amax(dim=(1, 3)).view(x.shape[0], -1, group).amax(-1)
    descale = amax / 57344.0
    scaled = (x / descale.repeat_interleave(group, 1)[:, None, :, None]).clamp(-57344.0, 57344.0)
    return scaled.to(torch.float8_e5m2), descale


def problem(seed: int = 0, causal: bool = True, do_format: str = "e4m3"):
    """The model's keyword arguments (e4m3 q, k, v, O; dO in do_format; descales; fp32 lse) and
    the dequantised q, k, v, dO and O in float64, with the oracle's O."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, N, h, D, generator=g) for h in (H, HK, HK, H))
    (q8, qd), (k8, kd), (v8, vd) = quantize(q, H // HK), quantize(k), quantize(v)
    do8, dod = quantize(dout, H // HK) if do_format == "e4m3" else e5m2(dout, H // HK)
    qx, kx, vx, dox = (dequantised(t, s) for t, s in ((q8, qd), (k8, kd), (v8, vd), (do8, dod)))
    out, lse = attention_forward(qx, kx, vx, causal=causal)
    o8, od = quantize(out.float(), H // HK)
    kwargs = dict(q=q8, k=k8, v=v8, out=o8, dout=do8, lse=lse.float(), q_descale=qd, k_descale=kd,
                  v_descale=vd, o_descale=od, do_descale=dod, causal=causal)
    return kwargs, (qx, kx, vx, dox, dequantised(o8, od), out)


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()) ** 2).mean().sqrt().item()


def heads_first(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """(B, N, heads, d) float64 -> (B, heads * group, N, d): a K/V head repeated for its query heads."""
    return x.double().transpose(1, 2).repeat_interleave(group, 1)


def sum_group(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B, N, Hk, d): the query heads of each K/V head summed."""
    return x.view(B, HK, H // HK, *x.shape[2:]).sum(2).transpose(1, 2)


@pytest.mark.parametrize("causal, do_format", [(True, "e4m3"), (False, "e5m2")])
def test_bf16_gemms_err_by_bf16_operands_and_output_alone(causal, do_format):
    """With every GEMM in bf16 the model is the exact gradient of the inputs it reads (D taken from the
    e4m3 O, as the kernel takes it: the oracle's dlse = D - D(O8) makes its dS = P (dP - D(O8))) but for
    P and dS rounded to bf16 (each within U of itself) and the bf16 output: each element within
    U |oracle| + (U + 2^-14) T, T the sum of the magnitudes of the GEMM's terms (2^-14 for fp32's
    S, exp and sums). The bound is tight enough that P or dS in e4m3 (16 U) would break it."""
    kwargs, (qx, kx, vx, dox, ox, exact_out) = problem(causal=causal, do_format=do_format)
    delta_gap = ((dox * exact_out).sum(-1) - (dox * ox).sum(-1)).transpose(1, 2)   # (B, H, N)
    oracle = attention_gradients(qx, kx, vx, dox, dlse=delta_gap, causal=causal)
    tau = D ** -0.5
    probs = torch.exp(tau * heads_first(qx) @ heads_first(kx, 2).transpose(-1, -2)
                      - kwargs["lse"].double()[..., None])
    if causal:
        probs = probs.tril()
    magnitude = probs * (heads_first(dox).abs() @ heads_first(vx, 2).abs().transpose(-1, -2)
                         + (heads_first(dox) * heads_first(ox)).abs().sum(-1, keepdim=True))   # >= |dS|
    terms = {"dv": sum_group(probs.transpose(-1, -2) @ heads_first(dox).abs()),
             "dk": sum_group(tau * magnitude.transpose(-1, -2) @ heads_first(qx).abs()),
             "dq": (tau * magnitude @ heads_first(kx, 2).abs()).transpose(1, 2)}
    ratios = {}
    for name, got in zip(("dq", "dk", "dv"), attention_backward_same_fp8(**kwargs, fp8_gemms=())):
        assert got.dtype == torch.bfloat16 and got.shape == oracle[name].shape
        bound = U * oracle[name].abs() + (U + 2.0 ** -14) * terms[name]
        ratios[name] = ((got.double() - oracle[name]).abs() / bound).max().item()
    assert max(ratios.values()) <= 1.0, ratios
    assert min(ratios.values()) >= 1 / 16, ratios   # not vacuous: P or dS in e4m3 would pass 1


def test_each_fp8_gemm_raises_its_gradients_error_alone():
    """dV, dK and dQ in fp8 each raise their own gradient's error several-fold (finite) and leave the
    other two bit for bit; S and dP, whose operands are 8-bit already, change nothing. (Not causal:
    there e4m3 O's error in D dominates the all-bf16 model's dQ and dK on the first rows.)"""
    kwargs, (qx, kx, vx, dox, _, out) = problem(seed=1, causal=False)
    oracle = dict(zip(("dq", "dk", "dv"), attention_backward(qx, kx, vx, out, dox)))
    base = dict(zip(("dq", "dk", "dv"), attention_backward_same_fp8(**kwargs, fp8_gemms=())))
    for gemm in GEMMS:
        grads = dict(zip(("dq", "dk", "dv"), attention_backward_same_fp8(**kwargs, fp8_gemms=(gemm,))))
        for name, got in grads.items():
            assert torch.isfinite(got).all(), (gemm, name)
            if name == gemm:
                assert rmse(got, oracle[name]) > 3 * rmse(base[name], oracle[name]), gemm
            else:
                assert torch.equal(got, base[name]), (gemm, name)


def test_ds_in_e4m3_errs_less_than_in_e5m2():
    """The choice of DS_DTYPE: at the same tile scale, e4m3's extra significant bit beats e5m2's range."""
    kwargs, (qx, kx, vx, dox, _, out) = problem(seed=2, causal=False)
    oracle = attention_backward(qx, kx, vx, out, dox)
    errors = {dtype: [rmse(g, o) for g, o in zip(attention_backward_same_fp8(**kwargs, ds_dtype=dtype), oracle)]
              for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}
    for e4m3_error, e5m2_error in zip(errors[torch.float8_e4m3fn][:2], errors[torch.float8_e5m2][:2]):
        assert e5m2_error > 1.5 * e4m3_error, errors


def test_gqa_sums_dk_and_dv_over_the_query_heads_of_a_group():
    """Against k, v (and the shared descales) repeated per query head: dQ bit for bit, dK and dV the
    sums of the per-head results, within their bf16 roundings: the sum's and each head's, U each."""
    kwargs, _ = problem(seed=3)
    grouped = attention_backward_same_fp8(**kwargs)
    group = H // HK
    expanded = dict(kwargs, k=kwargs["k"].repeat_interleave(group, 2), v=kwargs["v"].repeat_interleave(group, 2),
                    **{name: kwargs[name].repeat_interleave(group, 1)
                       for name in ("q_descale", "k_descale", "v_descale", "o_descale", "do_descale")})
    dq, dk_heads, dv_heads = attention_backward_same_fp8(**expanded)
    assert torch.equal(grouped[0], dq)
    for got, heads in zip(grouped[1:], (dk_heads, dv_heads)):
        per_head = heads.double().view(B, N, HK, group, D)
        bound = 2 * U / (1 - U) * per_head.abs().sum(3) + 1e-30
        assert ((got.double() - per_head.sum(3)).abs() <= bound).all()
        assert not ((got.double() - per_head[:, :, :, 0]).abs() <= bound).all()   # a missing head fails


@pytest.mark.parametrize("name, change, error, message", [
    ("q", lambda kw: dict(kw, q=kw["q"].float().bfloat16()), TypeError, "q must be torch.float8_e4m3fn"),
    ("v", lambda kw: dict(kw, v=kw["v"].float().to(torch.float8_e5m2)), TypeError, "v must be torch.float8_e4m3fn"),
    ("out", lambda kw: dict(kw, out=kw["out"].float().half()), TypeError, "out must be torch.float8_e4m3fn or"),
    ("dout", lambda kw: dict(kw, dout=kw["dout"].float()), TypeError, "dout must be torch.float8_e4m3fn or"),
    ("ds_dtype", lambda kw: dict(kw, ds_dtype=torch.bfloat16), TypeError, "ds_dtype must be"),
    ("fp8_gemms", lambda kw: dict(kw, fp8_gemms=("dv", "do")), ValueError, "fp8_gemms must name"),
    ("do_descale", lambda kw: dict(kw, do_descale=kw["do_descale"][:, :1]), ValueError, r"do_descale must be \(batch"),
])
def test_wrong_inputs_are_named(name, change, error, message):
    kwargs, _ = problem()
    with pytest.raises(error, match=message):
        attention_backward_same_fp8(**change(kwargs))

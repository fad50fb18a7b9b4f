"""The 8-bit forward's cases (Spec.fp8): e4m3 inputs with their descales, the kernel run where the
case says, and the accuracy rule (docs/design.md "fp8"), shared by the emulated tests
(tests/kernels/test_sm90_fp8_forward.py), the mutants and the GPU's.

The rule, per tensor, against the float64 oracle on the inputs the kernel reads (the e4m3 values
times their descales, so the inputs' own quantisation is not the kernel's error):
  O   its largest error at most FP8_OUTPUT_FACTOR times that of the same math in a torch model of
      e4m3's roundings (fagen.reference.same_fp8: P~ to e4m3, fp32 sums, bf16 O), plus the suite's
      floor: FlashAttention-2's rule with the model in place of a same-dtype PyTorch (and, with a
      softcap, what tanh.approx.f32 may move O by: kernel_cases.softcap_output_slack)
  L   within the suite's 1e-3 of the oracle's logsumexp (S and l are fp32, as in bf16), plus
      tanh.approx's bound times the cap (kernel_cases.lse_tolerance)
"""

from __future__ import annotations

import torch

from fagen.kernels import attention_kernels
from fagen.kernels.render import render
from fagen.emulate import assert_written
from fagen.ops.fp8_inputs import dequantize, quantize_qkv
from fagen.reference import attention_forward
from fagen.reference.same_fp8 import attention_same_fp8
from fagen.spec import Spec
from kernel_cases import ABS_FLOOR, Shape, key_lengths, lse_tolerance, max_error, softcap_output_slack
from variant_cases import variant_spec

FP8_OUTPUT_FACTOR = 2.0
LSE_TOLERANCE = lse_tolerance()   # 1e-3 without a softcap


def fp8_inputs(spec: Spec, shape: Shape, seed: int = 0, outliers: float = 0.0, descales: bool = True,
               v_mean: float = 0.0):
    """(q8, k8, v8, descales by kernel parameter name, (q, k, v) dequantised in float64): standard
    normal q, k, v (d_v columns for v) quantised per (batch, K/V head); `outliers` > 0 multiplies two
    channels of q and k by it (the inputs FlashAttention-3's rotation is for). `descales=False`: the
    normal values rounded to e4m3 as they are, their descales 1. `v_mean` is added to v: O is then
    about it, where a bias in P's rounding shows whole (random signs would average it away)."""
    generator = torch.Generator().manual_seed(seed)
    d, d_v = spec.head_dim, spec.head_dim_v
    q = torch.randn(shape.batch, shape.seqlen_q, shape.heads, d, generator=generator)
    k = torch.randn(shape.batch, shape.seqlen_k, shape.kv_heads, d, generator=generator)
    v = torch.randn(shape.batch, shape.seqlen_k, shape.kv_heads, d_v, generator=generator) + v_mean
    if outliers:
        q[..., :2] *= outliers
        k[..., :2] *= outliers
    if descales:
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    else:
        (q8, k8, v8), (qd, kd, vd) = ((x.to(torch.float8_e4m3fn) for x in (q, k, v)),
                                      (torch.ones(shape.batch, shape.kv_heads) for _ in range(3)))
    descales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    dequantised = tuple(dequantize(x, s) for x, s in ((q8, qd), (k8, kd), (v8, vd)))
    return q8, k8, v8, descales, dequantised


def run_fp8_case(spec: Spec, shape: Shape, variant: dict | None = None, *, device: str = "cpu", source=None,
                 outliers: float = 0.0, descales: bool = True, v_mean: float = 0.0) -> dict:
    """The forward of `spec` (with `variant`'s values) on `shape`, run on `device`, held to the rule
    above; returns {"out": (kernel's error, model's), "lse": kernel's}. `descales=False` passes
    none (the kernel's 1; `fp8_inputs`). `source`: another rendering of the case's spec (the mutants)."""
    variant = dict(variant or {})
    q8, k8, v8, scales, (q, k, v) = fp8_inputs(spec, shape, outliers=outliers, descales=descales, v_mean=v_mean)
    lengths = torch.tensor(key_lengths(spec, shape), dtype=torch.int32) if spec.key_padding else None
    case_spec, call = variant_spec(spec, q, k, variant) if variant else (spec, None)
    source = render(case_spec) if source is None else source
    assert source.spec == case_spec, f"the source is {source.spec.name}'s, the case {case_spec.name}'s"
    on = lambda t: None if t is None else t.to(device)
    out, (lse,) = attention_kernels.forward(
        source, on(q8), on(k8), on(v8), seqlens_k=on(lengths), descales=None if not descales else
        {name: on(s) for name, s in scales.items()},
        variant_values=None if call is None else {n: on(x) if isinstance(x, torch.Tensor) else x
                                                  for n, x in call.values.items()})
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == torch.bfloat16, f"{case_spec.name}: O is {out.dtype}, not bf16"
    assert_written(out, "out")
    assert_written(lse, "lse")
    kwargs = dict(causal=spec.causal, seqlens_k=lengths, **variant)
    ref, ref_lse = attention_forward(q, k, v, **kwargs)
    same = attention_same_fp8(q8, k8, v8, **scales, **kwargs)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{case_spec.name}: rows with no key differ from the oracle's"
    errors = {"out": (max_error(out, ref), max_error(same, ref)),
              "lse": max_error(lse[finite], ref_lse[finite]) if finite.any() else 0.0}
    kernel_err, model_err = errors["out"]
    cap = float(variant.get("softcap", 0.0))
    assert kernel_err <= FP8_OUTPUT_FACTOR * model_err + ABS_FLOOR + softcap_output_slack(cap, v), (
        f"{case_spec.name} {shape}: O's error {kernel_err:.3g} exceeds {FP8_OUTPUT_FACTOR}x the e4m3 model's "
        f"{model_err:.3g}")
    assert errors["lse"] < lse_tolerance(cap), f"{case_spec.name} {shape}: L error {errors['lse']:.3g}"
    return errors

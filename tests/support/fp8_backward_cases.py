"""The fp8 backward's cases (issue 45, part 3): e4m3 q, k, v (and O, dO in e4m3, e5m2 or bf16) with
their descales, the sm90 backward run where the case says, and its accuracy rule, shared by the
emulated tests (tests/kernels/test_sm90_fp8_backward.py, tests/ops/test_fp8_training.py), the
mutants and the GPU's.

The rule, per gradient, against the float64 oracle on the inputs the kernel reads (q, k, v and dO
dequantised; D = rowsum(dO o O) from the O it is given, as the kernel takes it: the oracle's dlse
carries the difference from the exact O's):
  dQ, dK, dV  the largest error at most FP8_GRAD_FACTOR times that of the same math in the torch
              model of the fp8 backward's roundings (fagen.reference.same_fp8_backward with
              RECOMMENDED_FP8_GEMMS, the kernel's: P and dS rounded to bf16, fp32 sums, bf16
              out), plus the suite's floor.
"""

from __future__ import annotations

import torch

from fagen.kernels import attention_kernels
from fagen.kernels.render import render
from fagen.ops.fp8_inputs import dequantize, quantize
from fagen.reference import attention_forward, attention_gradients
from fagen.reference.same_fp8_backward import RECOMMENDED_FP8_GEMMS, attention_backward_same_fp8
from fagen.spec import Spec
from fp8_cases import fp8_inputs
from kernel_cases import ABS_FLOOR, Shape, key_lengths, max_error
from variant_cases import variant_spec

FP8_GRAD_FACTOR = 2.0


def _in_format(x: torch.Tensor, fmt: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, H, d) in `fmt`, with its descale per (batch, group of heads): e4m3 by `quantize`,
    e5m2 scaled to its 57344, bf16 as it rounds (descale 1)."""
    if fmt == "e4m3":
        return quantize(x, group)
    ones = torch.ones(x.shape[0], x.shape[2] // group)
    if fmt == "bf16":
        return x.to(torch.bfloat16), ones
    amax = x.abs().amax(dim=(1, 3)).view(x.shape[0], -1, group).amax(-1)
    descale = (amax / 57344.0).clamp_min(1e-30)
    scaled = x / descale.repeat_interleave(group, 1)[:, None, :, None]
    return scaled.clamp(-57344.0, 57344.0).to(torch.float8_e5m2), descale


def run_fp8_backward_case(spec: Spec, shape: Shape, variant: dict | None = None, *, device: str = "cpu", source=None,
                          out_format: str = "e4m3", do_format: str = "e4m3", seed: int = 0) -> tuple[dict, tuple]:
    """The backward of `spec` (an 8-bit spec with a backward; with `variant`'s values, a window) on
    `shape`, run on `device`, held to the rule above; O and dO arrive in `out_format` / `do_format`.
    Returns ({name: (kernel's error, model's)}, (dq, dk, dv) on the CPU). `source`: another
    rendering of the case's spec (the mutants)."""
    variant = dict(variant or {})
    q8, k8, v8, descales, (q, k, v) = fp8_inputs(spec, shape, seed=seed)
    case_spec, call = variant_spec(spec, q, k, variant) if variant else (spec, None)
    group = shape.heads // shape.kv_heads
    lengths = torch.tensor(key_lengths(spec, shape), dtype=torch.int32) if spec.key_padding else None
    kwargs = dict(causal=spec.causal, seqlens_k=lengths, **variant)
    exact_out, lse = attention_forward(q, k, v, **kwargs)
    dout = torch.randn(*exact_out.shape, generator=torch.Generator().manual_seed(seed + 1))
    o8, od = _in_format(exact_out.float(), out_format, group)
    do8, dod = _in_format(dout, do_format, group)
    o, do = dequantize(o8, od), dequantize(do8, dod)
    scales = {**descales, "o_descale": od, "do_descale": dod}
    source = render(case_spec) if source is None else source
    assert source.spec == case_spec, f"the source is {source.spec.name}'s, the case {case_spec.name}'s"
    on = lambda t: None if t is None else t.to(device)
    dq, dk, dv = attention_kernels.backward(source, on(q8), on(k8), on(v8), on(o8), (on(lse.float()),), on(do8),
                                            seqlens_k=on(lengths), descales={n: on(s) for n, s in scales.items()},
                                            variant_values=None if call is None else call.values)
    # D from the O the kernel reads: dS = P (dP - (D(exact O) - dlse)).
    dlse = ((do * exact_out).sum(-1) - (do * o).sum(-1)).transpose(1, 2)
    oracle = attention_gradients(q, k, v, do, dlse=dlse, **kwargs)
    model = attention_backward_same_fp8(q8, k8, v8, o8, do8, lse.float(), **scales, **kwargs,
                                        fp8_gemms=RECOMMENDED_FP8_GEMMS)
    errors, grads = {}, tuple(t.cpu() for t in (dq, dk, dv))
    for name, got, modelled in zip(("dq", "dk", "dv"), grads, model):
        assert got.dtype == torch.bfloat16 and not got.isnan().any(), f"{case_spec.name}: {name}"
        errors[name] = kernel_err, model_err = max_error(got, oracle[name]), max_error(modelled, oracle[name])
        assert kernel_err <= FP8_GRAD_FACTOR * model_err + ABS_FLOOR, (
            f"{case_spec.name} {shape} O {out_format} dO {do_format}: {name}'s error {kernel_err:.3g} exceeds "
            f"{FP8_GRAD_FACTOR}x the model's {model_err:.3g}")
    return errors, grads

"""The self-test's 8-bit case (the sm90 family's `sm90.fp8`): e4m3 q, k and v with descales per
(batch, K/V head), GQA, causal with ragged tiles, through `flash_attn_func` (the forward) and
`fp8_attention_backward` with dO in bf16 and in e4m3 (S and dP by 8-bit wgmma), each held to the
fp8 rule (fagen.selftest_cases.rule's factor) against the float64 oracle on the dequantised
inputs, the rounding models (fagen/reference/same_fp8*.py) standing in for a same-dtype PyTorch.
"""

from __future__ import annotations

import torch

from .. import ops
from ..ops.fp8_inputs import dequantize, quantize, quantize_qkv
from ..ops.fp8_training import fp8_attention_backward
from ..reference import attention_forward, attention_gradients
from ..reference.same_fp8 import attention_same_fp8
from ..reference.same_fp8_backward import RECOMMENDED_FP8_GEMMS, attention_backward_same_fp8
from .rule import Checks

SHAPE = (1, 150, 200, 4, 2)   # batch, Nq, Nk, heads, K/V heads


def check_fp8(head_dim: int, device: torch.device) -> list[str]:
    checks = Checks()
    batch, nq, nk, heads, kv_heads = SHAPE
    generator = torch.Generator().manual_seed(45)
    q, k, v, dout = (torch.randn(batch, n, h, head_dim, generator=generator)
                     for n, h in ((nq, heads), (nk, kv_heads), (nk, kv_heads), (nq, heads)))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    scales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    on = {name: t.to(device) for name, t in scales.items()}
    out, lse = ops.flash_attn_func(q8.to(device), k8.to(device), v8.to(device), causal=True, return_lse=True, **on)
    out, lse = out.cpu(), lse.cpu()
    exact = [dequantize(x8, s) for x8, s in ((q8, qd), (k8, kd), (v8, vd))]
    oracle_out, oracle_lse = attention_forward(*exact, causal=True)
    checks.output("O", out, oracle_out, attention_same_fp8(q8, k8, v8, causal=True, **scales))
    checks.lse("L", lse, oracle_lse)
    # dO in bf16 (every GEMM bf16), then in e4m3 (Transformer Engine's: S and dP by 8-bit wgmma).
    do8, do_descale = quantize(dout, heads // kv_heads)
    for name, given, descale in (("", dout.to(torch.bfloat16), None), (" (e4m3 dO)", do8, do_descale)):
        _check_backward(checks, name, given, descale, (q8, k8, v8), scales, exact, out, lse, oracle_out, device)
    return checks.problems


def _check_backward(checks: Checks, name: str, dout, do_descale, inputs, scales: dict, exact, out, lse, oracle_out,
                    device) -> None:
    """fp8_attention_backward on `dout` (bf16, or 8-bit with `do_descale`) against the oracle on the
    dequantised inputs and dO, the backward's rounding model beside it."""
    given = {**scales, **({} if do_descale is None else {"do_descale": do_descale})}
    grads = fp8_attention_backward(dout.to(device), *(t.to(device) for t in inputs), out.to(device), lse.to(device),
                                   causal=True, **{n: t.to(device) for n, t in given.items()})
    wide = dout.double() if do_descale is None else dequantize(dout, do_descale).double()
    # D from the bf16 O the backward reads: the oracle's dlse carries its difference from the exact O's.
    dlse = ((wide * oracle_out).sum(-1) - (wide * out.double()).sum(-1)).transpose(1, 2)
    oracle = attention_gradients(*exact, wide, dlse=dlse, causal=True)
    model = attention_backward_same_fp8(*inputs, out, dout, lse, **given, causal=True, fp8_gemms=RECOMMENDED_FP8_GEMMS)
    for grad, got, modelled in zip(("dq", "dk", "dv"), grads, model):
        checks.output(grad + name, got.cpu(), oracle[grad], modelled)

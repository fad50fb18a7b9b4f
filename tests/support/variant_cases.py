"""Run a variant call's kernels on the emulator and check them against the float64 oracle.

A case is flash_attn_func's variant keywords (window_size, softcap, alibi_slopes, sinks,
score_mod, mask_mod) with a base spec's flags (version, dtype, causal, key padding,
dropout, deterministic). The arguments go through `fagen.ops.variant_args.variant_call`, as a
call of the op does; the kernels run with a fixed Philox seed, and the oracle
(`fagen.reference`) uses the same keep mask. Every output and gradient (O, L, dQ, dK, dV,
and the sinks' and captured tensors' gradients) is held to FlashAttention-2's rule against
a same-dtype PyTorch implementation, with a random upstream gradient on L too.
"""

from __future__ import annotations

import torch

from fagen.kernels import attention_kernels
from fagen.kernels.render import render
from fagen.reference import attention_gradients, attention_same_dtype, dropout_keep_mask
from fagen.spec import Spec
from fagen.ops.variant_args import variant_call
from kernel_cases import (ABS_FLOOR, DROPOUT_P, GRAD_FACTOR, OFFSET, OUTPUT_FACTOR, SEED, Shape, lse_tolerance, make_inputs,
                          max_error)


def variant_spec(base: Spec, q, k, variant: dict):
    call = variant_call(q, k, causal=base.causal, **variant)
    return base.replace(**call.spec_fields), call


def run_variant_case(base: Spec, shape: Shape, variant: dict, *, captures=(), lengths=None, debug=None,
                     backward: bool = True, source=None) -> dict:
    """`source`: a rendered source of the variant's spec other than its own (the mutation tests)."""
    q, k, v, dout, seqlens_k = make_inputs(base, shape, lengths=lengths)
    spec, call = variant_spec(base, q, k, variant)
    if source is None:
        source = render(spec, debug=debug is not None)
    assert source.spec == spec, f"the source is {source.spec.name}'s, the case {spec.name}'s"
    p = DROPOUT_P if spec.dropout else 0.0
    out, stats = attention_kernels.forward(source, q, k, v, seqlens_k=seqlens_k, dropout_p=p, seed=SEED,
                                           philox_offset=OFFSET, variant_values=call.values, debug=debug)
    keep = dropout_keep_mask(SEED, OFFSET, shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k, p) \
        if spec.dropout else None
    kwargs = dict(causal=spec.causal, seqlens_k=seqlens_k, dropout_p=p, keep_mask=keep, **variant)
    dlse = torch.randn(shape.batch, shape.heads, shape.seqlen_q, generator=torch.Generator().manual_seed(1))
    ref = attention_gradients(q, k, v, dout, dlse=dlse, captures=captures, **kwargs)
    pt_out, pt_dq, pt_dk, pt_dv, pt_extra = attention_same_dtype(q, k, v, dout, dlse=dlse, captures=captures,
                                                                 return_extra=True, **kwargs)
    lse = stats[0] if spec.version == 2 else torch.where(stats[1] > 0, stats[0] + torch.log(stats[1]),
                                                         torch.full_like(stats[0], float("inf")))
    finite = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isfinite(lse), finite), f"{spec.name}: rows with no key differ from the oracle's"
    lse_error = max_error(lse[finite], ref["lse"][finite])
    assert lse_error < lse_tolerance(variant.get("softcap", 0.0)), f"{spec.name} {shape}: L error {lse_error:.3g}"
    errors = {"out": (max_error(out, ref["out"]), max_error(pt_out, ref["out"]))}
    if backward:
        extras: dict = {}
        drop = attention_kernels.dropout_args(p, SEED, OFFSET) if spec.dropout else None
        grads = attention_kernels.backward(source, q, k, v, out, stats, dout, seqlens_k=seqlens_k, dropout_args=drop,
                                           variant_values=call.values, dlse=dlse, extras=extras)
        for name, got, pt in zip(("dq", "dk", "dv"), grads, (pt_dq, pt_dk, pt_dv)):
            errors[name] = (max_error(got, ref[name]), max_error(pt, ref[name]))
        if spec.sinks:
            errors["dsinks"] = (max_error(extras["dsinks"], ref["dsinks"]),
                                max_error(pt_extra["dsinks"], ref["dsinks"]))
        for i, name in enumerate(n for n in call.grad_names if n != "dsinks"):
            errors[name] = (max_error(extras[name], ref["captures"][i]),
                            max_error(pt_extra["captures"][i], ref["captures"][i]))
    for name, (kernel_err, torch_err) in errors.items():
        factor = OUTPUT_FACTOR if name == "out" else GRAD_FACTOR
        assert kernel_err <= factor * torch_err + ABS_FLOOR, (
            f"{spec.name} {shape}: {name} error {kernel_err:.3g} exceeds {factor}x PyTorch's {torch_err:.3g}")
    return errors

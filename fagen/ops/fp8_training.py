"""fp8 training (issue 45, part 3): the e4m3 attention's backward, and a training step's autograd.

`fp8_attention_backward(dout, q, k, v, out, lse, ...)` takes Transformer Engine's contract with
cuDNN's fp8 attention: q, k, v and O in e4m3 (O may be bf16), dO in e4m3, e5m2 or bf16, an fp32
descale each per (batch, K/V head), None meaning 1; it returns dQ, dK and dV in bf16. The kernels
are the sm90 backward's, the descales applied in fp32 (templates/sm90/hopper_bwd_walk.j2):
fagen/reference/same_fp8_backward.py measured fp8 operands in dV's, dK's and dQ's GEMMs past the
accuracy rule (7-11x the bf16 GEMMs' error), so those read q, k and dO widened to bf16 exactly,
while S's and dP's give the same values either way. Where dO is 8-bit and the head dim 64 or 128,
S and dP run as 8-bit wgmma on the tensors as given (Spec.dout_dtype, Sm90BackwardTiles.fp8_scores);
a bf16 dO, or a wider head, has every GEMM read bf16. It takes causal, key padding, a window, a
softcap and ALiBi (arch_families.fp8_backward_refusal refuses sinks and mods, by name), as
`fp8_attention_func` does.

For a delayed-scaling recipe, `grad_dtype=torch.float8_e4m3fn` (or e5m2) returns the gradients in fp8
instead, each times its scale (`dq_scale`, `dk_scale`, `dv_scale`: one fp32 value each, the recipe's
per-tensor scale, None meaning 1) and saturated, with the amax of each before scaling, as cuDNN's fp8
backward returns them to Transformer Engine (`FP8Gradients`). The kernels still write bf16; the
scaling, the cast and the amax are torch's, one pass over each gradient after them.

`fp8_attention_func(q, k, v, ...)` is a training step's attention in fp8 from 16- or 32-bit q, k
and v: each is quantised per (batch, K/V head) (`quantize_qkv`), the fp8 forward runs, and the
backward runs on the same e4m3 tensors with O and dO in bf16 (the kernel widens them anyway, so
rounding them to e4m3 would only add error); the gradient passes straight through the
quantisation, as Transformer Engine's does. Both passes are custom ops (fagen::fp8_attention_fwd,
fagen::fp8_attention_bwd), so torch.compile traces a step without a graph break.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..arch_families import fp8_backward_refusal
from ..dtypes import FP8_DTYPE_NAME
from ..errors import InputError, InputTypeError
from ..kernels import attention_kernels
from ..kernels.fp8_operands import BACKWARD_DESCALES
from ..kernels.render import source_for
from ..variants.builtins import check_softcap
from .common import check_dense_tensor, check_options
from .fp8 import FP8, _check_device, _check_fp8_inputs, _checked_descale, _spec, fp8_attention
from .fp8_inputs import quantize_qkv, saturated
from .variant_args import variant_call

OUTPUT_DTYPES = (FP8, torch.bfloat16)                          # O as the backward takes it
GRADIENT_DTYPES = (FP8, torch.float8_e5m2, torch.bfloat16)     # dO, and dQ, dK, dV (grad_dtype)
GRADIENT_SCALES = ("dq_scale", "dk_scale", "dv_scale")


class FP8Gradients(NamedTuple):
    """fp8_attention_backward's result under an fp8 `grad_dtype`: each gradient times its scale, in
    that dtype (saturated), and its amax (fp32, 0-dim) before the scale."""
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dq_amax: torch.Tensor
    dk_amax: torch.Tensor
    dv_amax: torch.Tensor


def fp8_attention_backward(dout, q, k, v, out, lse, *, q_descale=None, k_descale=None, v_descale=None,
                           o_descale=None, do_descale=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, seqlens_k=None, deterministic=False,
                           grad_dtype=torch.bfloat16, dq_scale=None, dk_scale=None, dv_scale=None):
    """(dq, dk, dv) in bf16 of the fp8 attention O = softmax(q k^T tau) v: q (B, Nq, H, d), k, v
    (B, Nk, Hk, d / d_v) in float8_e4m3fn; out (B, Nq, H, d_v) in e4m3 or bf16; dout likewise or
    in e5m2; lse (B, H, Nq) fp32, the forward's (natural log); descales (B, Hk) fp32 or None (1);
    `window_size`, `softcap` and `alibi_slopes` as flash_attn_func's (the forward's own).
    `deterministic`: dQ summed in a fixed order, repeated calls bit-identical (the sm90 backward's).
    `grad_dtype` e4m3 or e5m2: an FP8Gradients of the gradients times dq_scale, dk_scale and
    dv_scale (module docstring)."""
    scales = _gradient_scales(grad_dtype, dict(zip(GRADIENT_SCALES, (dq_scale, dk_scale, dv_scale))), q.device)
    _check_fp8_inputs(q, k, v)
    for name, t, dtypes in (("out", out, OUTPUT_DTYPES), ("dout", dout, GRADIENT_DTYPES)):
        check_dense_tensor(name, t)
        if t.dtype not in dtypes:
            raise InputTypeError(f"{name} must be {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, "
                                 f"got {t.dtype}")
        expected = (*q.shape[:3], v.shape[-1])
        if tuple(t.shape) != expected or t.device != q.device:
            raise InputError(f"{name} must be (batch, seqlen_q, heads, head_dim_v) = {expected} on {q.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    check_dense_tensor("lse", lse)
    if lse.dtype != torch.float32 or tuple(lse.shape) != (q.shape[0], q.shape[2], q.shape[1]):
        raise InputError(f"lse must be float32 (batch, heads, seqlen_q) = {(q.shape[0], q.shape[2], q.shape[1])}, "
                         f"got {lse.dtype} {tuple(lse.shape)}")
    _, softmax_scale, causal, _, deterministic = check_options(0.0, softmax_scale, causal, False, deterministic, 2,
                                                               q.shape[-1])
    given = dict(zip(BACKWARD_DESCALES, (q_descale, k_descale, v_descale, o_descale, do_descale)))
    descales = {name: _checked_descale(name, descale, (k.shape[0], k.shape[2]), q.device)
                for name, descale in given.items()}
    call = variant_call(q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    # An 8-bit dO (Transformer Engine's e4m3 or e5m2): S and dP by 8-bit wgmma (Spec.dout_dtype).
    spec = _spec(q, v, causal, seqlens_k is not None, call, deterministic, FP8_DTYPE_NAME.get(dout.dtype))
    if spec.forward_only:
        raise InputError(f"no fp8 backward for this call: {fp8_backward_refusal(spec)}")
    _check_device(q, spec)
    grads = attention_kernels.backward(source_for(spec), q, k, v, out, (lse.contiguous(),), dout.contiguous(),
                                       softmax_scale=softmax_scale, seqlens_k=seqlens_k,
                                       variant_values=call.values if call else None, descales=descales)
    if scales is None:
        return grads
    scaled = [scaled_fp8(grad, scale, grad_dtype) for grad, scale in zip(grads, scales)]
    return FP8Gradients(*(t for t, _ in scaled), *(amax for _, amax in scaled))


def _gradient_scales(grad_dtype, given: dict, device) -> list[torch.Tensor] | None:
    """The three scales as fp32 0-dim tensors on `device` under an fp8 grad_dtype (None: 1); None
    under bf16, where a scale given is an error. Checked before the kernels run."""
    if grad_dtype not in GRADIENT_DTYPES:
        raise InputTypeError(f"grad_dtype must be torch.bfloat16, torch.float8_e4m3fn or torch.float8_e5m2, "
                             f"got {grad_dtype}")
    if grad_dtype == torch.bfloat16:
        named = [name for name, scale in given.items() if scale is not None]
        if named:
            raise InputError(f"{', '.join(named)}: only fp8 gradients take a scale; pass "
                             f"grad_dtype=torch.float8_e4m3fn or torch.float8_e5m2 (the gradients are bf16 here)")
        return None
    scales = []
    for name, scale in given.items():
        if scale is None:
            scale = 1.0
        elif isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or not scale.is_floating_point() or scale.device != device:
                raise InputError(f"{name} must be one floating-point value on {device} (a per-tensor scale), got "
                                 f"{tuple(scale.shape)} {scale.dtype} on {scale.device}")
        elif not isinstance(scale, (int, float)):
            raise InputTypeError(f"{name} must be a float or a one-element tensor, got {type(scale).__name__}")
        scales.append(torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(()))
    return scales


def scaled_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t times `scale` in the fp8 `dtype`, saturated, the amax of t before the scale, fp32 0-dim)."""
    wide = t.float()
    return saturated(wide * scale, dtype), wide.abs().amax()


def fp8_attention_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, deterministic=False):
    """O (B, Nq, H, d_v), in q's dtype, of q, k and v (fp32, fp16 or bf16) quantised to e4m3 per
    (batch, K/V head), with gradients for q, k and v from the fp8 backward (module docstring);
    `window_size`, `softcap` and `alibi_slopes` as flash_attn_func's; `deterministic` as
    fp8_attention_backward's."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dense_tensor(name, t)
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InputTypeError(f"{name} must be float32, float16 or bfloat16 (fp8_attention_func quantises it), "
                                 f"got {t.dtype}")
    left, right = window_size
    scale = -1.0 if softmax_scale is None else float(softmax_scale)
    out = fp8_attention_fwd(q, k, v, scale, bool(causal), int(left), int(right), float(check_softcap(softcap)),
                            alibi_slopes, bool(deterministic))[0]
    return out.to(q.dtype)


# -- the custom ops ---------------------------------------------------------------------------------

def _options(scale: float, causal: bool, left: int, right: int, softcap: float, alibi_slopes) -> dict:
    return dict(softmax_scale=None if scale < 0 else scale, causal=causal, window_size=(left, right), softcap=softcap,
                alibi_slopes=alibi_slopes)


# The custom ops take the call's options as plain values (scale -1: the default), so that a compiled
# step's graph holds them.


@torch.library.custom_op("fagen::fp8_attention_fwd", mutates_args=())
def fp8_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, left: int,
                      right: int, softcap: float, alibi_slopes: torch.Tensor | None,
                      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O bf16, L, q8, k8, v8, q_descale, k_descale, v_descale): the forward, and what its backward reads."""
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    options = _options(scale, causal, left, right, softcap, alibi_slopes)
    variant = {name: options.pop(name) for name in ("window_size", "softcap", "alibi_slopes")}   # unset: no variant
    out, lse = fp8_attention(q8, k8, v8, **options, return_lse=True, variant=variant,
                             descales={"q_descale": qd, "k_descale": kd, "v_descale": vd})
    return out, lse, q8, k8, v8, qd, kd, vd


@fp8_attention_fwd.register_fake
def _(q, k, v, scale, causal, left, right, softcap, alibi_slopes, deterministic):
    batch, seqlen_q, heads, _ = q.shape
    f32 = dict(dtype=torch.float32)
    descale = (batch, k.shape[2])
    return (q.new_empty(*q.shape[:-1], v.shape[-1], dtype=torch.bfloat16), q.new_empty(batch, heads, seqlen_q, **f32),
            torch.empty_like(q, dtype=FP8), torch.empty_like(k, dtype=FP8), torch.empty_like(v, dtype=FP8),
            q.new_empty(descale, **f32), q.new_empty(descale, **f32), q.new_empty(descale, **f32))


@torch.library.custom_op("fagen::fp8_attention_bwd", mutates_args=())
def fp8_attention_bwd(dout: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, qd: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, scale: float,
                      causal: bool, left: int, right: int, softcap: float, alibi_slopes: torch.Tensor | None,
                      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in bf16 for fp8_attention_fwd's outputs; O and dO in bf16 (descales 1)."""
    return fp8_attention_backward(dout.to(torch.bfloat16).contiguous(), q8, k8, v8, out, lse, q_descale=qd,
                                  k_descale=kd, v_descale=vd, deterministic=deterministic,
                                  **_options(scale, causal, left, right, softcap, alibi_slopes))


@fp8_attention_bwd.register_fake
def _(dout, q8, k8, v8, out, lse, qd, kd, vd, scale, causal, left, right, softcap, alibi_slopes, deterministic):
    fresh = dict(dtype=torch.bfloat16, memory_format=torch.contiguous_format)
    return torch.empty_like(q8, **fresh), torch.empty_like(k8, **fresh), torch.empty_like(v8, **fresh)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal, left, right, softcap, alibi_slopes, deterministic = inputs
    out, lse, q8, k8, v8, qd, kd, vd = output
    ctx.save_for_backward(out, lse, q8, k8, v8, qd, kd, vd, alibi_slopes)
    ctx.options = (scale, causal, left, right, softcap)
    ctx.deterministic = deterministic
    ctx.dtypes = (q.dtype, k.dtype, v.dtype)


def _backward(ctx, dout, *unused):
    out, lse, q8, k8, v8, qd, kd, vd, alibi_slopes = ctx.saved_tensors
    grads = fp8_attention_bwd(dout, q8, k8, v8, out, lse, qd, kd, vd, *ctx.options, alibi_slopes, ctx.deterministic)
    return (*(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), *([None] * 7))


torch.library.register_autograd("fagen::fp8_attention_fwd", _backward, setup_context=_setup_context)

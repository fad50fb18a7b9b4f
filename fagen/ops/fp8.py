"""The 8-bit forward as users call it: `flash_attn_func` with float8_e4m3fn q, k and v, FlashAttention-3's
fp8 signature (q_descale, k_descale, v_descale: fp32 (batch, K/V heads), None meaning 1), O in bf16.

The kernels are the sm90 family's (Spec.fp8: e4m3 wgmma, P~ = 2^8 P in e4m3, the descales folded
into the softmax's scale and O's), so a CUDA call needs compute capability 9.0; the CPU runs them
on the emulator. No dropout, as FlashAttention-3's; and no gradients through these e4m3 inputs (a
call with an input that requires grad is refused, not silently cut from the graph): training is
fagen/ops/fp8_training.py's. Each call makes V^T, the
operand the kernel's P V reads (`fagen.kernels.fp8_operands`): one pass over V.

`fagen.ops.fp8_inputs.quantize_qkv` makes the inputs and their descales from bf16 or fp32 tensors.
"""

from __future__ import annotations

import torch

from ..arch_families import FP8_FAMILY
from ..errors import InputError, InputTypeError
from ..kernels import attention_kernels
from ..kernels.fp8_operands import DESCALES
from ..kernels.render import source_for
from ..selftest.gate import check_fixed_spec
from ..spec import Spec
from .common import check_dense_tensor, check_inputs, check_options
from .variant_args import variant_call

FP8 = torch.float8_e4m3fn
NO_DESCALES = dict.fromkeys(DESCALES)


def is_fp8(q) -> bool:
    """Whether a call's q is 8-bit: it takes this module's path."""
    return isinstance(q, torch.Tensor) and q.dtype == FP8


def check_descales_for(q, q_descale, k_descale, v_descale) -> None:
    """Descales given with a q that is not 8-bit are refused, by name: they would be ignored."""
    if is_fp8(q):
        return
    given = [name for name, descale in zip(DESCALES, (q_descale, k_descale, v_descale)) if descale is not None]
    if given:
        raise InputError(f"{', '.join(given)} given, but q is {getattr(q, 'dtype', type(q).__name__)}: descales "
                         f"scale float8_e4m3fn inputs")


def fp8_attention(q, k, v, *, softmax_scale=None, causal=False, seqlens_k=None, return_lse=False, dropout_p=0.0,
                  deterministic=False, variant=None, descales=NO_DESCALES):
    """O (B, Nq, H, d_v) bf16, and L (B, H, Nq) with `return_lse`, of float8_e4m3fn q (B, Nq, H, d) and
    k, v (B, Nk, Hk, d / d_v); `descales` by name (`DESCALES`), each (B, Hk) fp32 or None (1). Under
    torch.compile the call is one custom op (fagen::fp8_forward), which takes causal, a window and
    seqlens_k."""
    if torch.compiler.is_compiling():
        return _traced(q, k, v, softmax_scale, causal, seqlens_k, return_lse, dropout_p, variant, descales)
    _check_fp8_inputs(q, k, v)
    if dropout_p:
        raise InputError(f"dropout_p must be 0 for float8_e4m3fn inputs (the fp8 forward has no dropout, as "
                         f"FlashAttention-3's has none), got {dropout_p}")
    if any(t.requires_grad for t in (q, k, v)):
        raise InputError("q, k and v in float8_e4m3fn take no gradients here: train with fagen.fp8_attention_func "
                         "(16- or 32-bit q, k, v quantised inside, gradients from the fp8 backward), or call "
                         "fagen.fp8_attention_backward; pass tensors that do not require grad")
    _, softmax_scale, causal, return_lse, _ = check_options(0.0, softmax_scale, causal, return_lse, deterministic, 2,
                                                            q.shape[-1])
    given = {name: _checked_descale(name, descales.get(name), (k.shape[0], k.shape[2]), q.device) for name in DESCALES}
    call = variant_call(q, k, causal=causal, **variant) if variant else None
    spec = _spec(q, v, causal, seqlens_k is not None, call)
    _check_device(q, spec)
    if seqlens_k is not None:
        seqlens_k = seqlens_k.contiguous()
    q, k, v = (t if _tma_ready(t) else t.contiguous() for t in (q, k, v))
    out, (lse,) = attention_kernels.forward(source_for(spec), q, k, v, softmax_scale=softmax_scale,
                                            seqlens_k=seqlens_k, variant_values=call.values if call else None,
                                            descales=given)
    return (out, lse) if return_lse else out


def _traced(q, k, v, softmax_scale, causal, seqlens_k, return_lse, dropout_p, variant, descales):
    """The call as torch.compile traces it: fagen::fp8_forward, its options as plain values."""
    window = (variant or {}).get("window_size", (-1, -1))
    others = {name: value for name, value in (variant or {}).items() if name != "window_size"
              and value is not None and value != 0.0}
    if others or dropout_p:
        raise InputError(f"under torch.compile, the fp8 forward takes causal, window_size and seqlens_k; "
                         f"{', '.join(others) or 'dropout_p'} given: call it outside the compiled region")
    if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(isinstance(w, int) for w in window)):
        raise InputTypeError(f"under torch.compile, window_size must be a pair of Python ints, got {window!r}")
    out, lse = fp8_forward(q, k, v, descales.get("q_descale"), descales.get("k_descale"), descales.get("v_descale"),
                           seqlens_k, -1.0 if softmax_scale is None else float(softmax_scale), bool(causal),
                           int(window[0]), int(window[1]))
    return (out, lse) if return_lse else out


@torch.library.custom_op("fagen::fp8_forward", mutates_args=())
def fp8_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None,
                k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, seqlens_k: torch.Tensor | None,
                scale: float, causal: bool, left: int, right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_attention, eagerly, as the compiled graph calls it (scale -1: the default)."""
    variant = {"window_size": (left, right)} if (left, right) != (-1, -1) else None
    out, lse = fp8_attention(q, k, v, softmax_scale=None if scale < 0 else scale, causal=causal, seqlens_k=seqlens_k,
                             return_lse=True, variant=variant,
                             descales={"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale})
    return out, lse


@fp8_forward.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, seqlens_k, scale, causal, left, right):
    batch, seqlen_q, heads, _ = q.shape
    return (q.new_empty(batch, seqlen_q, heads, v.shape[-1], dtype=torch.bfloat16),
            q.new_empty(batch, heads, seqlen_q, dtype=torch.float32))


def _check_fp8_inputs(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dense_tensor(name, t)
        if t.dtype != FP8:
            raise InputTypeError(f"q is float8_e4m3fn, so {name} must be too, got {t.dtype}")
    check_inputs(q, k, v, dtypes=(FP8,))


@torch.compiler.disable   # packed fp8 sequences run eagerly under torch.compile (a graph break, said in usage.md)
def fp8_varlen_attention(q, k, v, varlen, *, softmax_scale, causal: bool, dropout_p, call, descales):
    """Packed sequences' fp8 forward (flash_attn_varlen_func's e4m3 path, its arguments checked there but
    for these): q (total_q, H, d), k, v (total_k, Hk, d / d_v) in float8_e4m3fn, `varlen` = (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k), descales (B, Hk) fp32 by name or None (1). Returns O
    (total_q, H, d_v) bf16 and L in (B, H, max_seqlen_q) slots."""
    for name, t in (("k", k), ("v", v)):
        if t.dtype != FP8:
            raise InputTypeError(f"q is float8_e4m3fn, so {name} must be too, got {t.dtype}")
    if dropout_p:
        raise InputError(f"dropout_p must be 0 for float8_e4m3fn inputs (the fp8 forward has no dropout), got "
                         f"{dropout_p}")
    if any(t.requires_grad for t in (q, k, v)):
        raise InputError("q, k and v in float8_e4m3fn take no gradients here: train with fagen.fp8_attention_func")
    shape = (varlen[0].numel() - 1, k.shape[1])   # a descale per (sequence, K/V head)
    given = {name: _checked_descale(name, descales.get(name), shape, q.device) for name in DESCALES}
    d, d_v = q.shape[-1], v.shape[-1]
    try:
        spec = Spec(d, head_dim_v=None if d_v == d else d_v, dtype="e4m3", arch_family=FP8_FAMILY.name,
                    mask="causal" if causal else "none", varlen=True, **(call.spec_fields if call else {}))
    except ValueError as refusal:
        raise InputError(f"float8_e4m3fn q (head_dim {d}), v (head_dim {d_v}): {refusal}") from None
    _check_device(q, spec)
    q, k, v = (t if _tma_ready(t) else t.contiguous() for t in (q, k, v))
    out, (slots,) = attention_kernels.forward(source_for(spec), q, k, v, softmax_scale=softmax_scale, varlen=varlen,
                                              variant_values=call.values if call else None, descales=given)
    return out, slots


def _checked_descale(name: str, descale, shape: tuple, device):
    """`descale` as the kernel reads it: contiguous fp32 of `shape` ((B, Hk)) on `device`, or None."""
    if descale is None:
        return None
    check_dense_tensor(name, descale)
    if descale.dtype != torch.float32 or tuple(descale.shape) != shape:
        raise InputError(f"{name} must be float32 of shape (batch, kv_heads) = {shape}, got {descale.dtype} of "
                         f"shape {tuple(descale.shape)}")
    if descale.device != device:
        raise InputError(f"{name} must be on q's device {device}, got {descale.device}")
    return descale.contiguous()


def _spec(q, v, causal: bool, key_padding: bool, call, deterministic: bool = False, dout_dtype: str | None = None
          ) -> Spec:
    d, d_v = q.shape[-1], v.shape[-1]
    try:
        return Spec(d, head_dim_v=None if d_v == d else d_v, dtype="e4m3", arch_family=FP8_FAMILY.name,
                    mask="causal" if causal else "none", key_padding=key_padding, deterministic=deterministic,
                    dout_dtype=dout_dtype, **(call.spec_fields if call else {}))
    except ValueError as refusal:
        raise InputError(f"float8_e4m3fn q (head_dim {d}), v (head_dim {d_v}): {refusal}") from None


def _check_device(q, spec: Spec) -> None:
    """A CUDA call runs its family's cubins (sm_90a: compute capability 9.0), where the self-test has
    not failed the template (no other family has an 8-bit forward to fall back on)."""
    if q.device.type != "cuda":
        return
    capability, needed = torch.cuda.get_device_capability(q.device), FP8_FAMILY.capability
    if capability != needed:
        raise InputError(f"float8_e4m3fn attention runs on compute capability {needed[0]}.{needed[1]} alone; q is "
                         f"on {q.device}, of compute capability {capability[0]}.{capability[1]}")
    check_fixed_spec(spec, q.device)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a tensor map can describe `t`: its last dim contiguous, its other strides in whole 16 bytes."""
    return t.stride(-1) == 1 and all(s % 16 == 0 for s in t.stride()[:-1])

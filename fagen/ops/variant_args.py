"""A call's variant arguments, checked: flash-attn 2.8's window_size, softcap and
alibi_slopes, sinks, and FlexAttention-style score_mod / mask_mod.

`variant_call(...)` returns None for plain attention, else a `VariantCall`: the Spec fields
of the variant (which kernels to build: only the presence of each feature, never a value),
the kernels' run-time arguments by parameter name (values never cause a recompile), and
the tensors that receive gradients (sinks, floating tensors a score_mod captures that
require grad). Every error names the argument and what was expected.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InputError, InputTypeError
from ..variants.compose import custom_mod, mod_expression
from ..variants.language import trace_mask_mod, trace_score_mod
from ..variants.tiles import SUMMARY_ROWS, summaries


@dataclass
class VariantCall:
    spec_fields: dict
    values: dict = field(default_factory=dict)
    grad_tensors: list = field(default_factory=list)   # autograd inputs beyond q, k, v
    grad_names: list = field(default_factory=list)     # where backward's extras hold their gradients


def _window_int(w) -> int | None:
    """An integer-valued scalar as an int: a Python int (the plain path, no graph break under
    torch.compile), a NumPy integer or a one-element integer tensor, as flash-attn's tests pass
    them; None for anything else (bools, floats)."""
    if isinstance(w, int):
        return None if isinstance(w, bool) else w
    if isinstance(w, torch.Tensor) and (w.dtype == torch.bool or w.is_floating_point() or w.is_complex()):
        return None
    try:
        return operator.index(w)   # NumPy integers, integer tensors; NumPy bools and floats refuse
    except (TypeError, RuntimeError):
        return None


def _window(window_size, causal: bool, seqlen_q: int, seqlen_k: int):
    """flash-attn's (left, right), -1 unbounded; causal means right = 0. None: no window. The
    pair may be a tuple, a list, or a 2-element tensor or array (flash-attn's tests draw it
    with torch.randint)."""
    pair = window_size if isinstance(window_size, (tuple, list)) else \
        tuple(window_size) if isinstance(window_size, (torch.Tensor, np.ndarray)) and window_size.ndim == 1 else ()
    ints = [_window_int(w) for w in pair]
    if len(ints) != 2 or any(w is None or w < -1 for w in ints):
        raise InputError(f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded), "
                         f"got {window_size!r}")
    left, right = ints
    if causal:
        right = 0
    if left == -1 and right == -1 or (left == -1 and causal):
        return None
    unbounded = seqlen_q + seqlen_k   # reaches every key from every row
    return (unbounded if left == -1 else min(left, unbounded)), (unbounded if right == -1 else min(right, unbounded))


def _check_float(name: str, t, q, shapes: tuple) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise InputTypeError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) not in shapes:
        raise InputError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise InputError(f"{name} must be on q's device {q.device}, got {t.device}")
    return t.contiguous()


def _captures(prefix: str, traced, q, call: VariantCall) -> None:
    for i, tensor in enumerate(traced.tensors):
        name = f"{prefix}_cap{i}"
        if tensor.device != q.device:
            raise InputError(f"{prefix}_mod captures a tensor on {tensor.device}; captured tensors must be on "
                             f"q's device {q.device}")
        kernel_view = tensor.detach().contiguous()
        call.values[name] = kernel_view
        for axis, stride in enumerate(kernel_view.stride()):
            call.values[f"{name}_stride{axis}"] = stride
        if prefix == "score" and tensor.requires_grad and tensor.is_floating_point():
            call.grad_tensors.append(tensor)
            call.grad_names.append(f"{name}_grad")


def variant_call(q, k, *, causal: bool, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                 score_mod=None, mask_mod=None, sizes=None) -> VariantCall | None:
    """`sizes` = (batch, seqlen_q, heads, seqlen_k) where q and k are not (B, N, H, d) (packed sequences:
    the maxima)."""
    batch, seqlen_q, heads, seqlen_k = sizes or (*q.shape[:3], k.shape[1])
    window = _window(window_size, causal, seqlen_q, seqlen_k)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0:
        raise InputError(f"softcap must be a float >= 0 (0: off), got {softcap!r}")
    if window is None and not softcap and alibi_slopes is None and sinks is None and score_mod is None \
            and mask_mod is None:
        return None
    call = VariantCall({"window": window is not None, "softcap": bool(softcap), "alibi": alibi_slopes is not None,
                        "sinks": sinks is not None})
    if window is not None:
        call.values.update(window_left=window[0], window_right=window[1])
    if softcap:
        call.values["softcap"] = float(softcap)
    if alibi_slopes is not None:
        slopes = _check_float("alibi_slopes", alibi_slopes, q, ((heads,), (batch, heads)))
        call.values.update(alibi_slopes=slopes, alibi_stride_b=heads if slopes.dim() == 2 else 0)
    if sinks is not None:
        call.values["sinks"] = _check_float("sinks", sinks, q, ((heads,),)).detach()
        if sinks.requires_grad:
            call.grad_tensors.append(sinks)
            call.grad_names.append("dsinks")
    if score_mod is not None:
        traced = trace_score_mod(score_mod)
        call.spec_fields["score_mod"] = custom_mod(traced)
        _captures("score", traced, q, call)
    if mask_mod is not None:
        traced = trace_mask_mod(mask_mod)
        call.spec_fields["mask_mod"] = custom_mod(traced)
        _captures("mask", traced, q, call)
        _summaries(call, traced)
    return call


def _summaries(call: VariantCall, traced) -> None:
    """Per-group (16 rows) min and max of each captured tensor whose equality across q_idx and
    kv_idx the tile classes use (document ids): O(N / 16) work on the tensor's device."""
    for summary in summaries(mod_expression(call.spec_fields["mask_mod"], "mask")):
        ids = call.values[summary.capture].long().movedim(summary.dim, -1)
        pad = -ids.shape[-1] % SUMMARY_ROWS
        if pad:   # the last group repeats its last id: no id that is not there
            ids = torch.cat([ids, ids[..., -1:].expand(*ids.shape[:-1], pad)], dim=-1)
        groups = ids.reshape(*ids.shape[:-1], -1, SUMMARY_ROWS)
        low, high = (x.movedim(-1, summary.dim).contiguous() for x in (groups.amin(-1), groups.amax(-1)))
        call.values.update({f"{summary.capture}_gmin": low, f"{summary.capture}_gmax": high,
                            f"{summary.capture}_groups": low.shape[summary.dim]})
        for axis, stride in enumerate(low.stride()):
            call.values[f"{summary.capture}_sumstride{axis}"] = stride

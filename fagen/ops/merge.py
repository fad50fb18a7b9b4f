"""merge_attention: combine attention computed over disjoint key sets, exactly.

Split-KV decoding and context parallelism compute attention of the same queries over
P disjoint parts of the keys; part i gives, per query row, its output O_i and its
logsumexp L_i. The attention over all the keys is

    L = logsumexp_i L_i,   O = sum_i exp(L_i - L) O_i,

computed stably as L = M + log(sum_i exp(L_i - M)) with M = max_i L_i (M is detached
from autograd: the result does not depend on it). `fagen verify` proves this, its
gradient (dO_i = exp(L_i - L) dO, dL_i = exp(L_i - L) (dL + <dO, O_i - O>)) and that the
merge is associative and commutative (fagen/identities/merge.py).

Rows that saw no key. fagen's kernels (and fagen.reference) store L = +inf and O = 0 for
a row that sees no key; the logsumexp of an empty set is -inf. Both are read as "this
part is empty for this row": its weight is 0 and its O_i is not read (so whatever it
holds, even NaN, contributes nothing). A row for which every part is empty merges to
O = 0 and L = +inf, fagen's convention, with zero (finite) gradients. A NaN L_i is not
empty and propagates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError, InputTypeError

__all__ = ["EMPTY_ROW_LSE", "merge_attention"]

EMPTY_ROW_LSE = float("inf")  # the L fagen stores for a row that sees no key (fagen.reference.empty_rows)


def _as_parts(name: str, value, rank: int, layout: str) -> list[torch.Tensor]:
    """A list of tensors, from a sequence of them or a tensor stacked along dim 0."""
    if isinstance(value, torch.Tensor):
        if value.dim() != rank + 1:
            raise InputError(f"{name} as a stacked tensor must be (P, {layout}), "
                             f"got shape {tuple(value.shape)}")
        parts = list(value.unbind(0))
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        parts = list(value)
    else:
        raise InputTypeError(f"{name} must be a list of tensors or a stacked tensor, got {type(value).__name__}")
    if not parts:
        raise InputError(f"{name} is empty: merge_attention needs at least one part")
    for i, part in enumerate(parts):
        if not isinstance(part, torch.Tensor):
            raise InputTypeError(f"{name}[{i}] must be a tensor, got {type(part).__name__}")
        if not part.is_floating_point():
            raise InputTypeError(f"{name}[{i}] must be a floating-point tensor, got {part.dtype}")
        if part.dim() != rank:
            raise InputError(f"{name}[{i}] must be ({layout}), got shape {tuple(part.shape)}")
    return parts


def _check(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> None:
    if len(outs) != len(lses):
        raise InputError(f"outs and lses must hold as many parts: got {len(outs)} outs and {len(lses)} lses")
    B, N, H, _ = outs[0].shape
    device = outs[0].device
    for i, (out, lse) in enumerate(zip(outs, lses)):
        if out.shape != outs[0].shape:
            raise InputError(f"outs[{i}] has shape {tuple(out.shape)}, outs[0] {tuple(outs[0].shape)}: "
                             "every part must have the same (B, N, H, d)")
        if tuple(lse.shape) != (B, H, N):
            raise InputError(f"lses[{i}] must be (B, H, N) = {(B, H, N)} to match outs, got {tuple(lse.shape)}")
        for name, t in ((f"outs[{i}]", out), (f"lses[{i}]", lse)):
            if t.device != device:
                raise InputError(f"{name} is on {t.device}, outs[0] on {device}: every part must be on one device")


def merge_attention(outs, lses):
    """Merge partial attention results over disjoint key sets into the attention over their union.

    outs: P tensors (B, N, H, d) (flash-attn's layout, any float dtype), or one (P, B, N, H, d);
    lses: P tensors (B, H, N) of natural-log logsumexps (fp32 as the kernels return them; any
    float dtype), or one (P, B, H, N). Part i's row is empty where lses[i] is +inf (fagen's
    convention) or -inf; see the module docstring.

    Returns (out, lse): out (B, N, H, d) in outs[0]'s dtype, lse (B, H, N) fp32. The arithmetic
    is fp32 (float64 when any input is float64). Differentiable in every outs[i] and lses[i];
    runs on whatever device the inputs are on.
    """
    outs = _as_parts("outs", outs, 4, "B, N, H, d")
    lses = _as_parts("lses", lses, 3, "B, H, N")
    _check(outs, lses)
    wide = any(t.dtype == torch.float64 for t in (*outs, *lses))
    compute = torch.float64 if wide else torch.float32

    L = torch.stack([lse.to(compute) for lse in lses])                          # (P, B, H, N)
    empty = torch.isinf(L)
    L_live = torch.where(empty, torch.full_like(L, float("-inf")), L)
    M = L_live.amax(dim=0).detach()                                             # (B, H, N)
    none_live = torch.isneginf(M)
    M = torch.where(none_live, torch.zeros_like(M), M)
    scaled = torch.exp(L_live - M)                                              # 0 on empty parts
    total = scaled.sum(dim=0)
    total_safe = torch.where(none_live, torch.ones_like(total), total)
    lse = torch.where(none_live, torch.full_like(total, EMPTY_ROW_LSE), M + torch.log(total_safe))
    weights = (scaled / total_safe).transpose(-1, -2).unsqueeze(-1)             # (P, B, N, H, 1)
    live = ~empty.transpose(-1, -2).unsqueeze(-1)

    merged = None
    for i, out in enumerate(outs):
        part = torch.where(live[i], out.to(compute), torch.zeros((), dtype=compute, device=out.device))
        term = weights[i] * part
        merged = term if merged is None else merged + term
    return merged.to(outs[0].dtype), lse

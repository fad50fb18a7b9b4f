"""One attention problem as the reference sees it: float64 tensors, head-major.

Every reference function (naive, tiled, standard) starts by turning its
arguments into a `Problem`. That keeps argument checking and the three
masking rules (causal, key padding, dropout) in one place, so the oracle and
the executable specifications cannot disagree about what a mask means.

Conventions (DESIGN.md):
  q (B, Nq, H, d); k, v (B, Nk, Hk, d), H % Hk == 0; query head h reads kv head
  h // (H // Hk).
  Causal is aligned bottom-right: query i sees key j iff j <= i + Nk - Nq.
  Key padding: batch b sees keys j < seqlens_k[b] (Nk is the padded length);
  with both, causal aligns to the keys that exist, as flash-attn's varlen
  kernels do: query i sees key j iff j < seqlens_k[b] and
  j <= i + seqlens_k[b] - Nq.
  Dropout: O = (P * Z) V with Z = keep / (1 - p); keep is given explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fagen.spec import check_dropout_p

F64 = torch.float64


@dataclass(frozen=True)
class Problem:
    q: torch.Tensor  # (B, H, Nq, d) float64
    k: torch.Tensor  # (B, Hk, Nk, d) float64
    v: torch.Tensor  # (B, Hk, Nk, d) float64
    scale: float
    causal: bool
    seqlens_k: tuple | None  # per-batch key lengths, or None
    dropout_p: float
    keep: torch.Tensor | None  # (B, H, Nq, Nk) bool, or None when there is no dropout

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA); 1 for ordinary multi-head attention."""
        return self.heads // self.kv_heads

    @property
    def nq(self) -> int:
        return self.q.shape[2]

    @property
    def nk(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    def kv_head(self, h: int) -> int:
        return h // self.group

    def key_length(self, b: int) -> int:
        """How many keys batch b sees before any causal limit."""
        return self.nk if self.seqlens_k is None else self.seqlens_k[b]

    def visible(self, b: int, rows: range, cols: range) -> torch.Tensor:
        """Bool (len(rows), len(cols)): which (query, key) pairs batch b may attend."""
        i = torch.arange(rows.start, rows.stop).unsqueeze(1)
        j = torch.arange(cols.start, cols.stop).unsqueeze(0)
        seen = j < self.key_length(b)
        if self.causal:
            seen = seen & (j <= i + (self.key_length(b) - self.nq))
        return seen.expand(len(rows), len(cols))

    def visible_all(self) -> torch.Tensor:
        """Bool (B, 1, Nq, Nk): `visible` for the whole problem (heads share it)."""
        rows, cols = range(self.nq), range(self.nk)
        return torch.stack([self.visible(b, rows, cols) for b in range(self.batch)]).unsqueeze(1)

    def block_is_masked(self, b: int, rows: range, cols: range) -> bool:
        """True if no pair in the block is visible, decided from block bounds alone.

        This is how a kernel decides to skip a block (causal block skipping and
        the key-padding loop bound) without looking at individual entries:
        the first key of the block lies past the last key any of its rows sees.
        """
        if len(rows) == 0 or len(cols) == 0:
            return True
        last_seen = self.key_length(b) - 1
        if self.causal:
            last_seen = min(last_seen, rows.stop - 1 + self.key_length(b) - self.nq)
        return cols.start > last_seen

    def dropout_factor(self, b: int, h: int, rows: range, cols: range) -> torch.Tensor | None:
        """Z = keep / (1 - p) for a block, or None when there is no dropout."""
        if self.keep is None:
            return None
        keep = self.keep[b, h, rows.start:rows.stop, cols.start:cols.stop]
        return keep.to(F64) / (1.0 - self.dropout_p)

    def dropout_factor_all(self) -> torch.Tensor | None:
        """Z for the whole problem, (B, H, Nq, Nk), or None."""
        if self.keep is None:
            return None
        return self.keep.to(F64) / (1.0 - self.dropout_p)


def make_problem(q, k, v, *, softmax_scale=None, causal=False, seqlens_k=None,
                 dropout_p=0.0, keep_mask=None) -> Problem:
    """Check the arguments of any reference function and build its Problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seq, heads, head_dim)")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, Nq, H, d = q.shape
    Bk, Nk, Hk, dk = k.shape
    if Bk != B or dk != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if Hk == 0 or H % Hk != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hk})")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    lengths = _check_seqlens(seqlens_k, B, Nk)
    p = check_dropout_p(dropout_p)
    keep = _check_keep_mask(keep_mask, p, (B, H, Nq, Nk))
    return Problem(
        q=q.to(F64).transpose(1, 2), k=k.to(F64).transpose(1, 2), v=v.to(F64).transpose(1, 2),
        scale=scale, causal=bool(causal), seqlens_k=lengths, dropout_p=p, keep=keep)


def _check_seqlens(seqlens_k, batch: int, nk: int):
    if seqlens_k is None:
        return None
    lengths = torch.as_tensor(seqlens_k)
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.shape != (batch,):
        raise ValueError(f"seqlens_k must be an integer tensor of shape ({batch},), "
                         f"got {lengths.dtype} {tuple(lengths.shape)}")
    values = tuple(int(x) for x in lengths.tolist())
    if any(x < 0 or x > nk for x in values):
        raise ValueError(f"seqlens_k must lie in [0, Nk={nk}], got {list(values)}")
    return values


def _check_keep_mask(keep_mask, p: float, shape: tuple):
    if keep_mask is None:
        if p > 0.0:
            raise ValueError("dropout_p > 0 needs an explicit keep_mask (B, H, Nq, Nk); "
                             "make one with fagen.reference.dropout_keep_mask(seed, offset, ...)")
        return None
    if not isinstance(keep_mask, torch.Tensor) or keep_mask.dtype != torch.bool:
        raise ValueError("keep_mask must be a bool tensor")
    if tuple(keep_mask.shape) != shape:
        raise ValueError(f"keep_mask must have shape {shape} (B, H, Nq, Nk), got {tuple(keep_mask.shape)}")
    if p == 0.0:
        if not bool(keep_mask.all()):
            raise ValueError("keep_mask drops elements but dropout_p is 0")
        return None
    return keep_mask


def to_query_layout(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B, N, H, d), the layout of q, k, v and of the outputs."""
    return x.transpose(1, 2).contiguous()

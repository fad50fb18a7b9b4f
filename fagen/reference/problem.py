"""One attention problem as the reference sees it: float64 tensors, head-major.

Every reference function (naive, tiled, standard) starts by turning its
arguments into a `Problem`. That keeps argument checking, the masking rules
(causal, key padding, sliding window, mask_mod, dropout) and the score
modifications (softcap, ALiBi, score_mod) in one place, so the oracle and the
executable specifications cannot disagree about what a mask means.

Conventions (DESIGN.md):
  q (B, Nq, H, d); k, v (B, Nk, Hk, d), H % Hk == 0; query head h reads kv head
  h // (H // Hk).
  Causal is aligned bottom-right: query i sees key j iff j <= i + Nk - Nq.
  Key padding: batch b sees keys j < seqlens_k[b] (Nk is the padded length);
  with both, causal aligns to the keys that exist, as flash-attn's varlen
  kernels do: query i sees key j iff j < seqlens_k[b] and
  j <= i + seqlens_k[b] - Nq.
  Dropout: O = (P * Z) V with Z = keep / (1 - p); keep is given explicitly.

Variants (flash-attn 2.8's semantics; below "Nk" is the batch entry's own key
length seqlens_k[b] when key padding is on, as in every alignment formula):
  window_size (left, right): query i sees key j iff
      i + Nk - Nq - left <= j <= i + Nk - Nq + right, -1 = unbounded side;
      causal is the window (left, 0), so causal=True forces right = 0.
  softcap c > 0: S = c * tanh(S / c) on the scaled score S = tau q.k.
  alibi_slopes (H,) or (B, H), fp32: S -= slope[b, h] * |i + Nk - Nq - j|.
  score_mod(score, b, h, q_idx, kv_idx): FlexAttention's hook, evaluated once
      on broadcast int64 indices b (B,1,1,1), h (1,H,1,1), q_idx (1,1,Nq,1),
      kv_idx (1,1,1,Nk); applied after softcap and ALiBi.
  mask_mod(b, h, q_idx, kv_idx) -> bool: ANDed into the visibility, which is
      then per head, (B, H, Nq, Nk). Masks come last: a masked score is -inf
      whatever the modifications made of it.
  sinks (H,): one extra logit per head in every softmax denominator, with no
      value row (gpt-oss); the reference functions that use it are in naive.
Visibility = key padding AND causal AND window AND mask_mod.
"""

from __future__ import annotations

import math
import operator
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
    # Variants; the defaults are plain attention (so older callers need not name them).
    window: tuple = (-1, -1)  # (left, right), -1 = unbounded; right is 0 when causal
    softcap: float = 0.0  # 0 = off
    alibi_slopes: torch.Tensor | None = None  # (B, H) float64 (exact copy of the fp32 slopes)
    score_mod: object = None  # callable(score, b, h, q_idx, kv_idx) -> score, or None
    mask_mod: object = None  # callable(b, h, q_idx, kv_idx) -> bool, or None
    sinks: torch.Tensor | None = None  # (H,) float64, differentiable from the caller's tensor

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

    @property
    def head_dim_v(self) -> int:
        """d_v, v's (and the output's) head dim."""
        return self.v.shape[3]

    def kv_head(self, h: int) -> int:
        return h // self.group

    def key_length(self, b: int) -> int:
        """How many keys batch b sees before any causal limit."""
        return self.nk if self.seqlens_k is None else self.seqlens_k[b]

    def _structural(self, b: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Key padding, causal and window for batch b at broadcast indices i, j."""
        nk = self.key_length(b)
        offset = nk - self.nq
        seen = j < nk
        if self.causal:
            seen = seen & (j <= i + offset)
        left, right = self.window
        if right >= 0 and not self.causal:  # causal already is right = 0
            seen = seen & (j <= i + offset + right)
        if left >= 0:
            seen = seen & (j >= i + offset - left)
        return seen

    def visible(self, b: int, rows: range, cols: range, h: int | None = None) -> torch.Tensor:
        """Bool (len(rows), len(cols)): which (query, key) pairs batch b may attend.

        Key padding, causal and window are the same for every head; a mask_mod
        may depend on the head, so with one `h` must be given.
        """
        i = torch.arange(rows.start, rows.stop).unsqueeze(1)
        j = torch.arange(cols.start, cols.stop).unsqueeze(0)
        seen = self._structural(b, i, j).expand(len(rows), len(cols))
        if self.mask_mod is not None:
            if h is None:
                raise ValueError("this problem has a mask_mod, whose mask may depend on the head: pass h")
            one = lambda x: torch.tensor(x, dtype=torch.int64).view(1, 1, 1, 1)  # noqa: E731
            mask = self._mask_mod_values(one(b), one(h), i.view(1, 1, -1, 1), j.view(1, 1, 1, -1),
                                         (1, 1, len(rows), len(cols)))
            seen = seen & mask[0, 0]
        return seen

    def visible_all(self) -> torch.Tensor:
        """Bool (B, 1, Nq, Nk): `visible` for the whole problem (heads share it);
        (B, H, Nq, Nk) when a mask_mod is given."""
        i = torch.arange(self.nq).unsqueeze(1)
        j = torch.arange(self.nk).unsqueeze(0)
        full = (self.nq, self.nk)
        seen = torch.stack([self._structural(b, i, j).expand(full) for b in range(self.batch)]).unsqueeze(1)
        if self.mask_mod is not None:
            seen = seen & self._mask_mod_values(*self.score_indices(), self.scores_shape)
        return seen

    def block_is_masked(self, b: int, rows: range, cols: range) -> bool:
        """True if no pair in the block is visible, decided from block bounds alone.

        This is how a kernel decides to skip a block (causal and window block
        skipping, the key-padding loop bound) without looking at individual
        entries. Under padding, causal and window the visible keys of row i
        form the interval [max(c0, i + off - left), min(c1, Nk - 1, i + off + right)]
        (off = Nk - Nq); some row of [r0, r1] has a nonempty interval iff every
        lower bound is <= every upper bound, which is linear in i, so the
        decision is exact. A mask_mod is not consulted: the answer stays sound
        (True only when nothing is visible) but may miss blocks it masks.
        """
        if len(rows) == 0 or len(cols) == 0:
            return True
        nk = self.key_length(b)
        offset = nk - self.nq
        left, right = self.window
        if self.causal:
            right = 0
        r0, r1, c0, c1 = rows.start, rows.stop - 1, cols.start, cols.stop - 1
        if c0 > nk - 1:
            return True  # key padding: the block starts past the last key
        lo, hi = r0, r1  # the rows that can see some key of the block
        if right >= 0:
            lo = max(lo, c0 - offset - right)  # c0 <= i + off + right
        if left >= 0:  # i + off - left <= c1 (<= Nk - 1 holds anyway: i <= Nq - 1)
            hi = min(hi, c1 - offset + left)
        return lo > hi

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

    @property
    def scores_shape(self) -> tuple:
        return (self.batch, self.heads, self.nq, self.nk)

    @property
    def has_score_mods(self) -> bool:
        return self.softcap > 0.0 or self.alibi_slopes is not None or self.score_mod is not None

    def key_lengths(self) -> torch.Tensor:
        """(B,) int64: each batch entry's key length (Nk without key padding)."""
        if self.seqlens_k is None:
            return torch.full((self.batch,), self.nk, dtype=torch.int64)
        return torch.tensor(self.seqlens_k, dtype=torch.int64)

    def score_indices(self):
        """FlexAttention's broadcast indices, int64: b (B,1,1,1), h (1,H,1,1),
        q_idx (1,1,Nq,1), kv_idx (1,1,1,Nk)."""
        ar = lambda n: torch.arange(n, dtype=torch.int64)  # noqa: E731
        return (ar(self.batch).view(-1, 1, 1, 1), ar(self.heads).view(1, -1, 1, 1),
                ar(self.nq).view(1, 1, -1, 1), ar(self.nk).view(1, 1, 1, -1))

    def alibi_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """-slope[b, h] * |i + Nk - Nq - j|, (B, H, Nq, Nk) in `dtype`.

        Computed in the wider of fp32 and `dtype` (so exactly in float64 for
        the oracle, in fp32 and then rounded for fp16/bf16, as a kernel holding
        fp32 slopes does)."""
        wide = torch.promote_types(dtype, torch.float32)
        _, _, i, j = self.score_indices()
        offset = (self.key_lengths() - self.nq).view(-1, 1, 1, 1)
        distance = (i + offset - j).abs().to(wide)  # (B, 1, Nq, Nk)
        slopes = self.alibi_slopes.to(wide).reshape(self.batch, self.heads, 1, 1)
        return (-slopes * distance).to(dtype)

    def modify_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """softcap, then ALiBi, then score_mod, on scaled scores (B, H, Nq, Nk),
        in the scores' own dtype, with differentiable ops only. Masks are not
        applied here (they come last, see `visible_all`)."""
        if self.softcap > 0.0:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if self.alibi_slopes is not None:
            scores = scores + self.alibi_bias(scores.dtype)
        if self.score_mod is not None:
            modified = self.score_mod(scores, *self.score_indices())
            if not isinstance(modified, torch.Tensor) or not modified.is_floating_point():
                raise ValueError("score_mod must return a floating-point tensor")
            try:
                scores = torch.broadcast_to(modified, self.scores_shape).to(scores.dtype)
            except RuntimeError as err:
                raise ValueError(f"score_mod returned shape {tuple(modified.shape)}, which does not "
                                 f"broadcast to {self.scores_shape}") from err
        return scores

    def _mask_mod_values(self, b, h, q_idx, kv_idx, shape) -> torch.Tensor:
        mask = self.mask_mod(b, h, q_idx, kv_idx)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ValueError("mask_mod must return a bool tensor")
        try:
            return torch.broadcast_to(mask, shape)
        except RuntimeError as err:
            raise ValueError(f"mask_mod returned shape {tuple(mask.shape)}, which does not "
                             f"broadcast to {shape}") from err


def make_problem(q, k, v, *, softmax_scale=None, causal=False, seqlens_k=None,
                 dropout_p=0.0, keep_mask=None, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, score_mod=None, mask_mod=None, sinks=None) -> Problem:
    """Check the arguments of any reference function and build its Problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seq, heads, head_dim)")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape[:-1] != v.shape[:-1]:   # v's head dim (d_v) may differ from k's
        raise ValueError(f"k and v must agree on batch, keys and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
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
    window = _check_window(window_size, bool(causal))
    cap = _check_softcap(softcap)
    slopes = _check_alibi(alibi_slopes, B, H)
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a callable or None, got {type(fn).__name__}")
    sink_logits = _check_sinks(sinks, H)
    return Problem(
        q=q.to(F64).transpose(1, 2), k=k.to(F64).transpose(1, 2), v=v.to(F64).transpose(1, 2),
        scale=scale, causal=bool(causal), seqlens_k=lengths, dropout_p=p, keep=keep,
        window=window, softcap=cap, alibi_slopes=slopes, score_mod=score_mod, mask_mod=mask_mod,
        sinks=sink_logits)


def _check_window(window_size, causal: bool) -> tuple:
    """(left, right) with -1 for an unbounded side; causal makes right 0 (flash-attn)."""
    try:
        values = tuple(window_size)
    except TypeError:
        values = None
    if values is None or len(values) != 2:
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1, got {window_size!r}")
    ints = []
    for x in values:
        try:
            if isinstance(x, bool):
                raise TypeError
            ints.append(operator.index(x))
        except TypeError:
            raise ValueError(f"window_size must be a pair (left, right) of ints >= -1, "
                             f"got {window_size!r}") from None
    if any(x < -1 for x in ints):
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(ints)}")
    left, right = ints
    return (left, 0) if causal else (left, right)


def _check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be a float >= 0 (0 = off), got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap}")
    return float(softcap)


def _check_alibi(alibi_slopes, batch: int, heads: int):
    """fp32 slopes (H,) or (B, H) -> (B, H) float64 (exact), or None."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        raise ValueError("alibi_slopes must be a float32 tensor of shape (H,) or (B, H)")
    shape = tuple(alibi_slopes.shape)
    if shape == (heads,):
        return alibi_slopes.detach().to(F64).unsqueeze(0).expand(batch, heads)
    if shape == (batch, heads):
        return alibi_slopes.detach().to(F64)
    raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), got {shape}")


def _check_sinks(sinks, heads: int):
    """(H,) floating logits -> float64, still attached to the caller's graph."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise ValueError("sinks must be a floating-point tensor of shape (H,)")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape ({heads},), got {tuple(sinks.shape)}")
    return sinks.to(F64)


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


def check_gradient_args(dlse, captures, lse_shape: tuple) -> list:
    """Validate the upstream gradient of L and the captured tensors whose gradients are wanted."""
    if dlse is not None and (not isinstance(dlse, torch.Tensor) or tuple(dlse.shape) != lse_shape):
        raise ValueError(f"dlse must be a tensor of shape {lse_shape} (B, H, Nq)")
    captures = list(captures)
    for n, t in enumerate(captures):
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            raise ValueError(f"captures[{n}] must be a tensor that requires grad "
                             "(the one score_mod closes over)")
    return captures

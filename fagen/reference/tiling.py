"""What the tiled specifications (FlashAttention-1 and -2) share.

A Spec fixes at compile time what the kernel can do (tile sizes, causal,
key padding, dropout); the call supplies run-time values (scale, lengths,
p, the keep mask). `tiled_problem` checks that the two agree, so a reference
run describes exactly one kernel spec.
"""

from __future__ import annotations

import torch

from fagen.spec import Spec

from .hbm import HBM
from .problem import Problem, make_problem


def tiled_problem(q, k, v, spec: Spec, *, softmax_scale=None, causal=None, seqlens_k=None,
                  dropout_p=0.0, keep_mask=None, window_size=(-1, -1)) -> Problem:
    """Build the Problem for a tiled run; `causal=None` takes the spec's mask. A sliding
    window (flash-attn's window_size) is structure, like causal: the tiled loops skip the
    blocks outside it, as the kernels do."""
    if not isinstance(spec, Spec):
        raise TypeError(f"spec must be a fagen.spec.Spec, got {type(spec).__name__}")
    if causal is None:
        causal = spec.causal
    elif bool(causal) != spec.causal:
        raise ValueError(f"causal={causal} contradicts spec mask {spec.mask!r}")
    if seqlens_k is not None and not spec.key_padding:
        raise ValueError("seqlens_k given but the spec has key_padding=False")
    if (dropout_p or keep_mask is not None) and not spec.dropout:
        raise ValueError("dropout requested but the spec has dropout=False")
    if tuple(window_size) != (-1, -1) and not spec.window:
        raise ValueError(f"window_size {tuple(window_size)} given but the spec has window=False")
    prob = make_problem(q, k, v, softmax_scale=softmax_scale, causal=causal, seqlens_k=seqlens_k,
                        dropout_p=dropout_p, keep_mask=keep_mask, window_size=window_size)
    if prob.head_dim != spec.head_dim:
        raise ValueError(f"inputs have head_dim {prob.head_dim}, the spec {spec.head_dim}")
    return prob


def masked_scores(prob: Problem, b: int, rows: range, cols: range,
                  q_tile: torch.Tensor, k_tile: torch.Tensor) -> torch.Tensor:
    """S_ij = tau Q_i K_j^T with the pairs row i may not see set to -inf."""
    scores = prob.scale * q_tile @ k_tile.T
    return scores.masked_fill(~prob.visible(b, rows, cols), float("-inf"))


def dropped(tile: torch.Tensor, prob: Problem, b: int, h: int, rows: range, cols: range):
    """tile * Z for the block (Z = keep / (1 - p)); the tile itself without dropout."""
    z = prob.dropout_factor(b, h, rows, cols)
    return tile if z is None else tile * z


def head_major_hbm(prob: Problem, **extra: torch.Tensor) -> HBM:
    """An HBM holding Q (B, H, Nq, d) and K, V (B, Hk, Nk, d), plus `extra` arrays
    (also head-major, float64)."""
    arrays = {"Q": prob.q.contiguous(), "K": prob.k.contiguous(), "V": prob.v.contiguous()}
    for name, t in extra.items():
        arrays[name] = t.to(torch.float64).contiguous()
    return HBM(**arrays)


def to_head_major(x: torch.Tensor) -> torch.Tensor:
    """(B, N, H, d) -> (B, H, N, d)."""
    return x.to(torch.float64).transpose(1, 2)

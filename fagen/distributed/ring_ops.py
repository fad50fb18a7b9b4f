"""The per-step ops of ring attention: one chunk pair's forward and backward, as torch custom ops.

Each step of `ring_attention` runs, for every chunk pair it keeps (ring.Block), the plain or
causal kernel on the pair's rows, with the pair's global coordinates (its dropout mask is the
single-device mask's part) and its shifted window; the step's partial (O, L) merge with
`fagen.merge_attention`. These two ops are that pair's kernels, registered with fake
implementations, so a step (the pairs and their merge) traces under torch.compile with no graph
break; eagerly they are plain calls of the same kernels.

What selects the kernels crosses as `kernels` (a string: head dim, dtype, causal, dropout,
deterministic, windowed), the values as `ints` (Philox seed and offset, the pair's first row
and column, the window's left and right) and `floats` (softmax scale, dropout p).
"""

from __future__ import annotations

import functools

import torch

from ..kernels import attention_kernels
from ..ops.call import CallOptions, source_at_spec_tiles
from ..ops.common import aligned_rows
from ..variants.builtins import WINDOW


@functools.lru_cache(maxsize=64)
def pair_options(kernels: str) -> CallOptions:
    """A pair's call options, once per kind (every pair of every step asks for one of a few): its
    Spec comes from them by the path every call's does (ops.call, CallOptions.spec)."""
    head_dim, dtype, causal, dropout, deterministic, window = _fields(kernels)
    flags = (("coord_offsets", True),) * dropout + (("window", True),) * window   # sorted: Spec field names
    return CallOptions(head_dim, dtype, causal=causal, dropout=dropout, deterministic=deterministic, variant=flags)


def pair_source(kernels: str, device):
    """A pair's kernels at its Spec's own tiles (a pair's shapes change every step), in the family
    that serves them on `device` (the self-test's gate decides, as for every call of fagen.ops)."""
    return source_at_spec_tiles(pair_options(kernels), device)


def pair_kernels(head_dim: int, dtype: str, causal: bool, dropout: bool, deterministic: bool, window: bool) -> str:
    """The `kernels` string (plain formatting: torch.compile builds it at trace time)."""
    return f"{head_dim} {dtype} {int(causal)} {int(dropout)} {int(deterministic)} {int(window)}"


def _fields(kernels: str) -> tuple:
    head_dim, dtype, *flags = kernels.split()
    return (int(head_dim), dtype, *(flag == "1" for flag in flags))


def _unpack(ints, floats, windowed: bool):
    seed, offset, row, col, left, right = ints
    variant = dict(zip((name for name, _, _ in WINDOW.params), (left, right))) if windowed else None
    return seed, offset, (row, col), variant, floats[0], floats[1]


@torch.library.custom_op("fagen::ring_pair_fwd", mutates_args=())
def pair_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ints: list[int], floats: list[float],
                 kernels: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, L) of q (B, Nq, H, d) against the pair's k, v (B, Nk, Hk, d)."""
    seed, offset, coords, variant, scale, dropout_p = _unpack(ints, floats, _fields(kernels)[5])
    source = pair_source(kernels, q.device)
    out, (lse,) = attention_kernels.forward(source, aligned_rows(q), aligned_rows(k), aligned_rows(v),
                                            softmax_scale=scale, dropout_p=dropout_p, seed=seed, philox_offset=offset,
                                            coord_offsets=coords, variant_values=variant)
    return out, lse


@pair_forward.register_fake
def _(q, k, v, ints, floats, kernels):
    batch, seqlen_q, heads, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty(batch, heads, seqlen_q, dtype=torch.float32)


@torch.library.custom_op("fagen::ring_pair_bwd", mutates_args=())
def pair_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, ints: list[int], floats: list[float],
                  kernels: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of the pair, with the merged O and L of the whole row (the pair's P is
    exp(S - L), so the pairs' gradients sum to the exact one)."""
    seed, offset, coords, variant, scale, dropout_p = _unpack(ints, floats, _fields(kernels)[5])
    drop = attention_kernels.dropout_args(dropout_p, seed, offset) if dropout_p > 0 else None
    return attention_kernels.backward(pair_source(kernels, q.device), aligned_rows(q), aligned_rows(k),
                                      aligned_rows(v), aligned_rows(out), (lse.contiguous(),), aligned_rows(dout),
                                      softmax_scale=scale, dropout_args=drop, coord_offsets=coords,
                                      variant_values=variant)


@pair_backward.register_fake
def _(q, k, v, out, lse, dout, ints, floats, kernels):
    fresh = dict(memory_format=torch.contiguous_format)
    return torch.empty_like(q, **fresh), torch.empty_like(k, **fresh), torch.empty_like(v, **fresh)

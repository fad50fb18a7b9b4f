"""FLOPs of exact attention, counted as the FlashAttention-2 paper counts them.

Forward: two matmuls of (N x d) by (d x N) and (N x N) by (N x d) per head,
2 FLOPs per multiply-add, so 4 * N^2 * d per head and 4 * N^2 * d * H * B in
all. Backward: 2.5 times the forward (five matmuls instead of two). Causal:
half, since about half the score matrix is masked and skipped. Softmax and
masking FLOPs are not counted, so TFLOP/s here compare across systems and
with the paper's figures, not with a hardware counter.
"""

from __future__ import annotations

PASSES = ("fwd", "bwd", "fwd_bwd")
BACKWARD_FACTOR = 2.5


def attention_flops(pass_: str, *, batch: int, heads: int, seqlen: int, head_dim: int,
                    causal: bool) -> float:
    """FLOPs of one pass ("fwd", "bwd" or "fwd_bwd") over a (B, N, H, d) problem."""
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")
    forward = 4.0 * seqlen * seqlen * head_dim * heads * batch
    if causal:
        forward /= 2.0
    factor = {"fwd": 1.0, "bwd": BACKWARD_FACTOR, "fwd_bwd": 1.0 + BACKWARD_FACTOR}[pass_]
    return forward * factor


def tflops(flops: float, milliseconds: float) -> float:
    """Rate in TFLOP/s of `flops` done in `milliseconds`."""
    if milliseconds <= 0:
        raise ValueError(f"time must be positive, got {milliseconds} ms")
    return flops / (milliseconds * 1e-3) / 1e12

"""The convention for rows that see no key, shared by every reference function.

A query row can see no key at all: causal attention with Nq > Nk (rows
i < Nq - Nk), or key padding with seqlens_k[b] == 0. Exact arithmetic on
such a row produces 0/0 and (-inf) - (-inf). The convention below keeps
every quantity finite where it is used, and the kernels copy it exactly:

  m = -inf      the max of an empty set; stored as is (FlashAttention-1)
  l = 0         the sum of an empty set; stored as is (FlashAttention-1)
  L = +inf      stored instead of m + log l = -inf (FlashAttention-2, and
                the `lse` every reference function returns)
  O = 0         the row's output

Where the arithmetic needs them, two guarded forms replace m and 1/l:

  safe_max(m)        = m, or 0 where m = -inf. Exponents are taken as
                       exp(s - safe_max(m)); a masked s is -inf, so the term
                       is exp(-inf) = 0 and never exp(-inf + inf) = NaN.
  safe_reciprocal(l) = 1/l, or 0 where l = 0, so O = O_acc / l is 0.

Recovering P in the backward pass then needs no branch in the v2 form:
P = exp(S - L) = exp(-inf or finite - inf) = 0, and in the v1 form
P = exp(S - safe_max(m)) * safe_reciprocal(l) = 0 * 0 = 0. With P = 0 every
gradient contribution of the row is exactly 0 (dS = P * (dP - D) = 0).

The forms are written so that torch autograd through them stays finite
(no branch of a `torch.where` divides by zero).

A row can also be emptied by a sliding window or a mask_mod (then per head).
With attention sinks (one logit s_h per head in every denominator) no row is
empty of softmax mass: a row that sees no key has m = s_h, l = 1, L = s_h
(finite) and O = 0, and the formulas above need no special case.
"""

from __future__ import annotations

import torch

EMPTY_ROW_MAX = float("-inf")
EMPTY_ROW_SUM = 0.0
EMPTY_ROW_LSE = float("inf")


def safe_max(m: torch.Tensor) -> torch.Tensor:
    """m with -inf (an empty row, or an all-masked tile) replaced by 0."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def safe_reciprocal(l: torch.Tensor) -> torch.Tensor:
    """1 / l, with 0 where l == 0."""
    nonzero = l > 0
    return nonzero.to(l.dtype) / torch.where(nonzero, l, torch.ones_like(l))


def lse_from_stats(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """L = m + log l for rows that see a key; +inf for rows that see none."""
    nonzero = l > 0
    lse = m + torch.log(torch.where(nonzero, l, torch.ones_like(l)))
    return torch.where(nonzero, lse, torch.full_like(lse, EMPTY_ROW_LSE))

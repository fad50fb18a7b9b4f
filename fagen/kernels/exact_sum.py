"""Order-free sums (templates/include/fagen/exact_sum.cuh): the host side.

A deterministic spec's kernels add the gradients of captured tensors into digits of fixed
places (int64 each) instead of floats, so the digits after the last term do not depend on the
order of the terms; `value` reads a float back from them by the same arithmetic every time.
The layout is the header's: `WORDS` int64 per value, digits 0..DIGITS-1 with digit w weighing
2^(DIGIT_BITS w + LOWEST_PLACE), then a special slot whose low half is a float (the sum of the
infinities and NaNs among the terms).

The cost is memory: 13 int64 (104 bytes) per element of a captured tensor, beside the 4 bytes
of an fp32 gradient, for the backward's duration.
"""

from __future__ import annotations

import torch

DIGIT_BITS = 24
DIGITS = 12
WORDS = DIGITS + 1
LOWEST_PLACE = -149            # fp32's smallest subnormal is 2^-149
MAX_TERMS = 2 ** 39            # a digit's pieces are below 2^24: this many fit an int64


def zeros(shape, device) -> torch.Tensor:
    """The digits of a tensor of sums, all zero: shape + (WORDS,), int64."""
    return torch.zeros(*shape, WORDS, dtype=torch.int64, device=device)


def value(words: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor the digits hold (shape words.shape[:-1]).

    The carries are first moved up, so that digits 0..DIGITS-2 lie in [0, 2^24) and the top one
    holds the sign: one form for each exact sum. The digits are then added in float64 from the
    top, where the partial sums lose nothing until they pass 53 bits, and rounded to fp32;
    the specials' float sum is added last (a NaN or an infinity wins, as in float addition)."""
    digits = words[..., :DIGITS].clone()
    for w in range(DIGITS - 1):
        carry = digits[..., w] >> DIGIT_BITS   # arithmetic shift: the floor, negative digits too
        digits[..., w] -= carry << DIGIT_BITS
        digits[..., w + 1] += carry
    total = torch.zeros(words.shape[:-1], dtype=torch.float64, device=words.device)
    for w in reversed(range(DIGITS)):
        total += digits[..., w].double() * 2.0 ** (DIGIT_BITS * w + LOWEST_PLACE)
    special = words.contiguous().view(torch.float32)[..., 2 * DIGITS]   # the slot's low half
    return (total + special.double()).float()

"""Philox4x32-10 in vectorized NumPy, and fagen's dropout mask built on it.

Bit-identical to templates/include/fagen/philox.cuh (host and device) and to
Random123 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011), whose known-answer vectors the tests check.

Dropout counter layout (the header documents the same layout). For element
(b, h, i, j) of a (B, H, Nq, Nk) score matrix, with a 64-bit seed and a
32-bit offset:

  key     = (seed & 0xffffffff, seed >> 32)
  counter = (j >> 1, ((i >> 4) << 3) | (i & 7), b * H + h, offset)
  word    = ((i >> 3) & 1) * 2 + (j & 1)       (which of the 4 output words)
  keep    = output[word] < dropout_threshold(p)

One Philox call thus yields the four elements (i, j), (i, j+1), (i+8, j),
(i+8, j+1) for even j and i & 8 == 0: exactly the four fp32 accumulators one
thread holds in a 16x8 mma.sync tile. The counter depends on absolute
coordinates only, so the mask does not depend on block sizes or warp layout.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

from fagen.spec import check_dropout_p

PHILOX_M0 = np.uint64(0xD2511F53)  # round multipliers
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint32(0x9E3779B9)  # key schedule increments (golden ratio, sqrt(3) - 1)
PHILOX_W1 = np.uint32(0xBB67AE85)
PHILOX_ROUNDS = 10
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _mulhilo(multiplier: np.uint64, x: np.ndarray):
    product = multiplier * x.astype(np.uint64)
    return (product >> _SHIFT32).astype(np.uint32), (product & _LOW32).astype(np.uint32)


def philox4x32_round(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """One Philox round on (..., 4) counters with (..., 2) keys."""
    hi0, lo0 = _mulhilo(PHILOX_M0, counter[..., 0])
    hi1, lo1 = _mulhilo(PHILOX_M1, counter[..., 2])
    return np.stack([hi1 ^ counter[..., 1] ^ key[..., 0], lo1,
                     hi0 ^ counter[..., 3] ^ key[..., 1], lo0], axis=-1)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10: uint32 counters (..., 4) and keys (..., 2), broadcast together,
    to uint32 outputs (..., 4)."""
    counter = _as_words(counter, 4, "counter")
    key = _as_words(key, 2, "key")
    shape = np.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    counter = np.broadcast_to(counter, shape + (4,))
    key = np.broadcast_to(key, shape + (2,)).copy()
    with np.errstate(over="ignore"):  # the key schedule wraps mod 2**32 by design
        for r in range(PHILOX_ROUNDS):
            if r > 0:
                key[..., 0] += PHILOX_W0
                key[..., 1] += PHILOX_W1
            counter = philox4x32_round(counter, key)
    return counter


def _as_words(x, width: int, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.shape[-1:] != (width,):
        raise ValueError(f"{name} must have last dimension {width}, got shape {arr.shape}")
    if arr.dtype != np.uint32:
        if not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() > 0xFFFFFFFF:
            raise ValueError(f"{name} words must be integers in [0, 2**32)")
        arr = arr.astype(np.uint32)
    return arr


def dropout_threshold(p: float) -> int:
    """floor((1 - p) * 2**32), computed exactly from the float p: keep iff word < it.

    The host computes this once and passes it to kernels as a uint32. p = 0
    has no uint32 threshold (it would be 2**32): a caller with p == 0 takes
    the no-dropout path instead, so this raises rather than let 2**32 wrap to 0.
    """
    p = check_dropout_p(p)
    if p == 0.0:
        raise ValueError("dropout_p == 0 has no uint32 keep threshold (2**32); skip dropout instead")
    return int((1 - Fraction(p)) * 2**32)  # int() floors a positive Fraction


def dropout_key(seed: int) -> np.ndarray:
    """The Philox key (2 words) for a 64-bit seed."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    seed = int(seed)
    return np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)


def dropout_words(seed: int, offset: int, B: int, H: int, Nq: int, Nk: int) -> np.ndarray:
    """The Philox word deciding each element (b, h, i, j): uint32 (B, H, Nq, Nk)."""
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not 0 <= int(offset) < 2**32:
        raise ValueError(f"offset must be an int in [0, 2**32), got {offset!r}")
    if B * H >= 2**32:
        raise ValueError("B * H must fit in 32 bits (counter word 2)")
    b = np.arange(B, dtype=np.uint64).reshape(B, 1, 1, 1)
    h = np.arange(H, dtype=np.uint64).reshape(1, H, 1, 1)
    i = np.arange(Nq, dtype=np.uint64).reshape(1, 1, Nq, 1)
    j = np.arange(Nk, dtype=np.uint64).reshape(1, 1, 1, Nk)
    shape = (B, H, Nq, Nk)
    counter = np.stack([
        np.broadcast_to(j >> 1, shape),
        np.broadcast_to(((i >> 4) << 3) | (i & 7), shape),
        np.broadcast_to(b * H + h, shape),
        np.full(shape, int(offset), dtype=np.uint64),
    ], axis=-1).astype(np.uint32)
    words = philox4x32_10(counter, dropout_key(seed))
    which = np.broadcast_to(((i >> 3) & 1) * 2 + (j & 1), shape).astype(np.intp)
    return np.take_along_axis(words, which[..., None], axis=-1)[..., 0]


def dropout_keep_mask(seed: int, offset: int, B: int, H: int, Nq: int, Nk: int,
                      dropout_p: float) -> torch.Tensor:
    """Bool (B, H, Nq, Nk): True where element (b, h, i, j) is kept."""
    p = check_dropout_p(dropout_p)
    if p == 0.0:
        return torch.ones(B, H, Nq, Nk, dtype=torch.bool)
    keep = dropout_words(seed, offset, B, H, Nq, Nk) < np.uint32(dropout_threshold(p))
    return torch.from_numpy(np.ascontiguousarray(keep))

"""Sizes the sections share: seeded random document lengths, and a sequence length in short.

Plain arithmetic (no torch): the sections' configs and the plan text use it on any machine.
"""

from __future__ import annotations


def random_lengths(total: int, count: int, seed: int) -> list[int]:
    """`count` document lengths (at most `total`), random (seeded) between 1/4 and 7/4 of the
    mean, summing to `total`."""
    import random

    count = max(1, min(count, total))
    rng = random.Random(seed)
    weights = [rng.uniform(0.25, 1.75) for _ in range(count)]
    lengths = [max(1, int(total * w / sum(weights))) for w in weights]
    lengths[-1] = total - sum(lengths[:-1])
    return lengths


def short_seqlen(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)

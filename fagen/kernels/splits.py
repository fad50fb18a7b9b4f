"""Split-KV: how many key ranges a decoding launch splits each query block's keys into, so that a
small batch still fills the GPU (FlashAttention-2's rule); their fp32 partials are merged by L
by the combine kernel."""

from __future__ import annotations

import functools
import math
import os

import torch

MAX_SPLITS = 128


def choose_splits(row_blocks: int, key_tiles: int, processors: int, max_splits: int = MAX_SPLITS) -> int:
    """The split count for `row_blocks` thread blocks (batch x heads x query blocks) each over
    `key_tiles` K/V tiles on `processors` SMs. Work that already fills the SMs (80%) is not
    split. Otherwise the count is the smallest whose last wave of blocks is nearly as full
    (85%) as the best count's, among counts that change the tiles per split (FlashAttention-2's
    split-KV rule)."""
    if row_blocks >= 0.8 * processors:
        return 1
    limit = max(1, min(max_splits, processors, key_tiles))

    def distinct(s):   # s splits give fewer tiles per split than s - 1 do
        return s == 1 or -(-key_tiles // s) != -(-key_tiles // (s - 1))

    def wave_fill(s):
        waves = row_blocks * s / processors
        return waves / math.ceil(waves)

    fills = {s: wave_fill(s) for s in range(1, limit + 1) if distinct(s)}
    best = max(fills.values())
    return next(s for s, fill in fills.items() if fill >= 0.85 * best)


@functools.lru_cache(maxsize=16)
def processor_count(device: torch.device) -> int:
    """SMs on a GPU; on the emulator, the CPU threads that run its blocks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1

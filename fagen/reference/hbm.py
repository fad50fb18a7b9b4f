"""A counted model of GPU main memory (HBM) for the tiled specifications.

The tiled algorithms touch their input and output arrays only through an
`HBM`: every `load` and `store` adds the number of elements moved to the
array's read or write count. Work done on loaded tiles is on-chip (SRAM) and
free. The counts are what the FlashAttention-1 paper's IO analysis is about
(Theorem 2: Theta(N^2 d^2 / M) accesses for the tiled forward versus
Theta(N d + N^2) for standard attention).

Tiles are indexed by (batch, head, rows) into (B, H, N, ...) arrays; rows is
a `range`. The dropout keep mask is not an HBM array: kernels regenerate it
from Philox on chip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class IOCount:
    """Elements read from and written to each HBM array."""

    reads: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)

    @property
    def total_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def total_writes(self) -> int:
        return sum(self.writes.values())

    @property
    def total(self) -> int:
        return self.total_reads + self.total_writes

    def __add__(self, other: "IOCount") -> "IOCount":
        merged = IOCount(dict(self.reads), dict(self.writes))
        for name, n in other.reads.items():
            merged.reads[name] = merged.reads.get(name, 0) + n
        for name, n in other.writes.items():
            merged.writes[name] = merged.writes.get(name, 0) + n
        return merged


class HBM:
    """Named arrays with counted tile loads and stores."""

    def __init__(self, **arrays: torch.Tensor):
        self.arrays = dict(arrays)
        self.io = IOCount({name: 0 for name in arrays}, {name: 0 for name in arrays})

    def allocate(self, name: str, shape: tuple, fill: float = 0.0) -> None:
        """Create an output array. Allocation is free; writing the fill is not
        (call `store` for an initialization the algorithm performs)."""
        self.arrays[name] = torch.full(shape, fill, dtype=torch.float64)
        self.io.reads.setdefault(name, 0)
        self.io.writes.setdefault(name, 0)

    def load(self, name: str, b: int, h: int, rows: range) -> torch.Tensor:
        tile = self.arrays[name][b, h, rows.start:rows.stop].clone()
        self.io.reads[name] += tile.numel()
        return tile

    def store(self, name: str, b: int, h: int, rows: range, tile: torch.Tensor) -> None:
        target = self.arrays[name][b, h, rows.start:rows.stop]
        if tuple(tile.shape) != tuple(target.shape):
            raise ValueError(f"store to {name}: tile {tuple(tile.shape)} != slot {tuple(target.shape)}")
        target.copy_(tile)
        self.io.writes[name] += tile.numel()

    def accumulate(self, name: str, b: int, h: int, rows: range, tile: torch.Tensor) -> None:
        """Read-modify-write (an atomic add on the GPU): one read and one write."""
        self.store(name, b, h, rows, self.load(name, b, h, rows) + tile)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.arrays[name]


def blocks(n: int, size: int):
    """Yield consecutive row ranges of `size`; the last one may be shorter."""
    for start in range(0, n, size):
        yield range(start, min(start + size, n))

"""wgmma operand tiles in shared memory, as the tests lay them out (tests/emulate/test_emulate_wgmma.py).

A second reading of the ISA's "Shared Memory Matrix Layout" and "Strides" sections, written as
the canonical layouts CuTe's comments describe (strides in elements, T = 16 bytes / element
size: 8 16-bit or 16 8-bit elements per 16-byte unit; K = 32 bytes of elements), not as the
emulator's formulas:
  K-major,  interleave: ((8, m), (T, 2)) : ((1T, SBO), (1, LBO))
  K-major,  swizzle W:  ((8, m), (T, 2)) : ((W/16 T, SBO), (1, T))
  MN-major, interleave: ((T, 1, m), (8, k)) : ((1, T, SBO), (1T, LBO))
  MN-major, swizzle W:  ((T, W/16, m), (8, k)) : ((1, T, LBO), (W/16 T, SBO))
then the swizzle on the absolute shared address: bits [4, 4+b) ^= bits [7, 7+b).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SWIZZLES = {"none": 0, "128B": 1, "64B": 2, "32B": 3}
WIDTH = {0: 16, 1: 128, 2: 64, 3: 32}  # bytes of one swizzle row (16: the interleave core row)


def swizzle(address: int, mode: int) -> int:
    bits = {0: 0, 1: 3, 2: 2, 3: 1}[mode]
    return address ^ (((address >> 7) & ((1 << bits) - 1)) << 4)


def element_offset(mn: int, k: int, mn_major: bool, mode: int, lbo: int, sbo: int, size: int = 2) -> int:
    """Byte offset (before the swizzle) of element (mn, k) of `size`-byte elements, LBO and SBO in bytes."""
    w, T = WIDTH[mode] // 16, 16 // size
    L, S = lbo // size, sbo // size  # element units
    if not mn_major:
        coords = (mn % 8, mn // 8, k % T, k // T)
        stride = (T, S, 1, L) if mode == 0 else (w * T, S, 1, T)
    else:
        coords = (mn % T, (mn // T) % w, mn // (T * w), k % 8, k // 8)
        stride = (1, T, S, T, L) if mode == 0 else (1, T, L, w * T, S)
    return size * sum(c * s for c, s in zip(coords, stride))


@dataclass(frozen=True)
class Placement:
    """Where a rows x 16 operand sits in the image: `offset` bytes from a 1024-aligned base."""
    offset: int
    lbo: int
    sbo: int
    mode: int
    mn_major: bool
    span: int  # bytes from offset the tile may touch


def canonical(rows: int, mn_major: bool, mode: int, offset: int) -> Placement:
    """A packing of a rows x K operand (K = 32 bytes) with LBO != SBO wherever both matter."""
    width = WIDTH[mode]
    groups = -(-rows // 8)
    if not mn_major and mode == 0:  # 8-row core matrices along MN, the two k halves far apart
        return Placement(offset, lbo=groups * 128, sbo=128, mode=mode, mn_major=False, span=2 * groups * 128)
    if not mn_major:  # 8-row swizzle atoms stacked along MN, K = 16 in the first 32 bytes of a row
        return Placement(offset, lbo=16, sbo=8 * width, mode=mode, mn_major=False, span=groups * 8 * width)
    if mode == 0:  # 8 x 8 core matrices, MN groups adjacent, the two k groups far apart
        return Placement(offset, lbo=groups * 128, sbo=128, mode=mode, mn_major=True, span=2 * groups * 128)
    columns = -(-rows // (width // 2))  # W-byte-wide column groups of MN, each two 8-k atoms deep
    return Placement(offset, lbo=2 * 8 * width, sbo=8 * width, mode=mode, mn_major=True,
                     span=columns * 2 * 8 * width)


def place(image: np.ndarray, tile: np.ndarray, p: Placement, base: int = 1024) -> None:
    """Write `tile` (rows x K, uint16 or uint8 bits) into `image` (uint8) as the wgmma will read
    it; `base`: the image's shared-window address (a multiple of 1024 in the tests' kernels)."""
    size = tile.dtype.itemsize
    for mn in range(tile.shape[0]):
        for k in range(tile.shape[1]):
            offset = element_offset(mn, k, p.mn_major, p.mode, p.lbo, p.sbo, size)
            at = swizzle(base + p.offset + offset, p.mode) - base
            image[at:at + size] = np.frombuffer(tile[mn, k].tobytes(), dtype=np.uint8)

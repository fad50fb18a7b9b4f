"""The PTX ISA's wgmma .m64nNk16 register fragments, as tables (tests/emulate/test_emulate_wgmma.py).

Source: PTX ISA 8.7, "Asynchronous Warpgroup Level Matrix Shape" / "Register Fragments and
Shared Memory Matrix Layouts" (#asynchronous-warpgroup-level-matrix-register-fragment-wgmma-64n16):
- "WGMMA .m64nNk16 register fragment layout for matrix A": the 64 x 16 A tile in four 16-row
  slices, slice i held by warp i of the warpgroup (threads T32i..T32i+31) in the same
  arrangement as mma.m16n8k16's A figure, elements a0..a7 in four .f16x2 registers.
- "WGMMA .m64nNk16 register fragment layout for accumulator matrix D": the 64 x N tile in four
  16-row slices, one per warp, each an mma.m16n8 C figure (d0..d3) for columns 0-7, repeated
  for every further 8 columns with the next four registers (columns 8-15: d4..d7, ...,
  columns N-8..N-1: d(N/2-4)..d(N/2-1)).

- "WGMMA .m64nNk32 register fragment layout for matrix A" (.e4m3/.e5m2): the 64 x 32 A tile,
  again one 16-row slice per warp as mma.m16n8k32's 8-bit A figure: four .b32 registers of four
  elements, a0..a3 at row groupID, columns 4 * threadID_in_group + 0..3; a4..a7 the same 8 rows
  down; a8..a11 and a12..a15 the same 16 columns to the right.

So the grids here are the mma.sync figures already transcribed in isa_fragments.py, placed per
warp and per column block as the wgmma figures draw them: read off the figures, not off the
emulator's formulas.
"""

from __future__ import annotations

import isa_fragments as isa


def accumulator(n: int) -> dict[tuple[int, int], tuple[int, int]]:
    """{(thread, register): (row, column)} of D (64 x n) for .m64nNk16."""
    c = isa.parse(isa.MMA_C)  # (lane, c_e) -> (row, column) of a 16 x 8 block
    where = {}
    for warp in range(4):
        for block in range(n // 8):
            for (lane, element), (row, column) in c.items():
                where[(32 * warp + lane, 4 * block + element)] = (16 * warp + row, 8 * block + column)
    return where


def a_fragment() -> dict[tuple[int, int], tuple[int, int]]:
    """{(thread, element): (row, column)} of A (64 x 16) from registers; element e is the
    (e % 2) half of register e // 2."""
    a = isa.parse(isa.MMA_A)
    return {(32 * warp + lane, element): (16 * warp + row, column)
            for warp in range(4) for (lane, element), (row, column) in a.items()}


def a_fragment_8bit() -> dict[tuple[int, int], tuple[int, int]]:
    """{(thread, element): (row, column)} of 8-bit A (64 x 32) from registers; element e is byte
    e % 4 of register e // 4 (the figure's rule above: no 8-bit grid is transcribed yet)."""
    where = {}
    for thread in range(128):
        warp, group, quad = thread // 32, thread % 32 // 4, thread % 4
        for element in range(16):
            register = element // 4
            where[(thread, element)] = (16 * warp + group + 8 * (register % 2),
                                        16 * (register // 2) + 4 * quad + element % 4)
    return where

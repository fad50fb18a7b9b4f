"""The PTX ISA's fragment tables, transcribed as literal data (tests/emulate/test_emulate_layouts.py).

The emulator's tensor-core and ldmatrix twins are checked against these grids, not against
formulas of their own: each grid is the ISA's figure, one cell per matrix element, naming
the lane (T<lane>) and the fragment element that holds it. The hardware stays the final
judge: the same tests run on a GPU in the GPU check.

Sources (PTX ISA 8.7, https://docs.nvidia.com/cuda/parallel-thread-execution/):
- "Matrix Fragments for mma.m16n8k16 with floating point type"
  (#warp-level-matrix-fragment-mma-16816-float): the figures for matrix A (.f16/.bf16),
  matrix B (.f16/.bf16) and the accumulators C/D (.f32). A's elements a0..a7 sit two per
  .f16x2 register (register i holds a(2i), a(2i+1), the lower index in the low half); B's
  b0..b3 likewise in two registers; C/D are four .f32 registers c0..c3.
- "Warp-level matrix load instruction: ldmatrix" (#warp-level-matrix-instructions-ldmatrix):
  the fragment layout of one 8x8 .b16 matrix (each lane gets one 32-bit register per
  matrix, elements h0 and h1 in its low and high halves), the same with .trans (the matrix
  read column-major), and which lanes supply the row addresses of which matrix.
- "Warp-level matrix store instruction: stmatrix" (#warp-level-matrix-instructions-stmatrix):
  the same grids for the store (sm_90).
"""

from __future__ import annotations

import re

# mma.m16n8k16, matrix A (16 x 16, row = M, column = K).
MMA_A = """
  T0a0   T0a1   T1a0   T1a1   T2a0   T2a1   T3a0   T3a1   T0a4   T0a5   T1a4   T1a5   T2a4   T2a5   T3a4   T3a5
  T4a0   T4a1   T5a0   T5a1   T6a0   T6a1   T7a0   T7a1   T4a4   T4a5   T5a4   T5a5   T6a4   T6a5   T7a4   T7a5
  T8a0   T8a1   T9a0   T9a1  T10a0  T10a1  T11a0  T11a1   T8a4   T8a5   T9a4   T9a5  T10a4  T10a5  T11a4  T11a5
 T12a0  T12a1  T13a0  T13a1  T14a0  T14a1  T15a0  T15a1  T12a4  T12a5  T13a4  T13a5  T14a4  T14a5  T15a4  T15a5
 T16a0  T16a1  T17a0  T17a1  T18a0  T18a1  T19a0  T19a1  T16a4  T16a5  T17a4  T17a5  T18a4  T18a5  T19a4  T19a5
 T20a0  T20a1  T21a0  T21a1  T22a0  T22a1  T23a0  T23a1  T20a4  T20a5  T21a4  T21a5  T22a4  T22a5  T23a4  T23a5
 T24a0  T24a1  T25a0  T25a1  T26a0  T26a1  T27a0  T27a1  T24a4  T24a5  T25a4  T25a5  T26a4  T26a5  T27a4  T27a5
 T28a0  T28a1  T29a0  T29a1  T30a0  T30a1  T31a0  T31a1  T28a4  T28a5  T29a4  T29a5  T30a4  T30a5  T31a4  T31a5
  T0a2   T0a3   T1a2   T1a3   T2a2   T2a3   T3a2   T3a3   T0a6   T0a7   T1a6   T1a7   T2a6   T2a7   T3a6   T3a7
  T4a2   T4a3   T5a2   T5a3   T6a2   T6a3   T7a2   T7a3   T4a6   T4a7   T5a6   T5a7   T6a6   T6a7   T7a6   T7a7
  T8a2   T8a3   T9a2   T9a3  T10a2  T10a3  T11a2  T11a3   T8a6   T8a7   T9a6   T9a7  T10a6  T10a7  T11a6  T11a7
 T12a2  T12a3  T13a2  T13a3  T14a2  T14a3  T15a2  T15a3  T12a6  T12a7  T13a6  T13a7  T14a6  T14a7  T15a6  T15a7
 T16a2  T16a3  T17a2  T17a3  T18a2  T18a3  T19a2  T19a3  T16a6  T16a7  T17a6  T17a7  T18a6  T18a7  T19a6  T19a7
 T20a2  T20a3  T21a2  T21a3  T22a2  T22a3  T23a2  T23a3  T20a6  T20a7  T21a6  T21a7  T22a6  T22a7  T23a6  T23a7
 T24a2  T24a3  T25a2  T25a3  T26a2  T26a3  T27a2  T27a3  T24a6  T24a7  T25a6  T25a7  T26a6  T26a7  T27a6  T27a7
 T28a2  T28a3  T29a2  T29a3  T30a2  T30a3  T31a2  T31a3  T28a6  T28a7  T29a6  T29a7  T30a6  T30a7  T31a6  T31a7
"""

# mma.m16n8k16, matrix B (16 x 8, row = K, column = N).
MMA_B = """
  T0b0   T4b0   T8b0  T12b0  T16b0  T20b0  T24b0  T28b0
  T0b1   T4b1   T8b1  T12b1  T16b1  T20b1  T24b1  T28b1
  T1b0   T5b0   T9b0  T13b0  T17b0  T21b0  T25b0  T29b0
  T1b1   T5b1   T9b1  T13b1  T17b1  T21b1  T25b1  T29b1
  T2b0   T6b0  T10b0  T14b0  T18b0  T22b0  T26b0  T30b0
  T2b1   T6b1  T10b1  T14b1  T18b1  T22b1  T26b1  T30b1
  T3b0   T7b0  T11b0  T15b0  T19b0  T23b0  T27b0  T31b0
  T3b1   T7b1  T11b1  T15b1  T19b1  T23b1  T27b1  T31b1
  T0b2   T4b2   T8b2  T12b2  T16b2  T20b2  T24b2  T28b2
  T0b3   T4b3   T8b3  T12b3  T16b3  T20b3  T24b3  T28b3
  T1b2   T5b2   T9b2  T13b2  T17b2  T21b2  T25b2  T29b2
  T1b3   T5b3   T9b3  T13b3  T17b3  T21b3  T25b3  T29b3
  T2b2   T6b2  T10b2  T14b2  T18b2  T22b2  T26b2  T30b2
  T2b3   T6b3  T10b3  T14b3  T18b3  T22b3  T26b3  T30b3
  T3b2   T7b2  T11b2  T15b2  T19b2  T23b2  T27b2  T31b2
  T3b3   T7b3  T11b3  T15b3  T19b3  T23b3  T27b3  T31b3
"""

# mma.m16n8k16, accumulators C and D (16 x 8, row = M, column = N), .f32.
MMA_C = """
  T0c0   T0c1   T1c0   T1c1   T2c0   T2c1   T3c0   T3c1
  T4c0   T4c1   T5c0   T5c1   T6c0   T6c1   T7c0   T7c1
  T8c0   T8c1   T9c0   T9c1  T10c0  T10c1  T11c0  T11c1
 T12c0  T12c1  T13c0  T13c1  T14c0  T14c1  T15c0  T15c1
 T16c0  T16c1  T17c0  T17c1  T18c0  T18c1  T19c0  T19c1
 T20c0  T20c1  T21c0  T21c1  T22c0  T22c1  T23c0  T23c1
 T24c0  T24c1  T25c0  T25c1  T26c0  T26c1  T27c0  T27c1
 T28c0  T28c1  T29c0  T29c1  T30c0  T30c1  T31c0  T31c1
  T0c2   T0c3   T1c2   T1c3   T2c2   T2c3   T3c2   T3c3
  T4c2   T4c3   T5c2   T5c3   T6c2   T6c3   T7c2   T7c3
  T8c2   T8c3   T9c2   T9c3  T10c2  T10c3  T11c2  T11c3
 T12c2  T12c3  T13c2  T13c3  T14c2  T14c3  T15c2  T15c3
 T16c2  T16c3  T17c2  T17c3  T18c2  T18c3  T19c2  T19c3
 T20c2  T20c3  T21c2  T21c3  T22c2  T22c3  T23c2  T23c3
 T24c2  T24c3  T25c2  T25c3  T26c2  T26c3  T27c2  T27c3
 T28c2  T28c3  T29c2  T29c3  T30c2  T30c3  T31c2  T31c3
"""

# ldmatrix .m8n8 .b16, one matrix (row r is the 8 elements at the address lane r supplies).
LDMATRIX = """
  T0h0   T0h1   T1h0   T1h1   T2h0   T2h1   T3h0   T3h1
  T4h0   T4h1   T5h0   T5h1   T6h0   T6h1   T7h0   T7h1
  T8h0   T8h1   T9h0   T9h1  T10h0  T10h1  T11h0  T11h1
 T12h0  T12h1  T13h0  T13h1  T14h0  T14h1  T15h0  T15h1
 T16h0  T16h1  T17h0  T17h1  T18h0  T18h1  T19h0  T19h1
 T20h0  T20h1  T21h0  T21h1  T22h0  T22h1  T23h0  T23h1
 T24h0  T24h1  T25h0  T25h1  T26h0  T26h1  T27h0  T27h1
 T28h0  T28h1  T29h0  T29h1  T30h0  T30h1  T31h0  T31h1
"""

# The same with .trans.
LDMATRIX_TRANS = """
  T0h0   T4h0   T8h0  T12h0  T16h0  T20h0  T24h0  T28h0
  T0h1   T4h1   T8h1  T12h1  T16h1  T20h1  T24h1  T28h1
  T1h0   T5h0   T9h0  T13h0  T17h0  T21h0  T25h0  T29h0
  T1h1   T5h1   T9h1  T13h1  T17h1  T21h1  T25h1  T29h1
  T2h0   T6h0  T10h0  T14h0  T18h0  T22h0  T26h0  T30h0
  T2h1   T6h1  T10h1  T14h1  T18h1  T22h1  T26h1  T30h1
  T3h0   T7h0  T11h0  T15h0  T19h0  T23h0  T27h0  T31h0
  T3h1   T7h1  T11h1  T15h1  T19h1  T23h1  T27h1  T31h1
"""

# stmatrix .m8n8 .b16 ("Warp-level matrix store instruction: stmatrix"): the ISA's figures for
# stmatrix show the same fragment grids as ldmatrix's, plain and .trans, and the same lanes give
# the row addresses; they are named here so that a test says which instruction's figure it reads.
STMATRIX = LDMATRIX
STMATRIX_TRANS = LDMATRIX_TRANS

# ldmatrix: the lanes that supply the 8 row addresses of matrix i (row j from lane 8i + j);
# the addresses of other lanes are not read.
LDMATRIX_ADDRESS_LANES = {1: {0: range(0, 8)},
                          2: {0: range(0, 8), 1: range(8, 16)},
                          4: {0: range(0, 8), 1: range(8, 16), 2: range(16, 24), 3: range(24, 32)}}

CELL = re.compile(r"T(\d+)([a-z])(\d)")


def parse(grid: str) -> dict[tuple[int, int], tuple[int, int]]:
    """{(lane, element): (row, column)} of a grid; every lane's elements exactly once."""
    where: dict[tuple[int, int], tuple[int, int]] = {}
    for row, line in enumerate(grid.strip().splitlines()):
        for column, cell in enumerate(line.split()):
            lane, _, element = CELL.fullmatch(cell).groups()
            key = (int(lane), int(element))
            if key in where:
                raise ValueError(f"T{lane} element {element} appears twice")
            where[key] = (row, column)
    return where

"""The kernels' tile shapes: the fallback tables by head dim, and the shared-memory layouts a
thread block carves (the Spec computes each layout from its fields; these are their records).
A mask's tile classes are another concept: fagen/variants/tiles.py."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Past this head dim the forward splits O's columns over pairs of warps that share Q_i's rows
# (Spec.column_split): one warp's 16 rows of a 512-wide fp32 O would take 256 registers.
SPLIT_O_ABOVE = 256

# Tensor-core tile (mma.sync m16n8k16): rows of a warp's Q slice and the K/V
# block must come in multiples of 16.
MMA_M = 16
MMA_K = 16

# Each shared-memory row is padded by 8 halves (16 bytes) so that the 8 rows
# an ldmatrix phase touches start in different bank groups.
SMEM_ROW_PAD = 8
ELEMENT_BYTES = 2  # fp16 and bf16


def default_tiles(head_dim: int, version: int = 2) -> dict:
    """The fallback tile table by head dim: used when nothing is tuned.

    Sizes follow FlashAttention-2's forward kernels, adjusted so that the fp32
    O accumulator fits in registers without spills and Q plus double-buffered
    K and V fit in sm_80's shared memory.
    """
    if head_dim <= 64:
        block_m, block_n, num_warps = 128, 64, 4   # two 16-row mma tiles per warp
    elif head_dim <= 128:
        block_m, block_n, num_warps = 128, 64, 8   # one per warp keeps O in registers
    elif head_dim <= SPLIT_O_ABOVE:
        block_m, block_n, num_warps = 64, 32, 4
    else:   # eight warps: four row groups of 16 rows, each two warps with half of O's columns
        return {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 1}
    return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": 2}


def backward_block_n_choices(head_dim: int) -> tuple[int, ...]:
    """The backward's keys per thread block at a head dim, the table's default first."""
    if head_dim <= 128:
        return (128, 64)
    return (32,) if head_dim <= SPLIT_O_ABOVE else (32, 16)   # 16: past d = 256 on the 99 KB parts


@dataclass(frozen=True)
class SharedLayout:
    """Byte offsets of the tiles a forward thread block keeps in shared memory.

    Version 2 keeps one Q tile and pipelines K/V through `kv_stages` buffers;
    version 1 (K/V-outer) keeps one K/V tile and pipelines Q through `q_stages`.
    Stage s of Q starts at q_offset + s * q_stage_bytes, likewise for K and V.
    """

    row_elems: int  # padded row length in elements
    q_offset: int
    q_stages: int
    q_stage_bytes: int
    k_offset: int
    v_offset: int
    kv_stages: int
    kv_stage_bytes: int
    total_bytes: int
    # An 8-bit KV cache (Spec.cache_dtype): K_j and V_j land as bytes in kv_stages stages of their
    # own (rows of raw_row_bytes), and the K/V tiles above (one stage each) hold them widened.
    k_raw_offset: int = 0
    v_raw_offset: int = 0
    raw_row_bytes: int = 0


@dataclass(frozen=True)
class BackwardTiles:
    """Tiles of the backward kernels, derived from the head dim (and `bwd_block_n`).

    The main backward kernel owns block_n keys (K_j, V_j stay on chip) and
    loops over Q blocks of block_m rows. Its warps form key_groups x dim_split:
    each warp owns key_tiles x 16 keys and a 1/dim_split slice of the head dim for its
    dK and dV accumulators. At d <= 128 dim_split is 1 and no warp computes what another
    does; at d > 128 splitting d keeps dK and dV in registers, and the warps of a key
    group then share the work of S^T and dP^T by recomputing it. dQ = dS K is split over
    all warps in tiles of dq_tiles = (16-row tiles, 8-column tiles).
    The deterministic dQ kernel uses the same block_m with warps splitting Q.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dim_split: int
    dq_block_n: int  # keys per K/V tile of the deterministic dQ kernel
    key_tiles: int = 1  # 16-key mma tiles per warp
    head_dim: int = 0  # d (set by Spec.backward_tiles)
    head_dim_v: int = 0  # d_v (set by Spec.backward_tiles)

    @property
    def head_dim_pad(self) -> int:
        """d rounded up so that each of the dim_split slices is whole 16-wide mma steps."""
        step = 16 * self.dim_split
        return -(-self.head_dim // step) * step

    @property
    def head_dim_v_pad(self) -> int:
        """d_v rounded up as d is: dV's dim_split slices are whole mma steps too."""
        step = 16 * self.dim_split
        return -(-self.head_dim_v // step) * step

    @property
    def key_groups(self) -> int:
        return self.num_warps // self.dim_split

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def dq_tiles(self) -> tuple[int, int]:
        """(row tiles, column tiles) of one warp's dQ task: the most reuse of each ldmatrix
        (fewest loads per mma) among those whose tasks split evenly over the warps, at
        most 8 accumulator tiles (32 registers) each."""
        rows, cols = self.block_m // MMA_M, self.head_dim_pad // 8
        best = None
        for r in (d for d in range(1, rows + 1) if rows % d == 0):
            for c in (d for d in range(2, cols + 1, 2) if cols % d == 0):
                tasks = (rows // r) * (cols // c)
                if r * c > 8:
                    continue
                # Loads per mma, then tasks left over when they do not split evenly.
                key = (tasks % self.num_warps != 0, -(-tasks // self.num_warps) * (r + c / 2), (r + c / 2) / (r * c))
                if best is None or key < best[0]:
                    best = (key, (r, c))
        return best[1]


@dataclass(frozen=True)
class BackwardLayout:
    """Byte offsets of the backward kernel's shared tiles (rows padded like the forward)."""

    row_elems: int
    k_offset: int
    v_offset: int
    q_offset: int      # stage s at q_offset + s * qdo_stage_bytes
    do_offset: int     # stage s at do_offset + s * qdo_stage_bytes
    qdo_stage_bytes: int
    ds_offset: int     # dS^T (block_n keys x block_m queries), for dQ = dS K
    ds_row_elems: int
    stats_offset: int  # stage s at stats_offset + s * stats_stage_bytes: fp32 L_i (log2 units), then D_i
    stats_stage_bytes: int
    total_bytes: int


def backward_tiles(head_dim: int, head_dim_v: int, bwd_block_n: int | None,
                   bwd_stages: int | None = None) -> BackwardTiles:
    """The backward's tiles by head dim: one warp per 16 keys and the whole d up to d = 128 (dK
    and dV in registers, nothing computed twice); 99 KB parts take bwd_block_n = 64 (four warps).
    Past 128 four warps split d and share a key group. `bwd_block_n` and `bwd_stages` None: the
    table's defaults."""
    block_n = bwd_block_n or backward_block_n_choices(head_dim)[0]
    if head_dim <= 128:
        table = BackwardTiles(block_m=64, block_n=block_n, num_warps=block_n // 16, num_stages=2, dim_split=1,
                              dq_block_n=64)
    elif block_n == 16:   # d > 256 on a 99 KB part: 16 x 16 tiles, four warps splitting d
        table = BackwardTiles(block_m=16, block_n=16, num_warps=4, num_stages=1, dim_split=4, dq_block_n=16)
    else:   # dq_block_n = 16 keeps the deterministic dQ pass (d x 16 rows of fp32 per warp) spill-free
        table = BackwardTiles(block_m=32, block_n=32, num_warps=8, num_stages=1, dim_split=4, dq_block_n=16)
    stages = table.num_stages if bwd_stages is None else bwd_stages
    return replace(table, head_dim=head_dim, head_dim_v=head_dim_v, num_stages=stages)


def backward_layout(t: BackwardTiles) -> BackwardLayout:
    """The main backward kernel's shared tiles: K_j and V_j, then Q_i's and dO_i's stages, dS^T,
    and each stage's L_i and D_i."""
    row = t.head_dim_pad + SMEM_ROW_PAD
    kv_bytes = t.block_n * row * ELEMENT_BYTES
    stage = t.block_m * row * ELEMENT_BYTES
    q_offset = 2 * kv_bytes
    do_offset = q_offset + t.num_stages * stage
    ds_offset = do_offset + t.num_stages * stage
    ds_row = t.block_m + SMEM_ROW_PAD
    stats_offset = ds_offset + t.block_n * ds_row * ELEMENT_BYTES
    stats_stage = 2 * t.block_m * 4
    total = stats_offset + t.num_stages * stats_stage
    return BackwardLayout(row, 0, kv_bytes, q_offset, do_offset, stage, ds_offset, ds_row,
                          stats_offset, stats_stage, total)


def dq_layout(t: BackwardTiles, row: int) -> SharedLayout:
    """The deterministic dQ kernel's shared tiles: Q_i and dO_i (q stages 0 and 1), then K and V
    pipelined over `t.num_stages`; `row` is a row's elements (the forward's padded d)."""
    q_stage = t.block_m * row * ELEMENT_BYTES
    kv_stage = t.dq_block_n * row * ELEMENT_BYTES
    k_offset = 2 * q_stage
    v_offset = k_offset + t.num_stages * kv_stage
    total = v_offset + t.num_stages * kv_stage
    return SharedLayout(row, 0, 2, q_stage, k_offset, v_offset, t.num_stages, kv_stage, total)


def smaller_kv_cache_tiles(spec):
    """A decoding spec's tiles from large to small (Spec.for_kv_cache's order): half the query
    rows (four warps past d = 256, whose warp pairs split O's columns), then half the keys while
    16 or more, and only then fewer stages (a decoding step is bound by its copies, which the
    stages overlap with the math)."""
    block_m = spec.block_m // 2
    warps = 4 if spec.column_split > 1 else max(1, spec.num_warps // 2)
    for stages in range(spec.num_stages, 0, -1):
        block_n = spec.block_n
        while block_n >= 16:
            yield spec.replace(block_m=block_m, num_warps=warps, block_n=block_n, num_stages=stages)
            block_n //= 2

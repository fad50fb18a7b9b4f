"""Kernel families: which machine instructions a Spec's forward kernel is built from.

  sm80   mma.sync tensor cores, cp.async copies, every warp alike (templates/sm80/): runs on
         every GPU from sm_80 on, with every fagen feature. The default, but on compute capability
         9.0 for what the sm90 family takes and passed the self-test there (fagen.selftest.gate).
  sm90   Hopper's wgmma, TMA and mbarriers, warp-specialised after FlashAttention-3's design
         (templates/sm90/hopper_fwd.cu.j2): one producer warpgroup loads Q once and K/V tiles through a
         ring of shared-memory stages, two consumer warpgroups compute. Its cubins are
         arch-specific (sm_90a): they run on compute capability 9.0 only. So far a forward for
         plain, causal and windowed attention, with softcap, ALiBi, sinks, score_mod and mask_mod
         (captured tensors too), dropout, key padding, packed sequences, d_v != d, head dims up to
         512 (past d_v = 256 a block per column slice of O), and decoding against a KV cache
         (contiguous or paged, split-KV, GQA packing, absorbed MLA, packed queries over a paged
         cache); the backward stays the sm80 family's.

Each family is one `Family` object here (`SM80`, `SM90`, registered in `FAMILIES`): its facts
below the Spec, which the Spec's validation, the compile and the launch read: its refusals, its
tiles' head dims, its NVRTC target, the arch and compute capability it needs, and its forward's
shared memory and key tile. Its passes and templates are the kernels layer's
(`fagen.kernels.families`, `templates/<family>/`). Code elsewhere asks the object
(`family_of(spec)`), never compares the family's name.

What the sm90 family does not take yet is refused by name (`sm90_refusal`), so that a Spec never
silently drops a feature. The geometry of its forward (`Sm90Tiles`) is computed here once, for
the Spec's checks, the kernel table and the template alike.

Imports nothing of the pipeline: the Spec's validation uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .tile_shapes import SPLIT_O_ABOVE, default_tiles

SM90_HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
SM90_FP8_HEAD_DIMS = (64, 128, 192, 256)   # the 8-bit forward's (Sm90Tiles.box_columns: 64 and 192 in 64-byte rows)
# Its key tiles: whole 32-key k-steps (V^T's TMA boxes, 32 keys wide under the 32-byte swizzle), by
# head dim: FlashAttention-3's 224 at d = 128 and 160 at d = 192 (O's rescale and each row's work
# over more keys); 256 at d = 64, whose O takes 32 registers a thread; at d = 256, O's 128 leave
# room for 128.
SM90_FP8_BLOCK_N = {64: 256, 128: 224, 192: 160, 256: 128}
SM90_FP8_KEY_STEP = 32
SM90_MLA_HEAD_DIM = 576   # absorbed MLA decoding's, with V as K's first 512 columns (Spec.v_from_k)
SM90_ARCH = "sm_90"   # the arch whose shared memory and register file the sm90 family is sized for
SM90_SHARED_BYTES = 227 * 1024   # an sm_90 block's shared memory, dynamic and static together
# The forward's static shared memory: its mbarriers, which ptxas reports as up to 1024 bytes (the
# dynamic tiles after them start on the 128B swizzle's 1024-byte period).
SM90_STATIC_BYTES = 1024
# A consumer warpgroup's O is 64 rows of its columns in fp32: d_v / 2 registers a thread. Past 256
# columns it would not fit the 240 setmaxnreg gives, so wider O is computed a column slice per block.
SM90_SLICE_COLUMNS = 256

# The 128-byte swizzle row is 64 two-byte elements: a tile is stored as d / 64 boxes of 64 columns.
BOX_COLUMNS = 64
SWIZZLE_PERIOD = 1024   # bytes after which the 128B swizzle repeats: the tiles' alignment


def family_archs(family: str, archs: list[str] | None) -> list[str] | None:
    """The archs a command compiles a `family` forward for, given the user's --arch (`archs`; None
    where none was given): the family's own target by default (sm90: sm_90a; None for a family
    without one, which takes the command's defaults), else `archs`, which must all be archs the
    family can use. One it cannot use is refused in one line naming both (a ValueError: the command
    line prints it and exits 2)."""
    target = FAMILIES[family].target
    if target is None:
        return archs
    if archs is None:
        return [target]
    refused = [arch for arch in archs if arch != target]
    if refused:
        raise ValueError(f"--arch {','.join(refused)}: the {family} arch family compiles for {target} only "
                         f"({FAMILIES[family].target_why}); give --arch {target} or leave --arch out")
    return archs


def sm90_refusal(spec) -> str | None:
    """Why the sm90 family cannot render `spec`'s forward yet, naming the field; None if it can."""
    unsupported = [("version", spec.version != 2, "version=1 (FlashAttention-1 stays on the sm80 family)"),
                   ("head_dim", spec.head_dim not in SM90_HEAD_DIMS and not _mla(spec),
                    f"head_dim={spec.head_dim} (it has {', '.join(map(str, SM90_HEAD_DIMS))}, and "
                    f"{SM90_MLA_HEAD_DIM} with v_from_k)"),
                   ("head_dim_v", (spec.head_dim_v or spec.head_dim) % BOX_COLUMNS,
                    f"head_dim_v={spec.head_dim_v} (a multiple of {BOX_COLUMNS})"),
                   ("cache_dtype", spec.cache_dtype is not None,
                    f"cache_dtype={spec.cache_dtype!r} (an 8-bit KV cache is widened by the sm80 family's decoding)")]
    found = [what for _, refused, what in unsupported if refused] + _fp8_refusals(spec)
    if not found:
        return None
    if spec.fp8:   # no other family has an 8-bit forward to send it to
        return f"arch_family='sm90' has no forward for {', '.join(found)} yet; use dtype='bf16' there"
    return (f"arch_family='sm90' has no forward for {', '.join(found)} yet; use arch_family='sm80' (the "
            f"mma.sync kernels, every feature)")


def _fp8_refusals(spec) -> list[str]:
    """What the 8-bit forward (Spec.fp8) does not take: head dims but 64, 128, 192 and 256 (its tiles,
    SM90_FP8_BLOCK_N)."""
    if not spec.fp8:
        return []
    refused = [("head_dim", spec.head_dim not in SM90_FP8_HEAD_DIMS,
                f"head_dim={spec.head_dim} in {spec.dtype} (it has {', '.join(map(str, SM90_FP8_HEAD_DIMS))})")]
    return [what for _, on, what in refused if on]


def fp8_backward_refusal(spec) -> str | None:
    """Why an 8-bit spec (Spec.fp8) has no backward yet, naming the fields; None if the sm90
    backward takes it (the descales in fp32: hopper_bwd_walk.j2). It takes causal, key padding, a
    window, a softcap and ALiBi (their chain on tau S in true units); sinks and mods are refused for
    now: their gradients (dsinks, a captured tensor's) would come out in dS's scaled units."""
    refused = [name for name in ("sinks",) if getattr(spec, name)]
    refused += [name for name in ("score_mod", "mask_mod") if getattr(spec, name) is not None]
    found = sm90_backward_refusal(spec)
    if found:
        return f"the fp8 backward is the sm90 family's, which says: {found}"
    if refused:
        return (f"the fp8 backward takes causal, key padding, a window, a softcap and ALiBi for now, not "
                f"{', '.join(refused)}")
    return None


def sm80_refusal(spec) -> str | None:
    """The sm80 family renders every spec but the 8-bit ones (mma.sync has no e4m3 before sm_89,
    and fagen's 8-bit forward is the sm90 family's)."""
    if spec.fp8:
        return (f"dtype={spec.dtype!r}: the 8-bit forward is the sm90 family's (Hopper's e4m3 wgmma); "
                f"use arch_family='sm90'")
    return None


def _mla(spec) -> bool:
    """Absorbed MLA decoding: d = 576, V being K's first d_v columns in the same shared-memory tile
    (Q and two stages of K fit in 217 KiB; with a V tile of its own they would not)."""
    return spec.head_dim == SM90_MLA_HEAD_DIM and spec.v_from_k


@dataclass(frozen=True)
class Sm90Tiles:
    """The sm90 forward's geometry for a head dim: 128 query rows per block (64 per consumer
    warpgroup), `block_n` keys per K/V tile, `stages` K/V tiles in flight."""

    head_dim: int
    head_dim_v: int
    block_m: int = 128
    block_n: int = 128
    stages: int = 2
    consumers: int = 2
    v_from_k: bool = False   # V's tile is K's first d_v columns (Spec.v_from_k): a stage holds K alone
    element_bytes: int = 2   # Q's, K's and V's: 1 for the 8-bit forward (Spec.fp8), whose V tile is V^T

    @property
    def slices(self) -> int:
        """O's column slices: blocks that share their query rows, each recomputing S and the softmax
        and accumulating O's columns of its own slice (one past d_v = 256; FlashAttention-3 stops
        there). The slices of a row block are neighbours in the grid, so that they read each K/V
        tile at about the same time, the second from L2."""
        return -(-self.head_dim_v // SM90_SLICE_COLUMNS)

    @property
    def slice_columns(self) -> int:
        """O's (and V's tile's) columns per slice: whole 64-column boxes. Where they overrun d_v
        (d_v = 320 and 448), the last slice's boxes past it are neither loaded nor stored
        (`last_slice_boxes_v`)."""
        boxes_v = self.head_dim_v // BOX_COLUMNS
        return BOX_COLUMNS * -(-boxes_v // self.slices)

    @property
    def last_slice_boxes_v(self) -> int:
        """V's boxes of the last slice that start below d_v: those its block loads (and counts in a
        stage's bytes). The rest of its slice (one box at d_v = 320 and 448) lies wholly outside V,
        and whether TMA completes a load of such a box (zero-filled, its bytes counted) is not
        documented, so it is not issued; its shared memory then holds stale bytes, which reach
        only O's columns past d_v, never stored."""
        return self.head_dim_v // BOX_COLUMNS - (self.slices - 1) * (self.slice_columns // BOX_COLUMNS)

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)   # the producer warpgroup, then the consumers

    @property
    def page_box_rows(self) -> int:
        """A paged cache's box where its pages do not hold whole tiles (`page_box_rows`)."""
        return PAGE_BOX_ROWS

    @property
    def box_columns(self) -> int:
        """A TMA box's columns of Q or K: one 128-byte swizzle row (64 two-byte elements, 128 one-byte),
        or in the 8-bit forward at d = 64 and 192, one 64-byte row (64 one-byte elements)."""
        if self.element_bytes == 1 and self.head_dim % 128:
            return 64
        return 128 // self.element_bytes

    @property
    def box_bytes(self) -> int:
        """A box's row in bytes, and so its swizzle's width (128 or 64)."""
        return self.box_columns * self.element_bytes

    @property
    def boxes(self) -> int:
        """Boxes per row of a Q or K tile."""
        return self.head_dim // self.box_columns

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: Q, then each stage's K and V (d and a slice of d_v wide; K alone
        where V is K's), and the slack that aligns them to the swizzle's period."""
        stage = self.block_n * (self.head_dim + (0 if self.v_from_k else self.slice_columns)) * self.element_bytes
        return SWIZZLE_PERIOD + self.block_m * self.head_dim * self.element_bytes + self.stages * stage

    @property
    def fits(self) -> bool:
        """Whether the tiles and the static shared memory fit an sm_90 block."""
        return self.shared_bytes + SM90_STATIC_BYTES <= SM90_SHARED_BYTES


def sm90_tiles(spec) -> Sm90Tiles:
    """The key tiles FlashAttention-3 takes: 176 keys at d = 128 (the per-row work of a tile, its
    max and O's rescale, spread over more keys; Q and two stages fit in 209 KiB), 112 at d = 192,
    80 at d = 256 (Q and two stages in 225 KiB), 128 at d = 64. Narrower where the consumers' 240
    registers would not hold a variant's state beside them (NVRTC 12.9, sm_90a: these spilled): a
    window's mask or ALiBi's chain with a softcap at d = 128 (128 keys), dropout's Philox words (112
    at d = 128, 48 at d = 256), and a custom score_mod or mask_mod, whose per-element loads and
    captured tensors' pointers take registers too (96, 80, 64 and 48 keys at d = 64, 128, 192, 256:
    a relative-bias table, a document mask and both with dropout spilled one step wider)."""
    if spec.sm90_block_n is not None:   # chosen for this spec (kernels.spill_free narrows a mod's)
        return _tiles(spec, spec.sm90_block_n)
    if spec.fp8:
        return _tiles(spec, SM90_FP8_BLOCK_N[spec.head_dim])
    if spec.kv_cache is not None:   # decoding: a power of two, a paged cache's box per page where it divides them
        return _tiles(spec, _decoding_block_n(spec))
    custom = spec.score_mod is not None or spec.mask_mod is not None
    if spec.head_dim > 256:   # 32 keys for dropout's Philox words and a mod's state (wider spilled)
        return _widest_fitting(spec, (32,) if custom or spec.dropout else (64, 48, 32))
    if spec.head_dim == 128:
        block_n = 80 if custom else 112 if spec.dropout else 128 if spec.window or spec.alibi and spec.softcap else 176
    elif spec.head_dim == 192:
        block_n = 64 if custom else 112
    elif spec.head_dim == 256:
        block_n = 48 if custom or spec.dropout else 80
    else:
        block_n = 96 if custom else 128
    return _tiles(spec, block_n)


def _tiles(spec, block_n: int) -> Sm90Tiles:
    return Sm90Tiles(spec.head_dim, spec.head_dim_v or spec.head_dim, block_n=block_n, v_from_k=spec.v_from_k,
                     element_bytes=1 if spec.fp8 else 2)


def _decoding_block_n(spec) -> int:
    """A decoding spec's key tile: a power of two, so that it divides the usual pages (a paged
    cache's tile is then one TMA box; `page_box_rows`): 128 keys to d = 128, 64 to d = 256 (Q and
    two stages in 193 KiB), past it the widest that fits."""
    if spec.head_dim > 256:
        return _widest_fitting(spec, (64, 32)).block_n
    return 128 if spec.head_dim <= 128 else 64


def _widest_fitting(spec, widths) -> Sm90Tiles:
    """Past d = 256 Q alone takes 80-128 KiB (128 rows): the widest key tile of `widths` whose Q
    and two stages fit an sm_90 block's shared memory (64 keys at d = 320, 48 at 384, 32 at 448
    and 512, and at 576 with V from K). Its registers are never the limit: O is at most a
    256-column slice, as at d = 256, and S is narrower."""
    for block_n in widths:
        tiles = _tiles(spec, block_n)
        if tiles.fits:
            return tiles
    raise ValueError(f"head_dim={spec.head_dim}: no key tile of {widths} fits the sm90 forward's shared memory")


# The sm90 forward's key tiles a spec may set (Spec.sm90_block_n): whole 16-key k-steps of P V,
# at least two of them.
SM90_BLOCK_N_STEP = 16
SM90_MIN_BLOCK_N = 32


def sm80_backward_problem(spec) -> str | None:
    """Why `spec.sm80_backward` (set) asks for nothing it can have, or None: it gives an sm90
    training spec the sm80 family's backward (the self-test's gate sets it)."""
    if spec.arch_family != "sm90" or spec.kv_cache is not None:
        return (f"sm80_backward=True gives an sm90 training spec the sm80 family's backward: it needs "
                f"arch_family='sm90' and no kv_cache, got arch_family={spec.arch_family!r}, kv_cache={spec.kv_cache!r}")
    return None


def sm90_block_n_problem(spec) -> str | None:
    """Why `spec.sm90_block_n` (set) is not a key tile of its sm90 forward, or None."""
    block_n = spec.sm90_block_n
    if spec.arch_family != "sm90":
        return f"sm90_block_n sets the sm90 forward's key tile: it needs arch_family='sm90', got {spec.arch_family!r}"
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n % SM90_BLOCK_N_STEP \
            or not SM90_MIN_BLOCK_N <= block_n <= 256:
        return (f"sm90_block_n must be a multiple of {SM90_BLOCK_N_STEP} from {SM90_MIN_BLOCK_N} to 256, "
                f"got {block_n!r}")
    if spec.fp8 and block_n % SM90_FP8_KEY_STEP:
        return (f"sm90_block_n={block_n} in {spec.dtype}: the 8-bit forward's key tile is whole {SM90_FP8_KEY_STEP}-key "
                f"k-steps (V^T's boxes)")
    tiles = _tiles(spec, block_n)
    if not tiles.fits:
        return (f"sm90_block_n={block_n} at head_dim={spec.head_dim}: Q and two K/V stages need "
                f"{tiles.shared_bytes + SM90_STATIC_BYTES} bytes of shared memory, more than an sm_90 block's "
                f"{SM90_SHARED_BYTES}")
    return None


def narrower_sm90_tiles(spec) -> list[int]:
    """The sm90 forward's key tiles below `spec`'s, widest first (kernels.spill_free's candidates)."""
    step = SM90_FP8_KEY_STEP if spec.fp8 else SM90_BLOCK_N_STEP
    widest = sm90_tiles(spec).block_n - step
    return list(range(widest - widest % step, SM90_MIN_BLOCK_N - 1, -step))


@dataclass(frozen=True)
class Sm90BackwardTiles:
    """The sm90 backward's geometry (templates/sm90/hopper_bwd.cu.j2), FlashAttention-3's: a thread
    block per key block of `block_n` keys, 64 per consumer warpgroup, walking the query blocks of
    `block_m` rows that can see it through `stages` Q/dO stages; one producer warpgroup.
    `paired` (templates/sm90/hopper_bwd_paired.cu.j2; `sm90_backward_tiles` says for which specs:
    past d = 128 one warpgroup's dK and dV would take d registers a thread): two consumer
    warpgroups share the block's 64 keys, each computing S^T and dP^T for half the queries, and
    one accumulates dK, the other dV. `fp8_scores` (an 8-bit spec with an 8-bit dO, Spec.dout_dtype;
    unpaired only): S^T and dP^T by 8-bit wgmma from e4m3 K_j, V_j, Q_i and 8-bit dO_i, loaded beside
    the bf16 K_j, Q_i and dO_i that dQ's, dK's and dV's GEMMs read; V_j's bf16 tile gives way to the
    8-bit K_j and V_j (the same bytes), and one stage of 8-bit Q_i and dO_i (a bf16 Q tile's bytes)
    joins: two would not fit at d = 128 (242 KB) or, with the barriers, at d = 64."""

    head_dim: int
    block_m: int = 64
    block_n: int = 128
    stages: int = 2
    paired: bool = False
    head_dim_v: int | None = None   # V's, dO's and dV's (the paired form's), if not d
    fp8_scores: bool = False

    @property
    def consumers(self) -> int:
        return 2 if self.paired else self.block_n // 64

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    @property
    def shared_bytes(self) -> int:
        """K and V; Q_i and dO_i per stage; each consumer's dS^T (16-bit) and dQ partial (fp32);
        L_i and D_i per stage; and 1024 bytes to align the tiles to the 128B swizzle's period."""
        q_tile, k_tile = self.block_m * self.head_dim * 2, self.block_n * self.head_dim * 2
        per_consumer = 64 * self.block_m * 2 + self.block_m * self.head_dim * 4
        rows = self.stages * 2 * self.block_m * 4
        if self.paired:   # V and dO d_v wide; P^T's and dS^T's tiles, one dQ partial
            v_cols = self.head_dim_v or self.head_dim
            v_tile, do_tile = self.block_n * v_cols * 2, self.block_m * v_cols * 2
            return (1024 + k_tile + v_tile + self.stages * (q_tile + do_tile) + 2 * 64 * self.block_m * 2 + q_tile * 2
                    + rows)
        eight_bit_stage = q_tile if self.fp8_scores else 0   # 8-bit Q_i and dO_i: one stage
        return 1024 + 2 * k_tile + self.stages * 2 * q_tile + eight_bit_stage + self.consumers * per_consumer + rows


SM90_BACKWARD_HEAD_DIMS = (64, 128, 192, 256)


def sm90_backward_tiles(spec) -> Sm90BackwardTiles:
    """128-query blocks at d = 64 (FlashAttention-3's 128 x 128: wgmma's N of 128 halves each step's
    descriptors, barriers and stores per unit of tensor work), except where a thread's elements carry
    more than S^T and dP^T (dropout's keep bits, a score chain's derivative, a mask_mod's loads) or
    the registers run out; measured at 128 rows: dropout's keep words for 128 queries spill 8-28
    bytes, packed sequences 4 (outside the loop), a deterministic window's turn count 4 (in it).
    Those keep 64, as d = 128 does (its dK and dV hold 128 registers). Past d = 128 the paired form's
    64 x 64 tiles, with one stage of Q and dO where two do not fit (d = 256); where d_v != d; at
    d = 128 for what spilled beside its 128 registers of dK and dV: dropout's Philox rounds (140
    bytes), a mask_mod's loads (32-68), a natural-log chain's ds'/dx (160); and at d = 64 for a
    score_mod with a mask_mod (a relative bias over documents: 24 bytes)."""
    head_dim_v = spec.head_dim_v or spec.head_dim
    heavy = (spec.dropout or spec.mask_mod is not None or spec.score_mod is not None
             or bool(spec.softcap and spec.alibi))
    both_mods = spec.score_mod is not None and spec.mask_mod is not None
    if spec.head_dim > 128 or head_dim_v != spec.head_dim or (spec.head_dim == 128 and heavy) or both_mods:
        # two stages of Q and dO where they fit in 227 KB
        two = Sm90BackwardTiles(spec.head_dim, block_n=64, paired=True,
                                head_dim_v=None if head_dim_v == spec.head_dim else head_dim_v)
        return two if two.shared_bytes <= 227 * 1024 else replace(two, stages=1)
    lean = not (spec.dropout or spec.softcap or spec.alibi or spec.score_mod is not None or spec.mask_mod is not None
                or spec.varlen or (spec.deterministic and spec.window))
    return Sm90BackwardTiles(spec.head_dim, block_m=128 if spec.head_dim == 64 and lean else 64,
                             fp8_scores=spec.fp8 and spec.dout_dtype is not None)


def sm90_backward_refusal(spec) -> str | None:
    """Why the sm90 family's own backward does not take `spec` yet, naming the fields (the sm80
    family's backward then computes its gradients, as before it had one); None if it does.
    `Spec.sm80_backward` refuses it outright: the self-test's gate asks for sm80's where this
    one did not pass on the GPU."""
    if spec.sm80_backward:
        return "sm80_backward=True asks for the sm80 family's backward"
    if spec.head_dim not in SM90_BACKWARD_HEAD_DIMS:   # past 256: wgmma's N, dK's accumulator
        return f"the sm90 backward has no head_dim={spec.head_dim} yet (it has {SM90_BACKWARD_HEAD_DIMS})"
    return None


# A paged cache's keys reach the sm90 forward a TMA box per page: a whole tile where the pages
# hold whole tiles, else boxes of 16 rows (every page size fagen takes is a multiple of 16, and 16
# rows of 128 bytes keep the 128B swizzle's 1024-byte period): tensor_map.PageBox, KeySource.
PAGE_BOX_ROWS = 16


def page_box_rows(block_n: int, page_size: int) -> int:
    """The rows of a paged cache's TMA box for key tiles of `block_n` (the host's map and the
    kernel's loads agree on it)."""
    return block_n if page_size % block_n == 0 else PAGE_BOX_ROWS


@dataclass(frozen=True)
class Family:
    """A kernel family's facts below the Spec: what its validation, its compile and its launch need.
    Its passes (templates and kernels) are the kernels layer's: `fagen.kernels.families`."""

    name: str                   # Spec.arch_family's value, FAGEN_ARCH_FAMILY's, a name's suffix
    templates: str              # its folder under templates/ (the shared templates lie beside it)
    head_dims: tuple            # the head dims whose forward has tiles of its own (a head dim takes
                                # the first >= it: the self-test's templates by head dim)
    refusal: Callable           # spec -> why this family cannot render it (naming the field), or None
    shared_bytes: Callable      # spec -> its forward's dynamic shared memory per block
    key_tile: Callable          # spec -> its forward's keys per K/V tile (decoding's split-KV counts them)
    narrower: Callable          # spec -> makers of its forward's tiles with fewer registers a thread, in the
                                # order to try where a mod spills (kernels.spill_free); a maker may raise ValueError
    tiles_text: Callable        # spec -> its forward's tiles and the backward's key tile, as a log line says them
    arch: str | None = None     # the one arch whose hardware it needs (its shared memory, its
                                # instructions), or None: any from sm_80 on
    capability: tuple | None = None   # the compute capability it runs on alone (sm90: 9.0), or None: any
    tensor_maps: bool = False   # q, k and v reach its forward as TMA tensor maps, encoded at each launch
                                # from the tensors passed (so a view's shape and strides must be its own)
    target: str | None = None   # the arch-specific NVRTC target it compiles for, or None: the device's
    target_why: str = ""        # why that target alone (for plain sm_90, ptxas refuses wgmma, TMA, setmaxnreg)

    @property
    def arch_specific(self) -> bool:
        """Whether its kernels compile for an arch-specific NVRTC target (sm_XYa), not a portable one."""
        return self.target is not None


SM80_MAX_WARPS = 8


def _sm80_narrower(spec):
    """More warps over the same rows (fewer rows per warp, fewer accumulators per thread), then
    half the rows."""
    if spec.num_warps * 2 <= SM80_MAX_WARPS and spec.block_m >= 16 * spec.num_warps * 2:
        yield lambda: spec.replace(num_warps=spec.num_warps * 2)
    yield lambda: spec.replace(block_m=spec.block_m // 2)


def _sm90_narrower(spec):
    """Its warpgroups and rows are fixed: fewer keys per K/V tile (Spec.sm90_block_n), 16 at a time."""
    for block_n in narrower_sm90_tiles(spec):
        yield lambda block_n=block_n: spec.replace(sm90_block_n=block_n)


SM80 = Family("sm80", templates="sm80", head_dims=(64, 128, SPLIT_O_ABOVE, 512), refusal=sm80_refusal,
              shared_bytes=lambda spec: spec.shared_layout.total_bytes, key_tile=lambda spec: spec.block_n,
              narrower=_sm80_narrower,
              tiles_text=lambda spec: (f"block_m={spec.block_m}, block_n={spec.block_n}, num_warps={spec.num_warps}, "
                                       f"bwd_block_n={spec.bwd_block_n}"))
SM90 = Family("sm90", templates="sm90", head_dims=SM90_HEAD_DIMS, refusal=sm90_refusal,
              shared_bytes=lambda spec: sm90_tiles(spec).shared_bytes, key_tile=lambda spec: sm90_tiles(spec).block_n,
              narrower=_sm90_narrower,
              tiles_text=lambda spec: f"sm90_block_n={sm90_tiles(spec).block_n}, bwd_block_n={spec.bwd_block_n}",
              arch=SM90_ARCH, capability=(9, 0), tensor_maps=True, target="sm_90a",
              target_why="its wgmma, TMA and setmaxnreg exist on sm_90a alone")
# The family of the 8-bit forward (Spec.fp8): the one with e4m3 wgmma; the others refuse such specs.
FP8_FAMILY = SM90
# The registry: a new family is one line here (its passes are fagen/kernels/families/<name>.py, found by name).
FAMILIES = {family.name: family for family in (SM80, SM90)}
ARCH_FAMILIES = tuple(FAMILIES)
DEFAULT_FAMILY = SM80


def family_of(spec) -> Family:
    """The kernel family of `spec`'s forward (Spec.arch_family)."""
    return FAMILIES[spec.arch_family]


ARCH_FAMILY_ENV = "FAGEN_ARCH_FAMILY"


def chosen_family(spec, requested: str, capability: tuple[int, int] | None) -> str:
    """The family a call's forward runs on a device of compute `capability` (None: the CPU's
    emulator, which runs both): `requested` (FAGEN_ARCH_FAMILY: "sm80", "sm90", or "" for the
    default: the spec's own, which is sm80 unless `fagen tune` chose sm90 for this shape on this
    GPU) where the spec and the device allow it, else sm80.

    This rule alone never picks sm90 for an untuned spec: the self-test's gate
    (fagen.selftest.gate.serving_spec) does, on a compute capability 9.0 GPU whose self-test passed
    the templates the spec uses, so that no kernel serves a call on hardware it has not run on."""
    if requested not in ("", *ARCH_FAMILIES):
        raise ValueError(f"{ARCH_FAMILY_ENV}={requested!r}: expected one of {', '.join(ARCH_FAMILIES)}, or unset")
    wanted = FAMILIES[requested or spec.arch_family]
    if wanted.refusal(spec) is None and capability in (None, wanted.capability or capability):
        return wanted.name
    return DEFAULT_FAMILY.name


def chosen_decoding_spec(spec, requested: str, capability: tuple[int, int] | None):
    """A decoding step's `spec` in the family `chosen_family` picks for it. On sm90 the sm80
    family's tiles (Spec.for_kv_cache fits them to the page size and the GPU's shared memory)
    mean nothing to the forward, nor to the combine and the append: they go back to the defaults,
    so that one spec, and one name, serves every page size."""
    chosen = chosen_family(spec, requested, capability)
    if chosen == DEFAULT_FAMILY.name:
        return spec
    return spec.replace(arch_family=chosen, **default_tiles(spec.head_dim, spec.version))

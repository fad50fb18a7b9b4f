"""Kernel families: which machine instructions a Spec's forward kernel is built from.

  sm80   mma.sync tensor cores, cp.async copies, every warp alike (templates/fwd_v1, fwd_v2): runs on
         every GPU from sm_80 on, with every fagen feature. The default.
  sm90   Hopper's wgmma, TMA and mbarriers, warp-specialised after FlashAttention-3's design
         (templates/hopper_fwd.cu.j2): one producer warpgroup loads Q once and K/V tiles through a
         ring of shared-memory stages, two consumer warpgroups compute. Its cubins are
         arch-specific (sm_90a): they run on compute capability 9.0 only. So far a forward for
         plain, causal and windowed attention, with softcap, ALiBi, sinks, score_mod and mask_mod
         (captured tensors too), dropout, key padding, packed sequences, d_v != d, and decoding
         against a KV cache (contiguous or paged, split-KV, GQA packing); the backward stays the
         sm80 family's.

What the sm90 family does not take yet is refused by name (`sm90_refusal`), so that a Spec never
silently drops a feature. The geometry of its forward (`Sm90Tiles`) is computed here once, for
the Spec's checks, the kernel table and the template alike.

Imports nothing of the pipeline: the Spec's validation uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tile_shapes import default_tiles

ARCH_FAMILIES = ("sm80", "sm90")
SM90_HEAD_DIMS = (64, 128, 192, 256)
SM90_ARCH = "sm_90"   # the arch whose shared memory and register file the sm90 family is sized for

# The 128-byte swizzle row is 64 two-byte elements: a tile is stored as d / 64 boxes of 64 columns.
BOX_COLUMNS = 64
SWIZZLE_PERIOD = 1024   # bytes after which the 128B swizzle repeats: the tiles' alignment


def sm90_refusal(spec) -> str | None:
    """Why the sm90 family cannot render `spec`'s forward yet, naming the field; None if it can."""
    unsupported = [("version", spec.version != 2, "version=1 (FlashAttention-1 stays on the sm80 family)"),
                   ("head_dim", spec.head_dim not in SM90_HEAD_DIMS,
                    f"head_dim={spec.head_dim} (it has {', '.join(map(str, SM90_HEAD_DIMS))})"),
                   ("head_dim_v", (spec.head_dim_v or spec.head_dim) % BOX_COLUMNS,
                    f"head_dim_v={spec.head_dim_v} (a multiple of {BOX_COLUMNS})"),
                   ("kv_cache", spec.kv_cache is not None and spec.varlen,
                    f"kv_cache={spec.kv_cache!r} with varlen (packed queries over a paged cache)"),
                   ("v_from_k", spec.v_from_k, "v_from_k=True (absorbed MLA)")]
    found = [what for _, refused, what in unsupported if refused]
    if not found:
        return None
    return (f"arch_family='sm90' has no forward for {', '.join(found)} yet; use arch_family='sm80' (the "
            f"mma.sync kernels, every feature)")


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

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)   # the producer warpgroup, then the consumers

    @property
    def page_box_rows(self) -> int:
        """A paged cache's box where its pages do not hold whole tiles (`page_box_rows`)."""
        return PAGE_BOX_ROWS

    @property
    def boxes(self) -> int:
        """64-column boxes per row of a tile (a TMA box is one 128-byte swizzle row wide)."""
        return self.head_dim // BOX_COLUMNS

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: Q, then each stage's K and V (d and d_v wide), and the slack that
        aligns them to the swizzle's period."""
        stage = self.block_n * (self.head_dim + self.head_dim_v) * 2
        return SWIZZLE_PERIOD + self.block_m * self.head_dim * 2 + self.stages * stage


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
        return Sm90Tiles(spec.head_dim, spec.head_dim_v or spec.head_dim, block_n=spec.sm90_block_n)
    if spec.kv_cache is not None:   # decoding: a power of two, a paged cache's box per page where it divides them
        return Sm90Tiles(spec.head_dim, spec.head_dim_v or spec.head_dim, block_n=_decoding_block_n(spec))
    custom = spec.score_mod is not None or spec.mask_mod is not None
    if spec.head_dim == 128:
        block_n = 80 if custom else 112 if spec.dropout else 128 if spec.window or spec.alibi and spec.softcap else 176
    elif spec.head_dim == 192:
        block_n = 64 if custom else 112
    elif spec.head_dim == 256:
        block_n = 48 if custom or spec.dropout else 80
    else:
        block_n = 96 if custom else 128
    return Sm90Tiles(spec.head_dim, spec.head_dim_v or spec.head_dim, block_n=block_n)


def _decoding_block_n(spec) -> int:
    """A decoding spec's key tile: a power of two, so that it divides the usual pages (a paged
    cache's tile is then one TMA box; `page_box_rows`): 128 keys to d = 128, 64 past it (Q and two
    stages in 193 KiB at d = 256)."""
    return 128 if spec.head_dim <= 128 else 64


# The sm90 forward's key tiles a spec may set (Spec.sm90_block_n): whole 16-key k-steps of P V,
# at least two of them.
SM90_BLOCK_N_STEP = 16
SM90_MIN_BLOCK_N = 32


def sm90_block_n_problem(spec) -> str | None:
    """Why `spec.sm90_block_n` (set) is not a key tile of its sm90 forward, or None."""
    block_n = spec.sm90_block_n
    if spec.arch_family != "sm90":
        return f"sm90_block_n sets the sm90 forward's key tile: it needs arch_family='sm90', got {spec.arch_family!r}"
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n % SM90_BLOCK_N_STEP \
            or not SM90_MIN_BLOCK_N <= block_n <= 256:
        return (f"sm90_block_n must be a multiple of {SM90_BLOCK_N_STEP} from {SM90_MIN_BLOCK_N} to 256, "
                f"got {block_n!r}")
    return None


def narrower_sm90_tiles(spec) -> list[int]:
    """The sm90 forward's key tiles below `spec`'s, widest first (kernels.spill_free's candidates)."""
    widest = sm90_tiles(spec).block_n - SM90_BLOCK_N_STEP
    return list(range(widest - widest % SM90_BLOCK_N_STEP, SM90_MIN_BLOCK_N - 1, -SM90_BLOCK_N_STEP))


# A paged cache's keys reach the sm90 forward a TMA box per page: a whole tile where the pages
# hold whole tiles, else boxes of 16 rows (every page size fagen takes is a multiple of 16, and 16
# rows of 128 bytes keep the 128B swizzle's 1024-byte period): tensor_map.PageBox, KeySource.
PAGE_BOX_ROWS = 16


def page_box_rows(block_n: int, page_size: int) -> int:
    """The rows of a paged cache's TMA box for key tiles of `block_n` (the host's map and the
    kernel's loads agree on it)."""
    return block_n if page_size % block_n == 0 else PAGE_BOX_ROWS


ARCH_FAMILY_ENV = "FAGEN_ARCH_FAMILY"


def chosen_family(spec, requested: str, capability: tuple[int, int] | None) -> str:
    """The family a call's forward runs on a device of compute `capability` (None: the CPU's
    emulator, which runs both): `requested` (FAGEN_ARCH_FAMILY: "sm80", "sm90", or "" for the
    default: the spec's own, which is sm80 unless `fagen tune` chose sm90 for this shape on this
    GPU) where the spec and the device allow it, else sm80.

    The default is sm80 on every device, Hopper included, until the sm90 forward has passed the
    GPU check on one (benchmarks/gpu_check.sh): it is correct on the emulator and static checks
    only, and a kernel that hangs on hardware would hang a user's training step. A tuning result
    is the exception: the tuner checked that forward's output on the GPU before it timed it."""
    if requested not in ("", *ARCH_FAMILIES):
        raise ValueError(f"{ARCH_FAMILY_ENV}={requested!r}: expected one of {', '.join(ARCH_FAMILIES)}, or unset")
    wanted = requested or spec.arch_family
    if wanted == "sm90" and sm90_refusal(spec) is None and capability in (None, (9, 0)):
        return "sm90"
    return "sm80"


def chosen_decoding_spec(spec, requested: str, capability: tuple[int, int] | None):
    """A decoding step's `spec` in the family `chosen_family` picks for it. On sm90 the sm80
    family's tiles (Spec.for_kv_cache fits them to the page size and the GPU's shared memory)
    mean nothing to the forward, nor to the combine and the append: they go back to the defaults,
    so that one spec, and one name, serves every page size."""
    if chosen_family(spec, requested, capability) != "sm90":
        return spec
    return spec.replace(arch_family="sm90", **default_tiles(spec.head_dim, spec.version))

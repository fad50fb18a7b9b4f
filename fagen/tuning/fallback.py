"""The tiles used when nothing is tuned: a table by arch class (shared memory per block) and head dim.

`fagen.tile_shapes.default_tiles(head_dim, version)` is the arch-independent base;
it is sized for sm_80 (A100-class: 164 KB of shared memory per block). The
table here only records where another arch class needs or wants something
else, so a change to the base carries over to every arch. (An arch class is
not a kernel family, fagen.arch_families: it sizes the sm80 family's tiles.)
"""

from __future__ import annotations

from ..arch import SMEM_LIMIT_BYTES, base_arch
from ..spec import Spec
from ..tile_shapes import default_tiles

# Arch -> class, named by its per-block shared-memory budget, which is what decides which tiles fit.
SMEM_163K, SMEM_99K, SMEM_227K = "smem_163k", "smem_99k", "smem_227k"
ARCH_CLASSES = {
    "sm_80": SMEM_163K, "sm_87": SMEM_163K,
    "sm_86": SMEM_99K, "sm_88": SMEM_99K, "sm_89": SMEM_99K, "sm_120": SMEM_99K, "sm_121": SMEM_99K,
    "sm_90": SMEM_227K, "sm_90a": SMEM_227K, "sm_100": SMEM_227K, "sm_101": SMEM_227K, "sm_103": SMEM_227K,
    "sm_110": SMEM_227K,
}
DEFAULT_ARCH = "sm_80"
HEAD_DIM_BUCKETS = (64, 128, 256, 512)   # a head dim falls in the first bucket >= it

# (arch class, head-dim bucket) -> overrides of default_tiles. Tests check that
# every entry builds a legal Spec that fits every arch of its class.
FALLBACK_OVERRIDES: dict[tuple[str, int], dict] = {
    # The base d=128 tiles (128 x 64, two K/V stages) need 104448 bytes; 99 KB
    # parts take half-height K/V tiles instead. (Their backward, 158720 bytes
    # with 128 keys and two Q/dO stages, is fitted separately: `fit_backward_to`.)
    (SMEM_99K, 128): {"block_n": 32},
    # Hopper has 227 KB per block: a third K/V stage hides more load latency
    # and changes no register use.
    (SMEM_227K, 64): {"num_stages": 3},
    # ... or, at d=128, whole 128-key K/V tiles in two stages (174 KB, spill-free):
    # 2.47 non-matmul instructions per useful mma against 3.07 for 128 x 64, the
    # machine-code sweep of benchmarks/sass_tile_sweep.py (benchmarks/RESULTS.md).
    (SMEM_227K, 128): {"block_n": 128},
    (SMEM_227K, 256): {"num_stages": 3},
    # Past d = 256 (eight warps, pairs splitting O's columns; one K/V stage: 133 KB at d = 512):
    # 99 KB parts take 32 x 16 tiles on four warps (67 KB), Hopper a second K/V stage (200 KB).
    (SMEM_99K, 512): {"block_m": 32, "block_n": 16, "num_warps": 4},
    (SMEM_227K, 512): {"num_stages": 2},
}


def arch_class(arch: str, shared_per_block_optin: int | None = None) -> str:
    """The class of `arch`; an arch fagen does not list is placed by its shared memory."""
    if base_arch(arch) in ARCH_CLASSES:
        return ARCH_CLASSES[base_arch(arch)]
    shared = shared_per_block_optin
    if shared is None:
        return ARCH_CLASSES[DEFAULT_ARCH]
    if shared >= SMEM_LIMIT_BYTES["sm_90"]:
        return SMEM_227K
    if shared >= SMEM_LIMIT_BYTES["sm_80"]:
        return SMEM_163K
    return SMEM_99K


def head_dim_bucket(head_dim: int) -> int:
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim {head_dim} is above the largest bucket {HEAD_DIM_BUCKETS[-1]}")


def fallback_tiles(head_dim: int, version: int = 2, arch: str = DEFAULT_ARCH,
                   shared_per_block_optin: int | None = None) -> dict:
    """block_m, block_n, num_warps, num_stages for an untuned (head dim, arch)."""
    tiles = dict(default_tiles(head_dim, version))
    tiles.update(FALLBACK_OVERRIDES.get((arch_class(arch, shared_per_block_optin),
                                         head_dim_bucket(head_dim)), {}))
    return tiles


def fallback_spec(spec: Spec, arch: str = DEFAULT_ARCH, shared_per_block_optin: int | None = None) -> Spec:
    """`spec` with the fallback tiles for `arch`.

    If the table's forward tiles do not fit this arch's shared memory (a
    stale entry, or a device that reports less than its arch allows), the
    arch-independent base is used: a wrong guess here must cost speed, not
    a failed launch. The backward kernels' tiles do not depend on these; their
    pipeline is then made shallow enough for the arch (`fit_backward_to`).
    """
    limit = _shared_limit(arch, shared_per_block_optin)
    tiles = fallback_tiles(spec.head_dim, spec.version, arch, shared_per_block_optin)
    try:
        candidate = spec.replace(**tiles)
    except ValueError:
        candidate = None
    if candidate is None or (limit is not None and candidate.shared_layout.total_bytes > limit):
        candidate = spec.replace(**default_tiles(spec.head_dim, spec.version))
    return fit_backward_to(candidate, arch, shared_per_block_optin)


def fit_backward_to(spec: Spec, arch: str, shared_per_block_optin: int | None = None) -> Spec:
    """`spec` with its backward pipeline (`bwd_stages`) made shallow enough for `arch`.

    At 64 < d <= 128 the backward's 128-key tile with two Q/dO stages needs
    158720 bytes; the 99 KB parts (sm_86/89/120) train with 64 keys and one
    stage (`Spec.fit_backward`). Applied to tuned specs too: tuning times the
    forward tiles only.
    """
    limit = _shared_limit(arch, shared_per_block_optin)
    return spec if limit is None else spec.fit_backward(limit)


def _shared_limit(arch: str, shared_per_block_optin: int | None) -> int | None:
    return shared_per_block_optin if shared_per_block_optin is not None else SMEM_LIMIT_BYTES.get(base_arch(arch))

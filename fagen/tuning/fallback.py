"""The tiles used when nothing is tuned: a table by arch family and head dim.

`fagen.tile_shapes.default_tiles(head_dim, version)` is the arch-independent base;
it is sized for sm_80 (A100-class: 164 KB of shared memory per block). The
table here only records where another arch family needs or wants something
else, so a change to the base carries over to every arch.
"""

from __future__ import annotations

from ..arch import SMEM_LIMIT_BYTES, base_arch
from ..spec import Spec
from ..tile_shapes import default_tiles

# Arch -> family. Members of a family share a per-block shared-memory budget,
# which is what decides which tiles fit.
ARCH_FAMILIES = {
    "sm_80": "sm80", "sm_87": "sm80",                                        # 163 KB per block
    "sm_86": "sm86", "sm_88": "sm86", "sm_89": "sm86", "sm_120": "sm86",     # 99 KB per block
    "sm_121": "sm86",
    "sm_90": "sm90", "sm_90a": "sm90", "sm_100": "sm90", "sm_101": "sm90",   # 227 KB per block
    "sm_103": "sm90", "sm_110": "sm90",
}
DEFAULT_ARCH = "sm_80"
HEAD_DIM_BUCKETS = (64, 128, 256, 512)   # a head dim falls in the first bucket >= it

# (family, head-dim bucket) -> overrides of default_tiles. Tests check that
# every entry builds a legal Spec that fits every arch of its family.
FALLBACK_OVERRIDES: dict[tuple[str, int], dict] = {
    # The base d=128 tiles (128 x 64, two K/V stages) need 104448 bytes; 99 KB
    # parts take half-height K/V tiles instead. (Their backward, 158720 bytes
    # with 128 keys and two Q/dO stages, is fitted separately: `fit_backward_to`.)
    ("sm86", 128): {"block_n": 32},
    # Hopper has 227 KB per block: a third K/V stage hides more load latency
    # and changes no register use.
    ("sm90", 64): {"num_stages": 3},
    # ... or, at d=128, whole 128-key K/V tiles in two stages (174 KB, spill-free):
    # 2.47 non-matmul instructions per useful mma against 3.07 for 128 x 64, the
    # machine-code sweep of benchmarks/sass_tile_sweep.py (benchmarks/RESULTS.md).
    ("sm90", 128): {"block_n": 128},
    ("sm90", 256): {"num_stages": 3},
    # Past d = 256 (eight warps, pairs splitting O's columns; one K/V stage: 133 KB at d = 512):
    # 99 KB parts take 32 x 16 tiles on four warps (67 KB), Hopper a second K/V stage (200 KB).
    ("sm86", 512): {"block_m": 32, "block_n": 16, "num_warps": 4},
    ("sm90", 512): {"num_stages": 2},
}


def arch_family(arch: str, shared_per_block_optin: int | None = None) -> str:
    """The family of `arch`; an arch fagen does not list is placed by its shared memory."""
    if base_arch(arch) in ARCH_FAMILIES:
        return ARCH_FAMILIES[base_arch(arch)]
    shared = shared_per_block_optin
    if shared is None:
        return ARCH_FAMILIES[DEFAULT_ARCH]
    if shared >= SMEM_LIMIT_BYTES["sm_90"]:
        return "sm90"
    if shared >= SMEM_LIMIT_BYTES["sm_80"]:
        return "sm80"
    return "sm86"


def head_dim_bucket(head_dim: int) -> int:
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim {head_dim} is above the largest bucket {HEAD_DIM_BUCKETS[-1]}")


def fallback_tiles(head_dim: int, version: int = 2, arch: str = DEFAULT_ARCH,
                   shared_per_block_optin: int | None = None) -> dict:
    """block_m, block_n, num_warps, num_stages for an untuned (head dim, arch)."""
    tiles = dict(default_tiles(head_dim, version))
    tiles.update(FALLBACK_OVERRIDES.get((arch_family(arch, shared_per_block_optin),
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

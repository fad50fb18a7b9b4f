"""The ring section's sizes, layouts and links (RingConfig), its forecast, and the overlap model's
arithmetic.

Pure data and arithmetic (no torch): the plan, its text and the CPU tests use it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sizes import short_seqlen

# Kernel calls of the one ring step at world 1 (causal); the dry run checks these against
# fagen.distributed's step_blocks. zigzag: chunks 0 and 1 against themselves, the causal
# halves (0, 0) and (1, 1) and the full block (1, 0); contiguous: the causal whole.
PAIRS_AT_WORLD_ONE = {"zigzag": 3, "contiguous": 1}
BF16_ROUNDING = 2.0 ** -7   # the spacing of bf16 values in [1, 2): one rounding of a value below 2
ROUNDINGS_ALLOWED = 2


@dataclass(frozen=True)
class RingConfig:
    """The ring section: fagen.distributed.ring_attention in a world-1 process group (every chunk
    pair of the one step on this GPU, no communication) against fagen.flash_attn_func, and a
    model, not a measurement, of the transfer/compute overlap of a zigzag ring at `model_worlds`
    ranks over the `links` (name, GB/s per direction: assumptions from the vendors' specs)."""

    dtype: str = "bf16"
    batch: int = 1
    seqlen: int = 16384
    heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    causal: bool = True
    layouts: tuple = ("zigzag", "contiguous")
    model_worlds: tuple = (2, 4, 8)
    links: tuple = (("NVLink 4", 450.0), ("IB NDR", 50.0))
    cap_s: float = 20.0

    @property
    def enabled(self) -> bool:
        return bool(self.layouts)

    @property
    def label(self) -> str:
        return (f"{self.dtype} B={self.batch} N={short_seqlen(self.seqlen)} H={self.heads} Hk={self.kv_heads} "
                f"d={self.head_dim} {'causal' if self.causal else 'non-causal'}")

    def chunk(self, world: int) -> int:
        """A zigzag chunk's length at `world` ranks (2 W chunks)."""
        return self.seqlen // (2 * world)

    def kv_bytes(self, world: int) -> int:
        """One ring step's transfer: the K and V block of one rank, B (N / W) Hk d at 2 bytes."""
        return 2 * self.batch * (self.seqlen // world) * self.kv_heads * self.head_dim * 2

    def timed_runs(self) -> int:
        """The plain op once; per layout the ring and each pair kernel; one full pair per modelled world."""
        return 1 + sum(1 + PAIRS_AT_WORLD_ONE.get(layout, 1) for layout in self.layouts) + len(self.model_worlds)

    def estimate_seconds(self) -> float:
        """About 2 s for the process group, the inputs and the equality checks, and 0.3 s per
        measurement (a warm-up, a sizing call and up to 20 calls of 0.1-5 ms), within the cap."""
        return min(self.cap_s, 2.0 + 0.3 * self.timed_runs()) if self.enabled else 0.0


def overlap_row(world: int, pair_equivalents: float, pair_ms: float, kv_bytes: int, links) -> dict:
    """The model at one world size: compute per step = the step's pairs (in full c x c blocks)
    x one full pair's measured time; transfer per step = the K/V block over each link; overlap =
    min(1, compute / transfer), the share of the transfer hidden under the step's kernels."""
    compute_ms = pair_equivalents * pair_ms
    row = {"world": world, "pair_equivalents": pair_equivalents, "pair_ms": pair_ms, "compute_ms": compute_ms,
           "kv_bytes": kv_bytes, "links": {}}
    for name, gb_per_s in links:
        transfer_ms = kv_bytes / (gb_per_s * 1e9) * 1e3
        row["links"][name] = {"gb_per_s": gb_per_s, "transfer_ms": transfer_ms,
                              "overlap": min(1.0, compute_ms / transfer_ms)}
    return row


def equality_tolerance(max_magnitude: float) -> float:
    """Two bf16 roundings of the output's largest magnitude."""
    return ROUNDINGS_ALLOWED * BF16_ROUNDING * max_magnitude

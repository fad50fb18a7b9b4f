"""The variants section's cases, systems and sizes (VariantsConfig), and its forecast.

Pure data and arithmetic (no torch): the plan, its text and the CPU tests use it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..flops import attention_flops
from ..sizes import random_lengths, short_seqlen
from ..speed.config import SYSTEM_LABELS, SYSTEM_SHORT, timed_passes

# The variants section: fagen with a mod against FlexAttention with the same mod, and
# against plain causal attention (fagen's own and SDPA's flash backend, measured once).
VARIANT_CASES = ("window", "softcap", "alibi", "document")
VARIANT_SYSTEMS = ("fagen_v2", "fagen_sm90", "flex", "sdpa_flash", "fagen_v2_nomod")
# fagen's systems with the mod, each variant sanity-checked before it is timed: fagen v2, and v2 on
# the sm90 family (its own forward and backward; compute capability 9.0).
FAGEN_VARIANT_SYSTEMS = ("fagen_v2", "fagen_sm90")
# The systems of a variant row that run without the mod (plain causal attention).
NO_MOD_SYSTEMS = ("sdpa_flash", "fagen_v2_nomod")
# The sweep's labels, and fagen v2 without the mod beside fagen v2 with it.
VARIANT_LABELS = {**SYSTEM_LABELS, "fagen_v2_nomod": "fagen v2 (no mod)"}
VARIANT_SHORT = {**SYSTEM_SHORT, "fagen_v2_nomod": "v2nm"}


@dataclass(frozen=True)
class VariantsConfig:
    """The variants section: one point (the sweep's longest: N = 16k, B = 1, H = 16), causal,
    each variant timed in fagen, in FlexAttention with the same mod, and set against plain
    causal attention. FLOPs are counted as for causal attention whatever the mod hides (the
    sweep's count), so a mask that hides more keys shows as a higher rate; `visible` says
    how many keys each variant leaves."""

    dtype: str = "bf16"
    head_dim: int = 128
    heads: int = 16
    batch: int = 1
    seqlen: int = 16384
    causal: bool = True
    passes: tuple = ("fwd", "fwd_bwd")
    cases: tuple = VARIANT_CASES
    systems: tuple = VARIANT_SYSTEMS
    window: int = 4096          # window_size=(window, 0)
    softcap: float = 50.0
    documents: int = 8          # the document mask's documents, of random lengths
    seed: int = 0               # their lengths' seed
    # The section's cap, and the part of it FlexAttention's compiles (one per mod, forward
    # and backward) may spend; Flex cases past it are skipped with a note.
    cap_s: float = 60.0
    flex_allowance_s: float = 45.0

    @property
    def label(self) -> str:
        return (f"{self.dtype} d={self.head_dim} {'causal' if self.causal else 'non-causal'} "
                f"N={short_seqlen(self.seqlen)} B={self.batch} H={self.heads}")

    def case_label(self, case: str) -> str:
        return {"window": f"sliding window {self.window}", "softcap": f"softcap {self.softcap:g}",
                "alibi": "ALiBi", "document": f"document mask ({self.documents} docs)"}[case]

    def flops(self, pass_: str) -> float:
        return attention_flops(pass_, batch=self.batch, heads=self.heads, seqlen=self.seqlen,
                               head_dim=self.head_dim, causal=self.causal)

    def document_lengths(self, seqlen: int | None = None) -> list[int]:
        """Lengths of the document mask's documents: `documents` of them, random (seeded)
        between 1/4 and 7/4 of the mean, summing to `seqlen`."""
        return random_lengths(self.seqlen if seqlen is None else seqlen, self.documents, self.seed)

    def window_for(self, seqlen: int) -> int:
        """The window at `seqlen`: the plan's, or a quarter of a short sequence (sanity checks)."""
        return self.window if seqlen >= 4 * self.window else max(1, seqlen // 4)

    def visible_pairs(self, case: str, seqlen: int | None = None) -> int:
        """(query, key) pairs a variant leaves visible per (batch, head), causal included."""
        n = self.seqlen if seqlen is None else seqlen
        causal = n * (n + 1) // 2 if self.causal else n * n
        if case == "window":
            w = min(self.window_for(n), n - 1)
            return w * (w + 1) // 2 + (n - w) * (w + 1) if self.causal else causal
        if case == "document":
            lengths = self.document_lengths(n)
            return sum(L * (L + 1) // 2 if self.causal else L * L for L in lengths)
        return causal

    def timed_runs(self) -> int:
        """Measurements: each case with its mod (fagen, Flex; a forward-only system its forward),
        plus the no-mod peers once."""
        with_mod = [s for s in self.systems if s not in NO_MOD_SYSTEMS]
        no_mod = [s for s in self.systems if s in NO_MOD_SYSTEMS]
        per_case = sum(len(timed_passes(s, self.passes)) for s in with_mod)
        return len(self.cases) * per_case + (len(self.passes) * len(no_mod) if self.cases else 0)

    def fagen_systems(self) -> list[str]:
        """The plan's fagen systems with the mod (FAGEN_VARIANT_SYSTEMS)."""
        return [s for s in FAGEN_VARIANT_SYSTEMS if s in self.systems]

    def estimate_seconds(self) -> float:
        """About 0.5 s per 16k measurement (warm-up, sizing call, 3 repeats of 10-100 ms),
        a sanity check per case and fagen system, a block mask per case, and Flex's compiles
        (about 20 s per mod, forward and backward), capped by its allowance and by the section's cap."""
        if not self.cases:
            return 0.0
        flex = min(self.flex_allowance_s, 20.0 * len(self.cases)) if "flex" in self.systems else 0.0
        checks = 1.5 * len(self.cases) * max(1, len(self.fagen_systems()))
        return min(self.cap_s, 0.5 * self.timed_runs() + checks + flex)

    def fagen_kernels(self) -> int:
        """Distinct fagen kernels the section compiles (one per case and fagen system; its no-mod
        peer is the sweep's causal kernel)."""
        return len(self.cases) * len(self.fagen_systems())

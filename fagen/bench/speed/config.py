"""The speed section's systems, labels and panels, and its forecast.

Pure data and arithmetic (no torch). Sizes follow the FlashAttention-2 paper's benchmark:
sequence lengths 512 to 16k with the batch set so that every batch holds 16k tokens, hidden
size 2048, head dim 64 or 128 (so 32 or 16 heads). Every point therefore moves the same amount
of Q/K/V (64 MiB per tensor in 16-bit types, above the H200's 60 MB L2, so back-to-back
repeats do not time the cache), while the FLOPs grow with N. Those sizes are the Plan's own
fields (plan.Plan: dtypes, head_dims, causal, seqlens, tokens_per_batch, hidden_dim).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...arch_families import SM90
# Every system the speed sweep knows, in table order. fagen first, then the
# peers (PyTorch's scaled_dot_product_attention pinned to one backend each,
# then FlexAttention). fagen_sm90 is fagen v2 on the Hopper family (FAGEN_ARCH_FAMILY=sm90,
# sm_90a: wgmma, TMA; its own backward where sm90_backward_refusal lets a spec through), on
# compute capability 9.0 only.
SYSTEMS = ("fagen_v2", "fagen_sm90", "fagen_v1", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math",
           "flex")
FAGEN_SYSTEMS = ("fagen_v2", "fagen_sm90", "fagen_v1")
# Systems timed forward only, each with why (its other cells say so). None now: fagen_sm90 was,
# while its backward was the sm80 family's; the fp8 forward will be, until its backward lands.
FORWARD_ONLY: dict[str, str] = {}


def timed_passes(system: str, passes: tuple) -> tuple:
    """The passes of `passes` that `system` is timed in: a forward-only system's forward alone."""
    return tuple(p for p in passes if p == "fwd" or system not in FORWARD_ONLY)


def skipped_cells(system: str, passes: tuple, reason: str) -> dict:
    """{pass: cell} of a system not timed at a point for `reason`; a forward-only system's
    other passes say why they never run."""
    timed = timed_passes(system, passes)
    return {p: {"skipped": reason if p in timed else FORWARD_ONLY[system]} for p in passes}
SYSTEM_LABELS = {
    "fagen_v2": "fagen v2", "fagen_sm90": "fagen sm90", "fagen_v1": "fagen v1", "sdpa_flash": "SDPA flash",
    "sdpa_cudnn": "SDPA cuDNN", "sdpa_efficient": "SDPA efficient", "sdpa_math": "SDPA math",
    "flex": "FlexAttention",
}
# Column headings of the printed table (kept narrow so the whole table fits in
# the last 12,000 characters of output the device tool returns).
SYSTEM_SHORT = {
    "fagen_v2": "v2", "fagen_sm90": SM90.name, "fagen_v1": "v1", "sdpa_flash": "flsh", "sdpa_cudnn": "cdnn",
    "sdpa_efficient": "eff", "sdpa_math": "math", "flex": "flex",
}
# The short table's column headings: at most 3 characters, as its columns are 4 wide (the full
# plan's table, every system a column, must fit the device tool's returned output).
COLUMN_SHORT = {
    "fagen_v2": "v2", "fagen_sm90": "s90", "fagen_v1": "v1", "sdpa_flash": "fla", "sdpa_cudnn": "cdn",
    "sdpa_efficient": "eff", "sdpa_math": "mth", "flex": "flx",
}
PASS_LABELS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}


@dataclass(frozen=True)
class SpeedConfig:
    """One panel of the speed plots: all passes and sequence lengths share it."""

    dtype: str
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        return f"{self.dtype} d={self.head_dim} {'causal' if self.causal else 'non-causal'}"


def estimate_seconds(plan) -> float:
    """The sweep without its guard: about 0.12 s per measurement (warm-up, 3-20 repeats of up to
    ~30 ms, synchronisation), plus FlexAttention's compiles (about 20 s per panel, within its
    allowance)."""
    flex_panels = len(plan.configs()) if "flex" in plan.systems else 0
    return 0.12 * plan.timed_runs() + min(plan.flex_allowance_s, 20.0 * flex_panels)

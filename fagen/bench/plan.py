"""What the GPU check runs: the sections in order, each section's config, and the whole run's
budget and caps (plan.Plan).

Each section's config (its dataclass, sizes and forecast) lives with the section: the speed sweep's
systems and panels in speed/config.py (its sizes are the Plan's own fields below), VariantsConfig in
variants/config.py, DecodeConfig in decode/config.py, ModelsConfig in models/config.py, RingConfig in
ring/config.py, MemoryConfig in memory.py. This module only puts them together, with the caps the time guard
keeps for each section (schedule.py) and the counts that cross sections (which kernels the sweep
compiles already). Pure data and arithmetic (no torch), so `--dry-run` and the CPU tests can print
and check the plan on any machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .decode.config import DecodeConfig
from .flops import PASSES, attention_flops
from .memory import MemoryConfig
from .models.config import ModelsConfig
from .ring.config import RingConfig
from .speed.config import FAGEN_SYSTEMS, SYSTEMS, SpeedConfig, timed_passes
from .variants.config import VariantsConfig

# Sections in the order they run. Correctness first: a fast wrong kernel is
# worth nothing, and a kernel that faults shows up there, in a subprocess,
# before it can take down the sweep's CUDA context; the self-test (`fagen
# selftest`, what a user's first call runs) first of all that launches the
# sm90 family, as it is on a user's GPU. The sanitizers (also
# subprocesses, with fixed caps) run before the sweep, so the sweep can use
# every second they leave over; memory last, since it pushes the allocator
# to out-of-memory on purpose.
SECTIONS = ("setup", "precompile", "peak", "selftest", "correctness", "sanitizers", "speed", "variants", "decode",
            "models", "ring", "memory", "report")
OPTIONAL_SECTIONS = ("precompile", "peak", "selftest", "correctness", "sanitizers", "speed", "variants", "decode",
                     "models", "ring", "memory")


@dataclass(frozen=True)
class Plan:
    name: str = "full"
    # The speed sweep's sizes (speed/config.py): the FlashAttention-2 paper's.
    dtypes: tuple = ("bf16", "fp16")
    head_dims: tuple = (128, 64)
    causal: tuple = (False, True)
    seqlens: tuple = (512, 1024, 2048, 4096, 8192, 16384)
    tokens_per_batch: int = 16384
    hidden_dim: int = 2048
    passes: tuple = PASSES
    systems: tuple = SYSTEMS
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    variants: VariantsConfig = field(default_factory=VariantsConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    # The ring's cap: twice its 5 s forecast, less the second the decode section's sm90 MLA rows took.
    ring: RingConfig = field(default_factory=lambda: RingConfig(cap_s=9.0))
    # The whole run's budget. The shell wrapper kills at 460 s; this leaves time to start
    # Python before the budget's clock starts and to write the report after the last section.
    budget_s: float = 420.0
    # What each section may take (schedule.caps), kept back for it by the sections before it;
    # together at most the budget, compute-sanitizer's two runs included (schedule.fits). The
    # speed sweep has a floor instead: it takes what the others leave, at least min_speed_s.
    # Setup (torch, the CUDA context, nvidia-smi) and peak run unguarded; report writes files.
    # The self-test's 40 s came from the caps with the most room over their forecasts (in
    # seconds: precompile 30 -> 25 over its 18, correctness 90 -> 80 over its 60, each
    # sanitizer run 30 -> 25, whose forecast is 70% of it) and from the sweep's floor (50 -> 35;
    # the sweep takes what the others leave, about 85 s here): the sections after the sweep
    # keep theirs, which their forecasts fill.
    setup_reserve_s: float = 15.0
    precompile_cap_s: float = 25.0
    peak_reserve_s: float = 5.0
    selftest_cap_s: float = 40.0
    correctness_cap_s: float = 80.0
    sanitizer_cap_s: float = 25.0  # each of memcheck and racecheck
    min_speed_s: float = 35.0
    memory_cap_s: float = 20.0
    report_reserve_s: float = 10.0
    # FlexAttention compiles with Inductor (tens of seconds per graph); it may
    # spend at most this much of the sweep, then its remaining points are
    # skipped with a note rather than starving every other system. (The
    # variants section has its own allowance, `variants.flex_allowance_s`.)
    flex_allowance_s: float = 60.0
    # Timing: per measurement, repeat until about target_ms of GPU time.
    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 20
    target_ms: float = 30.0
    # (batch, seqlen, heads) of the small problem on which each timed fagen
    # kernel is checked against fp32 torch before its numbers are trusted.
    sanity_shape: tuple = (2, 256, 4)

    # -- the speed sweep's points ------------------------------------------------------------
    def configs(self) -> list[SpeedConfig]:
        """Panels in priority order: if the time guard cuts the sweep, the
        last ones (fp16, d=64) are the ones lost."""
        return [SpeedConfig(dtype, d, causal)
                for dtype in self.dtypes for d in self.head_dims for causal in self.causal]

    def batch(self, seqlen: int) -> int:
        return max(1, self.tokens_per_batch // seqlen)

    def heads(self, head_dim: int) -> int:
        return self.hidden_dim // head_dim

    def flops(self, pass_: str, config: SpeedConfig, seqlen: int) -> float:
        return attention_flops(pass_, batch=self.batch(seqlen), heads=self.heads(config.head_dim),
                               seqlen=seqlen, head_dim=config.head_dim, causal=config.causal)

    def timed_runs(self) -> int:
        """Measurements in the speed sweep: configs x seqlens x passes x systems (a forward-only
        system's forward alone)."""
        per_point = sum(len(timed_passes(s, self.passes)) for s in self.systems)
        return len(self.configs()) * len(self.seqlens) * per_point

    # -- kernels to compile, across sections (the precompile forecast) -------------------------
    def sweep_kernels(self) -> int:
        """Distinct fagen kernels the speed sweep compiles (one source per system, dtype, d and mask)."""
        versions = sum(1 for s in self.systems if s in FAGEN_SYSTEMS)
        return versions * len(self.dtypes) * len(self.head_dims) * len(self.causal)

    def sweep_compiles_causal(self, dtype: str, head_dim: int) -> bool:
        """Whether the sweep's kernels include fagen v2's plain causal one at this dtype and d."""
        return ("fagen_v2" in self.systems and dtype in self.dtypes and head_dim in self.head_dims
                and True in self.causal)

    def variant_kernels(self) -> int:
        return self.variants.fagen_kernels()

    def decode_kernels(self) -> int:
        return self.decode.fagen_kernels(self.sweep_compiles_causal(self.decode.dtype, self.decode.head_dim))

    def models_kernels(self) -> int:
        return self.models.fagen_kernels(self.sweep_compiles_causal(self.models.dtype, self.models.head_dim))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def full_plan() -> Plan:
    return Plan()


def quick_plan() -> Plan:
    """A ~5 minute subset: bf16, d=128, three sequence lengths, small memory sweep. Its reserves
    fill its 290 s budget (schedule.caps), compute-sanitizer's two runs included."""
    # The self-test is the full plan's (every template of both families): its 40 s came from
    # precompile (30 -> 20 over its 15), correctness (70 -> 65 over its 60), each sanitizer run
    # (25 -> 18) and the sweep's floor (30 -> 20).
    return Plan(name="quick", dtypes=("bf16",), head_dims=(128,), seqlens=(1024, 4096, 16384),
                memory=MemoryConfig(seqlens=(4096, 16384, 65536)), budget_s=290.0,
                precompile_cap_s=20.0, correctness_cap_s=65.0, sanitizer_cap_s=18.0, min_speed_s=20.0,
                memory_cap_s=15.0, flex_allowance_s=45.0,
                # One score mod and one mask mod; Flex compiles the first of them.
                variants=VariantsConfig(cases=("softcap", "document"), cap_s=30.0, flex_allowance_s=20.0),
                # No Flex compile, and of SDPA only its flash backend (the fastest peer).
                decode=DecodeConfig(decode_systems=("fagen", "fagen_paged", "sdpa_flash"), cap_s=10.0,
                                    mla_systems=("fagen_mla", "sdpa"), mla_batches=(1,)),
                # The training row against SDPA only: no Flex compile, no generate.
                models=ModelsConfig(train_systems=("fagen", "sdpa"), decode_systems=(), cap_s=15.0))


def plan_named(name: str) -> Plan:
    return {"full": full_plan, "quick": quick_plan}[name]()

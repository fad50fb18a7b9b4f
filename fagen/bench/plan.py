"""What the GPU check runs: sections, sizes, systems, and a time estimate.

Pure data and arithmetic (no torch), so `--dry-run` and the CPU tests can
print and check the plan on any machine.

Sizes follow the FlashAttention-2 paper's benchmark: sequence lengths 512 to
16k with the batch set so that every batch holds 16k tokens, hidden size 2048,
head dim 64 or 128 (so 32 or 16 heads). Every point therefore moves the same
amount of Q/K/V (64 MiB per tensor in 16-bit types, above the H200's 60 MB L2,
so back-to-back repeats do not time the cache), while the FLOPs grow with N.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .flops import PASSES, attention_flops
from .ring_report import RingConfig

# Every system the speed sweep knows, in table order. fagen first, then the
# peers (PyTorch's scaled_dot_product_attention pinned to one backend each,
# then FlexAttention).
SYSTEMS = ("fagen_v2", "fagen_v1", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math",
           "flex")
FAGEN_SYSTEMS = ("fagen_v2", "fagen_v1")
SYSTEM_LABELS = {
    "fagen_v2": "fagen v2", "fagen_v1": "fagen v1", "sdpa_flash": "SDPA flash",
    "sdpa_cudnn": "SDPA cuDNN", "sdpa_efficient": "SDPA efficient", "sdpa_math": "SDPA math",
    "flex": "FlexAttention",
}
# Column headings of the printed table (kept narrow so the whole table fits in
# the last 12,000 characters of output the device tool returns).
SYSTEM_SHORT = {
    "fagen_v2": "v2", "fagen_v1": "v1", "sdpa_flash": "flsh", "sdpa_cudnn": "cdnn",
    "sdpa_efficient": "eff", "sdpa_math": "math", "flex": "flex",
}
PASS_LABELS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}

# The variants section: fagen with a mod against FlexAttention with the same mod, and
# against plain causal attention (fagen's own and SDPA's flash backend, measured once).
VARIANT_CASES = ("window", "softcap", "alibi", "document")
VARIANT_SYSTEMS = ("fagen_v2", "flex", "sdpa_flash", "fagen_v2_nomod")
# The systems of a variant row that run without the mod (plain causal attention).
NO_MOD_SYSTEMS = ("sdpa_flash", "fagen_v2_nomod")
SYSTEM_LABELS["fagen_v2_nomod"] = "fagen v2 (no mod)"
SYSTEM_SHORT["fagen_v2_nomod"] = "v2nm"

# Sections in the order they run. Correctness first: a fast wrong kernel is
# worth nothing, and a kernel that faults shows up there, in a subprocess,
# before it can take down the sweep's CUDA context. The sanitizers (also
# subprocesses, with fixed caps) run before the sweep, so the sweep can use
# every second they leave over; memory last, since it pushes the allocator
# to out-of-memory on purpose.
SECTIONS = ("setup", "precompile", "peak", "correctness", "sanitizers", "speed", "variants", "decode",
            "models", "ring", "memory", "report")
# Distinct kernels the gpu tests launch on an H200 (the precompile forecast counts them;
# tests/test_gpu_check_plan.py checks the number against the kernels recorded from the tests).
GPU_TEST_KERNELS = 72
OPTIONAL_SECTIONS = ("precompile", "peak", "correctness", "sanitizers", "speed", "variants", "decode", "models",
                     "ring", "memory")

# The decode section: one decoding step against a KV cache (memory-bound, so judged by its
# bandwidth), and causal training over packed documents of mixed lengths (varlen).
DECODE_SYSTEMS = ("fagen", "fagen_paged", "sdpa_math", "sdpa_efficient", "sdpa_flash", "flex")
VARLEN_SYSTEMS = ("fagen_varlen", "fagen_padded", "sdpa_padded")
DECODE_LABELS = {
    "fagen": "fagen", "fagen_paged": "fagen paged", "sdpa_math": "SDPA math",
    "sdpa_efficient": "SDPA efficient", "sdpa_flash": "SDPA flash", "flex": "FlexAttention",
    "fagen_varlen": "fagen varlen", "fagen_padded": "fagen padded", "sdpa_padded": "SDPA padded",
}


@dataclass(frozen=True)
class SpeedConfig:
    """One panel of the speed plots: all passes and sequence lengths share it."""

    dtype: str
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        return f"{self.dtype} d={self.head_dim} {'causal' if self.causal else 'non-causal'}"


@dataclass(frozen=True)
class MemoryConfig:
    """The one shape the memory sweep grows: B = 1, forward + backward."""

    dtype: str = "bf16"
    head_dim: int = 128
    heads: int = 16
    batch: int = 1
    causal: bool = False
    seqlens: tuple = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    systems: tuple = ("fagen_v2", "sdpa_math", "sdpa_flash")


def random_lengths(total: int, count: int, seed: int) -> list[int]:
    """`count` document lengths (at most `total`), random (seeded) between 1/4 and 7/4 of the
    mean, summing to `total`."""
    import random

    count = max(1, min(count, total))
    rng = random.Random(seed)
    weights = [rng.uniform(0.25, 1.75) for _ in range(count)]
    lengths = [max(1, int(total * w / sum(weights))) for w in weights]
    lengths[-1] = total - sum(lengths[:-1])
    return lengths


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
        """Measurements: each case with its mod (fagen, Flex), plus the no-mod peers once."""
        with_mod = [s for s in self.systems if s not in NO_MOD_SYSTEMS]
        no_mod = [s for s in self.systems if s in NO_MOD_SYSTEMS]
        return len(self.passes) * (len(self.cases) * len(with_mod) + (len(no_mod) if self.cases else 0))

    def estimate_seconds(self) -> float:
        """About 0.5 s per 16k measurement (warm-up, sizing call, 3 repeats of 10-100 ms),
        a sanity check and a block mask per case, and Flex's compiles (about 20 s per mod,
        forward and backward), capped by its allowance and by the section's cap."""
        if not self.cases:
            return 0.0
        flex = min(self.flex_allowance_s, 20.0 * len(self.cases)) if "flex" in self.systems else 0.0
        return min(self.cap_s, 0.5 * self.timed_runs() + 1.5 * len(self.cases) + flex)


@dataclass(frozen=True)
class DecodeConfig:
    """The decode section's two parts.

    decode: one step (Nq = 1, non-causal) of B entries against full KV caches of `cache_len`
    tokens, GQA (q_heads over kv_heads), in a contiguous cache and in a paged one (pages of
    `page_size`, a seeded random block table). Memory-bound: reported as bytes moved per
    second, and as a fraction of the device copy's bandwidth.
    varlen: causal training over `varlen_tokens` tokens packed from `documents` documents of
    random (seeded) lengths, against the same documents padded to the longest; TFLOP/s count
    only the documents' own causal FLOPs, so padding shows as a lower rate."""

    dtype: str = "bf16"
    head_dim: int = 128
    batch: int = 64
    cache_len: int = 8192
    q_heads: int = 32
    kv_heads: int = 8
    page_size: int = 256
    decode_systems: tuple = DECODE_SYSTEMS
    # (batch, cache_len) of the small step fagen's output is checked on against fp32 torch.
    sanity_shape: tuple = (2, 1024)
    varlen_tokens: int = 16384
    varlen_heads: int = 16
    documents: int = 10
    seed: int = 0               # the document lengths' and the block table's seed
    varlen_passes: tuple = ("fwd", "fwd_bwd")
    varlen_systems: tuple = VARLEN_SYSTEMS
    # (documents, tokens, heads) of the small packed problem fagen's varlen and padded calls
    # are checked on before they are timed.
    varlen_sanity_shape: tuple = (3, 512, 2)
    # The section's cap; FlexAttention (a torch.compile of its decoding kernel, tens of
    # seconds) runs last and only starts with at least `flex_start_s` of it left.
    cap_s: float = 30.0
    flex_start_s: float = 20.0

    @property
    def enabled(self) -> bool:
        return bool(self.decode_systems or self.varlen_systems)

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.q_heads // self.kv_heads

    @property
    def pages_per_entry(self) -> int:
        return -(-self.cache_len // self.page_size)

    @property
    def decode_label(self) -> str:
        return (f"{self.dtype} B={self.batch} cache {short_seqlen(self.cache_len)} Hq={self.q_heads} "
                f"Hk={self.kv_heads} d={self.head_dim} Nq=1 non-causal")

    @property
    def varlen_label(self) -> str:
        lengths = self.document_lengths()
        return (f"{self.dtype} {short_seqlen(self.varlen_tokens)} tokens in {len(lengths)} docs "
                f"(max {max(lengths)}) H={self.varlen_heads} d={self.head_dim} causal")

    def decode_bytes(self, kv_heads_read: int | None = None, *, batch: int | None = None,
                     cache_len: int | None = None) -> int:
        """Bytes one decoding step must move to or from memory: K and V read
        (B N Hk d, 2 bytes each, two tensors), q read and out written (B Hq d each). A peer
        that is given K/V expanded to every query head reads `kv_heads_read` = Hq heads."""
        b = self.batch if batch is None else batch
        n = self.cache_len if cache_len is None else cache_len
        heads = self.kv_heads if kv_heads_read is None else kv_heads_read
        element = 2   # bf16 / fp16
        return 2 * b * n * heads * self.head_dim * element + 2 * b * self.q_heads * self.head_dim * element

    def document_lengths(self) -> list[int]:
        """`documents` lengths, random (seeded) between 1/4 and 7/4 of the mean, summing to
        `varlen_tokens`."""
        return random_lengths(self.varlen_tokens, self.documents, self.seed)

    def padded_shape(self) -> tuple[int, int]:
        """(B, N) of the padded batch: one entry per document, as long as the longest."""
        lengths = self.document_lengths()
        return len(lengths), max(lengths)

    def varlen_flops(self, pass_: str, lengths: list[int] | None = None) -> float:
        """The documents' useful FLOPs: each document's causal count (flops.attention_flops),
        summed; the padding's work is not counted."""
        return sum(attention_flops(pass_, batch=1, heads=self.varlen_heads, seqlen=n, head_dim=self.head_dim,
                                   causal=True) for n in (self.document_lengths() if lengths is None else lengths))

    def timed_runs(self) -> int:
        return len(self.decode_systems) + len(self.varlen_passes) * len(self.varlen_systems)

    def estimate_seconds(self) -> float:
        """About 0.3 s per measurement (a warm-up, a sizing call and up to 20 calls of 0.5-5 ms,
        or 0.3-3 ms for varlen), 2 s for the inputs and the sanity checks, and Flex's compile
        (about 20 s), within the cap."""
        if not self.enabled:
            return 0.0
        flex = 20.0 if "flex" in self.decode_systems else 0.0
        others = self.timed_runs() - (1 if flex else 0)
        return min(self.cap_s, 0.3 * others + 2.0 + flex)

# The models section: attn_implementation names in transformers, in the order they run (Flex,
# which compiles, last).
MODEL_SYSTEMS = ("fagen", "sdpa", "flex_attention")


@dataclass(frozen=True)
class ModelsConfig:
    """The models section: a Llama (random weights) in Hugging Face transformers, bf16, with its
    attention run by each attn_implementation in turn (one model, switched between systems).

    train: one step (forward, loss, backward; no optimizer step) on B x N random tokens.
    decode: greedy `generate` of `new_tokens` on `decode_batch` prompts of seeded random lengths
    up to `prompt_len`, left-padded (so the padding mask's path runs).
    sanity: the same architecture with `sanity_layers` layers, logits of fagen against fp32 eager,
    next to bf16 SDPA (the 2x rule), on `sanity_seqlen` tokens, plain and left-padded."""

    hidden_size: int = 2048
    intermediate_size: int = 8192
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 32000
    dtype: str = "bf16"
    train_batch: int = 1
    train_seqlen: int = 4096
    train_systems: tuple = MODEL_SYSTEMS
    decode_batch: int = 32
    prompt_len: int = 128
    min_prompt_len: int = 64
    new_tokens: int = 32
    decode_systems: tuple = ("fagen", "sdpa")   # Flex's generate recompiles as the cache grows
    sanity_layers: int = 2
    sanity_seqlen: int = 256
    seed: int = 0
    # Timed calls after one warm-up call and the timer's sizing call (not in the median).
    train_repeats: int = 3
    decode_repeats: int = 2
    # The section's cap; FlexAttention (torch.compile of its forward and backward, about 20 s)
    # runs last and only starts with at least `flex_start_s` of it left.
    cap_s: float = 40.0
    flex_start_s: float = 20.0

    @property
    def enabled(self) -> bool:
        return bool(self.train_systems or self.decode_systems)

    def parameter_count(self, layers: int | None = None) -> int:
        """Llama's parameters (no biases, untied embeddings): embedding and LM head, per layer
        q/k/v/o, gate/up/down and two RMSNorms, and the final norm."""
        h, inner = self.hidden_size, self.heads * self.head_dim
        attention = h * inner * 2 + h * self.kv_heads * self.head_dim * 2
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return 2 * self.vocab_size * h + (self.layers if layers is None else layers) * layer + h

    @property
    def train_tokens(self) -> int:
        return self.train_batch * self.train_seqlen

    def prompt_lengths(self) -> list[int]:
        """Prompt lengths (seeded), the first the longest (`prompt_len`, the padded width), the
        others random between `min_prompt_len` and it."""
        import random

        rng = random.Random(self.seed)
        rest = [rng.randint(self.min_prompt_len, self.prompt_len) for _ in range(self.decode_batch - 1)]
        return [self.prompt_len] + rest if self.decode_batch else []

    def estimate_seconds(self) -> float:
        """About 9 s to import transformers, check the small model and build this one; 2 s per
        training system (5 steps of 0.1-0.3 s), 4.5 s per decode system (4 generate calls of
        about 1 s, host-bound), and Flex's compile (about 20 s), within the cap."""
        if not self.enabled:
            return 0.0
        flex = sum(1 for names in (self.train_systems, self.decode_systems) if "flex_attention" in names)
        train = sum(1 for s in self.train_systems if s != "flex_attention")
        decode = sum(1 for s in self.decode_systems if s != "flex_attention")
        return min(self.cap_s, 9.0 + 2.0 * train + 4.5 * decode + 21.0 * flex)


@dataclass(frozen=True)
class Plan:
    name: str = "full"
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
    ring: RingConfig = field(default_factory=lambda: RingConfig(cap_s=10.0))
    # The whole run's budget. The shell wrapper kills at 460 s; this leaves time to start
    # Python before the budget's clock starts and to write the report after the last section.
    budget_s: float = 420.0
    # What each section may take (schedule.caps), kept back for it by the sections before it;
    # together at most the budget, compute-sanitizer's two runs included (schedule.fits). The
    # speed sweep has a floor instead: it takes what the others leave, at least min_speed_s.
    # Setup (torch, the CUDA context, nvidia-smi) and peak run unguarded; report writes files.
    setup_reserve_s: float = 15.0
    precompile_cap_s: float = 30.0
    peak_reserve_s: float = 5.0
    correctness_cap_s: float = 90.0
    sanitizer_cap_s: float = 30.0  # each of memcheck and racecheck
    min_speed_s: float = 50.0
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
        """Measurements in the speed sweep: configs x seqlens x passes x systems."""
        return len(self.configs()) * len(self.seqlens) * len(self.passes) * len(self.systems)

    def fagen_variants(self) -> int:
        """Distinct fagen kernels the sweep compiles (one source per variant)."""
        versions = sum(1 for s in self.systems if s in FAGEN_SYSTEMS)
        return versions * len(self.dtypes) * len(self.head_dims) * len(self.causal)

    def variant_kernels(self) -> int:
        """Distinct fagen kernels the variants section compiles (one per case; its no-mod
        peer is the sweep's causal kernel)."""
        return len(self.variants.cases) if "fagen_v2" in self.variants.systems else 0

    def decode_kernels(self) -> int:
        """Distinct fagen kernels the decode section adds: one per fagen system, but the padded
        batch's plain causal kernel where the sweep compiles it already."""
        c = self.decode
        fagen = [s for s in c.decode_systems + c.varlen_systems if s.startswith("fagen")]
        return len(fagen) - (1 if self.sweep_compiles_causal(c.dtype, c.head_dim) and "fagen_padded" in fagen else 0)

    def sweep_compiles_causal(self, dtype: str, head_dim: int) -> bool:
        """Whether the sweep's kernels include fagen v2's plain causal one at this dtype and d."""
        return ("fagen_v2" in self.systems and dtype in self.dtypes and head_dim in self.head_dims
                and True in self.causal)

    def models_kernels(self) -> int:
        """Distinct fagen kernels the models section adds: plain causal (training, unless the sweep
        compiles it) and varlen causal (generate's padded batch)."""
        c = self.models
        train = "fagen" in c.train_systems and not self.sweep_compiles_causal(c.dtype, c.head_dim)
        return int(train) + int("fagen" in c.decode_systems)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def short_seqlen(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def full_plan() -> Plan:
    return Plan()


def quick_plan() -> Plan:
    """A ~5 minute subset: bf16, d=128, three sequence lengths, small memory sweep. Its reserves
    fill its 290 s budget (schedule.caps), compute-sanitizer's two runs included."""
    return Plan(name="quick", dtypes=("bf16",), head_dims=(128,), seqlens=(1024, 4096, 16384),
                memory=MemoryConfig(seqlens=(4096, 16384, 65536)), budget_s=290.0,
                correctness_cap_s=70.0, sanitizer_cap_s=25.0, min_speed_s=30.0, memory_cap_s=15.0,
                flex_allowance_s=45.0,
                # One score mod and one mask mod; Flex compiles the first of them.
                variants=VariantsConfig(cases=("softcap", "document"), cap_s=30.0, flex_allowance_s=20.0),
                # No Flex compile, and of SDPA only its flash backend (the fastest peer).
                decode=DecodeConfig(decode_systems=("fagen", "fagen_paged", "sdpa_flash"), cap_s=10.0),
                # The training row against SDPA only: no Flex compile, no generate.
                models=ModelsConfig(train_systems=("fagen", "sdpa"), decode_systems=(), cap_s=15.0))


def plan_named(name: str) -> Plan:
    return {"full": full_plan, "quick": quick_plan}[name]()

"""The decode section's systems and sizes (DecodeConfig), its bytes and FLOPs, and its forecast.

Pure data and arithmetic (no torch): the plan, its text and the CPU tests use it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..flops import attention_flops
from ..sizes import random_lengths, short_seqlen

# The decode section: one decoding step against a KV cache (memory-bound, so judged by its
# bandwidth), and causal training over packed documents of mixed lengths (varlen).
DECODE_SYSTEMS = ("fagen", "fagen_paged", "fagen_fp8", "fagen_fp8_paged", "fagen_sm90", "fagen_sm90_paged",
                  "sdpa_math", "sdpa_efficient", "sdpa_flash", "flex")
VARLEN_SYSTEMS = ("fagen_varlen", "fagen_padded", "sdpa_padded")
MLA_SYSTEMS = ("fagen_mla", "fagen_sm90_mla", "sdpa", "flex")   # mla.py
MLA_DIM, MLA_DIM_V = 576, 512   # absorbed MLA's cache row (512 latent + 64 rotary) and V's share of it
DECODE_LABELS = {
    "fagen_mla": "fagen MLA (paged 64)", "fagen_sm90_mla": "sm90 MLA (paged 64)", "sdpa": "SDPA (enable_gqa)",
    "fagen": "fagen", "fagen_paged": "fagen paged", "fagen_sm90": "fagen sm90", "fagen_sm90_paged": "sm90 paged",
    "fagen_fp8": "fagen fp8 cache", "fagen_fp8_paged": "fagen fp8 paged",
    "sdpa_math": "SDPA math",
    "sdpa_efficient": "SDPA efficient", "sdpa_flash": "SDPA flash", "flex": "FlexAttention",
    "fagen_varlen": "fagen varlen", "fagen_padded": "fagen padded", "sdpa_padded": "SDPA padded",
}


@dataclass(frozen=True)
class DecodeConfig:
    """The decode section's three parts.

    decode: one step (Nq = 1, non-causal) of B entries against full KV caches of `cache_len`
    tokens, GQA (q_heads over kv_heads), in a contiguous cache and in a paged one (pages of
    `page_size`, a seeded random block table). Memory-bound: reported as bytes moved per
    second, and as a fraction of the device copy's bandwidth.
    varlen: causal training over `varlen_tokens` tokens packed from `documents` documents of
    random (seeded) lengths, against the same documents padded to the longest; TFLOP/s count
    only the documents' own causal FLOPs, so padding shows as a lower rate.
    graph: a serving step (append one token with rotary, split-KV, combine) captured in a CUDA
    graph and replayed with new cache_seqlens: equal to the same step run eagerly, and the
    replay's time against the eager step's (what the host's launches cost)."""

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
    # The step captured in a CUDA graph (graph.py): (batch, cache capacity) of caches filled to
    # seeded lengths, one new token each, rotary over the whole head dim, split in `graph_splits`
    # key ranges (more than one, so the combine kernel is in the graph too); () for none.
    graph_shape: tuple = (8, 4096)
    graph_splits: int = 4
    # The section's cap; FlexAttention (a torch.compile of its decoding kernel, tens of
    # seconds) runs last and only starts with at least `flex_start_s` of it left.
    cap_s: float = 31.0
    flex_start_s: float = 20.0
    # Absorbed MLA (mla.py): one 576-wide cache of `mla_cache_len` rows per entry, V its first
    # 512 columns, one K/V head under `mla_heads` query heads, at each batch of `mla_batches`.
    mla_systems: tuple = MLA_SYSTEMS
    mla_batches: tuple = (64, 1)
    mla_cache_len: int = 8192
    mla_heads: int = 128

    @property
    def enabled(self) -> bool:
        return bool(self.decode_systems or self.varlen_systems or self.graph_shape or self.mla_systems)

    def mla_label(self, batch: int) -> str:
        return (f"absorbed MLA, {self.dtype} B={batch} cache {short_seqlen(self.mla_cache_len)} Hq={self.mla_heads} "
                f"Hk=1 d={MLA_DIM} d_v={MLA_DIM_V} (V = the cache's first {MLA_DIM_V} columns) Nq=1")

    def mla_bytes(self, batch: int) -> int:
        """Bytes an MLA step must move: each cache row read once (V is part of it), q read
        (B Hq 576) and out written (B Hq 512), 2 bytes each."""
        element = 2
        return (batch * self.mla_cache_len * MLA_DIM + batch * self.mla_heads * (MLA_DIM + MLA_DIM_V)) * element

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
                     cache_len: int | None = None, cache_element: int = 2) -> int:
        """Bytes one decoding step must move to or from memory: K and V read
        (B N Hk d, `cache_element` bytes each: 2 in bf16 / fp16, 1 in an 8-bit cache; two
        tensors), q read and out written (B Hq d each, 2 bytes). A peer that is given K/V expanded
        to every query head reads `kv_heads_read` = Hq heads."""
        b = self.batch if batch is None else batch
        n = self.cache_len if cache_len is None else cache_len
        heads = self.kv_heads if kv_heads_read is None else kv_heads_read
        element = 2   # q and O: bf16 / fp16
        return 2 * b * n * heads * self.head_dim * cache_element + 2 * b * self.q_heads * self.head_dim * element

    @property
    def graph_label(self) -> str:
        batch, capacity = self.graph_shape
        return (f"{self.dtype} B={batch} cache {short_seqlen(capacity)} Hq={self.q_heads} Hk={self.kv_heads} "
                f"d={self.head_dim} Nq=1, 1 new token with rotary, {self.graph_splits} splits")

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
        """Measurements: each decode system, each varlen system per pass, and the graph's replay
        and its eager step."""
        return (len(self.decode_systems) + len(self.varlen_passes) * len(self.varlen_systems)
                + (2 if self.graph_shape else 0) + len(self.mla_systems) * len(self.mla_batches))

    def estimate_seconds(self) -> float:
        """About 0.3 s per measurement (a warm-up, a sizing call and up to 20 calls of 0.5-5 ms,
        or 0.3-3 ms for varlen), 2 s for the inputs and the sanity checks, 1 s for the graph's
        inputs, warm-up, capture and equality check, and Flex's compile (about 20 s), within the
        cap."""
        if not self.enabled:
            return 0.0
        flex = 20.0 * (("flex" in self.decode_systems) + ("flex" in self.mla_systems))
        graph = 1.0 if self.graph_shape else 0.0
        flex_runs = ("flex" in self.decode_systems) + ("flex" in self.mla_systems) * len(self.mla_batches)
        others = self.timed_runs() - flex_runs
        return min(self.cap_s, 0.3 * others + 2.0 + graph + flex)

    def fagen_kernels(self, sweep_compiles_causal: bool) -> int:
        """Distinct fagen kernels the section adds: one per fagen system, but the padded batch's
        plain causal kernel where the sweep compiles it already (`sweep_compiles_causal`)."""
        fagen = [s for s in self.decode_systems + self.varlen_systems if s.startswith("fagen")]
        # The graph's step is the contiguous step's kernel (one query drops causal; the append,
        # the rotary and the combine are kernels of the same source).
        graph = 1 if self.graph_shape and "fagen" not in self.decode_systems else 0
        mla = sum(name.startswith("fagen") for name in self.mla_systems)
        return len(fagen) + graph + mla - (1 if sweep_compiles_causal and "fagen_padded" in fagen else 0)

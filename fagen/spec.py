"""The attention spec: a small, frozen description of one kernel.

A `Spec` is pure data. It knows which combinations are legal (and says why
when one is not), how much shared memory its tiles need, and its own stable,
readable name. Everything downstream (kernels, ops) takes a
Spec and nothing else to decide what to build.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass

from .arch_families import (ARCH_FAMILIES, DEFAULT_FAMILY, family_of, fp8_backward_refusal, sm80_backward_problem,
                             sm90_block_n_problem)
from .arch import DEFAULT_ARCHS, SMEM_LIMIT_BYTES, base_arch, smem_limit  # noqa: F401  (re-exported)
from .spec_fp8 import (CACHE_FP8_ROW_MULTIPLE, FP8_DTYPES, FP8_GRADIENT_DTYPES,  # noqa: F401  (re-exported)
                       FP8_OUTPUT_DTYPE, cache_fp8_layout, check_cache_dtype, check_fp8)
from .tile_shapes import (ELEMENT_BYTES, MMA_K, MMA_M, SMEM_ROW_PAD, SPLIT_O_ABOVE, BackwardLayout,  # noqa: F401
                          BackwardTiles, SharedLayout, backward_block_n_choices, backward_layout, backward_tiles,
                          default_tiles, dq_layout, smaller_kv_cache_tiles)

DTYPES = ("fp16", "bf16", "e4m3")
# The 8-bit ones (fagen/spec_fp8.py): q, k and v in e4m3 with their descales, O in bf16.
MASKS = ("none", "causal")
KV_CACHES = ("contiguous", "paged")   # Spec.kv_cache: how flash_attn_with_kvcache's cache is laid out
VERSIONS = (1, 2)
NUM_WARPS = (1, 2, 4, 8)
MAX_STAGES = 4
MAX_HEAD_DIM = 512
# Absorbed MLA decoding (DeepSeek-V2/V3): 512 latent + 64 rotary features per cache row, V being
# the first 512 of them. Decoding only (kv_cache), where it is the cache's row width.
MLA_HEAD_DIM = 576


def check_dropout_p(dropout_p) -> float:
    """Validate a dropout probability; returns it as a float."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


MOD_KINDS = ("score", "mask")
# The variants' built-ins, in name order. Their values (window sizes, the softcap, ALiBi
# slopes, sink logits) are run-time arguments: only their presence makes a variant.
BUILTIN_MODS = ("window", "softcap", "alibi", "sinks")


@dataclass(frozen=True)
class CustomMod:
    """A traced score_mod or mask_mod in canonical form (`fagen.variants` makes them).

    expression  sympy's srepr of the canonical expression: equal expressions give equal
                mods, so equal specs and one cache entry
    source      the expression as a person reads it (the generated CUDA's comments)
    captures    per captured tensor, in order of first use: (dtype, number of dims); their
                values are kernel arguments, so they never cause a recompile
    grads       per captured tensor, whether the backward accumulates its gradient
    params      per number the mod reads from its closure or globals (par0, par1, ... in the
                expression): "int" or "float"; their values are kernel arguments too
    """

    kind: str
    expression: str
    source: str
    captures: tuple = ()
    grads: tuple = ()
    params: tuple = ()

    def __post_init__(self):
        if self.kind not in MOD_KINDS:
            raise ValueError(f"CustomMod kind must be one of {MOD_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "captures", tuple(tuple(c) for c in self.captures))
        object.__setattr__(self, "grads", tuple(bool(g) for g in self.grads) or (False,) * len(self.captures))
        if len(self.grads) != len(self.captures):
            raise ValueError("CustomMod grads must have one entry per capture")
        object.__setattr__(self, "params", tuple(self.params))
        if any(p not in ("int", "float") for p in self.params):
            raise ValueError(f"CustomMod params must each be 'int' or 'float', got {self.params!r}")

    @property
    def digest(self) -> str:
        """A short hash of the canonical expression and the captures' kinds (the name part)."""
        import hashlib

        fields = (self.kind, self.expression, self.captures, self.grads) + ((self.params,) if self.params else ())
        return hashlib.sha256(repr(fields).encode()).hexdigest()[:8]

    def to_dict(self) -> dict:
        data = {"kind": self.kind, "expression": self.expression, "source": self.source,
                "captures": [list(c) for c in self.captures], "grads": list(self.grads)}
        if self.params:   # absent when empty: a mod without lifted numbers reads as before they existed
            data["params"] = list(self.params)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "CustomMod":
        return cls(**data)



@dataclass(frozen=True)
class Spec:
    """One attention kernel, as data.

    head_dim     d, a multiple of 8 up to 512 (Q's and K's head dim)
    dtype        "fp16" or "bf16" (inputs and outputs; accumulation is fp32), or "e4m3" (8-bit q, k
                 and v with their descales, output in bf16: the sm90 family's forward, and its
                 backward where arch_families.fp8_backward_refusal lets the variants through)
    version      1 = FlashAttention-1 (m, l statistics), 2 = FlashAttention-2 (L)
    block_m      rows of Q per tile (B_r)
    block_n      rows of K/V per tile (B_c)
    num_warps    warps per thread block; they split the block_m rows of Q
    num_stages   depth of the K/V copy pipeline
    mask         "none" or "causal" (bottom-right aligned when Nq != Nk)
    key_padding  per-batch key lengths (seqlens_k) mask the tail of K/V
    dropout      the kernel applies Philox dropout (p is a run-time argument)
    deterministic  repeated backward passes are bit-identical: dQ by a pass of its own (sm80) or
                 by reductions that take turns in key-block order (sm90), not by atomics;
                 captured tensors' gradients in order-free sums (fagen/exact_sum.cuh)
    bwd_stages   depth of the backward's Q/dO pipeline (and of the deterministic
                 dQ kernel's K/V pipeline); unset takes the backward tile table's.
    bwd_block_n  keys per backward thread block (BACKWARD_BLOCK_N lists the choices per
                 head dim); unset takes the table's. The 99 KB parts (sm_86/89/120)
                 need a smaller one, or a shallower pipeline (`fit_backward`).
    window       flash-attn's sliding window (left, right), sizes at run time
    softcap      s' = c tanh(s / c) on the scaled score, c at run time
    alibi        -slope |i + Nk - Nq - j| added after softcap, slopes at run time
    sinks        a learnable logit per head joins every row's softmax denominator
    score_mod    a traced score_mod (CustomMod), applied after softcap and ALiBi
    mask_mod     a traced mask_mod (CustomMod), applied with the other masks, last
    varlen       packed sequences (cu_seqlens_q / cu_seqlens_k), flash_attn_varlen_func's layout
    kv_cache     decoding against a KV cache (flash_attn_with_kvcache, forward only): "contiguous"
                 (B_cache, N_cache, Hk, d), rows from cache_batch_idx / cache_leftpad, or "paged"
                 (num_pages, page_size, Hk, d) through a block table; the keys split into
                 num_splits ranges whose fp32 partials a combine kernel merges by L
    coord_offsets  dropout keys on (row + row_offset, col + col_offset), run-time multiples of 16:
                 a shard of a longer sequence draws the whole sequence's mask (context parallelism)
    pack_gqa     kv_cache only: the query heads that share a K/V head fill one tile's rows (row
                 i * group + g holds query i of head kv_head * group + g); masks and mods see
                 each row's own query and head (the group size is a run-time argument)
    head_dim_v   d_v, V's (and O's) head dim: a multiple of 8 up to head_dim; unset means
                 head_dim (DeepSeek-V3's training shape is head_dim=192, head_dim_v=128)
    v_from_k     kv_cache only: V's rows are the first head_dim_v columns of K's (absorbed MLA
                 decoding, head_dim=576, head_dim_v=512): the kernels read each cache row once
                 and the append writes it once
    arch_family  the forward's kernel family's name (fagen.arch_families.FAMILIES): sm80 (mma.sync,
                 any GPU from sm_80; the default) or sm90 (wgmma and TMA, Hopper only); sm90's backward
                 takes what arch_families.sm90_backward_refusal lets through, sm80's the rest
    sm90_block_n the sm90 forward's keys per K/V tile; unset takes arch_families.sm90_tiles' rule
                 (a narrower one keeps a heavy mod from spilling: kernels.spill_free)
    cache_dtype  kv_cache only: the cache's dtype where it is not `dtype`: "e4m3" (an 8-bit cache with
                 k/v descales per (batch entry, K/V head), as vLLM and FlashInfer serve; q and O stay
                 dtype, and the sm80 family's kernels widen each K/V tile to dtype in shared memory)
    dout_dtype   an 8-bit spec's backward only: dO's dtype where it is 8-bit, "e4m3" or "e5m2" (as
                 Transformer Engine passes it to cuDNN): S and dP then run as 8-bit wgmma where the
                 sm90 backward's tiles allow (Sm90BackwardTiles.fp8_scores); unset, dO arrives in bf16
                 (or is widened to it) and every GEMM reads bf16
    sm80_backward  an sm90 training spec only: the backward is the sm80 family's even where
                 sm90's own takes the spec (the self-test's gate sets it where sm90.backward did not
                 pass on this GPU but the forward's templates did: fagen.selftest.gate)
    """

    head_dim: int
    dtype: str = "fp16"
    version: int = 2
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    mask: str = "none"
    key_padding: bool = False
    dropout: bool = False
    deterministic: bool = False
    bwd_stages: int | None = None
    bwd_block_n: int | None = None
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    sinks: bool = False
    score_mod: CustomMod | None = None
    mask_mod: CustomMod | None = None
    varlen: bool = False
    kv_cache: str | None = None
    coord_offsets: bool = False
    pack_gqa: bool = False
    head_dim_v: int | None = None
    v_from_k: bool = False
    arch_family: str = "sm80"
    sm90_block_n: int | None = None
    sm80_backward: bool = False
    cache_dtype: str | None = None
    dout_dtype: str | None = None

    def __post_init__(self):
        self._check_head_dim()
        self._check_head_dim_v()
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {DTYPES}")
        if self.mask not in MASKS:
            raise ValueError(f"unknown mask {self.mask!r}; expected one of {MASKS}")
        if self.version not in VERSIONS:
            raise ValueError(f"unknown version {self.version!r}; expected 1 or 2")
        for flag in ("key_padding", "dropout", "deterministic", "varlen", "coord_offsets", "pack_gqa", "v_from_k",
                     "sm80_backward", *BUILTIN_MODS):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        self._check_mods()
        if self.varlen and self.key_padding:
            raise ValueError("varlen takes each sequence's own key count from cu_seqlens_k: it has no key_padding")
        self._check_kv_cache()
        check_cache_dtype(self)
        check_fp8(self)
        if self.arch_family not in ARCH_FAMILIES:
            raise ValueError(f"unknown arch_family {self.arch_family!r}; expected one of {ARCH_FAMILIES}")
        refusal = family_of(self).refusal(self)
        if refusal:
            raise ValueError(refusal)
        if self.sm90_block_n is not None and sm90_block_n_problem(self):
            raise ValueError(sm90_block_n_problem(self))
        if self.sm80_backward and sm80_backward_problem(self):
            raise ValueError(sm80_backward_problem(self))
        if self.coord_offsets and not self.dropout:
            raise ValueError("coord_offsets shift the dropout mask's coordinates: it needs dropout=True")
        # Unset tile fields take the fallback table's values.
        for key, value in default_tiles(self.head_dim, self.version).items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.bwd_block_n is None:
            object.__setattr__(self, "bwd_block_n", backward_block_n_choices(self.head_dim)[0])
        if self.bwd_stages is None:
            object.__setattr__(self, "bwd_stages", backward_tiles(self.head_dim, 0, self.bwd_block_n).num_stages)
        self._check_tiles()
        self.check_arch(max(SMEM_LIMIT_BYTES, key=SMEM_LIMIT_BYTES.get))  # fits some GPU

    # -- validation -------------------------------------------------------
    def _check_mods(self):
        for field, kind in (("score_mod", "score"), ("mask_mod", "mask")):
            mod = getattr(self, field)
            if isinstance(mod, str):   # its JSON, as the front end's call options hold it
                mod = json.loads(mod)
            if isinstance(mod, dict):
                mod = CustomMod.from_dict(mod)
                object.__setattr__(self, field, mod)
            if mod is not None and (not isinstance(mod, CustomMod) or mod.kind != kind):
                raise ValueError(f"{field} must be a traced {kind} mod (fagen.variants.trace_{kind}_mod), "
                                 f"got {mod!r}")

    @classmethod
    def for_kv_cache(cls, head_dim: int, dtype: str, *, causal: bool, page_size: int | None, varlen: bool = False,
                     shared_limit: int | None = None, **fields) -> "Spec":
        """The kv_cache spec of a decoding step (or, with varlen, of packed queries over a paged
        cache): 64-row query tiles, few queries being the common case, and K/V tiles that never
        straddle a page (block_n divides page_size, a multiple of 16). With `shared_limit` (a
        GPU's shared memory per block), tiles too large for it shrink: past d = 256 (and for
        absorbed MLA) the 99 KB parts take 32-row query tiles on four warps, then fewer keys
        per tile, then one K/V stage."""
        block_n = 64 if head_dim <= 128 else 32
        while page_size is not None and page_size % block_n:
            block_n //= 2
        wide = head_dim > SPLIT_O_ABOVE   # warp pairs split O's columns; one K/V stage fits sm_80 ...
        stages = 1 if wide and not fields.get("v_from_k") else 2   # ... two K stages when V is K's (MLA)
        spec = cls(head_dim=head_dim, dtype=dtype, mask="causal" if causal else "none", key_padding=not varlen,
                   varlen=varlen, kv_cache="contiguous" if page_size is None else "paged", block_m=64,
                   num_warps=8 if wide else 4, block_n=block_n, num_stages=stages, **fields)
        if shared_limit is None or spec.shared_layout.total_bytes <= shared_limit:
            return spec
        for candidate in smaller_kv_cache_tiles(spec):
            if candidate.shared_layout.total_bytes <= shared_limit:
                return candidate
        return spec   # nothing fits: the launch's check names the shortfall

    def _check_kv_cache(self):
        if self.pack_gqa and (self.kv_cache is None or self.varlen):
            raise ValueError("pack_gqa packs the query heads of a decoding step: it needs kv_cache and no varlen")
        if self.v_from_k and self.kv_cache is None:
            raise ValueError("v_from_k reads V from a KV cache's K rows: it needs kv_cache")
        if self.kv_cache is None:
            return
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"unknown kv_cache {self.kv_cache!r}; expected None or one of {KV_CACHES}")
        if self.version != 2 or not (self.key_padding or self.varlen):
            raise ValueError("kv_cache needs version=2 and key_padding=True (each entry's keys: cache_seqlens), "
                             "or varlen=True (each sequence's keys: cu_seqlens_k)")
        if self.varlen and self.kv_cache != "paged":
            raise ValueError("packed sequences (varlen) read a KV cache only through a block table: kv_cache='paged'")
        if self.dropout or self.sinks:
            raise ValueError("kv_cache kernels take no dropout or sinks "
                             "(flash-attn's paged and decoding kernels take window, softcap and ALiBi)")

    @property
    def cache_fp8(self) -> bool:
        """An 8-bit KV cache (cache_dtype) under fp16 or bf16 queries."""
        return self.cache_dtype is not None

    @property
    def fp8(self) -> bool:
        """8-bit inputs (FP8_DTYPES): the sm90 family's, whose output is bf16 (`output_dtype`)."""
        return self.dtype in FP8_DTYPES

    @property
    def output_dtype(self) -> str:
        """The dtype of O (and of the backward's gradients): the inputs', or bf16 for 8-bit ones."""
        return FP8_OUTPUT_DTYPE if self.fp8 else self.dtype

    @property
    def forward_only(self) -> bool:
        """Whether its source has no backward: decoding (kv_cache), and an 8-bit spec whose variants
        the fp8 backward does not take yet (arch_families.fp8_backward_refusal)."""
        return self.kv_cache is not None or (self.fp8 and fp8_backward_refusal(self) is not None)

    @property
    def has_mods(self) -> bool:
        """Any variant beyond the flags of plain attention (window, softcap, ALiBi, sinks, mods)."""
        return any(getattr(self, f) for f in BUILTIN_MODS) or self.score_mod is not None \
            or self.mask_mod is not None

    def _check_head_dim(self):
        d = self.head_dim
        if isinstance(d, bool) or not isinstance(d, int):
            raise ValueError(f"head_dim must be an int, got {d!r}")
        if d <= 0 or d % 8 != 0:
            raise ValueError(f"head_dim must be a positive multiple of 8, got {d}")
        if d > MAX_HEAD_DIM and not (d == MLA_HEAD_DIM and self.kv_cache is not None):
            raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {d} ({MLA_HEAD_DIM}, absorbed MLA's, "
                             f"only for decoding: kv_cache)")
        if d > SPLIT_O_ABOVE and self.version == 1:
            raise ValueError(f"head_dim={d} needs version=2: FlashAttention-1 (the paper's baseline) runs head dims "
                             f"up to {SPLIT_O_ABOVE}")

    def _check_head_dim_v(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        dv = self.head_dim_v
        if isinstance(dv, bool) or not isinstance(dv, int) or dv <= 0 or dv % 8 != 0:
            raise ValueError(f"head_dim_v must be a positive multiple of 8, got {dv!r}")
        if dv == self.head_dim:
            return
        if dv > self.head_dim:
            raise ValueError(f"head_dim_v={dv} is larger than head_dim={self.head_dim}: the kernels stage V in "
                             f"K's shared-memory rows, so V's head dim can be at most Q's and K's")
        if self.version != 2:
            raise ValueError(f"head_dim_v={dv} != head_dim={self.head_dim} needs version=2 "
                             f"(FlashAttention-1 keeps one head dim)")

    def _check_tiles(self):
        for key in ("block_m", "block_n", "num_warps", "num_stages"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if self.num_warps not in NUM_WARPS:
            raise ValueError(f"num_warps must be one of {NUM_WARPS}, got {self.num_warps}")
        if self.block_n % MMA_K != 0:
            raise ValueError(
                f"block_n must be a multiple of {MMA_K} (the mma.sync k and n tiles), got {self.block_n}")
        if self.block_m % MMA_M != 0:
            raise ValueError(
                f"block_m must be a multiple of {MMA_M} (the mma.sync m tile), got {self.block_m}")
        if self.num_warps % self.column_split:
            raise ValueError(f"num_warps={self.num_warps} cannot pair up: past head_dim {SPLIT_O_ABOVE} two warps "
                             f"share each row group, each with half of O's columns")
        rows_per_split = MMA_M * self.num_warps // self.column_split
        if self.block_m % rows_per_split != 0:
            raise ValueError(
                f"block_m={self.block_m} cannot be split across num_warps={self.num_warps}: "
                f"each warp owns a multiple of {MMA_M} rows, so block_m must be a multiple of "
                f"{rows_per_split}")
        if not 1 <= self.num_stages <= MAX_STAGES:
            raise ValueError(f"num_stages must be in 1..{MAX_STAGES}, got {self.num_stages}")
        stages = self.bwd_stages
        if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= MAX_STAGES:
            raise ValueError(f"bwd_stages must be an int in 1..{MAX_STAGES}, got {stages!r}")
        choices = backward_block_n_choices(self.head_dim)
        if isinstance(self.bwd_block_n, bool) or self.bwd_block_n not in choices:
            raise ValueError(f"bwd_block_n must be one of {choices} at head_dim={self.head_dim}, "
                             f"got {self.bwd_block_n!r}")

    def check_arch(self, arch: str, backward: bool = True, shared_limit: int | None = None) -> None:
        """Raise ValueError if this spec's tiles do not fit `arch`'s shared memory.

        The forward kernel is always checked; `backward=False` skips the
        backward kernels, whose tiles depend on the head dim only (a variant can
        run inference on an arch whose shared memory its backward exceeds).
        `shared_limit` (bytes per block, as a GPU's driver reports it) replaces
        the table's value, so a GPU whose arch the table lacks still runs.
        """
        allowed = smem_limit(arch) if shared_limit is None else shared_limit
        family = family_of(self)
        if family.arch is not None and base_arch(arch) != family.arch:   # sm90: wgmma, TMA in sm_90a cubins
            raise ValueError(f"{self.name} (arch_family={family.name!r}) runs on {family.arch} only, not on {arch}")
        needed = family.shared_bytes(self)
        if needed > allowed:
            raise ValueError(
                f"{self.name} needs {needed} bytes of shared memory per block "
                f"(block_m={self.block_m}, block_n={self.block_n}, head_dim={self.head_dim}, "
                f"num_stages={self.num_stages}); {arch} allows at most {allowed}")
        needed = self.backward_shared_bytes
        if backward and self.kv_cache is None and needed > allowed:   # kv_cache kernels: forward only
            fitted = self.fit_backward(allowed)
            hint = (f"; bwd_stages={fitted.bwd_stages} needs {fitted.backward_shared_bytes}"
                    if fitted is not self else "")
            raise ValueError(
                f"the backward pass of {self.name} needs {needed} bytes of shared memory per block "
                f"(bwd_stages={self.bwd_stages}); {arch} allows at most {allowed} (the forward "
                f"pass fits){hint}")

    def fit_backward(self, shared_limit: int) -> "Spec":
        """This spec with the largest backward block (at most its own), then the deepest
        pipeline (at most its own), that fits `shared_limit` bytes per block; itself if it
        fits, or if nothing smaller does."""
        for block_n in (n for n in backward_block_n_choices(self.head_dim) if n <= self.bwd_block_n):
            for stages in range(self.bwd_stages, 0, -1):
                candidate = self.replace(bwd_block_n=block_n, bwd_stages=stages)
                if candidate.backward_shared_bytes <= shared_limit:
                    return self if candidate == self else candidate
        return self

    # -- derived facts ----------------------------------------------------
    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    @property
    def head_dim_pad(self) -> int:
        """head_dim rounded up to the mma k-step (16), per column slice past d = 256 (whole
        16-column ldmatrix loads in each); the extra columns are zeros."""
        step = MMA_K * self.column_split
        return -(-self.head_dim // step) * step

    @property
    def head_dim_v_pad(self) -> int:
        """head_dim_v rounded up as head_dim is."""
        step = MMA_K * self.column_split
        return -(-self.head_dim_v // step) * step

    @property
    def column_split(self) -> int:
        """Warps that share rows and split the columns of the accumulator they hold: O's in the
        forward, dQ's in the deterministic dQ kernel (2 past head_dim 256, where one warp's 16
        rows of a 512-wide fp32 accumulator would take 256 registers)."""
        return 2 if self.head_dim > SPLIT_O_ABOVE else 1

    @property
    def shared_layout(self) -> SharedLayout:
        row = self.head_dim_pad + SMEM_ROW_PAD
        q_stages, kv_stages = (1, self.num_stages) if self.version == 2 else (self.num_stages, 1)
        q_stage = self.block_m * row * ELEMENT_BYTES
        kv_stage = self.block_n * row * ELEMENT_BYTES
        k_offset = q_stages * q_stage
        v_offset = k_offset + kv_stages * kv_stage
        total = v_offset + kv_stages * kv_stage
        if self.v_from_k:   # V_j is K_j's first d_v columns: no tiles of its own
            v_offset, total = k_offset, v_offset
        if self.cache_fp8:
            return cache_fp8_layout(self, row, q_stage, kv_stage)
        return SharedLayout(row, 0, q_stages, q_stage, k_offset, v_offset, kv_stages, kv_stage, total)

    @property
    def backward_tiles(self) -> BackwardTiles:
        """The backward's tiles by head dim (tile_shapes.backward_tiles), sized so dK, dV, S^T and
        dP^T stay in registers; the pipeline depth is the spec's `bwd_stages`."""
        return backward_tiles(self.head_dim, self.head_dim_v, self.bwd_block_n, self.bwd_stages)

    @property
    def backward_shared_bytes(self) -> int:
        """Dynamic shared memory of the largest backward kernel."""
        return max(self.backward_layout.total_bytes, self.dq_layout.total_bytes)

    @property
    def backward_layout(self) -> BackwardLayout:
        return backward_layout(self.backward_tiles)

    @property
    def dq_layout(self) -> SharedLayout:
        """The deterministic dQ kernel: Q_i and dO_i (q stages 0 and 1), K/V pipelined."""
        return dq_layout(self.backward_tiles, self.head_dim_pad + SMEM_ROW_PAD)

    @property
    def tiles(self) -> dict:
        return {k: getattr(self, k) for k in ("block_m", "block_n", "num_warps", "num_stages")}

    @property
    def base_name(self) -> str:
        """The name without tile sizes: `fa2_d64_causal_bf16` (the tuning cache's key; not the
        kernel family, which is `arch_family`)."""
        parts = [f"fa{self.version}", f"d{self.head_dim}"]
        if self.head_dim_v != self.head_dim:
            parts[1] += f"v{self.head_dim_v}"
        if self.causal:
            parts.append("causal")
        parts.extend(flag for flag in BUILTIN_MODS if getattr(self, flag))
        for prefix, mod in (("smod", self.score_mod), ("mmod", self.mask_mod)):
            if mod is not None:
                parts.append(prefix + mod.digest)
        parts.append(self.dtype)
        if self.key_padding:
            parts.append("pad")
        if self.dropout:
            parts.append("drop")
        if self.deterministic:
            parts.append("det")
        if self.varlen:
            parts.append("varlen")
        if self.kv_cache:
            parts.append({"contiguous": "cache", "paged": "paged"}[self.kv_cache])
        if self.coord_offsets:
            parts.append("coords")
        if self.pack_gqa:
            parts.append("packgqa")
        if self.v_from_k:
            parts.append("vfromk")
        if self.cache_dtype:
            parts.append("kv" + self.cache_dtype)
        if self.dout_dtype:
            parts.append("do" + self.dout_dtype)
        if self.arch_family != "sm80":
            parts.append(self.arch_family)
        if self.sm80_backward:
            parts.append("bwdsm80")
        return "_".join(parts)

    @property
    def name(self) -> str:
        """Stable readable name; tile sizes and the backward pipeline depth appear only
        when they differ from the tables: `fa2_d128_bf16_m128n32w8s2_bwd1`."""
        parts = [self.base_name]
        if self.sm90_block_n is not None:
            parts.append(f"kn{self.sm90_block_n}")
        if self.tiles != default_tiles(self.head_dim, self.version):
            t = self.tiles
            parts.append(f"m{t['block_m']}n{t['block_n']}w{t['num_warps']}s{t['num_stages']}")
        if self.bwd_stages != backward_tiles(self.head_dim, 0, self.bwd_block_n).num_stages:
            parts.append(f"bwd{self.bwd_stages}")
        if self.bwd_block_n != backward_block_n_choices(self.head_dim)[0]:
            parts.append(f"bwdn{self.bwd_block_n}")
        return "_".join(parts)

    def to_dict(self) -> dict:
        """The fields; the variant fields only where set, so that a spec without them reads
        (and its generated header renders) exactly as before they existed."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for flag in (*BUILTIN_MODS, "varlen", "coord_offsets", "pack_gqa", "v_from_k", "sm80_backward"):
            if not data[flag]:
                del data[flag]
        if data["head_dim_v"] == data["head_dim"]:
            del data["head_dim_v"]
        if data["arch_family"] == "sm80":
            del data["arch_family"]
        for field in ("sm90_block_n", "cache_dtype", "dout_dtype"):
            if data[field] is None:
                del data[field]
        for field in ("score_mod", "mask_mod", "kv_cache"):
            if data[field] is None:
                del data[field]
            elif field != "kv_cache":
                data[field] = data[field].to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Spec":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown Spec fields: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_name(cls, name: str) -> "Spec":
        """Parse a name like `fa2_d64_causal_bf16` or `fa1_d128_fp16_pad_m64n32w4s2_bwd1`."""
        fields: dict = {}
        parts = name.split("_")
        block_n = re.fullmatch(r"bwdn(\d+)", parts[-1]) if parts else None
        if block_n:
            parts.pop()
            fields["bwd_block_n"] = int(block_n.group(1))
        bwd = re.fullmatch(r"bwd(\d+)", parts[-1]) if parts else None
        if bwd:
            parts.pop()
            fields["bwd_stages"] = int(bwd.group(1))
        flags = {"causal": ("mask", "causal"), "pad": ("key_padding", True),
                 "drop": ("dropout", True), "det": ("deterministic", True), "varlen": ("varlen", True),
                 "cache": ("kv_cache", "contiguous"), "paged": ("kv_cache", "paged"),
                 "coords": ("coord_offsets", True), "packgqa": ("pack_gqa", True), "vfromk": ("v_from_k", True),
                 "bwdsm80": ("sm80_backward", True),
                 **{"kv" + dtype: ("cache_dtype", dtype) for dtype in FP8_DTYPES},
                 **{"do" + dtype: ("dout_dtype", dtype) for dtype in FP8_GRADIENT_DTYPES},
                 **{family: ("arch_family", family) for family in ARCH_FAMILIES if family != DEFAULT_FAMILY.name},
                 **{flag: (flag, True) for flag in BUILTIN_MODS}}
        tiles = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)", parts[-1]) if parts else None
        if tiles:
            parts.pop()
            fields.update(zip(("block_m", "block_n", "num_warps", "num_stages"), map(int, tiles.groups())))
        keys = re.fullmatch(r"kn(\d+)", parts[-1]) if parts else None
        if keys:
            parts.pop()
            fields["sm90_block_n"] = int(keys.group(1))
        dims = re.fullmatch(r"d(\d+)(?:v(\d+))?", parts[1]) if len(parts) > 1 else None
        if len(parts) < 3 or not re.fullmatch(r"fa[12]", parts[0]) or not dims:
            raise ValueError(f"not a spec name: {name!r} (expected e.g. fa2_d64_causal_bf16)")
        fields.update(version=int(parts[0][2]), head_dim=int(dims.group(1)))
        if dims.group(2):
            fields["head_dim_v"] = int(dims.group(2))
        for part in parts[2:]:
            if part in DTYPES:
                fields["dtype"] = part
            elif part in flags:
                key, value = flags[part]
                fields[key] = value
            elif re.fullmatch(r"[sm]mod[0-9a-f]{8}", part):
                raise ValueError(f"{name!r} names a custom {'score' if part[0] == 's' else 'mask'}_mod by its "
                                 f"hash ({part}); a name cannot rebuild it: trace the function again "
                                 f"(fagen.variants) or read the spec from the variant's .json")
            else:
                raise ValueError(f"not a spec name: {name!r} (unknown part {part!r})")
        spec = cls(**fields)
        if spec.name != name:
            raise ValueError(f"not a canonical spec name: {name!r} (did you mean {spec.name!r}?)")
        return spec

    def replace(self, **changes) -> "Spec":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_sram(cls, sram_elements: int, head_dim: int, **fields) -> "Spec":
        """FlashAttention-1's block rule for an on-chip memory of M elements.

        B_c = ceil(M / 4d) and B_r = min(ceil(M / 4d), d), then rounded down
        to what the tensor-core tiles and the warp split can use: block_n to a
        multiple of 16, block_m to a multiple of 16 * num_warps (with the
        largest power-of-two num_warps up to 4 that the rows allow).
        """
        if isinstance(sram_elements, bool) or not isinstance(sram_elements, int) or sram_elements <= 0:
            raise ValueError(f"M (SRAM size in elements) must be a positive int, got {sram_elements!r}")
        if isinstance(head_dim, int) and head_dim > 0:
            block_c = math.ceil(sram_elements / (4 * head_dim))
            block_r = min(block_c, head_dim)
        else:
            block_c = block_r = MMA_M
        block_n = max(MMA_K, min(256, block_c) // MMA_K * MMA_K)
        num_warps = fields.pop("num_warps", None)
        if num_warps is None:
            num_warps = 4
            while num_warps > 1 and block_r < MMA_M * num_warps:
                num_warps //= 2
        rows = MMA_M * num_warps
        block_m = max(rows, block_r // rows * rows)
        fields.setdefault("num_stages", 1)
        return cls(head_dim=head_dim, block_m=block_m, block_n=block_n, num_warps=num_warps, **fields)

"""What 8-bit data a Spec may describe, and what it then refuses (issue 45).

Two places hold e4m3 values:
  dtype="e4m3"        q, k and v, each with an fp32 descale per batch entry and K/V head, as
                      FlashAttention-3's fp8 forward takes them; O (and the backward's gradients)
                      in bf16 (FP8_OUTPUT_DTYPE). The sm90 family's alone (arch_families.FP8_FAMILY).
  cache_dtype="e4m3"  a decoding step's KV cache under fp16 or bf16 queries, with k/v descales, as
                      vLLM and FlashInfer serve it; the sm80 family's decoding kernels widen each
                      tile in shared memory (`cache_fp8_layout`, templates/include/fagen/fp8_cache.cuh).
And an e4m3 spec's backward may name dO's 8-bit type, dout_dtype="e4m3" or "e5m2" (Transformer
Engine's): S and dP then run as 8-bit wgmma (arch_families.Sm90BackwardTiles.fp8_scores).
The checks take the Spec being validated (below fagen.spec: it imports this module).
"""

from __future__ import annotations

from .tile_shapes import SharedLayout

FP8_DTYPES = ("e4m3",)
FP8_GRADIENT_DTYPES = ("e4m3", "e5m2")   # dO's, where 8-bit (Spec.dout_dtype): Transformer Engine's two
FP8_OUTPUT_DTYPE = "bf16"
CACHE_FP8_ROW_MULTIPLE = 16   # an 8-bit cache's head dims: its rows are copied in 16-byte chunks


def check_fp8(spec) -> None:
    """An e4m3 spec refuses, by name, what its kernels have no meaning for; dout_dtype is an e4m3
    spec's alone."""
    if spec.dout_dtype is not None:
        if spec.dout_dtype not in FP8_GRADIENT_DTYPES:
            raise ValueError(f"unknown dout_dtype {spec.dout_dtype!r}; expected None (dO in bf16) or one of "
                             f"{FP8_GRADIENT_DTYPES}")
        if spec.dtype not in FP8_DTYPES:
            raise ValueError(f"dout_dtype={spec.dout_dtype!r} is the fp8 backward's dO: it needs dtype='e4m3', got "
                             f"dtype={spec.dtype!r}")
    if spec.dtype not in FP8_DTYPES:
        return
    refused = [what for what, on in (("dropout=True", spec.dropout), ("sm80_backward=True", spec.sm80_backward),
                                     (f"kv_cache={spec.kv_cache!r}", spec.kv_cache is not None)) if on]
    if refused:
        raise ValueError(f"dtype={spec.dtype!r} takes no {', '.join(refused)} (FlashAttention-3's fp8 forward has no "
                         f"dropout; the 8-bit backward is the sm90 family's; an fp8 KV cache is decoding's "
                         f"cache_dtype, not the spec's dtype)")


def check_cache_dtype(spec) -> None:
    """An 8-bit KV cache: a decoding spec's, under 16-bit queries, with head dims of whole 16-byte rows."""
    if spec.cache_dtype is None:
        return
    if spec.cache_dtype not in FP8_DTYPES:
        raise ValueError(f"unknown cache_dtype {spec.cache_dtype!r}; expected None (the cache is dtype) or one of "
                         f"{FP8_DTYPES}")
    if spec.kv_cache is None or spec.dtype in FP8_DTYPES:
        raise ValueError(f"cache_dtype={spec.cache_dtype!r} is a KV cache's dtype: it needs kv_cache and a dtype of "
                         f"fp16 or bf16 (q's and O's), got kv_cache={spec.kv_cache!r}, dtype={spec.dtype!r}")
    for field in ("head_dim", "head_dim_v"):
        if (getattr(spec, field) or spec.head_dim) % CACHE_FP8_ROW_MULTIPLE:
            raise ValueError(f"{field}={getattr(spec, field)} with cache_dtype={spec.cache_dtype!r}: an 8-bit cache's "
                             f"rows are copied in 16-byte chunks, so its head dims are multiples of "
                             f"{CACHE_FP8_ROW_MULTIPLE}")


def cache_fp8_layout(spec, row: int, q_stage: int, kv_stage: int) -> SharedLayout:
    """An 8-bit cache's shared memory: Q, one widened K tile and one V tile (the mmas' operands, in
    dtype), then num_stages stages of raw e4m3 K rows and of V rows (a byte per element, head_dim_pad
    wide plus 16 bytes against bank conflicts); absorbed MLA's V is K's."""
    raw_row = spec.head_dim_pad + 16
    raw_stage = spec.block_n * raw_row
    k_offset = q_stage
    v_offset = k_offset if spec.v_from_k else k_offset + kv_stage
    k_raw = v_offset + kv_stage
    v_raw = k_raw if spec.v_from_k else k_raw + spec.num_stages * raw_stage
    total = v_raw + spec.num_stages * raw_stage
    return SharedLayout(row, 0, 1, q_stage, k_offset, v_offset, spec.num_stages, kv_stage, total,
                        k_raw_offset=k_raw, v_raw_offset=v_raw, raw_row_bytes=raw_row)

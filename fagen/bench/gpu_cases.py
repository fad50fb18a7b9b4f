"""The gpu tests' parameter tables, shared by the tests (tests/gpu/test_gpu_kernels.py,
tests/gpu/test_gpu_decode.py, test_gpu_sm90_features.py, test_gpu_sm90_backward_rows.py,
tests/gpu/test_gpu_distributed.py) and by the precompile section's calls
(kernel_calls.gpu_test_calls), so that what precompile builds follows the tests' own cases.
Plain data, no torch: the tests import it at collection.
"""

from __future__ import annotations

import itertools

# -- tests/gpu/test_gpu_kernels.py ----------------------------------------------------------------

# (batch, seqlen_q, seqlen_k, heads, kv_heads): square; ragged with GQA; more queries than keys,
# where causal rows i < Nq - Nk see no key at all.
SHAPES = [(2, 256, 256, 4, 4), (2, 97, 161, 4, 2), (1, 161, 97, 3, 3), (1, 300, 40, 2, 1)]
# (version, dtype, causal, head_dim): flash_attn_func's forward, L and backward.
MATRIX = list(itertools.product((2, 1), ("fp16", "bf16"), (False, True), (64, 128)))
DROPOUT_P = 0.17
# (version, dtype, head_dim): the dropout mask read off the output, forward and backward.
DROPOUT_CASES = [(2, "fp16", 64), (2, "bf16", 128), (1, "fp16", 128), (1, "bf16", 64)]
# (dtype, head_dim) of test_dropout_mask_is_seeded_by_torch, for versions 2 and 1.
SEEDED_DROPOUT = ("fp16", 64)
# (version, causal, head_dim) of the deterministic backward, bf16.
DETERMINISTIC_CASES = list(itertools.product((2, 1), (False, True), (64, 128)))
# tests/support/kernel_cases.run_and_check on CUDA tensors: (Spec flags, shape), bf16, versions 2 and 1,
# at the head dims of KERNEL_CASE_HEAD_DIMS (d=128 is in the matrix above; keep compiles few).
KERNEL_CASES = [({"mask": "causal"}, (1, 300, 40, 2, 1)), ({"key_padding": True}, (2, 70, 90, 2, 2)),
                ({"key_padding": True, "mask": "causal", "dropout": True}, (2, 130, 130, 4, 1)),
                ({"mask": "causal", "num_stages": 1, "block_m": 64, "block_n": 32}, (1, 300, 40, 2, 1)),
                ({"mask": "causal", "num_stages": 3, "block_m": 64, "block_n": 32}, (2, 200, 17, 2, 2)),
                ({"deterministic": True, "dropout": True}, (1, 150, 150, 2, 1))]
KERNEL_CASE_HEAD_DIMS = (64, 256)
KERNEL_CASE_VERSIONS = (2, 1)
# The d=128 tiles and one-stage backward of the 99 KB parts (sm_86/89/120), on whatever GPU is
# at hand: (Spec flags, shape), bf16 d=128, versions 2 and 1.
SINGLE_STAGE_CASES = [({"block_n": 32, "bwd_stages": 1, "mask": "causal", "key_padding": True, "dropout": True},
                       (2, 200, 170, 4, 2)),
                      ({"block_n": 32, "bwd_stages": 1, "mask": "causal", "dropout": True, "deterministic": True},
                       (1, 150, 190, 2, 2))]

# -- tests/gpu/test_gpu_decode.py -----------------------------------------------------------------

# name: (tests/support/kvcache_cases.Case arguments, check_call arguments); dtype as fagen names it
# (fp16 when absent). The cache: B = 3 entries, H = 4 query heads over HK = 2, d = 64.
DECODE_CASES = {
    "contiguous, no append, split 3": (dict(), dict(num_splits=3)),
    "append + rotary, causal, heuristic": (dict(nq=3, new=3, seed=1), dict(causal=True, rotary=(32, True))),
    "paged 16, append + rotary, split 2": (dict(nq=2, new=2, page=16, seed=2),
                                           dict(causal=True, rotary=(64, False), num_splits=2)),
    "batch_idx + leftpad, bf16": (dict(dtype="bf16", nq=2, new=2, batch_idx=True, leftpad=True, seed=4),
                                  dict(causal=True, rotary=(16, True), num_splits=3)),
}
DECODE_SHAPE = {"batch": 3, "heads": 4, "kv_heads": 2, "head_dim": 64, "capacity": 128}
# The decoding step captured in a CUDA graph: one new token, pages of 16, two splits.
DECODE_GRAPH_CASE = (dict(new=1, page=16, seed=5), dict(num_splits=2))

# -- tests/gpu/test_gpu_sm90_features.py: the sm90 family past d = 256, and paged varlen -------------

# The forward's Specs (with arch_family=SM90.name): O in two 256-column slices at 32-key tiles, and
# d_v = 320 in two 192-column slices at 64-key tiles.
SM90_WIDE_SPECS = [dict(head_dim=512, dtype="bf16", mask="causal"), dict(head_dim=320, dtype="fp16", key_padding=True)]
# A d = 512 decoding step (DECODE_CASES' form, the cache d wide) and absorbed MLA's layouts
# (tests/support/kvcache_cases.check_mla's arguments: one fp16 cache of 576-wide rows, V its first 512).
SM90_WIDE_DECODE = (dict(nq=1, new=1, capacity=256, head_dim=512, seed=5), dict(num_splits=2))
SM90_MLA_LAYOUTS = {"paged64_split2": dict(page=64, num_splits=2),
                    "128_heads": dict(batch=1, heads=128, page=64, capacity=192)}
# Packed queries over a paged cache (tests/support/varlen_paged_cases: fp16, d = 64, H = 4 over
# HK = 2), causal, in pages of this many rows, with these variants.
SM90_VARLEN_PAGED_PAGE = 16
SM90_VARLEN_PAGED_VARIANT = {"window_size": (9, 0), "softcap": 20.0}
SM90_VARLEN_PAGED_SLOPES = [0.5, 0.25, 0.1, 0.05]

# -- tests/gpu/test_gpu_sm90_backward_rows.py: issue 44's rows -------------------------------------

# The head dims of its rows, bf16, causal or not: the sm90 family's backward (deterministic too) and
# the sm80 family's; on the emulator (and so for precompile's recording) at SM90_BACKWARD_ROW_SMALL,
# (batch, seqlen, heads).
SM90_BACKWARD_ROW_HEAD_DIMS = (64, 128, 256)
SM90_BACKWARD_ROW_SMALL = (1, 150, 2)

# -- tests/gpu/test_gpu_fp8_forward.py: issue 45's forward rows -------------------------------------

# The e4m3 forward's head dims (the sm90 family's: arch_families.SM90_FP8_HEAD_DIMS), causal or not,
# beside the bf16 sm90 forward and SDPA; on the emulator (and for precompile's recording) at
# FP8_FORWARD_ROW_SMALL, (batch, seqlen, heads).
FP8_FORWARD_ROW_HEAD_DIMS = (128, 256)
FP8_FORWARD_ROW_SMALL = (1, 300, 2)

# tests/gpu/test_gpu_fp8_decode.py: decoding from an 8-bit cache (tests/support/fp8_cache_cases.Fp8Case's
# arguments, then the call's), contiguous and paged, unsplit and split.
FP8_DECODE_CASES = {"contiguous": (dict(), dict(num_splits=1)), "paged 32 split 3": (dict(page=32), dict(num_splits=3))}

# -- tests/gpu/test_gpu_distributed.py ------------------------------------------------------------

RING_LAYOUTS = ("zigzag", "contiguous")
RING_DROPOUT_PS = (0.0, 0.2)
# (batch, seqlen, heads, kv_heads, head_dim), bf16, causal.
RING_SHAPE = (2, 512, 8, 2, 128)

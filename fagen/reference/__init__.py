"""fagen.reference: float64 attention on the CPU, the oracle of every kernel test.

It imports nothing of fagen but `fagen.spec`, so it can never share a bug
with the code generator it checks.

  naive       the closed forms (attention_forward, attention_backward) and
              attention_gradients (autograd, with dlse, sinks and score_mod
              captures); the forward covers flash-attn 2.8's variants:
              sliding window, softcap, ALiBi, attention sinks, and
              FlexAttention's score_mod / mask_mod
  problem     argument checks, masks (padding, causal, window, mask_mod) and
              score modifications, shared by every function here
  fa1, fa2    FlashAttention-1 and -2 as executable specifications, tiled by a
              Spec's block sizes, each counting its HBM traffic (hbm.IOCount)
  standard    the FlashAttention-1 paper's Algorithm 0, with its HBM traffic
  philox      Philox4x32-10 in NumPy and the dropout keep mask
  same_dtype  plain PyTorch in fp16/bf16: the yardstick of the tolerance rule
              (the same variants; return_extra adds lse, dsinks, captures)
  same_fp8    the fp8 forward's roundings alone (e4m3 inputs with descales, P scaled
              by 2^8 and rounded to e4m3): the yardstick of fp8's accuracy rule
  same_fp8_backward  the fp8 backward's roundings (8-bit inputs, P or dS to fp8 per GEMM): its yardstick
  empty_rows  the convention for rows that see no key (m = -inf, l = 0, L = +inf, O = 0)

All functions take q (B, Nq, H, d) and k, v (B, Nk, Hk, d) of any float dtype
and return float64, but the yardsticks: same_dtype returns the inputs' dtype,
same_fp8 takes e4m3 and returns bf16, as the kernels they measure.
"""

from .empty_rows import EMPTY_ROW_LSE, EMPTY_ROW_MAX, EMPTY_ROW_SUM, lse_from_stats
from .fa1 import fa1_backward, fa1_forward
from .fa2 import fa2_backward, fa2_forward
from .hbm import IOCount
from .naive import (attention_backward, attention_forward, attention_gradients,
                    row_statistics)
from .philox import (dropout_key, dropout_keep_mask, dropout_threshold, dropout_words,
                     philox4x32_10, philox4x32_round)
from .same_dtype import attention_same_dtype
from .standard import standard_forward

__all__ = [
    "EMPTY_ROW_LSE", "EMPTY_ROW_MAX", "EMPTY_ROW_SUM", "IOCount",
    "attention_backward", "attention_forward", "attention_gradients", "attention_same_dtype",
    "dropout_keep_mask", "dropout_key", "dropout_threshold", "dropout_words", "fa1_backward", "fa1_forward",
    "fa2_backward", "fa2_forward", "lse_from_stats", "philox4x32_10", "philox4x32_round", "row_statistics",
    "standard_forward",
]

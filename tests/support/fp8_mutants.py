"""The 8-bit forward's mutants (issue 45): a descale dropped, P's scale off by one exponent, V not
transposed, and P truncated where it is rounded; each killed by `fp8_check`, the accuracy rule on a
GQA shape whose descales differ per (batch, K/V head). And the 8-bit KV cache's (part 2): a descale
dropped, the bytes widened as e5m2, the append truncating or not saturating; each killed by
fp8_cache_cases.fp8_cache_kernels_check. And the fp8 backward's (part 3): each descale it applies
left out, killed by `fp8_backward_check`; with 8-bit S and dP, dO's type misread, V's tile from K,
and the 8-bit stage's barriers broken, killed by `fp8_scores_check`. Joined to
tests/support/kernel_mutants.py's."""

from __future__ import annotations

import os
from unittest import mock

import torch

from fagen.kernels import fp8_operands
from fagen.spec import Spec
from fp8_backward_cases import run_fp8_backward_case
from fp8_cache_cases import fp8_cache_kernels_check
from fp8_cases import run_fp8_case
from kernel_cases import Shape
from kernel_checks import SM90_SCHEDULES
from kernel_mutant import Edit, KernelMutant

FP8 = Spec(128, dtype="e4m3", mask="causal", arch_family="sm90")
FP8_CACHE = Spec.for_kv_cache(64, "bf16", causal=False, page_size=32, cache_dtype="e4m3")
FP8_BACKWARD = Spec(64, dtype="e4m3", mask="causal", arch_family="sm90")
FP8_SCORES = FP8_BACKWARD.replace(dout_dtype="e5m2")   # S and dP by 8-bit wgmma (Sm90BackwardTiles.fp8_scores)


def fp8_backward_check(spec: Spec, source=None) -> None:
    """GQA, ragged tiles, descales that differ per (batch, K/V head): the fp8 backward's rule."""
    run_fp8_backward_case(spec, Shape(2, 100, 140, heads=4, kv_heads=2), source=source)


def fp8_scores_check(spec: Spec, source=None) -> None:
    """The 8-bit S^T and dP^T (an e5m2 dO): three query blocks of 128 through the bf16 stages' two and
    the 8-bit stage's one (each reused, both parities), two key blocks (the last ragged), GQA, under
    the schedules that reorder the producer and the consumers, with the racecheck; the rule each time."""
    for schedule in SM90_SCHEDULES:
        with mock.patch.dict(os.environ, {"FAGEN_EMULATE_SCHEDULE": schedule, "FAGEN_EMULATE_SEED": "0",
                                          "FAGEN_EMULATE_RACECHECK": "1"}):
            run_fp8_backward_case(spec, Shape(1, 300, 200, heads=2, kv_heads=1), source=source,
                                  do_format=spec.dout_dtype)


def fp8_chain_check(spec: Spec, source=None) -> None:
    """The score chain (a softcap of 20, ALiBi with slopes 2^-1 .. 2^-4, as `spec` has them) on GQA,
    ragged tiles, descales that differ per (batch, K/V head): the fp8 backward's rule."""
    variant = {**({"softcap": 20.0} if spec.softcap else {}),
               **({"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])} if spec.alibi else {})}
    run_fp8_backward_case(spec.replace(softcap=False, alibi=False), Shape(2, 100, 140, heads=4, kv_heads=2), variant,
                          source=source, do_format=spec.dout_dtype or "e4m3")


def fp8_check(spec: Spec, source=None) -> None:
    """Four key tiles through the two stages (224 keys each), a ragged last one, GQA: the fp8 accuracy rule; then V
    about 3, so that O is too, and a bias in P's rounding moves it by as much (a rounding that is
    only unbiased-looking on random signs)."""
    shape = Shape(2, 150, 800, heads=4, kv_heads=2)
    run_fp8_case(spec, shape, source=source)
    run_fp8_case(spec, shape, source=source, v_mean=3.0)


def _v_untransposed(v: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """V as it comes, (B, Hk, Nk, d_v), its keys padded as V^T's: the keys down the rows where V^T
    has V's columns."""
    padded = -(-v.shape[1] // multiple) * multiple
    return torch.nn.functional.pad(v.permute(0, 2, 1, 3).view(torch.uint8), (0, 0, 0, padded - v.shape[1])).view(v.dtype)


# A conversion that clamps but truncates (rounds toward zero) where cvt.rn.satfinite rounds to nearest:
# fp32's mantissa cut to e4m3's 3 bits, so that the conversion after it is exact.
_TRUNCATED_E4M3X4 = '''__device__ __forceinline__ float toward_zero(float x) { return __uint_as_float(__float_as_uint(x) & 0xfff00000u); }
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  a = toward_zero(a); b = toward_zero(b); c = toward_zero(c); d = toward_zero(d);'''

MUTANTS = [
    KernelMutant("fp8: q's descale dropped", FP8,
                 (Edit("const float qk_descale = q_descale[descale_at] * k_descale[descale_at];",
                       "const float qk_descale = k_descale[descale_at];"),), (fp8_check,)),
    KernelMutant("fp8: v's descale dropped", FP8,
                 (Edit("const float out_scale = v_descale[descale_at] * fagen::kPScaleInverse;",
                       "const float out_scale = fagen::kPScaleInverse;"),), (fp8_check,)),
    KernelMutant("fp8: the descales of the query head, not its K/V head", FP8,
                 (Edit("const int descale_at = batch * kv_heads + kv_head;",
                       "const int descale_at = batch * kv_heads + head % kv_heads;"),), (fp8_check,)),
    KernelMutant("fp8: P's scale one exponent up (P~ past e4m3's 448)", FP8,
                 (Edit("constexpr int kPExponent = 8;", "constexpr int kPExponent = 9;", "fp8.cuh"),), (fp8_check,)),
    KernelMutant("fp8: P~'s exponent one less in the softmax than in l's", FP8,
                 (Edit("(offset[r] - fagen::kPExponent)", "(offset[r] - (fagen::kPExponent - 1))"),), (fp8_check,)),
    KernelMutant("fp8: V not transposed", FP8, (), (fp8_check,),
                 host=((fp8_operands, "v_in_slot_order", _v_untransposed),)),
    KernelMutant("fp8: V^T's keys in their own order, not pack_p's", FP8, (), (fp8_check,),
                 host=((fp8_operands, "SLOT_OF_KEY", tuple(range(fp8_operands.GROUP))),)),
    KernelMutant("fp8: P truncated (saturated, not rounded)", FP8,
                 (Edit("__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {",
                       _TRUNCATED_E4M3X4, "fp8.cuh"),), (fp8_check,)),
    KernelMutant("fp8 cache: k's descale dropped", FP8_CACHE,
                 (Edit("fagen::descale_all(s, k_scale);", "(void)k_scale;"),), (fp8_cache_kernels_check,)),
    KernelMutant("fp8 cache: v's descale dropped", FP8_CACHE,
                 (Edit("fagen::descale_all(o, v_scale);", "(void)v_scale;"),), (fp8_cache_kernels_check,)),
    KernelMutant("fp8 cache: the bytes widened as e5m2", FP8_CACHE,
                 (Edit("__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)", "__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E5M2)",
                       "fp8_cache.cuh"),), (fp8_cache_kernels_check,)),
    KernelMutant("fp8 cache: the append truncates (rounds toward zero)", FP8_CACHE,
                 (Edit("return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);",
                       "return __nv_cvt_float_to_fp8(__uint_as_float(__float_as_uint(x) & 0xfff00000u), __NV_SATFINITE, "
                       "__NV_E4M3);", "fp8_cache.cuh"),), (fp8_cache_kernels_check,)),
    KernelMutant("fp8 cache: the append does not saturate", FP8_CACHE,
                 (Edit("return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);",
                       "return __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E4M3);", "fp8_cache.cuh"),),
                 (fp8_cache_kernels_check,)),
    KernelMutant("fp8 backward: q's descale left out of the softmax's scale", FP8_BACKWARD,
                 (Edit("softmax_scale_log2 *= q_descale[descale_at] * k_descale[descale_at];",
                       "softmax_scale_log2 *= k_descale[descale_at];"),), (fp8_backward_check,)),
    KernelMutant("fp8 backward: dK's store without v's descale", FP8_BACKWARD,
                 (Edit("const float dk_scale = softmax_scale * do_descale[descale_at] * v_descale[descale_at] * "
                       "q_descale[descale_at];",
                       "const float dk_scale = softmax_scale * do_descale[descale_at] * q_descale[descale_at];"),),
                 (fp8_backward_check,)),
    KernelMutant("fp8 backward: dV's store without dO's descale", FP8_BACKWARD,
                 (Edit("const float dv_scale = do_descale[descale_at];", "const float dv_scale = 1.f;"),),
                 (fp8_backward_check,)),
    KernelMutant("fp8 backward: D without o's descale over v's", FP8_BACKWARD,
                 (Edit("partial *= o_descale[descale_at] / v_descale[descale_at];", "(void)descale_at;"),),
                 (fp8_backward_check,)),
    KernelMutant("fp8 backward: dQ's conversion without k's descale", FP8_BACKWARD,
                 (Edit("softmax_scale *= do_descale[descale_at] * v_descale[descale_at] * k_descale[descale_at];",
                       "softmax_scale *= do_descale[descale_at] * v_descale[descale_at];"),), (fp8_backward_check,)),
]
# The score chain's descales (a softcap's tau / c, ALiBi's -slope / tau): q's and k's joined.
MUTANTS += [
    KernelMutant("fp8 backward: the softcap's argument without q's and k's descales",
                 FP8_SCORES.replace(dout_dtype="e4m3", softcap=True),
                 (Edit("  softcap_scale *= q_descale[descale_at] * k_descale[descale_at];", ""),), (fp8_chain_check,)),
    KernelMutant("fp8 backward: ALiBi's scale without q's and k's descales", FP8_SCORES.replace(alibi=True),
                 (Edit("  softmax_scale *= q_descale[descale_at] * k_descale[descale_at];\n", ""),),
                 (fp8_chain_check,)),
]
# The 8-bit S^T and dP^T (FP8_SCORES): dO's type, and the 8-bit stage's ring.
_DP_RETIRED = ("    fagen::wgmma_fence_operands<kBlockM>(dpt);\n    fagen::wgmma_wait<0>();\n"
               "    fagen::wgmma_fence_operands<kBlockM>(dpt);\n")
_RELEASE = ("    // This warp's S^T and dP^T wgmmas have read the 8-bit stage: the producer may refill it.\n"
            "    __syncwarp();\n    if (fagen::elect_one_sync()) fagen::mbarrier_arrive(&bars->empty8[s8]);\n")
_WAIT_THEN_RELEASE, _RELEASE_THEN_WAIT = _DP_RETIRED + _RELEASE, _RELEASE + _DP_RETIRED
MUTANTS += [KernelMutant(f"fp8 backward, 8-bit S and dP: {name}", FP8_SCORES, (Edit(old, new),), (fp8_scores_check,))
            for name, old, new in [
    ("dO's e5m2 bytes read as e4m3", "constexpr bool kDoE5m2 = true;", "constexpr bool kDoE5m2 = false;"),
    ("V's 8-bit tile loaded from K's tensor", "load_row_box(tiles + kV8Offset, v_map,",
     "load_row_box(tiles + kV8Offset, k8_map,"),
    ("the consumers' wait for the 8-bit stage deleted",
     "    fagen::mbarrier_wait_parity(&bars->full8[s8], static_cast<uint32_t>(it / kStages8) & 1);\n", ""),
    ("the producer's wait for the 8-bit stage to empty deleted",
     "    fagen::mbarrier_wait_parity(&bars->empty8[s8], (static_cast<uint32_t>(it / kStages8) & 1) ^ 1);\n", ""),
    ("the 8-bit stage given back before dP^T's wgmma group retires", _WAIT_THEN_RELEASE, _RELEASE_THEN_WAIT),
    ("the 8-bit stage's bytes expected one tile short",
     "fagen::mbarrier_arrive_expect_tx(&bars->full8[s8], 2 * kQ8Bytes);",
     "fagen::mbarrier_arrive_expect_tx(&bars->full8[s8], kQ8Bytes);"),
]]

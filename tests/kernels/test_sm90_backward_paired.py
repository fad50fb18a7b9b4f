"""The sm90 family's paired backward (templates/sm90/hopper_bwd_paired.cu.j2, d > 128 or d_v != d):
two consumer warpgroups share a key block's 64 keys, each computing S^T and dP^T for half the
queries and storing its half of P^T and dS^T to shared tiles; one then accumulates dK, the other
dV, and each adds its boxes of dQ into one tile, which the writer warp reduces. Run by the emulator
after the sm90 forward: dQ, dK and dV against the float64 oracle under FlashAttention-2's rule,
every output buffer poisoned; d 192 (two Q/dO stages, three dQ boxes: an odd one for the first
warpgroup) and d 256 (one stage); d_v != d (DeepSeek-V3's 192/128, and 128/64: V, dO and dV d_v
wide); GQA, MQA, ragged blocks, key padding, masks and score chains, and what spilled in the other
form at d = 128: dropout, mask_mods, score_mods (captured tensors' gradients, exact sums when
deterministic), ALiBi with the softcap, and at d = 64 a score_mod with a mask_mod (packed
sequences: tests/ops/test_varlen.py); under the schedules that reorder producer and consumers, with the
racecheck; deterministic; compiled by NVRTC for sm_90a without spills or serialised wgmma."""

from __future__ import annotations

import pytest
import torch

import fagen
import kernel_checks as checks
from fagen.arch_families import sm90_backward_refusal, sm90_backward_tiles
from fagen.kernels.families import KERNEL_FAMILIES
from fagen.kernels.render import render
from fagen.spec import Spec
from fagen.variants import custom_mod, trace_mask_mod, trace_score_mod
from kernel_cases import Shape, run_and_check
from sm90_cases import ALIBI_SOFTCAP, BIAS, check_sm90_kernel_compiles, gated, relative_bias
from variant_cases import run_variant_case

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

SM90 = KERNEL_FAMILIES["sm90"]
PAIRED = [Spec(192, dtype="bf16", arch_family="sm90"), Spec(256, dtype="fp16", mask="causal", arch_family="sm90")]
# Ragged query and key blocks, GQA over two batches; Nq > Nk under causal (rows that see no key)
# with MQA; Nk > Nq, where a causal key block walks masked blocks, then unmasked ones.
SHAPES = {"ragged_gqa": Shape(2, 150, 200, heads=4, kv_heads=2), "more_queries_mqa": Shape(1, 200, 130, 2, 1),
          "diagonal_then_unmasked": Shape(1, 200, 260, heads=2, kv_heads=2)}


def _is_paired(spec: Spec) -> bool:
    return SM90.backward_of(spec).templates == ("sm90/hopper_bwd_paired.cu.j2",)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
@pytest.mark.parametrize("spec", PAIRED, ids=lambda s: s.name)
def test_the_paired_backward_matches_the_oracle(spec, shape):
    assert _is_paired(spec)
    run_and_check(spec, shape)


# d_v != d: dP^T over d_v, dV's accumulator in the first d_v / 2 of dK's registers.
HEAD_DIM_V = [Spec(192, head_dim_v=128, dtype="bf16", mask="causal", arch_family="sm90"),
              Spec(128, head_dim_v=64, dtype="fp16", arch_family="sm90")]


@pytest.mark.parametrize("spec", HEAD_DIM_V, ids=lambda s: s.name)
def test_a_narrower_v_matches_the_oracle(spec):
    assert _is_paired(spec)
    run_and_check(spec, SHAPES["ragged_gqa"])
    run_and_check(spec, SHAPES["more_queries_mqa"])


# Dropout: a warpgroup's keep bits are those of its 32 queries (16 a thread), bit for bit the
# forward's; with coordinate offsets (a shard's) and key padding.
DROPOUT = [Spec(128, dtype="bf16", mask="causal", dropout=True, arch_family="sm90"),
           Spec(256, dtype="fp16", dropout=True, coord_offsets=True, key_padding=True, arch_family="sm90")]


@pytest.mark.parametrize("spec", DROPOUT, ids=lambda s: s.name)
def test_dropout_replays_the_forwards_keep_bits(spec):
    assert _is_paired(spec)
    run_and_check(spec, SHAPES["ragged_gqa"])


# Score chains in natural-log units and mask_mods: the element's query is its warpgroup's half's.
CHAINS = {"relative_bias_d192": (Spec(192, mask="causal", arch_family="sm90"), {"score_mod": relative_bias}, (BIAS,)),
          "gated_d256": (Spec(256, dtype="bf16", arch_family="sm90"), {"score_mod": gated}, ()),
          "alibi_softcap_d128": (Spec(128, mask="causal", dtype="bf16", arch_family="sm90"), ALIBI_SOFTCAP, ()),
          "relative_bias_dropout_d128": (Spec(128, dropout=True, dtype="bf16", arch_family="sm90"),
                                         {"score_mod": relative_bias}, (BIAS,))}


@pytest.mark.parametrize("case", CHAINS.values(), ids=CHAINS)
def test_score_chains_and_captured_gradients_match_the_oracle(case):
    base, variant, captures = case
    run_variant_case(base, SHAPES["ragged_gqa"], variant, captures=captures)


def test_a_documents_mask_mod_matches_the_oracle():
    spec = Spec(128, mask_mod=custom_mod(trace_mask_mod(checks.document_mask)), dtype="bf16", arch_family="sm90")
    assert _is_paired(spec)
    checks.variant_check(spec)


def test_a_bias_over_documents_at_d64_matches_the_oracle():
    """A score_mod with a mask_mod at d = 64 (which spilled in the other form): the bias's gradient
    beside the documents' walk and element test."""
    base = Spec(64, mask="causal", arch_family="sm90")
    assert _is_paired(base.replace(score_mod=custom_mod(trace_score_mod(relative_bias)),
                                   mask_mod=custom_mod(trace_mask_mod(checks.document_mask))))
    run_variant_case(base, checks.VARIANT_SHAPE, {"score_mod": relative_bias, "mask_mod": checks.document_mask},
                     captures=(BIAS,))


def test_dropout_is_race_free_under_every_schedule():
    checks.sm90_backward_check(DROPOUT[0])


def test_a_deterministic_captured_gradient_repeats_bit_for_bit():
    """The bias's terms in an exact sum (fagen/exact_sum.cuh) from both warpgroups of every block."""
    generator = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, n, h, 128, generator=generator).to(torch.float16).requires_grad_()
               for n, h in ((150, 2), (200, 1), (200, 1)))
    bias = (torch.randn(2, 512, generator=generator) * 0.5).requires_grad_()
    def call():
        out = fagen.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                    score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 256])
        return out, (q, k, v, bias)

    found = checks.op_gradients(call, "sm90")
    assert checks.differing(found, ("dq", "dk", "dv", "dbias")) == []


def test_d256_takes_one_stage_and_d192_two():
    """Two stages of Q and dO at d = 256 would need 272 KB: it runs one, within 227 KB."""
    tiles = [sm90_backward_tiles(spec) for spec in PAIRED]
    assert [(t.paired, t.stages, t.block_m, t.block_n, t.consumers) for t in tiles] == [(True, 2, 64, 64, 2),
                                                                                      (True, 1, 64, 64, 2)]
    for spec, found in zip(PAIRED, tiles):
        assert render(spec).kernels.bwd_main.shared_bytes == found.shared_bytes <= 227 * 1024


# Masks, sinks (through L), the softcap alone and ALiBi alone.
VARIANTS = [Spec(192, window=True, mask="causal", arch_family="sm90"),
            Spec(256, softcap=True, sinks=True, dtype="bf16", arch_family="sm90"),
            Spec(192, alibi=True, mask="causal", dtype="bf16", arch_family="sm90")]


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_masks_sinks_softcap_and_alibi_match_the_oracle(spec):
    assert _is_paired(spec)
    checks.variant_check(spec)


def test_key_padding_aligns_causal_to_each_entrys_own_keys():
    spec = Spec(256, dtype="bf16", mask="causal", key_padding=True, arch_family="sm90")
    assert _is_paired(spec)
    checks.uneven_lengths_check(spec)


def test_keys_past_nk_stay_masked_where_every_score_is_very_negative():
    checks.negative_scores_check(PAIRED[1])


def test_every_schedule_is_race_free():
    """Producer-first, consumer-first, random and the plain order, with the happens-before racecheck:
    the warpgroups' shared P^T and dS^T tiles (kSyncBarrier), the dQ tile's hand-over to the
    writer and back."""
    checks.sm90_backward_check(PAIRED[0])


DETERMINISTIC = [Spec(256, mask="causal", deterministic=True, arch_family="sm90"),
                 Spec(192, dtype="bf16", window=True, deterministic=True, arch_family="sm90")]


def test_deterministic_repeats_are_bit_identical_and_match_the_oracle():
    """A key block's one dQ tile takes one turn per query block (dq_turn over kDqTiles)."""
    spec = DETERMINISTIC[0]
    assert _is_paired(spec)
    run_and_check(spec, Shape(1, 130, 200, heads=2, kv_heads=1))
    checks.repeat_check(spec, runs=checks.SCHEDULE_RUNS)


def test_a_deterministic_windows_turns_are_counted_over_its_query_ranges():
    """The consumers count a window's turn (the writer has no registers for its context) and hand
    it over in dq_turns."""
    spec = DETERMINISTIC[1]
    assert _is_paired(spec)
    checks.variant_check(spec)
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, n, h, 192, generator=generator).to(torch.bfloat16).requires_grad_()
               for n, h in ((200, 2), (330, 1), (330, 1)))
    found = checks.op_gradients(lambda: (fagen.flash_attn_func(q, k, v, window_size=(100, 30), deterministic=True),
                                         (q, k, v)), "sm90")
    assert checks.differing(found, ("dq", "dk", "dv")) == []


def test_the_repeat_check_fails_without_turns():
    with pytest.raises(AssertionError, match="dq differs between block orders"):
        checks.sm90_turns_check(DETERMINISTIC[0].replace(deterministic=False))


def test_what_it_does_not_take_runs_the_sm80_backward():
    """d past 256 (wgmma's N: dK's and dV's accumulators; arch_families.sm90_backward_refusal),
    with any feature, is computed by the sm80 family's backward."""
    for spec in (Spec(320, arch_family="sm90"), Spec(320, head_dim_v=256, dropout=True, arch_family="sm90")):
        assert sm90_backward_refusal(spec) is not None
        assert SM90.backward_of(spec) is KERNEL_FAMILIES["sm80"].backward[0]


@pytest.mark.parametrize("spec", [*PAIRED, *HEAD_DIM_V, DETERMINISTIC[1],
                                  Spec(256, dtype="bf16", window=True, deterministic=True, softcap=True, varlen=True,
                                       arch_family="sm90"),
                                  Spec(256, head_dim_v=192, mask="causal", deterministic=True, arch_family="sm90"),
                                  *DROPOUT, Spec(256, dropout=True, softcap=True, varlen=True, arch_family="sm90")],
                         ids=lambda s: s.name)
def test_compiles_for_sm90a_without_spills(spec):
    check_sm90_kernel_compiles(spec, "bwd_main")

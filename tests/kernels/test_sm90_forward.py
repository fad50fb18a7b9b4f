"""The sm90 family's forward (templates/sm90/hopper_fwd.cu.j2: TMA producer, two wgmma consumer
warpgroups) rendered from Specs and run by the emulator, then the backward on its O and L (the sm90
family's own at d = 64 without a variant, tests/kernels/test_sm90_backward.py; else the sm80
family's): against the float64 oracle under FlashAttention-2's rule (kernel_cases.run_and_check), with
every output buffer poisoned; under the schedules that reorder producer and consumers, with the
happens-before racecheck; compiled by NVRTC for sm_90a without spills or serialised wgmma."""

from __future__ import annotations

import pytest
import torch

from fagen.arch_families import sm90_refusal, sm90_tiles
from fagen.spec import Spec
import kernel_checks as checks
from sm90_cases import BIAS, check_every_exp2_in_flight, check_sm90_forward_compiles, relative_bias, same_document, traced
from variant_cases import run_variant_case
from kernel_cases import Shape, run_and_check

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

# A ragged query block and key tile (the tail mask, rows past Nq unstored), Nq > Nk under causal
# (rows that see no key: O = 0, L = +inf), GQA and MQA, two batches (the maps' coordinates); with
# key padding, one entry keeps every key and the other none (kernel_cases.key_lengths).
SHAPES = {"ragged_gqa": Shape(2, 150, 200, heads=4, kv_heads=2), "more_queries_mqa": Shape(1, 200, 130, 2, 1)}
SPECS = [Spec(64, dtype="bf16", mask="causal", arch_family="sm90"), Spec(128, dtype="fp16", arch_family="sm90"),
         Spec(64, dtype="fp16", key_padding=True, arch_family="sm90"),
         Spec(128, dtype="bf16", mask="causal", key_padding=True, arch_family="sm90"),
         Spec(256, dtype="bf16", mask="causal", arch_family="sm90"), Spec(256, dtype="fp16", arch_family="sm90"),
         # d_v != d: DeepSeek-V3's training shape (192, 128), and (128, 64); V's tiles and O are d_v wide.
         Spec(192, head_dim_v=128, dtype="bf16", mask="causal", arch_family="sm90"),
         Spec(128, head_dim_v=64, dtype="fp16", arch_family="sm90")]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_forward_then_the_backward_match_the_oracle(spec, shape):
    run_and_check(spec, shape)


@pytest.mark.parametrize("spec", [Spec(64, dtype="bf16", mask="causal", arch_family="sm90", sm90_block_n=32),
                                  Spec(128, dtype="fp16", arch_family="sm90", sm90_block_n=144)],
                         ids=lambda s: s.name)
def test_a_key_tile_the_spec_sets_meets_the_oracle(spec):
    """Spec.sm90_block_n (kernels.spill_free narrows a mod's): the narrowest tile, and one between
    the rule's; keys past a tile and a partial last tile."""
    assert sm90_tiles(spec).block_n == spec.sm90_block_n
    run_and_check(spec, Shape(2, 150, 170, heads=2, kv_heads=1))


def test_key_padding_aligns_causal_to_each_entrys_own_keys():
    """Entries of Nk, Nk - 37, 1 and 0 keys, more queries than keys and fewer."""
    checks.uneven_lengths_check(SPECS[3])


# flash-attn's sliding window: the block's tiles start past the window's left edge (tile skipping on
# both sides), each tile masked where the variant's tile class says it is not full.
WINDOWS = {"narrow": ((20, 7), Shape(2, 150, 170, heads=2, kv_heads=1)),
           "left_edge_past_a_tile": ((130, 0), Shape(1, 300, 700, heads=2, kv_heads=1))}


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS)
@pytest.mark.parametrize("base", [Spec(64, dtype="bf16", mask="causal", arch_family="sm90"),
                                  Spec(128, dtype="fp16", arch_family="sm90")], ids=lambda s: s.name)
def test_a_window_meets_the_oracle(base, window):
    sizes, shape = window
    run_variant_case(base, shape, {"window_size": sizes})


# The softcap alone works in units of the cap (t = tanh.approx(tau S / c), c log2(e) in the exponent,
# L = c m + log l), with a window or without; the tolerance on L is the hardware tanh's
# (variant_cases.lse_tolerance).
@pytest.mark.parametrize("variant", [{"softcap": 2.5}, {"softcap": 30.0, "window_size": (40, 10)}],
                         ids=["softcap", "softcap_window"])
@pytest.mark.parametrize("base", [Spec(64, dtype="bf16", mask="causal", arch_family="sm90"),
                                  Spec(128, dtype="fp16", arch_family="sm90")], ids=lambda s: s.name)
def test_a_softcap_meets_the_oracle(base, variant):
    run_variant_case(base, Shape(2, 150, 300, heads=2, kv_heads=1), variant)


# Dropout (FlashAttention-2's rule: l takes P whole, O the dropped P, scaled by 1 / (1 - p)) with the
# sm80 family's keep bits: run_and_check holds O against the oracle with kernel_cases' Philox mask,
# and the sm80 backward after it regenerates that mask, so a different bit fails the gradients.
DROPOUT = [Spec(64, dtype="bf16", mask="causal", dropout=True, arch_family="sm90"),
           Spec(128, dtype="fp16", dropout=True, arch_family="sm90"),
           Spec(256, dtype="bf16", dropout=True, key_padding=True, arch_family="sm90")]


@pytest.mark.parametrize("spec", DROPOUT, ids=lambda s: s.name)
def test_dropout_draws_the_sm80_familys_mask(spec):
    run_and_check(spec, Shape(2, 150, 200, heads=4, kv_heads=2))


# Sinks: every row starts from its head's logit (a key whose value row is zero), in raw score units
# or, with the softcap alone, in the cap's; the sm80 backward and the host's sink gradient after it.
@pytest.mark.parametrize("variant", [{"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
                                     {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0]), "softcap": 5.0,
                                      "window_size": (50, 0)}], ids=["sinks", "sinks_softcap_window"])
@pytest.mark.parametrize("base", [Spec(64, dtype="bf16", mask="causal", arch_family="sm90"),
                                  Spec(128, dtype="fp16", arch_family="sm90")], ids=lambda s: s.name)
def test_sinks_meet_the_oracle(base, variant):
    run_variant_case(base, Shape(2, 150, 200, heads=4, kv_heads=2), variant)


# ALiBi alone adds its bias to the raw scores, in the plain kernel's units; with a window and sinks too.
SLOPES = [0.25, 0.0625, 0.5, 0.125]


@pytest.mark.parametrize("variant", [{"alibi_slopes": torch.tensor(SLOPES)},
                                     {"alibi_slopes": torch.tensor([SLOPES] * 2), "window_size": (50, 3),
                                      "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}],
                         ids=["alibi", "alibi_window_sinks"])
@pytest.mark.parametrize("base", [Spec(64, dtype="bf16", mask="causal", arch_family="sm90"),
                                  Spec(128, dtype="fp16", arch_family="sm90")], ids=lambda s: s.name)
def test_alibi_meets_the_oracle(base, variant):
    run_variant_case(base, Shape(2, 150, 200, heads=4, kv_heads=2), variant)


# A score chain: ALiBi with a softcap, and custom mods (the same generated device functions as the sm80
# family's, on the wgmma accumulator's (row, col) map), with captured tensors and their gradients
# (the sm80 backward's); a document mask's tile classes; the narrower key tiles mods take
# (arch_families.sm90_tiles: 96, 80, 64 and 48 keys).
def _gated(score, b, h, q_idx, kv_idx):
    return score * torch.sigmoid(score)


MODS = {"alibi_softcap_d64": (Spec(64, dtype="bf16", mask="causal", arch_family="sm90"),
                              {"alibi_slopes": torch.tensor(SLOPES), "softcap": 5.0}, ()),
        "relative_bias_d64": (Spec(64, dtype="fp16", mask="causal", arch_family="sm90"),
                              {"score_mod": relative_bias}, (BIAS,)),
        "documents_d128": (Spec(128, dtype="bf16", arch_family="sm90"), {"mask_mod": same_document}, ()),
        "gated_documents_sinks_d256": (Spec(256, dtype="fp16", arch_family="sm90"),
                                       {"score_mod": _gated, "mask_mod": same_document,
                                        "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}, ()),
        "relative_bias_dropout_d192": (Spec(192, dtype="bf16", mask="causal", dropout=True,
                                            arch_family="sm90"), {"score_mod": relative_bias}, (BIAS,))}


@pytest.mark.parametrize("case", MODS.values(), ids=MODS)
def test_score_chains_and_mods_meet_the_oracle(case):
    base, variant, captures = case
    run_variant_case(base, Shape(2, 150, 200, heads=4, kv_heads=2), variant, captures=captures)


def test_dropout_with_a_window_and_a_softcap():
    run_variant_case(Spec(128, dtype="bf16", mask="causal", dropout=True, arch_family="sm90"),
                     Shape(1, 150, 300, heads=2, kv_heads=1), {"softcap": 30.0, "window_size": (60, 0)})


@pytest.mark.parametrize("schedule", ["producer-first", "consumer-first", "random"])
def test_every_schedule_is_race_free_and_exact(monkeypatch, schedule):
    """The schedules that let the producer run ahead, or the consumers first, and a seeded random
    one; the happens-before racecheck on (mbarrier phases, TMA's async proxy, wgmma operands)."""
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    run_and_check(SPECS[0], Shape(1, 150, 200, heads=2, kv_heads=1), backward=False)


# The score chains and mods at every head dim, on their key tiles (arch_families.sm90_tiles).
STATIC_MODS = [Spec(64, mask="causal", **traced(relative_bias), arch_family="sm90"),
               Spec(128, mask="causal", dropout=True, **traced(relative_bias), arch_family="sm90"),
               Spec(128, mask="causal", softcap=True, alibi=True, arch_family="sm90"),
               Spec(192, **traced(mask=same_document), arch_family="sm90"),
               Spec(256, **traced(_gated, same_document), arch_family="sm90")]


# Packed sequences (the oracle tests are tests/ops/test_varlen.py's): their guards and views too.
PACKED = [Spec(128, varlen=True, mask="causal", dtype="bf16", arch_family="sm90"),
          Spec(256, varlen=True, window=True, dropout=True, arch_family="sm90")]


def test_packed_sequences_meet_the_oracle():
    checks.packed_forward_check(PACKED[0])


@pytest.mark.parametrize("spec", SPECS + DROPOUT + STATIC_MODS + PACKED, ids=lambda s: s.name)
def test_nvrtc_compiles_the_source_for_sm_90a_without_spills_within_the_budgets(spec):
    check_sm90_forward_compiles(spec)


# The steady state of each head dim's key tile (sm90_tiles), plain and causal, with the variants
# whose scores keep the plain loop's shape; three in the default tier, the rest in the slow one.
OVERLAP = [Spec(d, dtype="bf16", arch_family="sm90", **fields)
           for d in (64, 128, 192, 256) for fields in (dict(), dict(mask="causal"))] + \
          [Spec(128, softcap=True, arch_family="sm90"), Spec(128, mask="causal", alibi=True, arch_family="sm90"),
           Spec(128, sinks=True, arch_family="sm90"), Spec(256, dropout=True, arch_family="sm90")]
OVERLAP_DEFAULT = {"fa2_d128_bf16_sm90", "fa2_d256_causal_bf16_sm90", "fa2_d128_softcap_fp16_sm90"}


@pytest.mark.parametrize("spec", [pytest.param(s, marks=() if s.name in OVERLAP_DEFAULT else pytest.mark.slow)
                                  for s in OVERLAP], ids=lambda s: s.name)
def test_every_exp2_of_the_consumer_loop_issues_while_p_v_is_in_flight(spec):
    """FlashAttention-3's intra-warpgroup overlap, read from the machine code (fagen.sass.overlap):
    the wait for P_{j-1} V_{j-1} stays after tile j's softmax (Consumer::keep_exp2_above), so
    ptxas does not hoist it above the exp2."""
    check_every_exp2_in_flight(spec)


def test_the_spec_names_the_family_and_round_trips():
    spec = Spec(128, dtype="bf16", mask="causal", arch_family="sm90")
    assert spec.name == "fa2_d128_causal_bf16_sm90" and Spec.from_name(spec.name) == spec
    assert spec.to_dict()["arch_family"] == "sm90" and "arch_family" not in Spec(128).to_dict()
    assert Spec.from_dict(spec.to_dict()) == spec
    # A key tile the spec sets (kernels.spill_free's): named, kept, refused where it is not one.
    narrow = Spec(128, dtype="bf16", arch_family="sm90", sm90_block_n=48, bwd_block_n=64)
    assert narrow.name == "fa2_d128_bf16_sm90_kn48_bwdn64" and Spec.from_name(narrow.name) == narrow
    assert Spec.from_dict(narrow.to_dict()) == narrow and "sm90_block_n" not in spec.to_dict()
    with pytest.raises(ValueError, match="sm90_block_n sets the sm90 forward's key tile: it needs arch_family"):
        Spec(128, sm90_block_n=48)
    with pytest.raises(ValueError, match="sm90_block_n must be a multiple of 16 from 32 to 256, got 40"):
        Spec(128, arch_family="sm90", sm90_block_n=40)


@pytest.mark.parametrize("fields, named", [
    (dict(head_dim=96), "head_dim=96"), (dict(version=1), "version=1"),
    (dict(head_dim=128, head_dim_v=96), "head_dim_v=96"),
])   # decoding's refusals: tests/ops/test_kvcache_sm90.py
def test_what_the_family_cannot_do_yet_is_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=f"arch_family='sm90' has no forward for {named}"):
        Spec(**{"head_dim": 128, **fields}, arch_family="sm90")
    assert sm90_refusal(Spec(**{"head_dim": 128, **fields})) is not None


def test_an_unknown_family_and_another_arch_are_refused():
    with pytest.raises(ValueError, match="unknown arch_family 'sm100'"):
        Spec(128, arch_family="sm100")
    with pytest.raises(ValueError, match="runs on sm_90 only, not on sm_80"):
        Spec(128, arch_family="sm90").check_arch("sm_80")

"""The sm90 family's 8-bit forward (Spec.fp8: e4m3 q, k and v with their descales, bf16 O;
templates/sm90/hopper_fwd.cu.j2's fp8 branches) rendered from Specs and run by the emulator: held to
the fp8 accuracy rule (tests/support/fp8_cases.py: O within twice the e4m3 model's error of the float64
oracle, L within 1e-3) with every output buffer poisoned; under the schedules with the racecheck;
compiled by NVRTC for sm_90a without spills or serialised wgmma. Bf16 and fp16 specs render as
before (their sources do not change with the fp8 branches: test_codegen's golden sources)."""

from __future__ import annotations

import pytest
import torch

from fagen.arch_families import sm90_tiles
from fagen.kernels import fp8_operands
from fagen.kernels.render import render
from fagen.spec import Spec
from fp8_cases import run_fp8_case
from kernel_cases import Shape
from sm90_cases import check_sm90_forward_compiles, relative_bias, same_document

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def fp8(head_dim: int, **fields) -> Spec:
    return Spec(head_dim, dtype="e4m3", arch_family="sm90", **fields)


# A ragged query block and key tile, GQA and MQA, Nq > Nk under causal (rows that see no key: O = 0,
# L = +inf), key padding with one entry of every key and one of none, d_v != d.
SHAPES = {"ragged_gqa": Shape(2, 150, 200, heads=4, kv_heads=2), "more_queries_mqa": Shape(1, 200, 130, 2, 1),
          "three_ragged_tiles": Shape(1, 130, 500, heads=2, kv_heads=1)}
SPECS = [fp8(128), fp8(128, mask="causal"), fp8(256, mask="causal"), fp8(128, key_padding=True),
         fp8(256, head_dim_v=128),
         # d = 64 and 192: Q's and K's rows in 64-byte boxes under the 64-byte swizzle (Sm90Tiles.box_columns)
         fp8(64, mask="causal"), fp8(192, head_dim_v=128)]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_the_fp8_forward_meets_the_accuracy_rule(spec, shape):
    run_fp8_case(spec, shape)


def test_values_about_three_show_no_bias_in_ps_rounding():
    """O about 3 (V's mean): a rounding of P~ that leans one way moves O by as much (tests/support/fp8_mutants.py
    plants a truncation); on random signs it would average away."""
    run_fp8_case(fp8(256, mask="causal"), SHAPES["ragged_gqa"], v_mean=3.0)


def test_without_descales_the_inputs_are_taken_as_they_are():
    """FlashAttention-3's q_descale=None (and k's, v's): 1."""
    run_fp8_case(fp8(128, mask="causal"), SHAPES["ragged_gqa"], descales=False)


# The variants whose values the descales reach: a window and a mask_mod (masks alone), ALiBi (its bias
# in the raw scores' units, -slope / (tau q_descale k_descale)), sinks (the logit over the same scale),
# the softcap (tanh(tau q_descale k_descale S / c)), and score chains (ALiBi with a softcap, a
# score_mod: from tau q_descale k_descale S).
VARIANTS = {"window": {"window_size": (40, 7)},
            "alibi_sinks": {"alibi_slopes": torch.tensor([0.25, 0.0625, 0.5, 0.125]),
                            "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
            "documents": {"mask_mod": same_document},
            "softcap": {"softcap": 2.5},
            "softcap_window_sinks": {"softcap": 30.0, "window_size": (40, 10),
                                     "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
            "alibi_softcap": {"alibi_slopes": torch.tensor([0.25, 0.0625, 0.5, 0.125]), "softcap": 5.0},
            "relative_bias": {"score_mod": relative_bias}}


# The window, ALiBi with sinks and the softcap in the fast tier; their combinations and the mods (an
# emulator build each) in the slow one.
SLOW_VARIANTS = ("documents", "softcap_window_sinks", "alibi_softcap", "relative_bias")


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if name in SLOW_VARIANTS else v
                                     for name, v in VARIANTS.items()], ids=VARIANTS)
def test_variants_meet_the_accuracy_rule(variant):
    run_fp8_case(fp8(128, mask="causal"), Shape(2, 150, 200, heads=4, kv_heads=2), variant)


@pytest.mark.parametrize("schedule", ["producer-first", "consumer-first", "random"])
def test_every_schedule_is_race_free(monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    run_fp8_case(SPECS[1], Shape(1, 150, 300, heads=2, kv_heads=1))


# d 128 in the fast tier; the others' compiles (3 s each) in the slow one.
@pytest.mark.parametrize("spec", [s if s.head_dim == 128 and not s.key_padding else pytest.param(s, marks=pytest.mark.slow)
                                  for s in SPECS], ids=lambda s: s.name)
def test_nvrtc_compiles_the_source_for_sm_90a_without_spills_within_the_budgets(spec):
    check_sm90_forward_compiles(spec)


def test_the_source_is_the_forward_and_the_sm90_backward_with_its_key_tiles():
    """The forward and the sm90 family's backward (a spec with sinks the forward alone:
    arch_families.fp8_backward_refusal), 128 e4m3 columns a box (64 at d = 64 and 192), FlashAttention-3's
    224-key tile at d = 128 and 128 at d = 256, and bf16 O (Spec.output_dtype)."""
    spec = fp8(128)
    source = render(spec)
    assert [e.name.rsplit("_", 1)[-1] for e in source.kernels.backward] == ["preprocess", "bwd", "convert"]
    assert "namespace hopper_bwd" in source.code and not spec.forward_only
    assert render(fp8(128, sinks=True)).kernels.backward == () and fp8(128, sinks=True).forward_only
    assert sm90_tiles(spec).box_columns == 128 and sm90_tiles(spec).block_n == 224 and sm90_tiles(fp8(256)).block_n == 128
    assert sm90_tiles(fp8(64)).box_columns == sm90_tiles(fp8(192)).box_columns == 64
    assert "typedef __nv_bfloat16 elem_t;" in source.code and "wgmma_rs_fp8" in source.code


def test_a_key_tile_the_spec_sets_meets_the_accuracy_rule():
    """Spec.sm90_block_n: any whole 32-key k-steps (V^T's boxes); three tiles of 96, the last ragged."""
    spec = fp8(128, mask="causal", sm90_block_n=96)
    assert sm90_tiles(spec).block_n == 96
    run_fp8_case(spec, Shape(1, 130, 250, heads=2, kv_heads=1))


@pytest.mark.parametrize("fields, named", [
    (dict(arch_family="sm80"), "arch_family='sm90'"), (dict(dropout=True), "dropout=True"),
    (dict(head_dim=96), "head_dim=96"),
    (dict(sm80_backward=True), "sm80_backward=True"), (dict(sm90_block_n=80), "sm90_block_n=80")])
def test_what_it_does_not_take_is_refused_by_name(fields, named):
    fields = {"head_dim": 128, "dtype": "e4m3", "arch_family": "sm90", **fields}
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Spec(**fields)


def test_packed_v_in_slot_order_starts_each_sequence_on_a_whole_tile_in_its_own_order():
    """Packed sequences' V^T: sequence b's keys from starts[b] (whole tiles of zeros between), each
    in v_in_slot_order's order counted from its own first key."""
    v = torch.randn(37 + 0 + 70, 2, 32).to(torch.float8_e4m3fn)
    cu = torch.tensor([0, 37, 37, 107], dtype=torch.int32)
    vt, starts = fp8_operands.packed_v_in_slot_order(v, cu, 32)
    assert starts.tolist() == [0, 64, 64] and vt.shape == (1, 2, 32, 224)   # 107 + 3 x 31 keys, in whole tiles
    assert not vt[..., 160:].view(torch.uint8).any()
    for b, length in enumerate((37, 0, 70)):
        own = fp8_operands.v_in_slot_order(v[int(cu[b]):int(cu[b + 1])][None], 32)
        got = vt[..., int(starts[b]):int(starts[b]) + own.shape[-1]]
        assert torch.equal(got.view(torch.uint8), own.view(torch.uint8)), b

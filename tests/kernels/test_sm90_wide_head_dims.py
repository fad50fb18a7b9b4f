"""The sm90 family's forward past d = 256 (issue 29's "and beyond"): d = 320, 384, 448 and 512 for
training, and absorbed MLA decoding (d = 576, V as K's first 512 columns). Q takes 80-144 KiB of
shared memory, so key tiles narrow to fit (arch_families._widest_fitting); past d_v = 256 a
consumer's O would not fit its registers, so each block computes one column slice of O
(Sm90Tiles.slices), S and the softmax alike. Checked as test_sm90_forward.py checks d <= 256:
against the float64 oracle (the sm80 backward after it), under the schedules with the racecheck,
and compiled by NVRTC for sm_90a without spills; decoding's cases are tests/ops/test_kvcache_sm90.py's."""

from __future__ import annotations

import pytest
import torch

from fagen.arch_families import Sm90Tiles, sm90_refusal, sm90_tiles
from fagen.kernels.render import render
from fagen.ops import kvcache
from fagen.arch_families import chosen_decoding_spec
from fagen.spec import Spec
import kernel_checks as checks
from sm90_cases import BIAS, check_every_exp2_in_flight, check_sm90_forward_compiles, relative_bias, same_document, traced
from variant_cases import run_variant_case
from kernel_cases import Shape, run_and_check

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

# d_v = 320 takes two 192-column slices, the second's last 64 columns past d_v (neither loaded nor
# stored: Sm90Tiles.last_slice_boxes_v); (448, 256) one slice at 32-key tiles; (512, 384) two slices of 192.
WIDE = [Spec(512, dtype="bf16", mask="causal", arch_family="sm90"),
        Spec(320, dtype="fp16", key_padding=True, arch_family="sm90"),
        Spec(448, head_dim_v=256, dtype="fp16", arch_family="sm90"),
        Spec(512, head_dim_v=384, dtype="bf16", arch_family="sm90"),
        Spec(384, dtype="bf16", mask="causal", dropout=True, arch_family="sm90")]
SHAPES = {"ragged_gqa": Shape(2, 150, 200, heads=4, kv_heads=2), "more_queries_mqa": Shape(1, 200, 130, 2, 1)}
# Each spec the emulator builds costs CI about 10 s on two cores: the default tier runs one of each
# kind (d 512 in two slices, d 320's short last slice under the racecheck, MLA in
# test_kvcache_sm90.py), the slow tier the rest.
slow = pytest.mark.slow


def _default_first(items, count=1):
    """`items` as pytest params, the first `count` in the default tier and the rest slow."""
    values = [item if isinstance(item, tuple) else (item,) for item in items]
    return [pytest.param(*value, marks=() if i < count else slow) for i, value in enumerate(values)]


def test_the_geometry_fits_an_sm90_block():
    """Key tiles, O's slices and shared memory per head dim (Q, two stages, the swizzle's slack)."""
    table = {(s.head_dim, s.head_dim_v): (t.block_n, t.slices, t.slice_columns, t.shared_bytes)
             for s in WIDE for t in [sm90_tiles(s)]}
    assert table == {(512, 512): (32, 2, 256, 230400), (320, 320): (64, 2, 192, 214016),
                     (448, 256): (32, 1, 256, 205824), (512, 384): (32, 2, 192, 222208),
                     (384, 384): (32, 2, 192, 173056)}   # dropout: 32 keys (48 spilled its Philox words)
    mla = sm90_tiles(_mla_spec())
    assert (mla.block_n, mla.slices, mla.slice_columns, mla.shared_bytes) == (32, 2, 256, 222208)
    assert all(t.fits for t in map(sm90_tiles, WIDE + [_mla_spec()]))
    assert sm90_tiles(Spec(384, dtype="bf16", arch_family="sm90")).block_n == 48   # the widest that fits
    assert render(WIDE[0]).kernels.forward.grid(2, 4, 150) == (4, 4, 2)   # two row blocks, two slices each


def test_the_last_slice_loads_only_its_boxes_below_d_v():
    """Where whole-box slices overrun d_v (320, 448), the last slice's box past d_v lies wholly
    outside V: not loaded, nor counted in a stage's bytes (the emulator refuses such a load)."""
    table = {dv: (t.slices, t.slice_columns, t.last_slice_boxes_v) for dv in (256, 320, 384, 448, 512)
             for t in [Sm90Tiles(512, dv)]}
    assert table == {256: (1, 256, 4), 320: (2, 192, 2), 384: (2, 192, 3), 448: (2, 256, 3), 512: (2, 256, 4)}
    code = render(WIDE[1]).code
    assert "constexpr int kLastSliceBoxesV = 2;" in code and "stage_bytes = kKBytes + boxes_v * kKBox;" in code
    assert "kLastSliceBoxesV" not in render(WIDE[3]).code   # d_v = 384: its slices end at d_v


# The short last slice (d_v = 448 here; 320 is WIDE[1]'s) in training, packed sequences and decoding:
# the stale shared memory in place of its unloaded box must reach no stored value.
@slow
def test_a_short_last_slice_meets_the_oracle():
    run_and_check(Spec(448, dtype="fp16", mask="causal", arch_family="sm90"), SHAPES["ragged_gqa"])
    checks.packed_forward_check(Spec(320, varlen=True, dtype="bf16", arch_family="sm90"))


@pytest.mark.parametrize("spec, shape", _default_first([(spec, shape) for spec in WIDE for shape in SHAPES.values()]),
                         ids=[f"{spec.name}-{name}" for spec in WIDE for name in SHAPES])
def test_forward_then_the_sm80_backward_match_the_oracle(spec, shape):
    run_and_check(spec, shape)


@pytest.mark.parametrize("variant", [{"softcap": 30.0, "window_size": (40, 10)},
                                     {"alibi_slopes": torch.tensor([0.25, 0.0625, 0.5, 0.125]),
                                      "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}],
                         ids=["softcap_window", "alibi_sinks"])
@slow
def test_variants_meet_the_oracle(variant):
    run_variant_case(Spec(512, dtype="bf16", mask="causal", arch_family="sm90"),
                     Shape(2, 150, 200, heads=4, kv_heads=2), variant)


# Custom mods over captured tensors (the sm80 backward's capture gradients after them), at 32-key
# tiles (arch_families.sm90_tiles: wider spilled a mod's state at d = 320).
@pytest.mark.parametrize("base, variant, captures", [
    (Spec(512, dtype="bf16", mask="causal", arch_family="sm90"), {"score_mod": relative_bias}, (BIAS,)),
    (Spec(320, dtype="fp16", dropout=True, arch_family="sm90"),
     {"score_mod": relative_bias, "mask_mod": same_document}, (BIAS,))], ids=["relative_bias_d512",
                                                                                 "bias_documents_dropout_d320"])
@slow
def test_mods_meet_the_oracle(base, variant, captures):
    run_variant_case(base, Shape(2, 150, 200, heads=4, kv_heads=2), variant, captures=captures)


STATIC_MODS = [Spec(512, mask="causal", **traced(relative_bias), arch_family="sm90"),
               Spec(448, mask="causal", dropout=True, **traced(relative_bias), arch_family="sm90"),
               Spec(320, **traced(relative_bias, same_document), arch_family="sm90"),
               Spec(512, window=True, softcap=True, alibi=True, arch_family="sm90")]


@slow
def test_packed_sequences_meet_the_oracle():
    checks.packed_forward_check(Spec(384, varlen=True, mask="causal", dtype="bf16", arch_family="sm90"))


@pytest.mark.parametrize("spec", _default_first([WIDE[1], WIDE[3]]), ids=lambda s: s.name)
def test_every_schedule_is_race_free_and_exact(spec):
    """Four key tiles through two stages under the producer-first, consumer-first and random
    schedules, with the happens-before racecheck (kernel_checks.sm90_pipeline_check)."""
    checks.sm90_pipeline_check(spec)


def _mla_spec() -> Spec:
    return chosen_decoding_spec(kvcache.decode_spec(576, torch.bfloat16, False, 64,
                                                    {"head_dim_v": 512, "v_from_k": True, "pack_gqa": True}),
                                "sm90", None)


def _decoding(head_dim: int, head_dim_v: int | None = None, page: int | None = None) -> Spec:
    fields = {"pack_gqa": True, **({"head_dim_v": head_dim_v} if head_dim_v else {})}
    return chosen_decoding_spec(kvcache.decode_spec(head_dim, torch.float16, True, page, fields), "sm90", None)


@pytest.mark.parametrize("spec", _default_first([WIDE[0], _mla_spec(), STATIC_MODS[0]] + WIDE[1:] + STATIC_MODS[1:]
                                                + [_decoding(512), _decoding(320, page=16),
                                                   _decoding(448, 256, page=64)], count=3), ids=lambda s: s.name)
def test_nvrtc_compiles_the_source_for_sm_90a_without_spills_within_the_budgets(spec):
    check_sm90_forward_compiles(spec)


@slow
@pytest.mark.parametrize("spec", [WIDE[0], WIDE[1], WIDE[2]], ids=lambda s: s.name)
def test_every_exp2_of_the_consumer_loop_issues_while_p_v_is_in_flight(spec):
    """FlashAttention-3's overlap holds at the narrow tiles too (fagen.sass.overlap)."""
    check_every_exp2_in_flight(spec)


def test_what_the_wide_forward_does_not_take_is_refused_by_name():
    """d = 576 is MLA's, with V from K: with a V tile of its own, Q and two stages would not fit."""
    fields = dict(head_dim=576, head_dim_v=512, kv_cache="paged", key_padding=True)
    with pytest.raises(ValueError, match="arch_family='sm90' has no forward for head_dim=576 .*576 with v_from_k"):
        Spec(**fields, arch_family="sm90")
    assert sm90_refusal(Spec(**fields)) is not None and sm90_refusal(Spec(**fields, v_from_k=True)) is None
    with pytest.raises(ValueError, match="sm90_block_n=64 at head_dim=512: Q and two K/V stages need 329728 bytes"):
        Spec(512, arch_family="sm90", sm90_block_n=64)

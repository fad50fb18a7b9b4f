"""fagen.kernels.spill_free: a spec with custom mods that spills at its tiles gets tiles that do
not, chosen automatically and logged once; other specs are left as they are. Static (NVRTC), no
GPU; the chosen tiles are then checked on the emulator against the oracle."""

import logging

import pytest
import torch

from fagen.kernels import spill_free as sf
from fagen.spec import Spec
from fagen.variants import custom_mod, trace_mask_mod, trace_score_mod
from kernel_cases import Shape
from variant_cases import run_variant_case

ROW_BIAS = torch.randn(2, 4096, generator=torch.Generator().manual_seed(1)).mul_(0.1).requires_grad_()
KEY_SCALE = torch.randn(2, 4096, generator=torch.Generator().manual_seed(2)).mul_(0.1).requires_grad_()
DISTANCE_BIAS = torch.randn(8, 8192, generator=torch.Generator().manual_seed(3)).mul_(0.1).requires_grad_()
DOCS = torch.sort(torch.randint(0, 3, (2, 4096), generator=torch.Generator().manual_seed(4),
                                dtype=torch.int32), dim=1).values


def heavy_score(s, b, h, q_idx, kv_idx):   # three captured tensors with gradients, two nonlinearities
    return s * torch.sigmoid(s + ROW_BIAS[b, q_idx]) + DISTANCE_BIAS[h, q_idx - kv_idx + 4095] * torch.tanh(
        s * KEY_SCALE[b, kv_idx])


def same_document(b, h, q_idx, kv_idx):
    return DOCS[b, q_idx] == DOCS[b, kv_idx]


HEAVY = Spec(64, mask="causal", dropout=True, score_mod=custom_mod(trace_score_mod(heavy_score)),
             mask_mod=custom_mod(trace_mask_mod(same_document)))


def test_a_spilling_custom_mod_gets_tiles_that_do_not_spill_logged_once(caplog):
    # The case's premise, on the pinned NVRTC: its forward spills at the default tiles on sm_90.
    assert sf.spilled_bytes(HEAVY, "sm_90")["forward"] > 0
    sf.spill_free.cache_clear()
    with caplog.at_level(logging.INFO, logger="fagen"):
        chosen = sf.spill_free(HEAVY, "sm_90")
        again = sf.spill_free(HEAVY, "sm_90")
    assert chosen is again and chosen != HEAVY
    assert chosen.replace(**HEAVY.tiles, bwd_block_n=HEAVY.bwd_block_n) == HEAVY   # only tiles change
    assert sf.spilled_bytes(chosen, "sm_90") == {"forward": 0, "backward": 0}
    messages = [r.getMessage() for r in caplog.records if "spills registers" in r.getMessage()]
    assert len(messages) == 1 and HEAVY.name in messages[0] and "forward 56 B" in messages[0]


@pytest.mark.slow   # five NVRTC compiles
def test_an_sm90_forward_that_spills_gets_a_narrower_key_tile(caplog):
    """The sm90 family's warpgroups and rows are fixed: its forward narrows the K/V tile
    (Spec.sm90_block_n) until it does not spill. (The backward is the sm80 family's, narrowed as
    before: at d = 128 this mod's still spills 48 B at the narrowest, which the warning says.)"""
    wide = Spec(128, mask="causal", score_mod=HEAVY.score_mod, arch_family="sm90", sm90_block_n=128)
    assert sf.spilled_bytes(wide, "sm_90a")["forward"] > 0   # the premise, on the pinned NVRTC
    assert [c.sm90_block_n for c in sf.forward_candidates(wide)] == [112, 96, 80, 64, 48, 32]
    with caplog.at_level(logging.INFO, logger="fagen"):
        chosen = sf.spill_free(wide, "sm_90a")
    assert chosen.sm90_block_n == 112 and chosen.replace(sm90_block_n=128, bwd_block_n=wide.bwd_block_n) == wide
    assert sf.spilled_bytes(chosen, "sm_90a")["forward"] == 0
    assert any("sm90_block_n=112" in r.getMessage() for r in caplog.records)


def test_specs_without_custom_mods_or_spills_are_left_alone():
    plain = Spec(64, mask="causal", softcap=True, alibi=True)
    assert sf.spill_free(plain, "sm_90") is plain
    light = Spec(64, score_mod=custom_mod(trace_score_mod(lambda s, b, h, q_idx, kv_idx: s * 0.5)))
    assert sf.spill_free(light, "sm_90") is light


def test_candidates_keep_the_rows_covered_and_refuse_illegal_shapes():
    forward = [c for c in sf.forward_candidates(HEAVY) if c is not None]
    assert [(c.block_m, c.num_warps) for c in forward] == [(128, 8), (64, 4)]
    assert [c.bwd_block_n for c in sf.backward_candidates(HEAVY)] == [64]
    narrow = HEAVY.replace(block_m=16, num_warps=1)
    assert all(c is None or c.block_m * 1 >= 16 * c.num_warps for c in sf.forward_candidates(narrow))


@pytest.mark.parametrize("arch", ["sm_90"])
def test_the_chosen_tiles_compute_the_same_attention(arch):
    chosen = sf.spill_free(HEAVY, arch)
    base = chosen.replace(score_mod=None, mask_mod=None)
    run_variant_case(base, Shape(2, 150, 170, heads=2, kv_heads=1),
                     {"score_mod": heavy_score, "mask_mod": same_document},
                     captures=(ROW_BIAS, DISTANCE_BIAS, KEY_SCALE))   # in the order the trace reads them

"""Spec validation: each illegal combination raises ValueError with its own message."""

import pytest

from fagen.arch import SMEM_LIMIT_BYTES
from fagen.spec import Spec, check_dropout_p
from fagen.tile_shapes import default_tiles


@pytest.mark.parametrize("fields, message", [
    ({"head_dim": 60}, "head_dim must be a positive multiple of 8, got 60"),
    ({"head_dim": 0}, "head_dim must be a positive multiple of 8"),
    ({"head_dim": 520}, "head_dim must be at most 512, got 520"),
    ({"head_dim": 264, "version": 1}, "head_dim=264 needs version=2: FlashAttention-1"),
    ({"head_dim": 64.0}, "head_dim must be an int"),
    ({"head_dim": 64, "dtype": "fp32"}, "unknown dtype 'fp32'"),
    ({"head_dim": 64, "mask": "sliding"}, "unknown mask 'sliding'"),
    ({"head_dim": 64, "version": 3}, "unknown version 3"),
    ({"head_dim": 64, "block_n": 40}, "block_n must be a multiple of 16"),
    ({"head_dim": 64, "block_m": 72}, "block_m must be a multiple of 16"),
    ({"head_dim": 64, "block_m": 96, "num_warps": 4}, "cannot be split across num_warps=4"),
    ({"head_dim": 64, "num_warps": 3}, "num_warps must be one of"),
    ({"head_dim": 64, "num_stages": 0}, "num_stages must be a positive int"),
    ({"head_dim": 64, "num_stages": 5}, "num_stages must be in 1..4"),
    ({"head_dim": 64, "dropout": 0.1}, "dropout must be True or False"),
    ({"head_dim": 64, "bwd_stages": 0}, "bwd_stages must be an int in 1..4, got 0"),
    ({"head_dim": 64, "bwd_stages": 5}, "bwd_stages must be an int in 1..4, got 5"),
    ({"head_dim": 64, "bwd_stages": True}, "bwd_stages must be an int in 1..4, got True"),
    ({"head_dim": 64, "sm80_backward": 1}, "sm80_backward must be True or False, got 1"),
    ({"head_dim": 64, "sm80_backward": True}, "sm80_backward=True gives an sm90 training spec the sm80 family's "
                                              "backward: it needs arch_family='sm90' and no kv_cache, got "
                                              "arch_family='sm80'"),
    ({"head_dim": 64, "kv_cache": "contiguous", "key_padding": True, "arch_family": "sm90", "sm80_backward": True},
     "sm80_backward=True gives .* kv_cache='contiguous'"),
    ({"head_dim": 256, "block_m": 128, "block_n": 128, "num_stages": 2},
     "needs 337920 bytes of shared memory per block"),
])
def test_illegal_specs_raise_their_message(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Spec(**fields)


def test_shared_memory_message_names_needed_and_allowed():
    spec = Spec(head_dim=128, block_m=128, block_n=128, num_stages=2)  # fits sm_90
    with pytest.raises(ValueError) as err:
        spec.check_arch("sm_80")
    text = str(err.value)
    assert str(spec.shared_layout.total_bytes) in text
    assert f"sm_80 allows at most {SMEM_LIMIT_BYTES['sm_80']}" in text
    spec.check_arch("sm_90")


def test_backward_pipeline_depth_defaults_by_head_dim_and_names_itself():
    assert [Spec(d).bwd_stages for d in (32, 64, 96, 128, 192, 256)] == [2, 2, 2, 2, 1, 1]
    assert Spec(128, bwd_stages=1).name == "fa2_d128_fp16_bwd1"
    assert Spec(128, block_n=32, bwd_stages=1).name == "fa2_d128_fp16_m128n32w8s2_bwd1"
    assert Spec(128, bwd_stages=2).name == "fa2_d128_fp16"
    assert Spec(128, bwd_stages=1).backward_tiles.num_stages == 1


def test_backward_that_exceeds_a_99kb_part_says_which_depth_fits():
    spec = Spec(128, block_n=32)   # the forward fits sm_86; two Q/dO stages do not
    spec.check_arch("sm_86", backward=False)
    with pytest.raises(ValueError) as err:
        spec.check_arch("sm_86")
    text = str(err.value)
    assert f"needs {spec.backward_shared_bytes} bytes" in text and "bwd_stages=2" in text
    fitted = spec.fit_backward(SMEM_LIMIT_BYTES["sm_86"])
    assert fitted.bwd_stages == 1 and f"bwd_stages=1 needs {fitted.backward_shared_bytes}" in text
    fitted.check_arch("sm_86")
    assert fitted.tiles == spec.tiles   # only the backward pipeline changes


def test_fit_backward_keeps_a_spec_that_fits_and_never_deepens():
    spec = Spec(64)
    assert spec.fit_backward(SMEM_LIMIT_BYTES["sm_86"]) is spec
    assert Spec(128).fit_backward(10**6) == Spec(128)
    assert Spec(128, bwd_stages=1).fit_backward(10**6).bwd_stages == 1
    assert spec.fit_backward(1000) is spec   # nothing fits: unchanged, check_arch will say why


def test_unknown_arch_is_rejected():
    with pytest.raises(ValueError, match="unknown arch 'sm_70'"):
        Spec(64).check_arch("sm_70")


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_probability_outside_unit_interval(p):
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        check_dropout_p(p)


def test_dropout_probability_type():
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        check_dropout_p("0.1")
    assert check_dropout_p(0) == 0.0


def test_defaults_come_from_the_tile_table():
    for d in (32, 64, 96, 128, 160, 192, 256):
        spec = Spec(d)
        assert spec.tiles == default_tiles(d)
        for arch in ("sm_80", "sm_90"):
            spec.check_arch(arch)


def test_names_are_stable_and_readable():
    assert Spec(64).name == "fa2_d64_fp16"
    assert Spec(64, mask="causal", dtype="bf16").name == "fa2_d64_causal_bf16"
    assert Spec(128, version=1, key_padding=True, dropout=True, deterministic=True).name == \
        "fa1_d128_fp16_pad_drop_det"
    assert Spec(64, block_m=64).name == "fa2_d64_fp16_m64n64w4s2"


def test_sm80_backward_is_named_and_dumped_only_when_set():
    """Its default leaves every spec's name and fields (a rendered file's header) as before it
    existed; set, the name says so (`bwdsm80`) and the dict holds it."""
    for fields in ({}, {"arch_family": "sm90"}, {"mask": "causal", "arch_family": "sm90"}):
        plain, explicit = Spec(64, **fields), Spec(64, sm80_backward=False, **fields)
        assert plain.name == explicit.name and "sm80_backward" not in explicit.to_dict()
    assert Spec(64, arch_family="sm90").name == "fa2_d64_fp16_sm90"
    moved = Spec(64, mask="causal", arch_family="sm90", sm80_backward=True)
    assert moved.name == "fa2_d64_causal_fp16_sm90_bwdsm80" and moved.to_dict()["sm80_backward"] is True
    assert moved != Spec(64, mask="causal", arch_family="sm90")


@pytest.mark.parametrize("spec", [Spec(64), Spec(128, mask="causal", dtype="bf16", version=1),
                                  Spec(32, block_m=64, block_n=32, num_warps=2, num_stages=3,
                                       key_padding=True, dropout=True),
                                  Spec(128, block_n=32, bwd_stages=1), Spec(64, bwd_stages=3),
                                  Spec(64, arch_family="sm90", sm80_backward=True, bwd_stages=3)])
def test_name_and_dict_round_trip(spec):
    assert Spec.from_name(spec.name) == spec
    assert Spec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("name", ["fa3_d64_fp16", "fa2_x64_fp16", "fa2_d64_fp16_sparse", "fa2_d64"])
def test_bad_names(name):
    with pytest.raises(ValueError, match="spec name"):
        Spec.from_name(name)


def test_from_sram_follows_the_paper_rule():
    # M = 16384 elements, d = 64: B_c = ceil(16384 / 256) = 64, B_r = min(64, 64) = 64.
    spec = Spec.from_sram(16384, 64)
    assert (spec.block_n, spec.block_m) == (64, 64)
    # d = 32: B_c = 128, B_r = min(128, 32) = 32 -> two warps of 16 rows.
    spec = Spec.from_sram(16384, 32)
    assert (spec.block_n, spec.block_m, spec.num_warps) == (128, 32, 2)
    # Ragged values round down to legal tiles: M = 10000, d = 64: B_c = 40 -> 32.
    spec = Spec.from_sram(10000, 64)
    assert spec.block_n == 32 and spec.block_m % (16 * spec.num_warps) == 0


def test_from_sram_rejects_bad_input():
    with pytest.raises(ValueError, match="SRAM size"):
        Spec.from_sram(0, 64)
    with pytest.raises(ValueError, match="head_dim"):
        Spec.from_sram(16384, 60)

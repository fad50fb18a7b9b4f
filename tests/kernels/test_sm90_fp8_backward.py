"""The fp8 backward (issue 45, part 3) on the emulator: the sm90 backward on e4m3 q, k, v (O and dO
in e4m3, e5m2 or bf16) widened to bf16, the descales in fp32, held to tests/support/fp8_backward_cases.py's
accuracy rule: each gradient's error against the float64 oracle at most twice the rounding model's
(fagen/reference/same_fp8_backward.py). Where the spec names an 8-bit dO (Spec.dout_dtype), S and dP
run as 8-bit wgmma on the tensors as given."""

import pytest
import torch

from fagen.arch_families import fp8_backward_refusal, sm90_backward_tiles
from fagen.errors import InputTypeError
from fagen.kernels import attention_kernels
from fagen.kernels.compile import compile_source
from fagen.kernels.render import render
from fagen.spec import Spec
from fp8_backward_cases import run_fp8_backward_case
from fp8_mutants import FP8_SCORES, fp8_scores_check
from kernel_cases import Shape

GQA = Shape(2, 150, 200, heads=4, kv_heads=2)   # ragged tiles, descales that differ per (batch, K/V head)


def fp8(d: int, causal: bool = False, **fields) -> Spec:
    return Spec(d, dtype="e4m3", arch_family="sm90", mask="causal" if causal else "none", **fields)


# d = 64's widened form in the slow tier: test_key_padding_and_mqa runs it by default, and the 8-bit
# form at d = 64 runs in test_s_and_dp_by_8_bit_wgmma_meet_the_rule.
@pytest.mark.parametrize("d, causal", [pytest.param(64, False, marks=pytest.mark.slow), (128, True), (192, True),
                                       (256, False)])
def test_the_fp8_backward_meets_the_rule_at_every_head_dim(d, causal):
    run_fp8_backward_case(fp8(d, causal), GQA)


@pytest.mark.parametrize("d, causal, do_format", [(64, False, "e5m2"), (128, True, "e4m3")])
def test_s_and_dp_by_8_bit_wgmma_meet_the_rule(d, causal, do_format):
    """An 8-bit dO (Spec.dout_dtype): S^T and dP^T by 8-bit wgmma from the tensors as given (e4m3 K,
    V, Q; dO in its own type), dK, dV and dQ by bf16 wgmma from the widened ones."""
    spec = fp8(d, causal, dout_dtype=do_format)
    assert sm90_backward_tiles(spec).fp8_scores
    run_fp8_backward_case(spec, GQA, do_format=do_format)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])   # ALiBi's, one per query head of GQA


# The two together (a natural-log chain) run by default at the op's level (tests/ops/test_fp8_training.py).
@pytest.mark.parametrize("d, do_format, variant", [(128, "e4m3", {"softcap": 20.0}), (64, "e5m2", {"alibi_slopes": SLOPES}),
                                                   pytest.param(64, "e4m3", {"softcap": 30.0, "alibi_slopes": SLOPES},
                                                                marks=pytest.mark.slow)],
                         ids=["softcap", "alibi", "softcap-alibi"])
def test_a_softcap_and_alibi_meet_the_rule(d, do_format, variant):
    """The score chain on tau S in true units (q's and k's descales times the e4m3 product), against
    the oracle and the rounding model with the same chain; S and dP by 8-bit wgmma. The softcap alone
    runs in the cap's units, ALiBi alone on the raw scores, the two together in natural-log units."""
    run_fp8_backward_case(fp8(d, True, dout_dtype=do_format), GQA, variant, do_format=do_format)


def test_a_window_meets_the_rule():
    """A sliding window (left 50, right 20) against the oracle with the same window, S and dP by
    8-bit wgmma: the window's masked blocks and the ones it skips, in fp8."""
    run_fp8_backward_case(fp8(128, dout_dtype="e4m3"), GQA, {"window_size": (50, 20)})


def test_s_and_dp_by_8_bit_wgmma_are_race_free_under_the_schedules():
    """The 8-bit stage's ring (full8 / empty8) beside the bf16 one: both parities, the producer first
    and the warps one at a time, under the racecheck (fp8_mutants.fp8_scores_check)."""
    fp8_scores_check(FP8_SCORES)


def test_8_bit_scores_take_dout_in_the_spec_s_type_and_the_unpaired_tiles_alone():
    spec = fp8(64, dout_dtype="e5m2")
    q8, k8, v8 = (torch.zeros(1, 64, 1, 64, dtype=torch.float8_e4m3fn) for _ in range(3))
    out = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 64)
    with pytest.raises(InputTypeError, match=r"dout must be float8_e5m2 for fa2_d64_e4m3_doe5m2_sm90 \(its "
                                             r"dout_dtype='e5m2'"):
        attention_kernels.backward(render(spec), q8, k8, v8, out, (lse,), q8)
    # Past d = 128 the paired tiles' budget has no room for them: every GEMM reads bf16.
    assert not sm90_backward_tiles(fp8(192, dout_dtype="e4m3")).fp8_scores
    assert not sm90_backward_tiles(fp8(128)).fp8_scores
    with pytest.raises(ValueError, match="dout_dtype='e4m3' is the fp8 backward's dO: it needs dtype='e4m3'"):
        Spec(128, dtype="bf16", arch_family="sm90", dout_dtype="e4m3")
    with pytest.raises(ValueError, match="unknown dout_dtype 'fp8'"):
        fp8(128, dout_dtype="fp8")
    assert Spec.from_name(spec.name) == spec and spec.to_dict()["dout_dtype"] == "e5m2"
    assert "dout_dtype" not in fp8(64).to_dict()


# An e5m2 dO widened (the host's cast) in the slow tier: the kernel reads e5m2 itself by default at d = 64.
@pytest.mark.parametrize("out_format, do_format", [("bf16", "bf16"), pytest.param("e4m3", "e5m2", marks=pytest.mark.slow)])
def test_o_and_do_in_bf16_or_e5m2(out_format, do_format):
    run_fp8_backward_case(fp8(128, True), Shape(1, 130, 130, heads=2, kv_heads=1), out_format=out_format,
                          do_format=do_format)


def test_key_padding_and_mqa():
    run_fp8_backward_case(fp8(64, True, key_padding=True), Shape(3, 70, 190, heads=4, kv_heads=1))


@pytest.mark.slow   # tests/ops/test_fp8_training.py repeats a deterministic training step by default
def test_deterministic_repeats_bit_for_bit_within_the_rule():
    """deterministic=True: dQ's reductions in key-block order (the sm90 backward's), three runs equal."""
    spec, shape = fp8(128, True, deterministic=True), Shape(1, 300, 300, heads=2, kv_heads=1)
    _, first = run_fp8_backward_case(spec, shape)
    for _ in range(2):
        _, again = run_fp8_backward_case(spec, shape)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# Slow: its pipeline is the bf16 sm90 backward's (kernel_checks.sm90_backward_check runs in the default
# tier), and the 8-bit stage's ring has a race test of its own there (fp8_scores_check).
@pytest.mark.slow
def test_the_fp8_backward_is_race_free_under_the_schedules(monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    for schedule in ("warp-serial", "producer-first"):
        monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
        run_fp8_backward_case(fp8(128, True), Shape(1, 140, 140, heads=2, kv_heads=1))


# The default tier compiles the 8-bit S and dP at d = 128 (the widened form's loop is the bf16 backward's).
@pytest.mark.parametrize("d, fields", [pytest.param(64, {}, marks=pytest.mark.slow),
                                       pytest.param(128, {}, marks=pytest.mark.slow),
                                       pytest.param(192, {}, marks=pytest.mark.slow),
                                       pytest.param(256, {}, marks=pytest.mark.slow),
                                       pytest.param(64, {"dout_dtype": "e5m2"}, marks=pytest.mark.slow),
                                       (128, {"dout_dtype": "e4m3", "window": True, "deterministic": True})])
def test_the_fp8_backward_compiles_for_sm90a_without_spills(d, fields):
    spec = fp8(d, True, **fields)
    compiled = compile_source(render(spec), "sm_90a")
    for name, report in compiled.resources.items():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, f"{name}: {report}"


def test_variants_the_fp8_backward_does_not_take_leave_a_forward_only_spec():
    spec = fp8(128, sinks=True)
    assert spec.forward_only and "not sinks" in fp8_backward_refusal(spec)
    assert [e.name.rsplit("_", 1)[-1] for e in render(spec).entries] == ["fwd"]
    assert not any(fp8(128, **{field: True}).forward_only for field in ("window", "softcap", "alibi"))


@pytest.mark.parametrize("dout_dtype", [None, "e4m3"])
def test_packed_sequences_get_each_sequence_s_dense_gradients_bit_for_bit(dout_dtype):
    """The fp8 backward over packed sequences (one of a single key): each sequence's dQ, dK and dV
    are the dense backward's on it alone, its descales a row of the packed call's; dO in bf16, or
    in e4m3 with S and dP by 8-bit wgmma (the 8-bit maps over the packed rows)."""
    cu = torch.tensor([0, 37, 167, 168], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q8, k8, v8 = (torch.randn(168, h, 64, generator=g).to(torch.float8_e4m3fn) for h in (4, 2, 2))
    kd = torch.rand(3, 2, generator=g) + 0.5
    dout = torch.randn(168, 4, 64, generator=g).to(torch.float8_e4m3fn if dout_dtype else torch.bfloat16)
    fields = {"dout_dtype": dout_dtype}
    packed, dense = render(fp8(64, True, varlen=True, **fields)), render(fp8(64, True, **fields))
    varlen = (cu, cu, 130, 130)
    out, (slots,) = attention_kernels.forward(packed, q8, k8, v8, varlen=varlen, descales={"k_descale": kd})
    grads = attention_kernels.backward(packed, q8, k8, v8, out, (slots,), dout, varlen=varlen,
                                       descales={"k_descale": kd})
    for b in range(3):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = [t[rows][None] for t in (q8, k8, v8)]
        scales = {"k_descale": kd[b:b + 1]}
        o, (lse,) = attention_kernels.forward(dense, *one, descales=scales)
        expected = attention_kernels.backward(dense, *one, o, (lse,), dout[rows][None], descales=scales)
        for got, want in zip(grads, expected):
            assert torch.equal(got[rows], want[0]), b

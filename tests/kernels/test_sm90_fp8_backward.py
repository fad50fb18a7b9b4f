"""The fp8 backward (issue 45, part 3) on the emulator: the sm90 backward on e4m3 q, k, v (O and dO
in e4m3, e5m2 or bf16) widened to bf16, the descales in fp32, held to tests/support/fp8_backward_cases.py's
accuracy rule: each gradient's error against the float64 oracle at most twice the rounding model's
(fagen/reference/same_fp8_backward.py)."""

import pytest

from fagen.arch_families import fp8_backward_refusal
from fagen.kernels.compile import compile_source
from fagen.kernels.render import render
from fagen.spec import Spec
from fp8_backward_cases import run_fp8_backward_case
from kernel_cases import Shape

GQA = Shape(2, 150, 200, heads=4, kv_heads=2)   # ragged tiles, descales that differ per (batch, K/V head)


def fp8(d: int, causal: bool = False, **fields) -> Spec:
    return Spec(d, dtype="e4m3", arch_family="sm90", mask="causal" if causal else "none", **fields)


@pytest.mark.parametrize("d, causal", [(64, False), (128, True), (192, True), (256, False)])
def test_the_fp8_backward_meets_the_rule_at_every_head_dim(d, causal):
    run_fp8_backward_case(fp8(d, causal), GQA)


@pytest.mark.parametrize("out_format, do_format", [("bf16", "bf16"), ("e4m3", "e5m2")])
def test_o_and_do_in_bf16_or_e5m2(out_format, do_format):
    run_fp8_backward_case(fp8(128, True), Shape(1, 130, 130, heads=2, kv_heads=1), out_format=out_format,
                          do_format=do_format)


def test_key_padding_and_mqa():
    run_fp8_backward_case(fp8(64, True, key_padding=True), Shape(3, 70, 190, heads=4, kv_heads=1))


def test_the_fp8_backward_is_race_free_under_the_schedules(monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")
    for schedule in ("warp-serial", "producer-first"):
        monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
        run_fp8_backward_case(fp8(128, True), Shape(1, 140, 140, heads=2, kv_heads=1))


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_the_fp8_backward_compiles_for_sm90a_without_spills(d):
    spec = fp8(d, True)
    compiled = compile_source(render(spec), "sm_90a")
    for name, report in compiled.resources.items():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, f"{name}: {report}"


def test_variants_the_fp8_backward_does_not_take_leave_a_forward_only_spec():
    for fields in ({"softcap": True}, {"alibi": True}, {"sinks": True}):
        spec = fp8(128, **fields)
        assert spec.forward_only and "not " + next(iter(fields)) in fp8_backward_refusal(spec)
        assert [e.name.rsplit("_", 1)[-1] for e in render(spec).entries] == ["fwd"]
    assert not fp8(128, window=True).forward_only

"""The prototype Hopper forward (tests/emulate/kernels/hopper_forward.cu: a TMA + mbarrier producer,
two wgmma consumer warpgroups, setmaxnreg) in the emulator: its O meets FlashAttention-2's error
rule and its L the oracle's logsumexp under the schedules that reorder producer and consumers;
ragged Nq and Nk; rows past Nq stay unstored; the P-to-A-fragment mapping it relies on agrees with
the ISA's figures; planted bugs are caught (slow tier); NVRTC compiles it for sm_90a without
spills or serialised wgmma."""

from __future__ import annotations

import pytest

import hopper_forward_case as case
import isa_wgmma
import twin_mutants

# (batch, Nq, Nk, heads): one tile each way; two query blocks with a ragged last one, three key tiles
# with a ragged last one (44 keys: the -inf mask), two heads and two batches (the maps' coordinates).
SHAPES = [(1, 128, 128, 1), (2, 200, 300, 2)]
SCHEDULES = ("forward", "producer-first", "consumer-first", "random")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_q{}_k{}_h{}".format(*s))
def test_forward_matches_the_oracle(monkeypatch, shape, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    inputs, out, lse = case.run_emulated(*shape)
    case.check(*inputs, out, lse)


def test_fp16_matches_the_oracle():
    inputs, out, lse = case.run_emulated(1, 200, 300, 2, dtype="fp16")
    case.check(*inputs, out, lse)


@pytest.mark.parametrize("shape", [(1, 128, 256, 1), (1, 64, 17, 1)], ids=["two_full_key_tiles", "one_short_tile"])
def test_other_key_lengths(shape):
    inputs, out, lse = case.run_emulated(*shape)
    case.check(*inputs, out, lse)


def test_probabilities_reach_the_a_fragment_of_pv():
    """The kernel hands S's accumulator register 8 kk + 2 r + h to P V's k16 step kk as the h half of
    A register r (probabilities_as_a): by the ISA's figures both must name the same (row, key)."""
    d = isa_wgmma.accumulator(128)     # (thread, register) -> (row, column) of the 64 x 128 S
    a = isa_wgmma.a_fragment()         # (thread, element) -> (row, k) of a 64 x 16 A
    for thread in range(128):
        for kk in range(8):
            for r in range(4):
                for half in range(2):
                    row, k = a[(thread, 2 * r + half)]
                    assert d[(thread, 8 * kk + 2 * r + half)] == (row, 16 * kk + k), (thread, kk, r, half)


def test_nvrtc_compiles_it_for_sm_90a_without_spills_or_serialised_wgmma():
    pytest.importorskip("cuda.bindings")
    from fagen.kernels.compile import check_wgmma_pipeline, nvrtc_compile, parse_ptxas_log

    cubin, log = nvrtc_compile(case.KERNEL.read_text(), "sm_90a")
    assert cubin, log
    check_wgmma_pipeline(log, "the Hopper forward micro-kernel", "sm_90a")
    reports = parse_ptxas_log(log, "sm_90a")
    assert set(reports) == {"hopper_forward_bf16", "hopper_forward_fp16"}, log
    for report in reports.values():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, report


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("schedule", twin_mutants.SCHEDULES)
def test_every_schedule(monkeypatch, schedule, dtype):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    for shape in SHAPES + [(1, 64, 17, 1)]:
        inputs, out, lse = case.run_emulated(*shape, dtype=dtype)
        case.check(*inputs, out, lse)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_schedule_seeds(monkeypatch, seed):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "random")
    monkeypatch.setenv("FAGEN_EMULATE_SEED", str(seed))
    inputs, out, lse = case.run_emulated(2, 200, 300, 2)
    case.check(*inputs, out, lse)



@pytest.mark.slow
@pytest.mark.parametrize("mutant", list(case.MUTANTS))
def test_a_planted_bug_is_caught(mutant):
    assert case.catching_schedules(mutant), f"{mutant}: no schedule caught it"


@pytest.mark.parametrize("schedule", ["forward", "producer-first"])
def test_racecheck_finds_no_hazard(monkeypatch, schedule):
    """Happens-before racecheck over the mbarrier phases, named barriers and TMA's async agents:
    the producer/consumer hand-offs order every shared-memory access (a RaceError would fail)."""
    from fagen.emulate import load_module

    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    kernel = load_module(case.KERNEL.read_text(), racecheck=True).get_function("hopper_forward_bf16")
    q, k, v = case.inputs(1, 200, 300, 2, "bf16")
    case.check(q, k, v, *case.launch(kernel, q, k, v, "emulated_bytes"))

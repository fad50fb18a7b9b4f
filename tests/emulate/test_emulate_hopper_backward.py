"""The prototype Hopper backward (tests/emulate/kernels/hopper_backward.cu: one CTA per key block, a
TMA + mbarrier producer streaming Q, dO, L and D, two wgmma consumer warpgroups, dQ summed by
cp.reduce.async.bulk, setmaxnreg) in the emulator: dQ, dK and dV meet FlashAttention-2's gradient
rule against the float64 oracle, non-causal and causal, fp16 and bf16, with ragged Nq and Nk and
Nq > Nk, under the schedules that reorder producer and consumers with happens-before racecheck
clean; keys past Nk stay unstored; the fragment mappings it relies on agree with the ISA's figures;
planted bugs are caught (the bulk reduction's wait_group.read here, the rest in the slow tier);
NVRTC compiles it for sm_90a without spills or serialised wgmma."""

from __future__ import annotations

import pytest

import hopper_backward_case as case
import isa_wgmma
import twin_mutants

# (batch, Nq, Nk, heads): two key blocks (the second ragged, 72 keys) and two query blocks (the
# second ragged, 36 rows), two heads; Nq > Nk, where causal rows 0..169 see no key and the first
# key block's walk starts at query block 2.
SHAPES = [(1, 100, 200, 2), (1, 300, 130, 1)]
SCHEDULES = ("producer-first", "consumer-first", "random")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_backward_matches_the_oracle_racecheck_clean(monkeypatch, causal, dtype, schedule):
    """Racecheck is on: a hazard between the producer's TMA, the consumers' reads, the dS^T and dQ
    tiles and the bulk reduction raises RaceError."""
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    inputs, grads = case.run_emulated(*SHAPES[0], dtype=dtype, causal=causal, racecheck=True)
    case.check(*inputs, *grads, causal)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_more_queries_than_keys(monkeypatch, causal, dtype):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "random")
    inputs, grads = case.run_emulated(*SHAPES[1], dtype=dtype, causal=causal, racecheck=True)
    case.check(*inputs, *grads, causal)


def test_dk_and_dv_do_not_depend_on_the_schedule(monkeypatch):
    """dK and dV are summed in one CTA's registers in query-block order: bit-identical under every
    reordering schedule (dQ's bulk reductions from several CTAs and warpgroups land in any order)."""
    results = []
    for schedule in ("producer-first", "consumer-first", "random"):
        monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
        results.append(case.run_emulated(1, 200, 200, 1, causal=True)[1])
    for _, dk, dv in results[1:]:
        assert dk.equal(results[0][1]) and dv.equal(results[0][2])


def test_scores_reach_the_a_fragments_and_the_ds_tile():
    """The kernel hands the m64n64 accumulator register 8 kk + 2 r + h (S^T's rows are keys, its
    columns queries) to the k16 step kk of dV += P^T dO and dK += dS^T Q as the h half of A
    register r (as_a), and stores A register r of step kk as dS^T's (key 16 w + g + 8 (r % 2), query
    16 kk + 8 (r / 2) + 2 quad + h) (store_ds): by the ISA's figures all three name one element."""
    d = isa_wgmma.accumulator(64)      # (thread, register) -> (row, column) of the 64 x 64 S^T
    a = isa_wgmma.a_fragment()         # (thread, element) -> (row, k) of a 64 x 16 A
    for thread in range(128):
        warp, g, quad = thread // 32, thread % 32 // 4, thread % 4
        for kk in range(4):
            for r in range(4):
                for half in range(2):
                    row, k = a[(thread, 2 * r + half)]
                    assert d[(thread, 8 * kk + 2 * r + half)] == (row, 16 * kk + k), (thread, kk, r, half)
                    stored = (16 * warp + g + 8 * (r % 2), 16 * kk + 8 * (r // 2) + 2 * quad + half)
                    assert stored == (row, 16 * kk + k), (thread, kk, r, half)


@pytest.mark.parametrize("mutant", ["no wait_group.read before the dQ tile is rewritten",
                                    "no barrier before dQ's wgmma reads dS"])
def test_a_planted_race_is_caught(mutant):
    """Deleting the bulk reduction's wait_group.read lets the next query block rewrite the dQ tile
    while the async proxy may still read it (the twin faults at the retiring wait); deleting the
    barrier before dQ's wgmma lets thread 0 issue it before the other warps stored dS^T (racecheck)."""
    assert case.catching_schedules(mutant, ("producer-first",), racecheck=True) == ["producer-first"]


def test_nvrtc_compiles_it_for_sm_90a_without_spills_or_serialised_wgmma():
    pytest.importorskip("cuda.bindings")
    from fagen.kernels.compile import check_wgmma_pipeline, nvrtc_compile, parse_ptxas_log

    cubin, log = nvrtc_compile(case.KERNEL.read_text(), "sm_90a")
    assert cubin, log
    check_wgmma_pipeline(log, "the Hopper backward micro-kernel", "sm_90a")
    reports = parse_ptxas_log(log, "sm_90a")
    assert set(reports) == {"hopper_backward_bf16", "hopper_backward_fp16"}, log
    for report in reports.values():
        assert report.spill_bytes == 0 and report.stack_bytes == 0, report


# Slow tier: every schedule, more shapes, seeds and every planted bug.
SLOW_SHAPES = [(1, 64, 128, 1), (2, 200, 300, 2), (1, 1, 17, 1), (1, 130, 256, 1), (1, 257, 129, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("schedule", twin_mutants.SCHEDULES)
def test_every_schedule(monkeypatch, schedule, causal, dtype):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    for shape in SHAPES + SLOW_SHAPES:
        inputs, grads = case.run_emulated(*shape, dtype=dtype, causal=causal)
        case.check(*inputs, *grads, causal)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_schedule_seeds_racecheck_clean(monkeypatch, seed, causal):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "random")
    monkeypatch.setenv("FAGEN_EMULATE_SEED", str(seed))
    inputs, grads = case.run_emulated(2, 200, 300, 2, causal=causal, racecheck=True, seed=seed)
    case.check(*inputs, *grads, causal)


# Caught only by racecheck: a missing barrier or proxy fence that the schedules' data does not show.
RACE_ONLY = {"no barrier before dQ's wgmma reads dS", "no fence.proxy.async before the bulk reduction"}


@pytest.mark.slow
@pytest.mark.parametrize("mutant", list(case.MUTANTS))
def test_a_planted_bug_is_caught(mutant):
    assert case.catching_schedules(mutant, racecheck=mutant in RACE_ONLY), f"{mutant}: no schedule caught it"

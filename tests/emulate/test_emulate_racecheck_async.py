"""Racecheck on happens-before in warp-specialised kernels: the mbarrier pipeline
(kernels/mbarrier_pipeline.cu) and the TMA pipeline (kernels/tma_pipeline.cu) order shared memory
only by mbarrier phases, named barriers and proxy fences, never by __syncthreads in their loops.
They run clean under racecheck on every schedule, and each planted ordering bug is reported as a
race naming both lines."""

from __future__ import annotations

import re

import pytest
import torch

import mbarrier_pipeline_case
import tma_pipeline_case as case
import twin_mutants
from fagen.emulate import EmulationError, RaceError, load_module

MBARRIER_SOURCE = mbarrier_pipeline_case.KERNEL.read_text()
TMA_SOURCE = case.KERNEL.read_text()
SCHEDULES = list(twin_mutants.SCHEDULES)


@pytest.fixture(scope="module")
def mbarrier_pipeline():
    return load_module(MBARRIER_SOURCE, racecheck=True).get_function("mbarrier_pipeline")


@pytest.fixture(scope="module")
def tma_pipeline():
    return load_module(TMA_SOURCE, racecheck=True).get_function("tma_pipeline")


def line_of(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def run_mbarrier(kernel, bug: int, tiles: int = 7) -> bool:
    """Whether y came out equal to x. One block: every block of this kernel writes all of y."""
    y, x = mbarrier_pipeline_case.run(kernel, bug, tiles, blocks=1)
    return torch.equal(y, x)


def run_tma(kernel, bug: int, tiles: int = 3) -> bool:
    y, expected_y, sums, expected_sums = case.run(kernel, bug, tiles)
    return torch.equal(y, expected_y) and torch.equal(sums, expected_sums)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_pipelines_run_clean_under_racecheck(mbarrier_pipeline, tma_pipeline, monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    for seed in (["1", "2"] if schedule == "random" else ["0"]):
        monkeypatch.setenv("FAGEN_EMULATE_SEED", seed)
        for tiles in (1, 2, 5):
            assert run_mbarrier(mbarrier_pipeline, 0, tiles), (schedule, seed, tiles)
            assert run_tma(tma_pipeline, 0, tiles), (schedule, seed, tiles)


def caught(run, kernel, bug: int, schedules) -> dict[str, str]:
    """The race report of each schedule; fails if a schedule ends without a fault."""
    reports = {}
    for schedule in schedules:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
            with pytest.raises(EmulationError) as error:
                run(kernel, bug)
        if isinstance(error.value, RaceError):
            reports[schedule] = str(error.value)
    return reports


M_WRITE = f".cu:{line_of(MBARRIER_SOURCE, 'ring[s * kTile + k] = x[i * kTile + k]')}"
M_READ = f".cu:{line_of(MBARRIER_SOURCE, 'y[i * kTile + c] = ring[s * kTile + c]')}"
# The schedules under which a bug's run reaches the race (under the others it deadlocks first, or trips
# the mbarrier twin's ABA rule: faults too, but not racecheck's).
LOCKSTEP = ["forward", "reverse", "warp-serial", "warp-serial-reverse", "random"]

# bug: (what the kernel does wrong, schedules whose run must be a race report)
MBARRIER_BUGS = {
    1: ("consumers wait with the flipped parity: they read a stage before it is full", LOCKSTEP),
    2: ("a consumer warp releases its stage before reading it", SCHEDULES),
    7: ("the producer delivers the bytes (complete_tx) before writing them", SCHEDULES),
    8: ("the producer refills a stage without waiting on its empty barrier",
        ["forward", "reverse", "consumer-first", "random"]),
}


@pytest.mark.parametrize("bug", list(MBARRIER_BUGS))
def test_mbarrier_pipeline_ordering_bugs_are_races(mbarrier_pipeline, bug):
    _, schedules = MBARRIER_BUGS[bug]
    reports = caught(run_mbarrier, mbarrier_pipeline, bug, schedules)
    assert set(reports) == set(schedules), sorted(reports)
    for schedule, message in reports.items():
        # The producer's write of the stage and the consumer's read of it, neither ordered before the other.
        assert re.search(r"racecheck: (read-after-write|write-after-read) hazard on static __shared__ byte", message)
        assert M_WRITE in message and M_READ in message, (schedule, message)
        assert "no named barrier or mbarrier phase orders them" in message


T_LOAD = f".cu:{line_of(TMA_SOURCE, 'fagen::tma_load<2>(smem + s * kTileBytes')}"
T_READ = f".cu:{line_of(TMA_SOURCE, 'const float v = __half2float(tile[at]);')}"
T_OUT = f".cu:{line_of(TMA_SOURCE, 'out[at] = __float2half(2.0f * v);')}"
T_STORE = f".cu:{line_of(TMA_SOURCE, 'fagen::tma_store<2>(y_map')}"

# bug: (schedules whose run must be a race report, the hazard's words, the lines it must name)
TMA_BUGS = {
    "consumers read a stage before its load lands (flipped parity)": (
        1, LOCKSTEP + ["producer-first"],
        r"(write-after-read|read-after-write \(TMA load in flight\)) hazard", [T_LOAD, T_READ]),
    "a consumer warp releases its stage before reading it": (
        2, SCHEDULES, r"(write-after-read|read-after-write \(TMA load in flight\)) hazard", [T_LOAD, T_READ]),
    "the output tile is rewritten while its store reads it": (
        4, SCHEDULES, r"write-after-read \(bulk store in flight\) hazard", [T_OUT, T_STORE]),
    "no fence.proxy.async before the store": (
        7, SCHEDULES, r"missing fence.proxy.async hazard .*no fence.proxy.async after the write", [T_OUT, T_STORE]),
    "no named barrier between the consumers' writes and the storing thread": (
        8, SCHEDULES, r"(missing fence.proxy.async|read-after-write) hazard", [T_OUT, T_STORE]),
    "the producer refills a stage without waiting on its empty barrier": (
        9, ["forward", "reverse", "warp-serial-reverse", "consumer-first", "random"],
        r"write-after-(write \(TMA load\)|read) hazard", [T_LOAD]),
}


@pytest.mark.parametrize("name", list(TMA_BUGS))
def test_tma_pipeline_ordering_bugs_are_races(tma_pipeline, name):
    bug, schedules, words, lines = TMA_BUGS[name]
    reports = caught(run_tma, tma_pipeline, bug, schedules)
    assert set(reports) == set(schedules), sorted(reports)
    for schedule, message in reports.items():
        assert re.search(words, message), (schedule, message)
        assert all(line in message for line in lines), (schedule, message)


def test_a_missing_fence_names_the_writer_and_the_issue(tma_pipeline, monkeypatch):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "forward")
    with pytest.raises(RaceError) as error:
        run_tma(tma_pipeline, 7)
    message = str(error.value)
    assert re.search(r"thread \d+ \(warp \d, lane \d+\) issues an async-proxy read of it .* at .*" + re.escape(T_STORE),
                     message)
    assert re.search(r"thread \d+ \(warp \d, lane \d+\) wrote it at .*" + re.escape(T_OUT), message)


def test_the_uninstrumented_build_misses_the_missing_fence(monkeypatch):
    """Positive control: without racecheck the unfenced store gives the right data (the emulator's
    proxies are coherent), so only racecheck's happens-before catches it."""
    monkeypatch.delenv("FAGEN_EMULATE_RACECHECK", raising=False)
    plain = load_module(TMA_SOURCE, racecheck=False).get_function("tma_pipeline")
    assert run_tma(plain, 7)

"""TMA in the emulator (fagen/tma.cuh; fagen/emulate/src/tma.cpp): a warp-specialised pipeline of
tile loads through mbarrier-guarded stages, tile stores and a bulk f32 reduction, against NumPy under
every schedule; the planted bugs the twin must catch; and the same source through NVRTC for sm_90a."""

from __future__ import annotations

import pytest
import torch

import tma_pipeline_case as case
import twin_mutants
from fagen.emulate import EmulationError, load_module

SCHEDULES = list(twin_mutants.SCHEDULES)


@pytest.fixture(scope="module")
def pipeline():
    return case.pipeline()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiles_pass_through_intact(pipeline, monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    for seed in (["1", "2"] if schedule == "random" else ["0"]):
        monkeypatch.setenv("FAGEN_EMULATE_SEED", seed)
        for tiles in (1, 2, 5):   # within one round of the ring, and several phases past it
            y, expected, sums, expected_sums = case.run(pipeline, 0, tiles)
            assert torch.equal(y, expected), (schedule, seed, tiles)
            assert torch.equal(sums, expected_sums), (schedule, seed, tiles)


@pytest.mark.parametrize("planted", case.PLANTED, ids=[p.name for p in case.PLANTED])
def test_a_planted_bug_is_caught(planted):
    assert twin_mutants.verdict(planted, case.outputs_correct) is None


def test_a_destination_written_while_its_load_is_in_flight_is_reported(monkeypatch):
    # Producer first: the load is issued before any consumer waits, so it is still in flight (it
    # lands at the consumers' wait) when the producer writes into its destination.
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "producer-first")
    source = case.KERNEL.read_text().replace(
        "      fagen::tma_load<2>(smem + s * kTileBytes, x_map, coords, &full[s]);",
        "      fagen::tma_load<2>(smem + s * kTileBytes, x_map, coords, &full[s]);\n"
        "      smem[s * kTileBytes + 5] = 0;")
    kernel = load_module(source).get_function("tma_pipeline")
    with pytest.raises(EmulationError, match="destination of a TMA load .* was written while the load was in flight"):
        case.run(kernel, 0, tiles=1)


def test_a_load_of_a_tile_wholly_past_the_tensor_is_refused(pipeline):
    # x a whole tile short: block 1's one tile (rows 32..63) lies past x's 32 rows. Whether TMA
    # completes such a load is not documented, so the twin refuses it, naming the box.
    with pytest.raises(EmulationError, match=r"tma_pipeline: block \(1,0,0\): .*the box at coordinates \(0, 32\) "
                                             r".*wholly outside the tensor: its dim 1 covers 32\.\.63 of 0\.\.31"):
        case.run(pipeline, 0, tiles=1, short_rows=case.ROWS)
    # One row longer, the tile's first row is inside: the rest load as zeros (documented), as before.
    y, expected_y, sums, expected_sums = case.run(pipeline, 0, tiles=1, short_rows=case.ROWS - 1)
    assert torch.equal(y, expected_y) and torch.equal(sums, expected_sums)


def test_nvrtc_compiles_the_pipeline_for_sm_90a():
    pytest.importorskip("cuda.bindings")
    from fagen.kernels.compile import nvrtc_compile

    cubin, log = nvrtc_compile(case.KERNEL.read_text(), "sm_90a")
    assert cubin, log


def test_the_checked_build_runs_tma(monkeypatch):
    """Under AddressSanitizer (the checked build's helper process, which copies every tensor): the
    maps are re-pointed at the copies, and what the TMA stores write comes back."""
    kernel = load_module(case.KERNEL.read_text(), checked=True).get_function("tma_pipeline")
    y, expected, sums, expected_sums = case.run(kernel, 0, tiles=2)
    assert torch.equal(y, expected) and torch.equal(sums, expected_sums)

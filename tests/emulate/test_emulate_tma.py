"""TMA in the emulator (fagen/tma.cuh; fagen/emulate/src/tma.cpp): a warp-specialised pipeline of
tile loads through mbarrier-guarded stages, tile stores and a bulk f32 reduction, against NumPy under
every schedule; the planted bugs the twin must catch; and the same source through NVRTC for sm_90a."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import tma_pipeline_case as case
from fagen.emulate import EmulationError, load_module
from fagen.kernels.tensor_map import Swizzle, TensorMapSpec

I32 = np.int32
SCHEDULES = ["forward", "reverse", "warp-serial", "warp-serial-reverse", "producer-first", "consumer-first",
             "random"]


@pytest.fixture(scope="module")
def pipeline():
    return load_module(case.KERNEL.read_text()).get_function("tma_pipeline")


def run(kernel, bug: int, tiles: int):
    """(y, expected y, sums, expected sums)."""
    x, y, sums = case.inputs(tiles)
    maps = [TensorMapSpec.of_tensor(t, (case.ROWS, case.COLS), swizzle=Swizzle.B128).emulated_bytes(t.data_ptr())
            for t in (x, y)]
    kernel((case.BLOCKS,), (case.THREADS,), (*maps, sums, I32(tiles), I32(bug)), shared_mem=case.SHARED)
    expected_y, expected_sums = case.expected(x, tiles)
    return y, expected_y, sums, expected_sums


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiles_pass_through_intact(pipeline, monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    for seed in (["1", "2"] if schedule == "random" else ["0"]):
        monkeypatch.setenv("FAGEN_EMULATE_SEED", seed)
        for tiles in (1, 2, 5):   # within one round of the ring, and several phases past it
            y, expected, sums, expected_sums = run(pipeline, 0, tiles)
            assert torch.equal(y, expected), (schedule, seed, tiles)
            assert torch.equal(sums, expected_sums), (schedule, seed, tiles)


# Each planted bug, the schedules that must catch it, and what its fault must say (None: wrong data
# or any fault catches it; the flipped parity, say, lets the producer arrive twice in one phase).
PLANTED = {
    "consumers wait with the flipped parity": (1, SCHEDULES, None),
    "a consumer warp releases its stage before reading it": (2, ["producer-first"], None),
    "expect_tx announces 16 bytes too few": (3, SCHEDULES, r"deadlock|tx-count"),
    "the output tile is rewritten before the store's wait_group.read": (
        4, SCHEDULES, r"shared source of a bulk tensor store issued here changed before the bulk wait_group"),
    "no bulk wait before the block exits": (5, SCHEDULES, r"exited with a bulk operation issued at .* still reading"),
    "the store's coordinates swap rows and columns": (6, ["forward"], None),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_planted_bug_is_caught(pipeline, monkeypatch, name):
    bug, schedules, fault = PLANTED[name]
    for schedule in schedules:
        monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
        try:
            y, expected, sums, expected_sums = run(pipeline, bug, tiles=3)
        except EmulationError as error:
            assert fault is None or re.search(fault, str(error)), (schedule, str(error))
            continue
        assert fault is None, f"{schedule}: expected a fault"
        assert not (torch.equal(y, expected) and torch.equal(sums, expected_sums)), f"not caught under {schedule}"


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
        run(kernel, 0, tiles=1)


def test_nvrtc_compiles_the_pipeline_for_sm_90a():
    pytest.importorskip("cuda.bindings")
    from fagen.kernels.compile import nvrtc_compile

    cubin, log = nvrtc_compile(case.KERNEL.read_text(), "sm_90a")
    assert cubin, log

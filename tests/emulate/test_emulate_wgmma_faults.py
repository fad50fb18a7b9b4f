"""Planted wgmma bugs (tests/emulate/kernels/wgmma_bugs.cu): the emulator catches each one.

The same pipeline runs clean first: two chained wgmmas on one accumulator in one group (no
fence needed between them), a second group on another accumulator, then a wgmma after the
threads rescaled the accumulator (a fence needed). Each bug then either faults, naming the
rule, or gives NaN where the kernel read an accumulator still in flight.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import isa_wgmma
import wgmma_tiles as tiles
from fagen.emulate import EmulationError, RaceError, load_module

SOURCE = (Path(__file__).parent / "kernels" / "wgmma_bugs.cu").read_text()
N = 16
I32 = np.int32


@pytest.fixture(scope="module")
def pipeline():
    return load_module(SOURCE).get_function("wgmma_pipeline")


def line_of(text: str) -> int:
    for number, line in enumerate(SOURCE.splitlines(), start=1):
        if text in line:
            return number
    raise AssertionError(text)


def operands(rng):
    """Two (A, B) pairs placed K-major with the 128B swizzle, their params and the image."""
    pairs = [(rng.integers(-4, 5, (64, 16)).astype(np.float64), rng.integers(-4, 5, (N, 16)).astype(np.float64))
             for _ in range(2)]
    image = np.zeros(2 * (8192 + 2048), dtype=np.uint8)
    params, offset = [], 0
    for tile in (x for pair in pairs for x in pair):
        placement = tiles.canonical(tile.shape[0], False, 1, offset)
        offset += placement.span  # spans are multiples of 1024: every tile starts on the swizzle pattern
        tiles.place(image, torch.from_numpy(tile).half().view(torch.int16).numpy().astype(np.uint16), placement)
        params += [placement.offset, placement.lbo, placement.sbo, placement.mode]
    return pairs, image, params


def launch(pipeline, bug: int, seed: int = 0):
    pairs, image, params = operands(np.random.default_rng(seed))
    out = torch.full((3, 128, N // 2), float("nan"))
    pipeline((1, 1, 1), (128, 1, 1), (torch.from_numpy(image), I32(image.size), torch.tensor(params, dtype=torch.int32),
                                      out, I32(bug)), shared_mem=image.size + 1024)
    where = isa_wgmma.accumulator(N)
    results = np.full((3, 64, N), np.nan)
    for (thread, register), (row, col) in where.items():
        results[:, row, col] = out[:, thread, register].numpy()
    (a0, b0), (a1, b1) = pairs
    d1 = a0 @ b0.T + a1 @ b1.T
    return results, (d1, a1 @ b1.T, 2 * d1 + a0 @ b0.T)


def test_clean_pipeline(pipeline):
    results, expected = launch(pipeline, 0)
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got, want)


def test_missing_fence_before_the_first_wgmma(pipeline):
    with pytest.raises(EmulationError, match=r"no wgmma\.fence has ordered") as error:
        launch(pipeline, 1)
    assert f".cu:{line_of('fagen::wgmma_ss<kN, false>(d, descriptor(base, p), descriptor')})" in str(error.value)


def test_operand_tile_overwritten_before_the_wait(pipeline):
    with pytest.raises(EmulationError, match="changed between its issue and the wgmma.wait_group") as error:
        launch(pipeline, 2)
    assert f".cu:{line_of('fagen::wgmma_wait<0>();')})" in str(error.value), "named at the retiring wait"


def test_wait_off_by_one_reads_poison(pipeline):
    results, expected = launch(pipeline, 3)
    np.testing.assert_array_equal(results[0], expected[0])  # the older group retired
    assert np.isnan(results[1]).all(), "the group still in flight must read as NaN"
    np.testing.assert_array_equal(results[2], expected[2])


def test_missing_fence_after_rescaling_the_accumulator(pipeline):
    with pytest.raises(EmulationError, match=r"thread \d+ wrote after the last wgmma left them, with no wgmma\.fence"):
        launch(pipeline, 4)


def test_part_of_the_warpgroup_is_a_fault(pipeline):
    with pytest.raises(EmulationError, match="warpgroup"):
        launch(pipeline, 5)


def test_descriptors_must_agree_across_the_warpgroup(pipeline):
    with pytest.raises(EmulationError, match="thread 5 passes descriptors .* they must agree across the warpgroup"):
        launch(pipeline, 8)


def test_base_offset_is_not_modelled(pipeline):
    with pytest.raises(EmulationError, match="has base offset 1: the emulator models base offset 0 only"):
        launch(pipeline, 9)


def test_deadlock_names_the_warpgroup_wait(pipeline):
    with pytest.raises(EmulationError, match=r"deadlock.*Warpgroup 0: threads 0,32,64,96 wait in wgmma\.fence"):
        launch(pipeline, 6)


def test_racecheck_sees_the_wgmma_read_the_copy_races_with():
    """Racecheck: the wgmma's operand reads (attributed to the warpgroup's thread 0) against the
    threads' unordered copy into the tile; clean with the barrier."""
    checked = load_module(SOURCE, racecheck=True).get_function("wgmma_pipeline")
    results, expected = launch(checked, 0)
    np.testing.assert_array_equal(results[0], expected[0])
    issue = line_of("fagen::wgmma_ss<kN, false>(d, descriptor(base, p), desc")
    copy = line_of("tile[i] = image[i];")
    with pytest.raises(RaceError, match=rf"thread 0 .* reads it at \w+\.cu:{issue} .* wrote it at \w+\.cu:{copy} "):
        launch(checked, 7)

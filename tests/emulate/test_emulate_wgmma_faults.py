"""Planted wgmma bugs (tests/emulate/kernels/wgmma_bugs.cu): the emulator catches each one.

The same pipeline runs clean first: two chained wgmmas on one accumulator in one group (no
fence needed between them), a second group on another accumulator, then a wgmma after the
threads rescaled the accumulator (a fence needed). Each bug then either faults, naming the
rule, or gives NaN where the kernel read an accumulator still in flight.
"""

from __future__ import annotations

import numpy as np
import pytest

import wgmma_pipeline_case as case
from fagen.emulate import EmulationError, RaceError, load_module

SOURCE, N, launch = case.SOURCE, case.N, case.launch


@pytest.fixture(scope="module")
def pipeline():
    return load_module(SOURCE).get_function("wgmma_pipeline")


def line_of(text: str) -> int:
    for number, line in enumerate(SOURCE.splitlines(), start=1):
        if text in line:
            return number
    raise AssertionError(text)


def test_clean_pipeline(pipeline):
    results, expected = launch(pipeline, 0)
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got, want)


def test_a_wait_that_retires_nothing_keeps_every_group_whole(pipeline):
    """wait_group 2 with two groups in flight retires none; the groups it keeps must still retire
    right at the next wait (once, keeping one moved it onto itself, which emptied it)."""
    results, expected = launch(pipeline, 11)
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
    with pytest.raises(RaceError, match=rf"thread 0 .* async-proxy read of it .* at \w+\.cu:{issue} .* wrote it at "
                                        rf"\w+\.cu:{copy} "):
        launch(checked, 7)


def test_racecheck_wants_a_proxy_fence_between_the_copy_and_the_wgmma():
    """The threads' copy into the operand tile is a generic-proxy write; the wgmma reads through
    the async proxy: without fence.proxy.async after the copy the GPU may read stale bytes, which
    the emulator, reading the bytes as they are, would not show. Racecheck reports it."""
    checked = load_module(SOURCE, racecheck=True).get_function("wgmma_pipeline")
    issue = line_of("fagen::wgmma_ss<kN, false>(d, descriptor(base, p), desc")
    with pytest.raises(RaceError, match=rf"missing fence.proxy.async hazard .* at \w+\.cu:{issue} .* no "
                                        r"fence.proxy.async after the write"):
        launch(checked, 10)
    results, expected = launch(load_module(SOURCE).get_function("wgmma_pipeline"), 10)   # the control: data right
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got, want)

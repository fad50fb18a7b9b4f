"""TMA feeding wgmma in the emulator (tests/emulate/kernels/tma_wgmma.cu): the tensor maps' swizzle
and the descriptors' must agree, the warpgroup must wait for the tiles, and the product comes out
exact under every schedule; planted bugs are caught; the source compiles for sm_90a."""

from __future__ import annotations

import pytest

import tma_wgmma_case as case
import twin_mutants


@pytest.mark.parametrize("schedule", twin_mutants.SCHEDULES)
def test_the_product_is_exact(monkeypatch, schedule):
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    assert case.outputs_correct(0)


@pytest.mark.parametrize("planted", case.PLANTED, ids=[p.name for p in case.PLANTED])
def test_a_planted_bug_is_caught(planted):
    assert twin_mutants.verdict(planted, case.outputs_correct) is None


def test_nvrtc_compiles_it_for_sm_90a():
    pytest.importorskip("cuda.bindings")
    from fagen.kernels.compile import nvrtc_compile

    cubin, log = nvrtc_compile(case.KERNEL.read_text(), "sm_90a")
    assert cubin, log

"""wgmma's emulated twin (fagen/emulate/src/wgmma.cpp) against NumPy, the ISA's fragment tables
(tests/support/isa_wgmma.py) and the tests' own reading of the shared-memory layouts
(tests/support/wgmma_tiles.py).

One probe kernel per (N, dtype, A source, transposes): it copies an image of shared memory
prepared here into a 1024-byte-aligned tile, builds the descriptors with fagen's
make_smem_desc, runs one wgmma (fence, issue, commit, wait) and dumps every thread's
accumulator registers. The test places the registers through the ISA's D table and compares
with A @ B + C in float64 (small integers: exact).
"""

from __future__ import annotations

import numpy as np
import pytest

import isa_wgmma
import wgmma_probe as probe_kernels
import wgmma_tiles as tiles
from fagen.emulate import EmulationError, load_module
from wgmma_probe import PROBES, bits16, probe_name, probe_source


@pytest.fixture(scope="module")
def probes():
    return load_module(probe_source())


def small_ints(shape, rng, low=-4, high=4) -> np.ndarray:
    return rng.integers(low, high + 1, size=shape).astype(np.float64)


def run_probe(probes, n, bf16, regs, ta, tb, mode, rng, *, scale_d=1, mutate=None, k_slice=True, pad=0):
    """Runs one probe; returns (D as read through the ISA table, the float64 reference)."""
    A, B, C = small_ints((64, 16), rng), small_ints((n, 16), rng), small_ints((64, n), rng, -50, 50)
    a_bits, b_bits = bits16(A, bf16), bits16(B, bf16)
    # K-major swizzled operands start inside a swizzle row, as a k-slice of a wider tile does.
    shift = (lambda mn_major: 32 * (tiles.WIDTH[mode] // 32 - 1) if (k_slice and mode and not mn_major) else 0)
    pa = tiles.canonical(64, bool(ta), mode, 0)
    pa = tiles.Placement(**{**pa.__dict__, "offset": shift(bool(ta))})
    b_at = -(-(pa.offset + pa.span) // 1024) * 1024 + (0 if mode else 384)
    pb = tiles.canonical(n, bool(tb), mode, b_at)
    pb = tiles.Placement(**{**pb.__dict__, "offset": b_at + shift(bool(tb))})
    size = -(-(pb.offset + pb.span + pad) // 1024) * 1024
    image = bits16(small_ints((size // 2,), rng, -3, 3) + 0.5, bf16).view(np.uint8).copy()  # filler: halves
    tiles.place(image, a_bits, pa)
    tiles.place(image, b_bits, pb)
    params = [pa.offset, pa.lbo, pa.sbo, pa.mode, pb.offset, pb.lbo, pb.sbo, pb.mode, scale_d]
    if mutate:
        params = mutate(params)
    d = probe_kernels.launch(probes, (n, bf16, regs, ta, tb), image, params, a_bits, C)
    expected = A @ B.T + (C if scale_d else 0)
    return d, expected


@pytest.mark.parametrize("mode", list(tiles.SWIZZLES.values()), ids=list(tiles.SWIZZLES))
@pytest.mark.parametrize("probe", PROBES, ids=[probe_name(*p) for p in PROBES])
def test_wgmma_matches_numpy(probes, probe, mode):
    d, expected = run_probe(probes, *probe, mode, np.random.default_rng(hash((probe, mode)) % 2**32))
    np.testing.assert_array_equal(d, expected)


def test_scale_d_zero_overwrites(probes):
    d, expected = run_probe(probes, 64, False, False, 0, 1, 1, np.random.default_rng(5), scale_d=0)
    np.testing.assert_array_equal(d, expected)


def test_twin_reads_registers_by_the_isa_tables():
    """The tables name every element once: 128 threads x N/2 registers over 64 x N, 8 A halves each."""
    for n in (8, 24, 256):
        where = isa_wgmma.accumulator(n)
        assert sorted(where.values()) == [(r, c) for r in range(64) for c in range(n)]
        assert len(where) == 128 * n // 2
    assert sorted(isa_wgmma.a_fragment().values()) == [(r, c) for r in range(64) for c in range(16)]


# -- planted bugs -------------------------------------------------------------------------

def test_swapped_lbo_and_sbo_give_wrong_results(probes):
    def swap(p):
        return [p[0], p[2], p[1], *p[3:]]
    for ta in (0, 1):
        d, expected = run_probe(probes, 64, False, False, ta, 0, 0, np.random.default_rng(6), mutate=swap, pad=8192)
        assert not np.array_equal(d, expected)
        d, expected = run_probe(probes, 64, False, False, ta, 0, 0, np.random.default_rng(6), pad=8192)
        np.testing.assert_array_equal(d, expected)
    # Without room past the tile, the swapped strides read past the launch's shared memory.
    with pytest.raises(EmulationError, match="outside the launch's"):
        run_probe(probes, 64, False, False, 0, 0, 0, np.random.default_rng(6), mutate=swap)

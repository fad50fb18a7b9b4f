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

import dataclasses
import zlib

import numpy as np
import pytest
import torch

import isa_wgmma
import wgmma_probe as probe_kernels
import wgmma_tiles as tiles
from fagen.emulate import EmulationError, load_module
from wgmma_probe import FP8_PROBES, NEGATED, PROBES, bits8, bits16, fp8_probe_name, probe_name, probe_source


@pytest.fixture(scope="module")
def probes():
    return load_module(probe_source())


def seeded(*key) -> np.random.Generator:
    """A generator seeded by the test's parameters, the same in every run."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def small_ints(shape, rng, low=-4, high=4) -> np.ndarray:
    return rng.integers(low, high + 1, size=shape).astype(np.float64)


def run_probe(probes, n, bf16, regs, ta, tb, mode, rng, *, scale_d=1, mutate=None, k_slice=True, pad=0, negate=""):
    """Runs one probe; returns (D as read through the ISA table, the float64 reference)."""
    A, B, C = small_ints((64, 16), rng), small_ints((n, 16), rng), small_ints((64, n), rng, -50, 50)
    a_bits, b_bits = bits16(A, bf16), bits16(B, bf16)
    # K-major swizzled operands start inside a swizzle row, as a k-slice of a wider tile does.
    shift = (lambda mn_major: 32 * (tiles.WIDTH[mode] // 32 - 1) if (k_slice and mode and not mn_major) else 0)
    pa = tiles.canonical(64, bool(ta), mode, 0)
    pa = dataclasses.replace(pa, offset=shift(bool(ta)))
    b_at = -(-(pa.offset + pa.span) // 1024) * 1024 + (0 if mode else 384)
    pb = tiles.canonical(n, bool(tb), mode, b_at)
    pb = dataclasses.replace(pb, offset=b_at + shift(bool(tb)))
    size = -(-(pb.offset + pb.span + pad) // 1024) * 1024
    image = bits16(small_ints((size // 2,), rng, -3, 3) + 0.5, bf16).view(np.uint8).copy()  # filler: halves
    tiles.place(image, a_bits, pa)
    tiles.place(image, b_bits, pb)
    params = [pa.offset, pa.lbo, pa.sbo, pa.mode, pb.offset, pb.lbo, pb.sbo, pb.mode, scale_d]
    if mutate:
        params = mutate(params)
    d = probe_kernels.launch(probes, (n, bf16, regs, ta, tb, negate), image, params, a_bits, C)
    expected = (-1 if negate else 1) * (A @ B.T) + (C if scale_d else 0)
    return d, expected


@pytest.mark.parametrize("mode", list(tiles.SWIZZLES.values()), ids=list(tiles.SWIZZLES))
@pytest.mark.parametrize("probe", PROBES, ids=[probe_name(*p) for p in PROBES])
def test_wgmma_matches_numpy(probes, probe, mode):
    d, expected = run_probe(probes, *probe, mode, seeded(probe, mode))
    np.testing.assert_array_equal(d, expected)


@pytest.mark.parametrize("probe", NEGATED, ids=[probe_name(*p) for p in NEGATED])
def test_negated_operands(probes, probe):
    *shape, negate = probe
    d, expected = run_probe(probes, *shape, 2, np.random.default_rng(7), negate=negate)
    np.testing.assert_array_equal(d, expected)


@pytest.mark.parametrize("mode", list(tiles.SWIZZLES.values()), ids=list(tiles.SWIZZLES))
@pytest.mark.parametrize("probe", FP8_PROBES, ids=[fp8_probe_name(*p) for p in FP8_PROBES])
def test_fp8_wgmma_matches_numpy(probes, probe, mode):
    """.m64nNk32 with e4m3 / e5m2 inputs: 8-bit elements, 32 of them along K, K-major."""
    n, a_type, b_type, _ = probe
    rng = seeded(probe, mode)
    A, B, C = small_ints((64, 32), rng), small_ints((n, 32), rng), small_ints((64, n), rng, -50, 50)
    a_bits, b_bits = bits8(A, a_type), bits8(B, b_type)
    shift = 32 * (tiles.WIDTH[mode] // 32 - 1) if mode else 0  # a k-slice inside a swizzle row
    pa = tiles.canonical(64, False, mode, shift)
    b_at = -(-(shift + pa.span) // 1024) * 1024
    pb = tiles.canonical(n, False, mode, b_at + shift)
    size = -(-(pb.offset + pb.span) // 1024) * 1024
    image = bits8(small_ints((size,), rng, -3, 3) + 0.5, "e4m3")
    tiles.place(image, a_bits, pa)
    tiles.place(image, b_bits, pb)
    params = [pa.offset, pa.lbo, pa.sbo, pa.mode, pb.offset, pb.lbo, pb.sbo, pb.mode, 1]
    d = probe_kernels.launch(probes, probe, image, params, a_bits, C)
    np.testing.assert_array_equal(d, A @ B.T + C)


@pytest.mark.parametrize("probe", [(64, "e4m3", "e4m3", False), (64, "e5m2", "e5m2", True)], ids=["e4m3", "e5m2"])
def test_fp8_decodes_every_finite_code(probes, probe):
    """Every finite 8-bit code (subnormals too) as A, picked out by a one-hot B: D is exactly the
    code's value as torch reads it (e4m3fn / e5m2). Infinities and NaNs are left out: times the
    one-hot B's zeros they would turn whole rows to NaN."""
    n, kind, _, _ = probe
    dtype = torch.float8_e5m2 if kind == "e5m2" else torch.float8_e4m3fn
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).double().numpy()
    finite = np.isfinite(values)
    a_bits = np.where(finite, codes.numpy(), 0).astype(np.uint8)
    a_bits = np.concatenate([a_bits, np.zeros(64 * 32 - 256, dtype=np.uint8)]).reshape(64, 32)
    B = np.zeros((n, 32))
    B[np.arange(32), np.arange(32)] = 1.0
    b_bits = bits8(B, kind)
    pa, pb = tiles.canonical(64, False, 0, 0), tiles.canonical(n, False, 0, 2048)
    image = np.zeros(4096, dtype=np.uint8)
    tiles.place(image, a_bits, pa)
    tiles.place(image, b_bits, pb)
    params = [pa.offset, pa.lbo, pa.sbo, pa.mode, pb.offset, pb.lbo, pb.sbo, pb.mode, 1]
    d = probe_kernels.launch(probes, probe, image, params, a_bits, np.zeros((64, n)))
    expected = np.where(finite, values, 0.0)
    np.testing.assert_array_equal(d[:8, :32].reshape(-1), expected)


def test_scale_d_zero_overwrites(probes):
    d, expected = run_probe(probes, 64, False, False, 0, 1, 1, np.random.default_rng(5), scale_d=0)
    np.testing.assert_array_equal(d, expected)


def test_isa_tables_name_every_element_once():
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


# -- the wrappers' GPU side -----------------------------------------------------------------

EVERY_N = r"""
#include <fagen/wgmma.cuh>
template <int N>
__device__ void every(float* out, uint64_t a_desc, uint64_t b_desc, const uint32_t* a_in, int scale_d) {
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = out[i];
  uint32_t a[4] = {a_in[0], a_in[1], a_in[2], a_in[3]};
  fagen::wgmma_fence();
  fagen::wgmma_ss<N, false>(d, a_desc, b_desc, scale_d);
  fagen::wgmma_ss<N, true, 1, 1, -1, 1>(d, a_desc, b_desc, scale_d);
  fagen::wgmma_rs<N, true, 1>(d, a, b_desc, scale_d);
  fagen::wgmma_rs<N, false, 0, 1, -1>(d, a, b_desc, scale_d);
  fagen::wgmma_ss_fp8<N, false, true>(d, a_desc, b_desc, scale_d);
  fagen::wgmma_rs_fp8<N, true, false, -1, 1>(d, a, b_desc, scale_d);
  fagen::wgmma_commit();
  fagen::wgmma_wait<0>();
  fagen::wgmma_fence_operands<N>(d);
  for (int i = 0; i < N / 2; ++i) out[i * 128 + threadIdx.x] = d[i];
}
template <int... Ns> struct Shapes {
  static __device__ void run(float* out, uint64_t a, uint64_t b, const uint32_t* r, int s) {
    (every<Ns>(out, a, b, r, s), ...);
  }
};
extern "C" __global__ void every_n(float* out, const uint32_t* a_in, int scale_d) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = fagen::shared_window_address(smem);
  const uint64_t a = fagen::make_smem_desc(base, 16, 1024, fagen::kSwizzle128B);
  const uint64_t b = fagen::make_smem_desc(base + 8192, 2048, 128, fagen::kSwizzleNone);
  Shapes<8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160, 168, 176, 184, 192,
         200, 208, 216, 224, 232, 240, 248, 256>::run(out, a, b, a_in, scale_d);
}
"""


def test_wrappers_compile_for_sm90a_with_nvrtc():
    """Every N of .m64nNk16 (f16, bf16) and .m64nNk32 (e4m3 x e5m2, e5m2 x e4m3), A from shared
    memory and from registers, with the transpose and negate immediates: NVRTC (and ptxas, for
    sm_90a) accept the inline PTX."""
    from nvrtc_ptx import nvrtc_ptx

    ptx = nvrtc_ptx(EVERY_N, "sm_90a")
    for n in range(8, 257, 8):
        for dtype in ("f16", "bf16"):
            shape = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dtype}.{dtype}"
            assert ptx.count(shape) == 2, shape
        for types in ("e4m3.e5m2", "e5m2.e4m3"):
            shape = f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.{types}"
            assert ptx.count(shape) == 1, shape
    assert "wgmma.fence.sync.aligned" in ptx and "wgmma.commit_group.sync.aligned" in ptx
    assert "wgmma.wait_group.sync.aligned 0" in ptx
    assert "wgmma.mma_async" in nvrtc_ptx(probe_source(), "sm_90a")

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
import torch

import isa_wgmma
import wgmma_tiles as tiles
from fagen.emulate import EmulationError, load_module

I32 = np.int32
# (N, bf16, A from registers, trans A, trans B)
PROBES = ([(n, False, False, ta, tb) for n in (8, 64, 256) for ta in (0, 1) for tb in (0, 1)]
          + [(64, True, False, 1, 0), (24, True, False, 0, 1)]
          + [(n, False, True, 0, tb) for n in (8, 64, 256) for tb in (0, 1)])


def probe_name(n, bf16, regs, ta, tb) -> str:
    return f"probe_n{n}_{'bf16' if bf16 else 'f16'}_{'rs' if regs else 'ss'}_{ta}{tb}"


PROBE = r"""
// One wgmma of the warpgroup: shared image -> tile (1024-aligned), descriptors from p[0..7]
// (A offset, LBO, SBO, swizzle; B likewise), C from c_in, registers dumped to out.
template <int N, bool kBf16, bool kRegs, int kTransA, int kTransB>
__device__ void probe(const unsigned char* image, int image_bytes, const int* p, const uint32_t* a_regs,
                      const float* c_in, float* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t window = fagen::shared_window_address(smem);
  unsigned char* tile = smem + (1024 - window % 1024) % 1024;
  const uint32_t base = fagen::shared_window_address(tile);
  for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) tile[i] = image[i];
  __syncthreads();
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = c_in[threadIdx.x * (N / 2) + i];
  uint32_t a[4];
  for (int r = 0; r < 4; ++r) a[r] = a_regs[threadIdx.x * 4 + r];
  const uint64_t a_desc = fagen::make_smem_desc(base + p[0], p[1], p[2], p[3]);
  const uint64_t b_desc = fagen::make_smem_desc(base + p[4], p[5], p[6], p[7]);
  fagen::wgmma_fence();
  if (kRegs) {
    fagen::wgmma_rs<N, kBf16, kTransB>(d, a, b_desc, p[8]);
  } else {
    fagen::wgmma_ss<N, kBf16, kTransA, kTransB>(d, a_desc, b_desc, p[8]);
  }
  fagen::wgmma_commit();
  fagen::wgmma_wait<0>();
  fagen::wgmma_fence_operands<N>(d);
  for (int i = 0; i < N / 2; ++i) out[threadIdx.x * (N / 2) + i] = d[i];
}
"""


def probe_source() -> str:
    lines = ["#include <fagen/prelude.cuh>", "#include <fagen/wgmma.cuh>", PROBE]
    for n, bf16, regs, ta, tb in PROBES:
        name = probe_name(n, bf16, regs, ta, tb)
        lines.append(
            f'extern "C" __global__ void {name}(const unsigned char* image, int image_bytes, const int* p, '
            f"const uint32_t* a_regs, const float* c_in, float* out) {{\n"
            f"  probe<{n}, {'true' if bf16 else 'false'}, {'true' if regs else 'false'}, {ta}, {tb}>"
            f"(image, image_bytes, p, a_regs, c_in, out);\n}}\nFAGEN_EXPORT({name})")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def probes():
    return load_module(probe_source())


def small_ints(shape, rng, low=-4, high=4) -> np.ndarray:
    return rng.integers(low, high + 1, size=shape).astype(np.float64)


def bits16(values: np.ndarray, bf16: bool) -> np.ndarray:
    t = torch.from_numpy(values).to(torch.bfloat16 if bf16 else torch.float16)
    return t.view(torch.int16).numpy().astype(np.uint16)


def a_registers(a_bits: np.ndarray) -> np.ndarray:
    """128 x 4 registers holding A (64 x 16) where the ISA's A table puts it."""
    regs = np.zeros((128, 4), dtype=np.uint32)
    for (thread, element), (row, col) in isa_wgmma.a_fragment().items():
        regs[thread, element // 2] |= np.uint32(a_bits[row, col]) << np.uint32(16 * (element % 2))
    return regs


def d_from_registers(registers: np.ndarray, n: int) -> np.ndarray:
    d = np.full((64, n), np.nan)
    for (thread, register), (row, col) in isa_wgmma.accumulator(n).items():
        d[row, col] = registers[thread, register]
    return d


def c_registers(c: np.ndarray, n: int) -> np.ndarray:
    regs = np.zeros((128, n // 2), dtype=np.float32)
    for (thread, register), (row, col) in isa_wgmma.accumulator(n).items():
        regs[thread, register] = c[row, col]
    return regs


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
    out = torch.full((128, n // 2), float("nan"))
    kernel = probes.get_function(probe_name(n, bf16, regs, ta, tb))
    kernel((1, 1, 1), (128, 1, 1),
           (torch.from_numpy(image), I32(size), torch.tensor(params, dtype=torch.int32),
            torch.from_numpy(a_registers(a_bits).view(np.int32)), torch.from_numpy(c_registers(C, n)), out),
           shared_mem=size + 1024)
    expected = A @ B.T + (C if scale_d else 0)
    return d_from_registers(out.numpy(), n), expected


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

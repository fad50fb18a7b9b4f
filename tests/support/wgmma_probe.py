"""The wgmma probe kernels (tests/emulate/test_emulate_wgmma.py, test_emulate_wgmma_cute.py).

One kernel per (N, dtype, A source, transposes): it copies an image of shared memory into a
1024-byte-aligned tile, builds both descriptors with fagen's make_smem_desc from
p = (A offset, LBO, SBO, swizzle, B offset, LBO, SBO, swizzle, scale-d), runs one wgmma (fence,
issue, commit, wait) and dumps every thread's accumulator registers, which the tests place
through the ISA's D table (isa_wgmma.py).
"""

from __future__ import annotations

import numpy as np
import torch

import isa_wgmma

I32 = np.int32
# (N, bf16, A from registers, trans A, trans B)
PROBES = ([(n, False, False, ta, tb) for n in (8, 64, 256) for ta in (0, 1) for tb in (0, 1)]
          + [(64, True, False, 1, 0), (24, True, False, 0, 1)]
          + [(n, False, True, 0, tb) for n in (8, 64, 256) for tb in (0, 1)]
          # the sm90 backward's paired form: S^T over a warpgroup's 32 queries; dK's B at d = 192
          + [(32, False, False, 0, 0), (192, False, False, 0, 1)])
# The same with imm-scale-a or imm-scale-b = -1 (a sixth field: which operand is negated).
NEGATED = [(64, False, False, 0, 1, "a"), (32, True, True, 0, 0, "b")]


# 8-bit inputs, K-major only: (N, A type, B type, A from registers).
FP8_PROBES = [(64, "e4m3", "e4m3", False), (256, "e5m2", "e4m3", False), (8, "e4m3", "e5m2", True),
              (64, "e5m2", "e5m2", True)]


def fp8_probe_name(n, a_type, b_type, regs) -> str:
    return f"probe8_n{n}_{a_type}_{b_type}_{'rs' if regs else 'ss'}"


def probe_name(n, bf16, regs, ta, tb, negate="") -> str:
    suffix = f"_neg{negate}" if negate else ""
    return f"probe_n{n}_{'bf16' if bf16 else 'f16'}_{'rs' if regs else 'ss'}_{ta}{tb}{suffix}"


PROBE = r"""
// One wgmma of the warpgroup: shared image -> tile (1024-aligned), descriptors from p[0..7]
// (A offset, LBO, SBO, swizzle; B likewise), C from c_in, registers dumped to out.
template <int N, class Wgmma>
__device__ void probe(const unsigned char* image, int image_bytes, const int* p, const uint32_t* a_regs,
                      const float* c_in, float* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t window = fagen::shared_window_address(smem);
  unsigned char* tile = smem + (1024 - window % 1024) % 1024;
  const uint32_t base = fagen::shared_window_address(tile);
  for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) tile[i] = image[i];
  fagen::fence_proxy_async_shared();   // the generic-proxy copy, visible to the wgmma's async proxy
  __syncthreads();
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = c_in[threadIdx.x * (N / 2) + i];
  uint32_t a[4];
  for (int r = 0; r < 4; ++r) a[r] = a_regs[threadIdx.x * 4 + r];
  const uint64_t a_desc = fagen::make_smem_desc(base + p[0], p[1], p[2], p[3]);
  const uint64_t b_desc = fagen::make_smem_desc(base + p[4], p[5], p[6], p[7]);
  fagen::wgmma_fence();
  Wgmma::run(d, a, a_desc, b_desc, p[8]);
  fagen::wgmma_commit();
  fagen::wgmma_wait<0>();
  fagen::wgmma_fence_operands<N>(d);
  for (int i = 0; i < N / 2; ++i) out[threadIdx.x * (N / 2) + i] = d[i];
}

template <int N, bool kBf16, bool kRegs, int kTransA, int kTransB, int kScaleA = 1, int kScaleB = 1>
struct Wide {  // 16-bit inputs
  static __device__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t a_desc, uint64_t b_desc, int s) {
    if (kRegs) {
      fagen::wgmma_rs<N, kBf16, kTransB, kScaleA, kScaleB>(d, a, b_desc, s);
    } else {
      fagen::wgmma_ss<N, kBf16, kTransA, kTransB, kScaleA, kScaleB>(d, a_desc, b_desc, s);
    }
  }
};

template <int N, bool kAE5M2, bool kBE5M2, bool kRegs>
struct Narrow {  // 8-bit inputs
  static __device__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t a_desc, uint64_t b_desc, int s) {
    if (kRegs) {
      fagen::wgmma_rs_fp8<N, kAE5M2, kBE5M2>(d, a, b_desc, s);
    } else {
      fagen::wgmma_ss_fp8<N, kAE5M2, kBE5M2>(d, a_desc, b_desc, s);
    }
  }
};
"""


def probe_source() -> str:
    lines = ["#include <fagen/prelude.cuh>", "#include <fagen/proxy_fence.cuh>", "#include <fagen/wgmma.cuh>", PROBE]
    kernels = []
    for n, bf16, regs, ta, tb, *negate in PROBES + NEGATED:
        scales = {"a": ", -1, 1", "b": ", 1, -1"}[negate[0]] if negate else ""
        kernels.append((probe_name(n, bf16, regs, ta, tb, *negate), n,
                        f"Wide<{n}, {str(bf16).lower()}, {str(regs).lower()}, {ta}, {tb}{scales}>"))
    for n, a_type, b_type, regs in FP8_PROBES:
        kernels.append((fp8_probe_name(n, a_type, b_type, regs), n,
                        f"Narrow<{n}, {str(a_type == 'e5m2').lower()}, {str(b_type == 'e5m2').lower()}, "
                        f"{str(regs).lower()}>"))
    for name, n, op in kernels:
        lines.append(
            f'extern "C" __global__ void {name}(const unsigned char* image, int image_bytes, const int* p, '
            f"const uint32_t* a_regs, const float* c_in, float* out) {{\n"
            f"  probe<{n}, {op}>(image, image_bytes, p, a_regs, c_in, out);\n}}\nFAGEN_EXPORT({name})")
    return "\n".join(lines) + "\n"


def bits16(values: np.ndarray, bf16: bool) -> np.ndarray:
    t = torch.from_numpy(values).to(torch.bfloat16 if bf16 else torch.float16)
    return t.view(torch.int16).numpy().astype(np.uint16)


def bits8(values: np.ndarray, kind: str) -> np.ndarray:
    dtype = torch.float8_e5m2 if kind == "e5m2" else torch.float8_e4m3fn
    t = torch.from_numpy(values).to(dtype)
    assert torch.equal(t.double(), torch.from_numpy(values)), "values must be exact in the 8-bit type"
    return t.view(torch.uint8).numpy()


def a_registers(a_bits: np.ndarray) -> np.ndarray:
    """128 x 4 registers holding A (64 x 16 16-bit or 64 x 32 8-bit elements) where the ISA's A
    table puts it."""
    regs = np.zeros((128, 4), dtype=np.uint32)
    wide = a_bits.dtype.itemsize == 2
    table, per = (isa_wgmma.a_fragment(), 2) if wide else (isa_wgmma.a_fragment_8bit(), 4)
    for (thread, element), (row, col) in table.items():
        regs[thread, element // per] |= np.uint32(a_bits[row, col]) << np.uint32(32 // per * (element % per))
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


def launch(module, probe, image: np.ndarray, params, a_bits: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Runs `probe` on `image` (uint8, a multiple of 1024 bytes); returns D (64 x N) as read
    through the ISA's accumulator table."""
    n = probe[0]
    out = torch.full((128, n // 2), float("nan"))
    kernel = module.get_function(fp8_probe_name(*probe) if isinstance(probe[1], str) else probe_name(*probe))
    kernel((1, 1, 1), (128, 1, 1),
           (torch.from_numpy(image), I32(image.size), torch.tensor(params, dtype=torch.int32),
            torch.from_numpy(a_registers(a_bits).view(np.int32)), torch.from_numpy(c_registers(c, n)), out),
           shared_mem=image.size + 1024)
    return d_from_registers(out.numpy(), n)

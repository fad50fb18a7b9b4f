"""The emulator's PTX twins and warp intrinsics against plain math.

Every test runs on the emulator and, marked `gpu`, on a real GPU with the
very same kernel source (tests/emulate/kernels/*.cu) and the same expectations, so
the first GPU run tells whether emulator and hardware agree on fragment
layouts and shuffle semantics.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

import isa_fragments as isa

KERNELS = Path(__file__).parent / "kernels"
I32 = np.int32


class GpuModule:
    """The same kernels compiled by NVRTC through CuPy, launched like the emulator's."""

    def __init__(self, source: str):
        import cupy

        from fagen.kernels.render import include_dir
        from fagen.kernels.compile import cuda_header_dir

        self._cupy = cupy
        options = ["-std=c++17", f"-I{include_dir()}"]
        try:
            options.append(f"-I{cuda_header_dir()}")
        except Exception:  # noqa: BLE001 - CuPy adds its own CUDA include path
            pass
        self._module = cupy.RawModule(code=source, options=tuple(options))

    def get_function(self, name: str):
        function = self._module.get_function(name)

        def launch(grid, block, args, shared_mem=0):
            converted = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args)
            if shared_mem > 48 * 1024:
                function.max_dynamic_shared_size_bytes = shared_mem
            function(grid, block, converted, shared_mem=shared_mem)
            self._cupy.cuda.runtime.deviceSynchronize()

        return launch


class Backend:
    def __init__(self, name: str):
        self.name = name
        self.device = "cuda" if name == "gpu" else "cpu"

    @functools.lru_cache(maxsize=None)
    def module(self, kernel_file: str):
        source = (KERNELS / kernel_file).read_text()
        if self.name == "gpu":
            return GpuModule(source)
        from fagen.emulate import load_module

        return load_module(source)

    def function(self, kernel_file: str, name: str):
        return self.module(kernel_file).get_function(name)


def _gpu_available() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


_BACKENDS = {"emulate": Backend("emulate"), "gpu": Backend("gpu")}


@pytest.fixture(params=["emulate", pytest.param("gpu", marks=pytest.mark.gpu)])
def backend(request) -> Backend:
    if request.param == "gpu" and not _gpu_available():
        pytest.skip("needs a CUDA GPU and CuPy")
    return _BACKENDS[request.param]


def small_ints(shape, dtype, generator, low=-8, high=8):
    """Integer-valued inputs: every product and partial sum is exact in fp32,
    so emulator, GPU and the float64 reference agree bit for bit."""
    return torch.randint(low, high + 1, shape, generator=generator).to(dtype)


def reference_mma(A, B, C):
    return (A.double() @ B.double() + C.double()).float()


# -- mma ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_mma_fragments_by_documented_layout(backend, dtype):
    kernel = backend.function("warp_layouts.cu", "mma_f16_layout" if dtype == torch.float16 else "mma_bf16_layout")
    gen = torch.Generator().manual_seed(1)
    tiles = 6
    A = small_ints((tiles, 16, 16), dtype, gen)
    B = small_ints((tiles, 16, 8), dtype, gen)
    C = small_ints((tiles, 16, 8), torch.float32, gen, -100, 100)
    D = torch.full((tiles, 16, 8), float("nan"))
    dev = [t.to(backend.device) for t in (A, B, C, D)]
    kernel((tiles, 1, 1), (32, 1, 1), tuple(dev))
    torch.testing.assert_close(dev[3].cpu(), reference_mma(A, B, C), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_mma_positions_are_distinct(backend, dtype):
    """Each A element a distinct value and B a one-hot column per k: any swap of
    two fragment slots changes the product."""
    kernel = backend.function("warp_layouts.cu", "mma_f16_layout" if dtype == torch.float16 else "mma_bf16_layout")
    A = torch.arange(256, dtype=torch.float32).reshape(1, 16, 16).to(dtype)  # 0..255, exact in both
    B = torch.zeros(1, 16, 8)
    for n in range(8):  # column n picks A[:, n] and 2 * A[:, n + 8]
        B[0, n, n] = 1.0
        B[0, n + 8, n] = 2.0
    B = B.to(dtype)
    C = torch.arange(128, dtype=torch.float32).reshape(1, 16, 8) * 1000
    D = torch.full((1, 16, 8), float("nan"))
    dev = [t.to(backend.device) for t in (A, B, C, D)]
    kernel((1, 1, 1), (32, 1, 1), tuple(dev))
    torch.testing.assert_close(dev[3].cpu(), reference_mma(A, B, C), rtol=0, atol=0)


def test_mma_random_floats_match_matmul(backend):
    kernel = backend.function("warp_layouts.cu", "mma_f16_layout")
    gen = torch.Generator().manual_seed(2)
    tiles = 4
    A = torch.randn(tiles, 16, 16, generator=gen).half()
    B = torch.randn(tiles, 16, 8, generator=gen).half()
    C = torch.randn(tiles, 16, 8, generator=gen)
    D = torch.empty(tiles, 16, 8)
    dev = [t.to(backend.device) for t in (A, B, C, D)]
    kernel((tiles, 1, 1), (32, 1, 1), tuple(dev))
    # fp32 accumulation of 16 exact products: a few fp32 ulps at most.
    torch.testing.assert_close(dev[3].cpu(), reference_mma(A, B, C), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_mma_with_ldmatrix_operands(backend, dtype):
    name = "mma_f16_ldmatrix" if dtype == torch.float16 else "mma_bf16_ldmatrix"
    kernel = backend.function("warp_layouts.cu", name)
    gen = torch.Generator().manual_seed(3)
    A = small_ints((16, 16), dtype, gen)
    B = small_ints((16, 8), dtype, gen)
    C = small_ints((16, 8), torch.float32, gen, -50, 50)
    outs = [torch.full((16, 8), float("nan")) for _ in range(2)]
    args = [t.to(backend.device) for t in (A, B, B.T.contiguous(), C, *outs)]
    kernel((1, 1, 1), (32, 1, 1), tuple(args))
    expected = reference_mma(A, B, C)
    torch.testing.assert_close(args[4].cpu(), expected, rtol=0, atol=0, msg="B from a k x n tile (.trans)")
    torch.testing.assert_close(args[5].cpu(), expected, rtol=0, atol=0, msg="B from an n x k tile")


# -- mma against the PTX ISA's tables (tests/support/isa_fragments.py) ----------------------

def bits16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)


def pack(matrix: torch.Tensor, grid: str, registers: int) -> np.ndarray:
    """Per-lane 32-bit registers holding `matrix`'s 16-bit elements where the ISA's grid puts
    them: element e of a lane in register e // 2, the lower e in the low half."""
    out, bits = np.zeros((32, registers), dtype=np.uint32), bits16(matrix)
    for (lane, element), (r, c) in isa.parse(grid).items():
        out[lane, element // 2] |= bits[r, c] << (16 * (element % 2))
    return out


def test_isa_tables_name_every_element_once():
    for grid, shape, per_lane in ((isa.MMA_A, (16, 16), 8), (isa.MMA_B, (16, 8), 4), (isa.MMA_C, (16, 8), 4),
                                  (isa.LDMATRIX, (8, 8), 2), (isa.LDMATRIX_TRANS, (8, 8), 2)):
        where = isa.parse(grid)
        assert sorted(set(where.values())) == [(r, c) for r in range(shape[0]) for c in range(shape[1])]
        assert sorted(where) == [(lane, e) for lane in range(32) for e in range(per_lane)]


@pytest.mark.parametrize("values", ["random", "distinct"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_mma_registers_follow_the_isa_tables(backend, dtype, values):
    """Operands packed per (lane, register) from the ISA's grids, the result read back through
    the C/D grid: exactly A @ B + C. `distinct` makes every A element different and B one-hot
    per k, so any two swapped fragment slots change the product."""
    kernel = backend.function("warp_layouts.cu", "mma_f16_registers" if dtype == torch.float16
                              else "mma_bf16_registers")
    if values == "random":
        gen = torch.Generator().manual_seed(4)
        A, B = small_ints((16, 16), dtype, gen), small_ints((16, 8), dtype, gen)
        C = small_ints((16, 8), torch.float32, gen, -100, 100)
    else:
        A = torch.arange(256, dtype=torch.float32).reshape(16, 16).to(dtype)
        B = torch.zeros(16, 8)
        for n in range(8):
            B[n, n], B[n + 8, n] = 1.0, 2.0
        B, C = B.to(dtype), torch.arange(128, dtype=torch.float32).reshape(16, 8) * 1000
    c_where = isa.parse(isa.MMA_C)
    c_regs = np.zeros((32, 4), dtype=np.float32)
    for (lane, e), (r, c) in c_where.items():
        c_regs[lane, e] = C[r, c].item()
    args = [torch.from_numpy(pack(A, isa.MMA_A, 4).view(np.int32)),
            torch.from_numpy(pack(B, isa.MMA_B, 2).view(np.int32)), torch.from_numpy(c_regs),
            torch.full((32, 4), float("nan"))]
    args = [t.to(backend.device) for t in args]
    kernel((1, 1, 1), (32, 1, 1), tuple(args))
    d_regs, D = args[3].cpu(), torch.full((16, 8), float("nan"))
    for (lane, e), (r, c) in c_where.items():
        D[r, c] = d_regs[lane, e]
    torch.testing.assert_close(D, reference_mma(A, B, C), rtol=0, atol=0)


# -- ldmatrix -------------------------------------------------------------------

def expected_ldmatrix(rows: np.ndarray, perm: np.ndarray, count: int, transpose: bool) -> np.ndarray:
    """From the PTX ISA's tables (tests/support/isa_fragments.py): matrix i's row j is the row whose
    address lane LDMATRIX_ADDRESS_LANES[count][i][j] supplies; register i of each lane holds
    the two elements its grid cell names for matrix i."""
    grid = isa.parse(isa.LDMATRIX_TRANS if transpose else isa.LDMATRIX)
    out = np.zeros((32, 4), dtype=np.uint32)
    u16 = rows.astype(np.uint16).astype(np.uint32)
    for i, lanes in isa.LDMATRIX_ADDRESS_LANES[count].items():
        matrix = u16[perm[list(lanes)]]   # 8 x 8
        for (lane, half), (r, c) in grid.items():
            out[lane, i] |= matrix[r, c] << (16 * half)
    return out


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "trans"])
def test_ldmatrix_layout(backend, count, transpose):
    kernel = backend.function("warp_layouts.cu", "ldmatrix_layout")
    rng = np.random.default_rng(10 * count + transpose)
    rows = rng.permutation(32 * 8).astype(np.int16).reshape(32, 8)  # every element distinct
    perm = rng.permutation(32).astype(np.int32)                     # lanes point at shuffled rows
    out = torch.zeros(32 * 4, dtype=torch.int32, device=backend.device)
    args = (torch.from_numpy(rows).to(backend.device), torch.from_numpy(perm).to(backend.device),
            out.view(torch.int32), I32(count), I32(int(transpose)))
    kernel((1, 1, 1), (32, 1, 1), args)
    got = out.cpu().numpy().view(np.uint32).reshape(32, 4)
    np.testing.assert_array_equal(got, expected_ldmatrix(rows, perm, count, transpose))


# -- shuffles, ballot, votes ---------------------------------------------------------

def expected_shuffles(value: np.ndarray, source: np.ndarray) -> np.ndarray:
    """The CUDA C++ Programming Guide's warp shuffle semantics, lane by lane."""
    n = len(value)
    cases = []

    def per_lane(fn):
        cases.append(np.array([fn(tid - tid % 32, tid % 32) for tid in range(n)]))

    def idx(width):
        return lambda base, lane: value[base + (lane - lane % width) + source[base + lane] % width]

    def xor(m, width=32):
        def fn(base, lane):
            target = lane ^ m
            # "attempting to access elements from later groups returns their own value"
            return value[base + lane] if target >= (lane - lane % width) + width else value[base + target]
        return fn

    def up(d, width=32):
        return lambda base, lane: value[base + lane] if lane - d < lane - lane % width else value[base + lane - d]

    def down(d, width=32):
        return lambda base, lane: (value[base + lane] if lane + d >= (lane - lane % width) + width
                                   else value[base + lane + d])

    per_lane(idx(32))
    per_lane(idx(8))
    for m in (1, 2, 4, 8, 16):
        per_lane(xor(m))
    per_lane(xor(8, 8))
    per_lane(up(3))
    per_lane(up(3, 16))
    per_lane(down(5))
    per_lane(down(5, 16))
    per_lane(lambda base, lane: int(np.int32(np.uint32(sum(int(value[base + i] & 1) << i for i in range(32))))))
    per_lane(lambda base, lane: value[base + (lane ^ 1)] if lane < 16 else -1)
    per_lane(lambda base, lane: int((value[base + (lane ^ 3)] + 0.25) * 4))
    per_lane(lambda base, lane: value[base] % 1024)
    per_lane(lambda base, lane: int(any(value[base:base + 32] == 7)) + 2 * int(all(value[base:base + 32] >= 0)))
    return np.stack(cases)


def test_warp_shuffles_and_votes(backend):
    kernel = backend.function("warp_layouts.cu", "warp_shuffles")
    rng = np.random.default_rng(4)
    n = 64  # two warps
    value = rng.integers(0, 100000, n).astype(np.int32)
    value[40] = 7  # warp 1 has a 7, warp 0 (most likely) none
    value[:32][value[:32] == 7] = 8
    source = rng.integers(0, 32, n).astype(np.int32)
    expected = expected_shuffles(value, source)
    out = torch.full((expected.shape[0] * n,), -12345, dtype=torch.int32, device=backend.device)
    kernel((1, 1, 1), (n, 1, 1), (torch.from_numpy(value).to(backend.device),
                                   torch.from_numpy(source).to(backend.device), out))
    got = out.cpu().numpy().reshape(expected.shape)
    for case in range(expected.shape[0]):
        np.testing.assert_array_equal(got[case], expected[case], err_msg=f"case {case}")


# -- barriers and shared memory ---------------------------------------------------------

def test_block_reduce_on_2d_blocks(backend):
    kernel = backend.function("warp_layouts.cu", "block_reduce")
    blocks, bx, by = 5, 16, 8
    x = torch.randint(-1000, 1000, (blocks, bx * by)).float().to(backend.device)
    sums = torch.full((blocks,), float("nan"), device=backend.device)
    ids = torch.full((blocks, bx * by), -1, dtype=torch.int32, device=backend.device)
    kernel((blocks, 1, 1), (bx, by, 1), (x, sums, ids), shared_mem=bx * by * 4)
    torch.testing.assert_close(sums.cpu(), x.cpu().sum(1), rtol=0, atol=0)
    assert torch.equal(ids.cpu(), torch.arange(bx * by, dtype=torch.int32).expand(blocks, -1))


def test_shared_memory_is_per_block(backend):
    kernel = backend.function("warp_layouts.cu", "block_private")
    blocks, n, rounds = 24, 128, 6
    out = torch.zeros(blocks * n, dtype=torch.int32, device=backend.device)
    kernel((blocks, 1, 1), (n, 1, 1), (out, I32(rounds)), shared_mem=n * 4)
    b = torch.arange(blocks).view(-1, 1)
    tid = torch.arange(n).view(1, -1)
    expected = sum((b * 1000 + (tid + r) % n) - (b * 1000 + (tid + 2 * r) % n) for r in range(rounds))
    assert torch.equal(out.cpu().view(blocks, n), expected.to(torch.int32))


# -- cp.async ---------------------------------------------------------------------------

@pytest.mark.parametrize("valid", [0, 5, 16, 37, 100, 128])
def test_cp_async_zero_fills_past_src_size(backend, valid):
    kernel = backend.function("warp_layouts.cu", "cp_async_zero_fill")
    threads = 8  # 128 bytes
    src = torch.randint(1, 256, (max(valid, 1),), dtype=torch.uint8, device=backend.device)
    dst = torch.full((threads * 16,), 0xA5, dtype=torch.uint8, device=backend.device)
    kernel((1, 1, 1), (threads, 1, 1), (src, dst, I32(valid)), shared_mem=threads * 16)
    expected = torch.zeros(threads * 16, dtype=torch.uint8)
    expected[:valid] = src.cpu()[:valid]
    assert torch.equal(dst.cpu(), expected)


# -- everything together ------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 256, 64), (100, 70, 96)], ids=["aligned", "ragged"])
def test_tiled_gemm_pipeline(backend, shape):
    """cp.async double buffering + ldmatrix + mma, as in the attention kernels."""
    M, N, K = shape
    kernel = backend.function("tiled_gemm.cu", "gemm_abt")
    gen = torch.Generator().manual_seed(5)
    A = torch.randn(M, K, generator=gen).half()
    B = torch.randn(N, K, generator=gen).half()
    C = torch.full((M, N), float("nan"), device=backend.device)
    kernel(((N + 63) // 64, (M + 63) // 64, 1), (128, 1, 1),
           (A.to(backend.device), B.to(backend.device), C, I32(M), I32(N), I32(K)), shared_mem=2 * 2 * 64 * 40 * 2)
    torch.testing.assert_close(C.cpu().double(), A.double() @ B.double().T, rtol=1e-5, atol=1e-4)


# -- launch geometry, atomics, numerics ---------------------------------------------------

def test_thread_and_block_coordinates(backend):
    kernel = backend.function("warp_layouts.cu", "thread_coordinates")
    grid, block = (3, 2, 2), (8, 4, 2)
    threads, blocks = 8 * 4 * 2, 3 * 2 * 2
    out = torch.full((blocks * threads * 12,), -1, dtype=torch.int32, device=backend.device)
    kernel(grid, block, (out,))
    got = out.cpu().view(2, 2, 3, 2, 4, 8, 12)  # (bz, by, bx, tz, ty, tx, value)
    bz, by, bx, tz, ty, tx = torch.meshgrid(*(torch.arange(n) for n in (2, 2, 3, 2, 4, 8)), indexing="ij")
    expected = torch.stack([bx, by, bz, tx, ty, tz] + [torch.full_like(bx, v) for v in (*block, *grid)], -1)
    assert torch.equal(got, expected.to(torch.int32))


def test_atomics_and_barrier_counts(backend):
    kernel = backend.function("warp_layouts.cu", "atomics_and_counts")
    blocks, n = 40, 96
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(-50, 100, (blocks, n), generator=gen).float()
    x[3] = torch.arange(1, n + 1)  # one block all positive
    x[4] = -1.0                    # one block none positive
    total = torch.zeros(1, device=backend.device)
    count = torch.zeros(2, dtype=torch.int32, device=backend.device)
    per_block = torch.full((blocks * 3,), -1, dtype=torch.int32, device=backend.device)
    kernel((blocks, 1, 1), (n, 1, 1), (x.to(backend.device), total, count, per_block))
    assert total.item() == x.sum().item()  # integer-valued: exact in any order
    assert count.cpu().tolist() == [blocks * n, blocks * n - 1]
    positives = (x > 0).sum(1)
    expected = torch.stack([positives, (positives == n).int(), (positives > 0).int()], 1).reshape(-1)
    assert torch.equal(per_block.cpu(), expected.to(torch.int32))


def test_numeric_intrinsics(backend):
    kernel = backend.function("warp_layouts.cu", "numeric_intrinsics")
    n = 64
    gen = torch.Generator().manual_seed(7)
    x = (torch.rand(n, generator=gen) * 8 - 4).float()
    x[:4] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1 + 3 * 2 ** -8])  # rounding ties
    h = torch.empty(n, dtype=torch.float16, device=backend.device)
    b = torch.empty(n, dtype=torch.bfloat16, device=backend.device)
    f = torch.empty(n, 8, device=backend.device)
    bits = torch.empty(n, 8, dtype=torch.int32, device=backend.device)
    kernel((1, 1, 1), (n, 1, 1), (x.to(backend.device), h, b, f, bits))
    assert torch.equal(h.cpu(), x.half()) and torch.equal(b.cpu(), x.bfloat16())
    f = f.cpu()
    assert torch.equal(f[:, 0], 4 * x.half().float())
    torch.testing.assert_close(f[:, 1], torch.exp2(x), rtol=1e-6, atol=0)
    torch.testing.assert_close(f[:, 2], torch.exp(x), rtol=1e-5, atol=0)  # __expf: a few ulp
    torch.testing.assert_close(f[:, 3], x / 3, rtol=1e-6, atol=0)
    assert torch.equal(f[:, 4], 1 / x)  # correctly rounded
    torch.testing.assert_close(f[:, 5], torch.rsqrt(x.abs() + 1), rtol=1e-6, atol=0)
    assert torch.equal(f[:, 6], x.clamp(0, 1))
    assert torch.equal(f[:, 7], torch.maximum(x, torch.tensor(0.5)) + torch.minimum(x, torch.tensor(-0.5)))

    u = x.numpy().view(np.uint32).astype(np.uint64)
    lane = np.arange(n)
    ones = np.array([bin(int(v)).count("1") for v in u])
    brev = np.array([int(f"{int(v):032b}"[::-1], 2) for v in u], dtype=np.uint64)
    both = (0x01234567 << 32) | u
    perm = sum(((both >> np.uint64(8 * ((0x5140 >> (4 * i)) & 7))) & np.uint64(0xFF)) << np.uint64(8 * i)
               for i in range(4))
    funnel = ((np.uint64(0x89ABCDEF) << np.uint64(32) | u) << np.uint64(12)) >> np.uint64(32) & np.uint64(0xFFFFFFFF)
    mulhi = (u * np.uint64(0x9E3779B9)) >> np.uint64(32)
    shifted = u >> (lane % 32).astype(np.uint64)
    clz = np.array([32 - int(v).bit_length() for v in shifted])
    expected = np.stack([np.rint(x.numpy() * np.float32(100)).astype(np.int64), ones, brev, perm, funnel, mulhi,
                         np.abs(lane - 7), clz], 1).astype(np.uint64).astype(np.uint32).view(np.int32)
    np.testing.assert_array_equal(bits.cpu().numpy(), expected)

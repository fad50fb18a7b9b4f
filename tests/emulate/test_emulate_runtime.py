"""The emulator's launcher, build cache and runtime limits; the wrappers' GPU side under NVRTC."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fagen.emulate import EmulationError, load_module
from fagen.emulate import build as emulate_build
from nvrtc_ptx import nvrtc_ptx

KERNELS = Path(__file__).parent / "kernels"
I32 = np.int32

SCALE = r"""
#include <fagen/prelude.cuh>
extern "C" __global__ void scale(const float* __restrict__ x, float* __restrict__ y, int n, float factor,
                                 long long offset, unsigned int flags) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * factor + static_cast<float>(offset) + static_cast<float>(flags);
}
FAGEN_EXPORT(scale)

extern "C" __global__ void big_block(int* out, int rounds) {
  __shared__ int counter[1];
  if (threadIdx.x == 0) counter[0] = 0;
  __syncthreads();
  for (int r = 0; r < rounds; ++r) {
    if (static_cast<int>(threadIdx.x) == r % static_cast<int>(blockDim.x)) counter[0] += 1;
    __syncthreads();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = counter[0];
}
FAGEN_EXPORT(big_block)
"""


@pytest.fixture(scope="module")
def scale_module():
    return load_module(SCALE)


def scale_args(n=300):
    x = torch.randn(n)
    return x, torch.zeros(n), (I32(n), np.float32(2.0), np.int64(3), np.uint32(4))


# -- the launcher interface --------------------------------------------------------

def test_launch_with_each_scalar_type(scale_module):
    x, y, scalars = scale_args()
    scale_module.get_function("scale")(((300 + 127) // 128,), (128,), (x, y, *scalars))
    assert torch.equal(y, x * 2 + 3 + 4)
    assert "scale(const float*, float*, int, float, long long, unsigned int)" in repr(scale_module.get_function("scale"))


@pytest.mark.parametrize("bad, message", [
    (lambda x, y, s: (x, y, 300, *s[1:]), r"argument 2 \(int\) takes np.int32, got int: pass np.int32"),
    (lambda x, y, s: (x, y, np.int64(300), *s[1:]), r"argument 2 \(int\) takes np.int32, got int64 \(int64\)"),
    (lambda x, y, s: (x.double(), y, *s), r"argument 0 \(const float\*\) takes a torch.float32 tensor, got torch.float64"),
    (lambda x, y, s: (x, y, *s[:3]), r"scale takes 6 arguments .* got 5"),
    (lambda x, y, s: (x, np.float32(1), *s), r"argument 1 \(float\*\) takes a CPU torch tensor or None"),
    (lambda x, y, s: (x, y, x, *s[1:]), r"argument 2 \(int\) is a scalar"),
    (lambda x, y, s: (x.to("meta"), y, *s), r"the emulator runs on CPU tensors, got one on meta"),
])
def test_arguments_are_checked_against_the_signature(scale_module, bad, message):
    x, y, scalars = scale_args()
    with pytest.raises(EmulationError, match=message):
        scale_module.get_function("scale")((3,), (128,), bad(x, y, scalars))


def test_unknown_kernel_lists_the_exported_ones(scale_module):
    with pytest.raises(EmulationError, match=r"no kernel 'scal' .*kernels with FAGEN_EXPORT: scale, big_block"):
        scale_module.get_function("scal")


@pytest.mark.parametrize("grid, block, shared, message", [
    ((1,), (1025,), 0, r"invalid block \(1025,1,1\)"),
    ((1,), (32, 32, 2), 0, r"invalid block"),
    ((1, 70000), (32,), 0, r"invalid grid \(1,70000,1\)"),
    ((1,), (32,), 232449, r"dynamic shared memory of 232449 bytes exceeds the 232448"),
    ((0,), (32,), 0, r"grid must be 1 to 3 positive integers"),
])
def test_launch_geometry_is_checked(scale_module, grid, block, shared, message):
    x, y, scalars = scale_args()
    with pytest.raises(EmulationError, match=message):
        scale_module.get_function("scale")(grid, block, (x, y, *scalars), shared_mem=shared)


def test_environment_settings_are_checked(scale_module, monkeypatch):
    x, y, scalars = scale_args()
    monkeypatch.setenv("FAGEN_EMULATE_THREADS", "zero")
    with pytest.raises(EmulationError, match="FAGEN_EMULATE_THREADS='zero'"):
        scale_module.get_function("scale")((3,), (128,), (x, y, *scalars))
    monkeypatch.setenv("FAGEN_EMULATE_THREADS", "2")
    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", "sideways")  # ("random" is a schedule now)
    with pytest.raises(EmulationError, match="FAGEN_EMULATE_SCHEDULE='sideways'"):
        scale_module.get_function("scale")((3,), (128,), (x, y, *scalars))


def test_largest_block_and_many_barriers(scale_module, monkeypatch):
    kernel = scale_module.get_function("big_block")
    out = torch.zeros(3 * 1024, dtype=torch.int32)
    kernel((3,), (1024,), (out, I32(50)))
    assert (out == 50).all()
    # 128 threads crossing 1000 barriers: the per-launch cost the report quotes
    monkeypatch.setenv("FAGEN_EMULATE_THREADS", "1")
    out = torch.zeros(128, dtype=torch.int32)
    start = time.perf_counter()
    kernel((1,), (128,), (out, I32(1000)))
    print(f"\n128 threads x 1000 barriers: {1e3 * (time.perf_counter() - start):.1f} ms")
    assert (out == 1000).all()


@pytest.mark.parametrize("threads", ["1", "2", "5"])
def test_results_do_not_depend_on_os_threads(monkeypatch, threads):
    monkeypatch.setenv("FAGEN_EMULATE_THREADS", threads)
    kernel = load_module((KERNELS / "warp_layouts.cu").read_text()).get_function("block_private")
    out = torch.zeros(24 * 128, dtype=torch.int32)
    kernel((24,), (128,), (out, I32(3)), shared_mem=512)
    b = torch.arange(24).view(-1, 1)
    tid = torch.arange(128).view(1, -1)
    expected = sum((b * 1000 + (tid + r) % 128) - (b * 1000 + (tid + 2 * r) % 128) for r in range(3))
    assert torch.equal(out.view(24, 128), expected.to(torch.int32))


# -- the build cache -------------------------------------------------------------------

def test_compile_errors_carry_the_compiler_message():
    with pytest.raises(EmulationError, match=r"(?s)compiling kernel source .*\.cu.*undeclared_thing"):
        load_module('#include <fagen/prelude.cuh>\nextern "C" __global__ void k(int* o) { o[0] = undeclared_thing; }\n'
                    "FAGEN_EXPORT(k)\n")


def test_concurrent_builds_of_one_source_all_succeed():
    source = SCALE + f"\n// unique {time.time_ns()}\n"
    results, errors = [], []

    def builder():
        try:
            results.append(emulate_build.build(source))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=builder) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({r.library for r in results}) == 1
    module = load_module(source)
    x, y, scalars = scale_args()
    module.get_function("scale")((3,), (128,), (x, y, *scalars))
    assert torch.equal(y, x * 2 + 3 + 4)
    assert not list(results[0].library.parent.glob(f"{results[0].key}-*.tmp"))


def test_cached_build_is_reused_and_keyed_by_source(monkeypatch):
    first = emulate_build.build(SCALE)
    compiles = []
    real_run = emulate_build._run_compiler
    monkeypatch.setattr(emulate_build, "_run_compiler", lambda command, what: (compiles.append(what),
                                                                               real_run(command, what)))
    again = emulate_build.build(SCALE)
    assert again.library == first.library and compiles == []   # a cache hit runs no compiler
    monkeypatch.undo()
    other = emulate_build.build(SCALE.replace("factor +", "factor -"))
    assert other.library != first.library
    assert emulate_build.build(SCALE, checked=True).library != first.library
    assert load_module(SCALE) is load_module(SCALE)


def test_missing_cuda_headers_raise_a_clear_error(monkeypatch, tmp_path):
    emulate_build.cuda_include_dir.cache_clear()
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(emulate_build, "Path", _PathWithoutToolkit)
    try:
        with pytest.raises(EmulationError, match=r"needs the CUDA headers cuda_fp16.h"):
            emulate_build.cuda_include_dir()
    finally:
        monkeypatch.undo()
        emulate_build.cuda_include_dir.cache_clear()


class _PathWithoutToolkit(type(Path())):
    """Path, except that /usr/local/cuda does not exist."""

    def is_file(self):
        return not str(self).startswith("/usr/local/cuda") and super().is_file()


# -- the wrappers' device branch --------------------------------------------------------

PTX_INSTRUCTIONS = [
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "ldmatrix.sync.aligned.m8n8.x1.shared.b16",
    "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
    "cp.async.cg.shared.global",
    "cp.async.commit_group",
    "cp.async.wait_group 0",
]


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_wrappers_compile_to_the_ptx_instructions_with_nvrtc(arch):
    ptx = nvrtc_ptx((KERNELS / "warp_layouts.cu").read_text() + (KERNELS / "tiled_gemm.cu").read_text(), arch)
    for instruction in PTX_INSTRUCTIONS:
        assert instruction in ptx, instruction


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_layout_kernels_build_cubins(arch):
    from fagen.kernels.compile import nvrtc_compile

    cubin, _ = nvrtc_compile((KERNELS / "tiled_gemm.cu").read_text(), arch)
    assert len(cubin) > 1000


def test_a_forked_child_can_launch(scale_module):
    """The pool's threads do not survive fork(); the child must start over, not hang."""
    import multiprocessing

    x, y, scalars = scale_args()
    scale_module.get_function("scale")((3,), (128,), (x, y, *scalars))  # the parent's pool exists now
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        result = pool.apply_async(_launch_scale_in_child, (SCALE,))
        assert result.get(timeout=60)


def _launch_scale_in_child(source: str) -> bool:
    import os

    os.environ["FAGEN_EMULATE_THREADS"] = "2"
    x, y, scalars = scale_args()
    load_module(source).get_function("scale")((3,), (128,), (x, y, *scalars))
    return bool(torch.equal(y, x * 2 + 3 + 4))


def test_portable_ucontext_fibers(monkeypatch):
    """The fiber switch used where there is no hand-written one (not x86-64)."""
    monkeypatch.setenv("FAGEN_EMULATE_CXXFLAGS", "-DFAGEN_EMU_FORCE_UCONTEXT")
    source = (KERNELS / "warp_layouts.cu").read_text()
    module = load_module(source)
    out = torch.zeros(16 * 128, dtype=torch.int32)
    module.get_function("block_private")((16,), (128,), (out, I32(3)), shared_mem=512)
    b = torch.arange(16).view(-1, 1)
    tid = torch.arange(128).view(1, -1)
    expected = sum((b * 1000 + (tid + r) % 128) - (b * 1000 + (tid + 2 * r) % 128) for r in range(3))
    assert torch.equal(out.view(16, 128), expected.to(torch.int32))
    gen = torch.Generator().manual_seed(8)
    A = torch.randint(-8, 9, (16, 16), generator=gen).half()
    B = torch.randint(-8, 9, (16, 8), generator=gen).half()
    C = torch.zeros(16, 8)
    D = torch.empty(16, 8)
    module.get_function("mma_f16_layout")((1,), (32,), (A, B, C, D))
    assert torch.equal(D, (A.double() @ B.double()).float())
    monkeypatch.delenv("FAGEN_EMULATE_CXXFLAGS")
    assert load_module(source).library_path != module.library_path  # the flags are part of the cache key

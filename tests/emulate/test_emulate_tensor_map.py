"""A tensor map as a kernel parameter (`const __grid_constant__ fagen::TensorMap`, fagen/tensor_map.cuh):
the emulator's launcher passes TensorMapSpec.emulated_bytes by value, aligned, and the kernel reads
the fields fagen's encoding defines; NVRTC compiles the same source for the GPU, where the type is
the driver's opaque 128 bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fagen.emulate import EmulationError, load_module
from fagen.kernels.tensor_map import DataType, Swizzle, TensorMapSpec

SOURCE = r"""
#include <fagen/prelude.cuh>
#include <fagen/tensor_map.cuh>

// Writes what the map holds, as the TMA twin will read it, and the parameter's alignment.
extern "C" __global__ void read_map(const __grid_constant__ fagen::TensorMap map, long long* out) {
#ifdef FAGEN_EMULATE
  out[0] = map.rank;
  out[1] = map.swizzle;
  out[2] = static_cast<long long>(map.global_address);
  for (int i = 0; i < 5; ++i) out[3 + i] = static_cast<long long>(map.global_dims[i]);
  for (int i = 0; i < 4; ++i) out[8 + i] = static_cast<long long>(map.global_strides[i]);
  for (int i = 0; i < 5; ++i) out[12 + i] = map.box_dims[i];
  out[17] = reinterpret_cast<unsigned long long>(&map) % 64;
#else
  out[0] = static_cast<long long>(map.opaque[0]);
#endif
}
FAGEN_EXPORT(read_map)
"""

SPEC = TensorMapSpec(DataType.FLOAT16, (64, 300, 4), (4 * 64 * 2, 64 * 2), (64, 128, 1), swizzle=Swizzle.B128)


@pytest.fixture(scope="module")
def read_map():
    return load_module(SOURCE).get_function("read_map")


def test_the_kernel_reads_the_map_it_was_passed(read_map):
    out = torch.full((18,), -1, dtype=torch.int64)
    read_map((1,), (1,), (SPEC.emulated_bytes(0x10000), out))
    got = out.tolist()
    assert got[:3] == [3, int(Swizzle.B128), 0x10000]
    assert got[3:8] == [64, 300, 4, 1, 1] and got[8:12] == [512, 128, 0, 0]
    assert got[12:17] == [64, 128, 1, 1, 1]
    assert got[17] == 0   # 64-byte aligned, as CUtensorMap is


def test_a_wrong_size_or_kind_is_refused_naming_the_parameter(read_map):
    out = torch.zeros(18, dtype=torch.int64)
    with pytest.raises(EmulationError, match=r"argument 0 \(a 128-byte struct\) is a 128-byte struct, got 64"):
        read_map((1,), (1,), (bytes(64), out))
    with pytest.raises(EmulationError, match=r"argument 0 \(a 128-byte struct\).*pass its bytes"):
        read_map((1,), (1,), (np.int64(0), out))


def test_nvrtc_compiles_the_same_source():
    pytest.importorskip("cuda.bindings")
    from fagen.kernels.compile import nvrtc_compile

    cubin, _ = nvrtc_compile(SOURCE, "sm_90")
    assert cubin

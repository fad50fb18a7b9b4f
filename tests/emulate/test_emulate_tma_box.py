"""The TMA twin's box (fagen/emulate/src/tma_box.cpp) against an independent NumPy reading of the
driver's and the PTX ISA's description (tests/support/tma_reference.py): which elements a tile copy
moves, the out-of-bounds fill, element strides, and the swizzle on absolute shared addresses, for
loads and stores, ranks 1 to 5."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import tma_reference as ref
from fagen.emulate import EmulationError, load_module
from fagen.kernels.tensor_map import DataType, OobFill, Swizzle, TensorMapSpec

SOURCE = r"""
#include <fagen/prelude.cuh>
#include <fagen/tensor_map.cuh>
#include <fagen_emulate/tma.h>

// Loads one box into dynamic shared memory at byte `at`, then copies the shared bytes out raw.
extern "C" __global__ void load_box(const __grid_constant__ fagen::TensorMap map, const int* coords,
                                    unsigned char* out, int at, int bytes) {
  extern __shared__ __align__(16) unsigned char smem[];
  if (threadIdx.x == 0) ::fagen_emu::tma_load_box_now(smem + at, &map, coords, {__FILE__, __LINE__});
  __syncthreads();
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = smem[at + i];
}
FAGEN_EXPORT(load_box)

// Writes `image` raw into shared memory at byte `at`, then stores the box from there.
extern "C" __global__ void store_box(const __grid_constant__ fagen::TensorMap map, const int* coords,
                                     const unsigned char* image, int at, int bytes) {
  extern __shared__ __align__(16) unsigned char smem[];
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) smem[at + i] = image[i];
  __syncthreads();
  if (threadIdx.x == 0) ::fagen_emu::tma_store_box_now(&map, coords, smem + at, {__FILE__, __LINE__});
}
FAGEN_EXPORT(store_box)
"""
SHARED = 64 * 1024


@pytest.fixture(scope="module")
def module():
    return load_module(SOURCE)


TORCH = {DataType.FLOAT16: torch.float16, DataType.BFLOAT16: torch.bfloat16, DataType.FLOAT32: torch.float32,
         DataType.UINT8: torch.uint8}


def _tensor(shape, dtype: DataType, rng):
    """Random bytes (NaN patterns included: only bytes are compared) as a tensor of `dtype`."""
    size = torch.empty(0, dtype=TORCH[dtype]).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, size=(*shape[:-1], shape[-1] * size), dtype=np.uint8))
    return raw.view(TORCH[dtype])


def _memory(tensor) -> np.ndarray:
    """The bytes the map's address points at: a view (writes reach the tensor) of a contiguous tensor."""
    assert tensor.is_contiguous()
    return tensor.view(torch.uint8).reshape(-1).numpy()


def _load(module, spec, tensor, coords, at):
    out = torch.zeros(spec.box_bytes, dtype=torch.uint8)
    module.get_function("load_box")((1,), (64,), (spec.emulated_bytes(tensor.data_ptr()),
                                                  torch.tensor(coords, dtype=torch.int32), out, np.int32(at),
                                                  np.int32(spec.box_bytes)), shared_mem=SHARED)
    return out.numpy()


# (dtype, tensor shape (outermost first), box (outermost first), coords (innermost first), element strides
# (innermost first), swizzle, oob fill): in bounds, hanging over every edge, strided, each swizzle.
CASES = [
    (DataType.FLOAT16, (40, 64), (16, 64), (0, 3), None, Swizzle.B128, OobFill.NONE),
    (DataType.BFLOAT16, (40, 64), (16, 64), (0, 30), None, Swizzle.B128, OobFill.NAN_REQUEST_ZERO_FMA),
    (DataType.FLOAT16, (5, 30, 32), (2, 8, 32), (0, -3, 4), None, Swizzle.B64, OobFill.NONE),
    (DataType.FLOAT32, (3, 7, 9, 8), (2, 4, 4, 8), (0, 7, -2, 2), None, Swizzle.B32, OobFill.NONE),
    (DataType.FLOAT16, (2, 3, 4, 5, 16), (2, 2, 2, 2, 16), (0, 4, 3, 2, 1), None, Swizzle.NONE, OobFill.NONE),
    (DataType.FLOAT16, (50, 24), (32, 8), (0, 5), (1, 3), Swizzle.NONE, OobFill.NONE),
    (DataType.UINT8, (1000,), (48,), (980,), None, Swizzle.NONE, OobFill.NONE),
]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("at", [0, 1024 + 128])
def test_a_loaded_box_matches_the_reference(module, case, at):
    dtype, shape, box, coords, steps, swizzle, fill = case
    rng = np.random.default_rng(len(shape) * 100 + at)
    tensor = _tensor(shape, dtype, rng)
    spec = TensorMapSpec.of_tensor(tensor, box, swizzle=swizzle, oob_fill=fill)
    if steps is not None:
        spec = dataclasses.replace(spec, element_strides=steps)
    expected = ref.shared_image(ref.load_image(spec, _memory(tensor), coords), at, swizzle)
    np.testing.assert_array_equal(_load(module, spec, tensor, coords, at), expected)


@pytest.mark.parametrize("case", [c for c in CASES if c[4] is None], ids=range(6))
def test_a_stored_box_matches_the_reference(module, case):
    dtype, shape, box, coords, _, swizzle, _ = case
    rng = np.random.default_rng(7)
    tensor = _tensor(shape, dtype, rng)
    spec = TensorMapSpec.of_tensor(tensor, box, swizzle=swizzle)
    shared = rng.integers(0, 256, size=spec.box_bytes, dtype=np.uint8)   # the shared bytes, as laid out
    # The dense image those shared bytes hold: undo the swizzle (a permutation) through the reference's map.
    placed = ref.place(np.arange(spec.box_bytes), 0, swizzle)
    image = np.empty_like(shared)
    for dense, address in ((int(v), a) for a, v in placed.items()):
        image[dense] = shared[address]
    expected = _memory(tensor).copy()
    ref.store_image(spec, expected, coords, image)
    module.get_function("store_box")((1,), (64,), (spec.emulated_bytes(tensor.data_ptr()),
                                                   torch.tensor(coords, dtype=torch.int32), torch.from_numpy(shared),
                                                   np.int32(0), np.int32(spec.box_bytes)), shared_mem=SHARED)
    np.testing.assert_array_equal(_memory(tensor), expected)


def test_the_swizzle_permutes_chunks_as_the_isa_describes():
    # 128B: the chunk at (row r, chunk c) of an aligned 8 x 128-byte atom lands at chunk c ^ r.
    for row in range(8):
        for chunk in range(8):
            assert ref.swizzled(row * 128 + chunk * 16 + 5, Swizzle.B128) == row * 128 + (chunk ^ row) * 16 + 5
    # 32B: bit 4 follows bit 7, so rows of 32 bytes swap their two chunks every 4 rows.
    assert [ref.swizzled(r * 32, Swizzle.B32) - r * 32 for r in range(8)] == [0, 0, 0, 0, 16, 16, 16, 16]


def test_misuse_is_reported(module):
    tensor = _tensor((40, 64), DataType.FLOAT16, np.random.default_rng(0))
    spec = TensorMapSpec.of_tensor(tensor, (16, 64), swizzle=Swizzle.B128)
    with pytest.raises(EmulationError, match="not 128-byte aligned"):
        _load(module, spec, tensor, (0, 0), 64)
    with pytest.raises(EmulationError, match="past the 65536 bytes"):
        _load(module, spec, tensor, (0, 0), SHARED - 1024)
    narrow = TensorMapSpec.of_tensor(tensor, (16, 32), swizzle=Swizzle.B128)
    with pytest.raises(EmulationError, match="not modelled"):
        _load(module, narrow, tensor, (0, 0), 0)
    driver_like = bytearray(spec.emulated_bytes(tensor.data_ptr()))
    driver_like[0] ^= 0xFF
    out = torch.zeros(spec.box_bytes, dtype=torch.uint8)
    with pytest.raises(EmulationError, match="not fagen's emulated encoding"):
        module.get_function("load_box")((1,), (64,), (bytes(driver_like), torch.zeros(2, dtype=torch.int32), out,
                                                      np.int32(0), np.int32(spec.box_bytes)), shared_mem=SHARED)


# (tensor shape (outermost first), box (outermost first), coords (innermost first)) of boxes with no
# element inside the tensor along one dim: past its end, before its start, and a strided box whose
# elements step over it.
WHOLLY_OUTSIDE = [
    ((40, 64), (16, 64), (64, 0), 0),
    ((40, 64), (16, 64), (0, 40), 1),
    ((40, 64), (16, 64), (0, -16), 1),
    ((5, 30, 32), (2, 8, 32), (0, 0, 5), 2),
]


@pytest.mark.parametrize("shape, box, coords, dim", WHOLLY_OUTSIDE, ids=range(len(WHOLLY_OUTSIDE)))
def test_a_load_of_a_box_wholly_outside_the_tensor_is_refused(module, shape, box, coords, dim):
    # Partly outside is documented (CASES: the zero fill); wholly outside is not, so the twin refuses it,
    # naming the coordinates and the dim.
    tensor = _tensor(shape, DataType.FLOAT16, np.random.default_rng(1))
    spec = TensorMapSpec.of_tensor(tensor, box, swizzle=Swizzle.B128 if shape[-1] == 64 else Swizzle.B64)
    at = ", ".join(map(str, coords))
    with pytest.raises(EmulationError, match=rf"load_box: .*the box at coordinates \({at}\) .*lies wholly outside "
                                             rf"the tensor: its dim {dim} covers"):
        _load(module, spec, tensor, coords, 0)
    inside = list(coords)
    inside[dim] = shape[::-1][dim] - 1 if coords[dim] > 0 else -box[::-1][dim] + 1   # one element in
    _load(module, spec, tensor, tuple(inside), 0)


def test_a_strided_box_whose_elements_step_over_the_tensor_is_refused(module):
    tensor = _tensor((3, 24), DataType.FLOAT16, np.random.default_rng(2))
    spec = dataclasses.replace(TensorMapSpec.of_tensor(tensor, (16, 8)), element_strides=(1, 8))
    with pytest.raises(EmulationError, match=r"dim 1 covers -5\.\.3 of 0\.\.2"):
        _load(module, spec, tensor, (0, -5), 0)   # rows -5 and 3: neither of 0..2
    _load(module, spec, tensor, (0, -6), 0)       # rows -6 and 2: row 2 is inside

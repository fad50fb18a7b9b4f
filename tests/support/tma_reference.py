"""A second reading of what one TMA tile copy (`cp.async.bulk.tensor`) moves, written from the
driver's description of cuTensorMapEncodeTiled and the PTX ISA's tensor-copy section, in NumPy,
independently of the emulator's twin (fagen/emulate/src/tma_box.cpp), which the tests check
against it:

- the box starts at signed element coordinates (innermost first) and takes, along each dim,
  ceil(box / element stride) elements c + k * stride (dim 0's stride is ignored: TMA has none);
- an element outside the tensor (a coordinate < 0 or >= its dim) loads as zero (or, with the NaN
  fill, as a quiet NaN of a floating type), and a store skips it;
- in shared memory the box is dense, dim 0 fastest, at the destination address;
- a swizzle permutes 16-byte chunks by the ABSOLUTE shared address: with span 32, 64 or 128 bytes,
  address bits 4.. (1, 2 or 3 of them) are XORed with the bits starting at 7.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from fagen.kernels.tensor_map import OobFill, Swizzle, TensorMapSpec

SWIZZLE_BITS = {Swizzle.NONE: 0, Swizzle.B32: 1, Swizzle.B64: 2, Swizzle.B128: 3}
NAN_BITS = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FFFFFFFFFFFFFFF}   # a quiet NaN's bits by element size


def swizzled(address: int, swizzle: Swizzle) -> int:
    """Where the byte a dense box puts at shared `address` lands under `swizzle`."""
    bits = SWIZZLE_BITS[Swizzle(swizzle)]
    mask = (1 << bits) - 1
    return address ^ (((address >> 7) & mask) << 4)


def box_counts(spec: TensorMapSpec) -> list[int]:
    """Elements the box takes along each dim."""
    return [spec.box_dims[0]] + [math.ceil(b / s) for b, s in zip(spec.box_dims[1:], spec.steps[1:])]


def box_elements(spec: TensorMapSpec, coords):
    """(index in the dense box, global element coordinates, inside the tensor?) for every element,
    dim 0 fastest."""
    counts = box_counts(spec)
    steps = [1, *spec.steps[1:]]
    for flat, ks in enumerate(itertools.product(*(range(n) for n in reversed(counts)))):
        ks = ks[::-1]
        point = [c + k * s for c, k, s in zip(coords, ks, steps)]
        inside = all(0 <= x < dim for x, dim in zip(point, spec.global_dims))
        yield flat, point, inside


def element_offset(spec: TensorMapSpec, point) -> int:
    """Byte offset of an element from the map's global address."""
    return point[0] * spec.element_bytes + sum(x * stride for x, stride in zip(point[1:], spec.global_strides))


def load_image(spec: TensorMapSpec, memory: np.ndarray, coords) -> np.ndarray:
    """The box as dense bytes (before the swizzle), read from `memory` (uint8, starting at the
    map's global address)."""
    size = spec.element_bytes
    image = np.zeros(math.prod(box_counts(spec)) * size, dtype=np.uint8)
    fill = NAN_BITS[size].to_bytes(size, "little") if spec.oob_fill == OobFill.NAN_REQUEST_ZERO_FMA else bytes(size)
    for flat, point, inside in box_elements(spec, coords):
        if inside:
            start = element_offset(spec, point)
            image[flat * size:(flat + 1) * size] = memory[start:start + size]
        else:
            image[flat * size:(flat + 1) * size] = np.frombuffer(fill, dtype=np.uint8)
    return image


def place(image: np.ndarray, base_address: int, swizzle: Swizzle) -> dict[int, int]:
    """{shared address: byte} of a dense image written at `base_address` under `swizzle`."""
    return {swizzled(base_address + i, swizzle): int(byte) for i, byte in enumerate(image)}


def shared_image(image: np.ndarray, base_address: int, swizzle: Swizzle) -> np.ndarray:
    """The bytes of [base_address, base_address + len(image)) after a swizzled write: a swizzle
    permutes 16-byte chunks within each 2^(7 + bits)-byte period, so an aligned box maps onto itself."""
    placed = place(image, base_address, swizzle)
    return np.array([placed[base_address + i] for i in range(len(image))], dtype=np.uint8)


def store_image(spec: TensorMapSpec, memory: np.ndarray, coords, image: np.ndarray) -> None:
    """A TMA store of a dense box image: elements outside the tensor are skipped."""
    size = spec.element_bytes
    for flat, point, inside in box_elements(spec, coords):
        if inside:
            start = element_offset(spec, point)
            memory[start:start + size] = image[flat * size:(flat + 1) * size]

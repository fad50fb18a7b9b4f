"""Tensor maps: what a TMA copy (`cp.async.bulk.tensor`) reads to find its box in global memory.

A kernel of the Hopper family takes one 128-byte `CUtensorMap` per TMA operand, by value
(`const __grid_constant__ CUtensorMap`). fagen describes each map once, as a `TensorMapSpec`:
the driver's `cuTensorMapEncodeTiled` parameters, dims innermost first, as the driver takes them.
`TensorMapSpec.check` applies the rules that the CUDA driver API documents for that call
(cuda.h, "cuTensorMapEncodeTiled", CUDA 13), so that a map the driver would refuse is refused on a
CPU too, with the field named.

Two encodings of the same spec:
- on a GPU, the driver's (`driver_bytes`): opaque; only the hardware reads it;
- in the emulator, fagen's own (`emulated_bytes`): its fields at fixed offsets, which only
  the emulator's TMA twin reads (`fagen_emulate/tensor_map.h` declares the same layout, and a test
  compiles it to check every offset). The first word marks it, so that a driver map handed to the
  emulator is refused rather than misread. The layout is `LAYOUT`: the mark and a version, the
  global address, dims and byte strides as uint64, box dims and element strides as uint16 (the
  driver bounds them by 256 and 8), then one byte each for rank, dtype, element size, interleave,
  swizzle, L2 promotion and out-of-bounds fill; zeros to 128 bytes.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from ..arch_families import page_box_rows

MAX_RANK = 5
MAP_BYTES = 128
MAP_ALIGNMENT = 64        # the driver requires the map itself 64-byte aligned
MAGIC = 0x4D544746        # "FGTM" as little-endian bytes
VERSION = 1


class DataType(enum.IntEnum):
    """CUtensorMapDataType, the values the driver takes (fagen uses the plain element types)."""

    UINT8 = 0
    UINT16 = 1
    UINT32 = 2
    INT32 = 3
    UINT64 = 4
    INT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9


ELEMENT_BYTES = {DataType.UINT8: 1, DataType.UINT16: 2, DataType.UINT32: 4, DataType.INT32: 4, DataType.UINT64: 8,
                 DataType.INT64: 8, DataType.FLOAT16: 2, DataType.FLOAT32: 4, DataType.FLOAT64: 8,
                 DataType.BFLOAT16: 2}
# torch dtype names (fp8 travels as bytes: TMA moves bits, it never converts).
TORCH_DATA_TYPES = {"float16": DataType.FLOAT16, "bfloat16": DataType.BFLOAT16, "float32": DataType.FLOAT32,
                    "float64": DataType.FLOAT64, "int32": DataType.INT32, "int64": DataType.INT64,
                    "uint8": DataType.UINT8, "float8_e4m3fn": DataType.UINT8, "float8_e5m2": DataType.UINT8}
FLOATING = frozenset({DataType.FLOAT16, DataType.FLOAT32, DataType.FLOAT64, DataType.BFLOAT16})


class Interleave(enum.IntEnum):
    NONE = 0
    B16 = 1
    B32 = 2


class Swizzle(enum.IntEnum):
    """CUtensorMapSwizzle: 16-byte chunks permuted within a 32, 64 or 128-byte span (the
    128B_ATOM variants of newer GPUs are not offered: sm_90 has none of them)."""

    NONE = 0
    B32 = 1
    B64 = 2
    B128 = 3

    @property
    def span(self) -> int:
        return {Swizzle.NONE: 0, Swizzle.B32: 32, Swizzle.B64: 64, Swizzle.B128: 128}[self]


class L2Promotion(enum.IntEnum):
    NONE = 0
    B64 = 1
    B128 = 2
    B256 = 3


class OobFill(enum.IntEnum):
    """Elements of a box outside the tensor load as zero (NONE) or as a NaN that asks FMA to
    treat it as zero (NAN_REQUEST_ZERO_FMA: floating-point types only)."""

    NONE = 0
    NAN_REQUEST_ZERO_FMA = 1


# (name, struct format, count): fagen's emulated encoding, little-endian, in order; padded to 128.
LAYOUT = (("magic", "I", 1), ("version", "I", 1), ("global_address", "Q", 1), ("global_dims", "Q", MAX_RANK),
          ("global_strides", "Q", MAX_RANK - 1), ("box_dims", "H", MAX_RANK), ("element_strides", "H", MAX_RANK),
          ("rank", "B", 1), ("dtype", "B", 1), ("element_bytes", "B", 1), ("interleave", "B", 1),
          ("swizzle", "B", 1), ("l2_promotion", "B", 1), ("oob_fill", "B", 1))
_FORMAT = "<" + "".join(f"{count}{fmt}" for _, fmt, count in LAYOUT)


def layout_offsets() -> dict[str, int]:
    """Each field's byte offset in the emulated encoding (what the C header must agree with)."""
    offsets, position = {}, 0
    for name, fmt, count in LAYOUT:
        offsets[name] = position
        position += struct.calcsize("<" + fmt) * count
    return offsets


class MappedBytes(bytes):
    """An emulated map's bytes with the tensor its address points into (`emulated_bytes(tensor)`)."""

    tensor = None

    def __new__(cls, data: bytes, tensor):
        made = super().__new__(cls, data)
        made.tensor = tensor
        return made


class TensorMapError(ValueError):
    """A tensor map the driver's rules refuse; the message names the field and the rule."""


@dataclass(frozen=True)
class PageBox:
    """A paged cache's box rows (its dim 1, the page's rows), fixed per call by its page size:
    `tile` keys where the pages hold whole tiles, else arch_families.PAGE_BOX_ROWS (the sm90
    forward's KeySource loads a tile as that many boxes)."""

    tile: int

    def rows(self, page_size: int) -> int:
        return page_box_rows(self.tile, page_size)


def resolved_box(box: tuple, shape) -> tuple:
    """`box` with each `PageBox` entry turned into its rows for a tensor of `shape`."""
    return tuple(b.rows(shape[i]) if isinstance(b, PageBox) else b for i, b in enumerate(box))


@dataclass(frozen=True)
class TensorMapSpec:
    """cuTensorMapEncodeTiled's parameters. Dims innermost first; `global_strides` in bytes for
    dims 1.. (dim 0 is contiguous: TMA has no stride for it); `element_strides` default to 1."""

    dtype: DataType
    global_dims: tuple[int, ...]
    global_strides: tuple[int, ...]
    box_dims: tuple[int, ...]
    element_strides: tuple[int, ...] | None = None
    interleave: Interleave = Interleave.NONE
    swizzle: Swizzle = Swizzle.NONE
    l2_promotion: L2Promotion = L2Promotion.NONE
    oob_fill: OobFill = OobFill.NONE

    @staticmethod
    def of_tensor(tensor, box: tuple, **options) -> "TensorMapSpec":
        """The map of a torch tensor whose last dim is contiguous, with `box` in the tensor's own
        dim order (outermost first), e.g. (1, 128, 1, 64) rows of q (B, N, H, d); an entry may be a
        `PageBox`, whose rows follow the tensor's size in that dim."""
        box = resolved_box(box, tensor.shape)
        if tensor.dim() == 0 or tensor.stride(-1) != 1:
            raise TensorMapError(f"a tensor map needs a contiguous last dim, got strides {tuple(tensor.stride())}")
        if len(box) != tensor.dim():
            raise TensorMapError(f"box={tuple(box)} needs one entry per dim of a {tensor.dim()}-dim tensor")
        dtype = TORCH_DATA_TYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise TensorMapError(f"no tensor map data type for {tensor.dtype}")
        size = tensor.element_size()
        strides = tuple(stride * size for stride in reversed(tensor.stride()[:-1]))
        return TensorMapSpec(dtype, tuple(reversed(tensor.shape)), strides, tuple(reversed(box)), **options)

    @property
    def rank(self) -> int:
        return len(self.global_dims)

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[DataType(self.dtype)]

    @property
    def steps(self) -> tuple[int, ...]:
        return self.element_strides if self.element_strides is not None else (1,) * self.rank

    @property
    def box_bytes(self) -> int:
        """Bytes one copy of the box writes to shared memory (what `arrive.expect_tx` announces):
        ceil(box / element stride) elements per dim, out-of-bounds ones included (they are filled)."""
        count = 1
        for box, step in zip(self.box_dims, self.steps):
            count *= -(-box // step)
        return count * self.element_bytes

    def check(self, global_address: int = 0) -> None:
        """Raise TensorMapError unless cuTensorMapEncodeTiled's documented rules hold."""
        _check_kinds(self)
        _check_rank(self)
        _check_address(self, global_address)
        _check_dims(self)
        _check_box(self)

    def emulated_bytes(self, global_address) -> bytes:
        """fagen's own 128-byte encoding (`LAYOUT`), which the emulator's TMA twin reads. Given
        the tensor itself (its data_ptr is the address), the bytes carry it (`MappedBytes`): the
        emulator's checked build copies that tensor into its helper process and re-points the map."""
        tensor = None
        if not isinstance(global_address, int):
            tensor, global_address = global_address, global_address.data_ptr()
        self.check(global_address)
        pad = MAX_RANK - self.rank
        values = [MAGIC, VERSION, global_address, *self.global_dims, *(1,) * pad,
                  *self.global_strides, *(0,) * pad, *self.box_dims, *(1,) * pad, *self.steps, *(1,) * pad,
                  self.rank, int(self.dtype), self.element_bytes, int(self.interleave), int(self.swizzle),
                  int(self.l2_promotion), int(self.oob_fill)]
        packed = struct.pack(_FORMAT, *values)
        data = packed + bytes(MAP_BYTES - len(packed))
        return data if tensor is None else MappedBytes(data, tensor)

    def driver_bytes(self, global_address) -> bytes:
        """The driver's encoding (needs a CUDA driver: a GPU machine), of an address or of a
        tensor's data_ptr. Checked here first, so a refusal names the field instead of returning
        CUDA_ERROR_INVALID_VALUE."""
        if not isinstance(global_address, int):
            global_address = global_address.data_ptr()
        self.check(global_address)
        result, data = driver_encode(self, global_address)
        if data is None:
            raise TensorMapError(f"cuTensorMapEncodeTiled refused {self}: {result}")
        return data


def driver_encode(spec: TensorMapSpec, global_address: int) -> tuple[object, bytes | None]:
    """cuTensorMapEncodeTiled on `spec` as it is, unchecked: (the driver's result, the 128 bytes or
    None). The GPU tests hand it maps `check` refuses, to see the driver refuse them too."""
    from cuda.bindings import driver

    result, tensor_map = driver.cuTensorMapEncodeTiled(*driver_arguments(spec, global_address))
    return result, _opaque_bytes(tensor_map) if result == driver.CUresult.CUDA_SUCCESS else None


def driver_arguments(spec: TensorMapSpec, global_address: int) -> tuple:
    """cuTensorMapEncodeTiled's arguments in cuda.bindings' types. Its arrays take cuuint64_t /
    cuuint32_t elements: cuda-bindings 12.9 refuses plain ints there ("Cannot convert int to
    cuda.bindings.driver.cuuint32_t"), before any driver call."""
    from cuda.bindings import driver

    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    return (driver.CUtensorMapDataType(int(spec.dtype)), spec.rank, global_address,
            [u64(n) for n in spec.global_dims], [u64(n) for n in spec.global_strides],
            [u32(n) for n in spec.box_dims], [u32(n) for n in spec.steps],
            driver.CUtensorMapInterleave(int(spec.interleave)), driver.CUtensorMapSwizzle(int(spec.swizzle)),
            driver.CUtensorMapL2promotion(int(spec.l2_promotion)), driver.CUtensorMapFloatOOBfill(int(spec.oob_fill)))


def _opaque_bytes(tensor_map) -> bytes:
    """A CUtensorMap's 16 opaque uint64 words as 128 bytes."""
    return struct.pack("<16Q", *(int(word) for word in tensor_map.opaque))


def decode_emulated(data: bytes) -> dict:
    """The fields of an emulated encoding (tests, and messages about a map)."""
    if len(data) != MAP_BYTES:
        raise TensorMapError(f"a tensor map is {MAP_BYTES} bytes, got {len(data)}")
    values = struct.unpack_from(_FORMAT, data)
    fields, position = {}, 0
    for name, _, count in LAYOUT:
        chunk = values[position:position + count]
        fields[name] = chunk[0] if count == 1 else tuple(chunk)
        position += count
    if fields["magic"] != MAGIC:
        raise TensorMapError("not an emulated tensor map (its first word is not fagen's mark)")
    return fields


def _fail(field: str, value, rule: str) -> None:
    raise TensorMapError(f"tensor map {field}={value!r}: {rule} (cuTensorMapEncodeTiled's rules)")


def _check_kinds(spec: TensorMapSpec) -> None:
    for field, kind in (("dtype", DataType), ("interleave", Interleave), ("swizzle", Swizzle),
                        ("l2_promotion", L2Promotion), ("oob_fill", OobFill)):
        value = getattr(spec, field)
        if value not in kind.__members__.values():
            _fail(field, value, f"must be one of {', '.join(m.name for m in kind)}")


def _check_rank(spec: TensorMapSpec) -> None:
    if not 1 <= spec.rank <= MAX_RANK:
        _fail("global_dims", spec.global_dims, f"rank must be 1..{MAX_RANK}")
    if spec.interleave != Interleave.NONE and spec.rank < 3:
        _fail("global_dims", spec.global_dims, "an interleaved map needs rank >= 3")
    for field, want in (("global_strides", spec.rank - 1), ("box_dims", spec.rank),
                        ("element_strides", spec.rank)):
        got = getattr(spec, field)
        if got is not None and len(got) != want:
            _fail(field, got, f"needs {want} entries for rank {spec.rank}")


def _check_address(spec: TensorMapSpec, address: int) -> None:
    alignment = 32 if spec.interleave == Interleave.B32 else 16
    if address % alignment:
        _fail("global_address", hex(address), f"must be {alignment}-byte aligned")


def _check_dims(spec: TensorMapSpec) -> None:
    for dim in spec.global_dims:
        if not 0 < dim <= 2**32:
            _fail("global_dims", spec.global_dims, "each must be in 1..2**32")
    multiple = 32 if spec.interleave == Interleave.B32 else 16
    for stride in spec.global_strides:
        # No ordering between strides is enforced: the driver accepts a (d, N, H, B) view of a
        # (B, N, H, d) tensor, whose heads stride is below its rows stride (FA3's maps are such).
        if stride % multiple or not 0 < stride < 2**40:
            _fail("global_strides", spec.global_strides, f"each must be a positive multiple of {multiple} below 2**40")


def _check_box(spec: TensorMapSpec) -> None:
    for box in spec.box_dims:
        if not 0 < box <= 256:
            _fail("box_dims", spec.box_dims, "each must be in 1..256")
    for step in spec.steps:
        if not 0 < step <= 8:
            _fail("element_strides", spec.steps, "each must be in 1..8")
    inner = spec.box_dims[0] * spec.element_bytes
    if spec.interleave == Interleave.NONE:
        if inner % 16:
            _fail("box_dims", spec.box_dims, f"the inner box is {inner} bytes; it must be a multiple of 16")
        if spec.swizzle != Swizzle.NONE and inner > spec.swizzle.span:
            _fail("box_dims", spec.box_dims,
                  f"the inner box is {inner} bytes; swizzle {spec.swizzle.name} allows at most {spec.swizzle.span}")
    if spec.interleave == Interleave.B32 and spec.swizzle != Swizzle.B32:
        _fail("swizzle", spec.swizzle.name, "an interleave of 32B needs swizzle B32")
    if spec.oob_fill == OobFill.NAN_REQUEST_ZERO_FMA and spec.dtype not in FLOATING:
        _fail("oob_fill", spec.oob_fill.name, "NaN fill needs a floating-point dtype")

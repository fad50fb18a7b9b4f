"""TensorMapSpec: cuTensorMapEncodeTiled's rules on a CPU, and fagen's own 128-byte encoding, whose
layout the emulator's C header must share (compiled here and compared field by field)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import fagen.emulate
from fagen.kernels.tensor_map import (LAYOUT, MAGIC, MAP_BYTES, DataType, Interleave, PageBox, Swizzle,
                                      TensorMapError, TensorMapSpec, decode_emulated, layout_offsets)
from tensor_map_cases import Q_MAP, REFUSED

def test_a_flash_attention_q_map_is_accepted_and_sized():
    Q_MAP.check(0x7F0000001000)
    assert Q_MAP.box_bytes == 64 * 128 * 2
    strided = dataclasses.replace(Q_MAP, box_dims=(64, 128, 1, 1), element_strides=(1, 2, 1, 1))
    assert strided.box_bytes == 64 * 64 * 2   # ceil(box / element stride) per dim


def test_of_tensor_reverses_dims_and_gives_byte_strides():
    q = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16)
    plain = TensorMapSpec.of_tensor(q, (1, 128, 1, 64), swizzle=Swizzle.B128)
    assert (plain.global_dims, plain.global_strides) == ((128, 8, 1000, 2), (256, 8 * 256, 1000 * 8 * 256))
    assert plain.box_dims == (64, 1, 128, 1)
    # (B, H, N, d) of the same storage, FlashAttention-3's order: rows before heads.
    assert TensorMapSpec.of_tensor(q.transpose(1, 2), (1, 1, 128, 64), swizzle=Swizzle.B128) == Q_MAP
    view = torch.empty(2, 1000, 3, 8, 128, dtype=torch.float16)[:, :, 1]   # a qkv-packed view: strides kept
    spec = TensorMapSpec.of_tensor(view, (1, 64, 1, 64))
    assert spec.global_strides == (128 * 2, 3 * 8 * 128 * 2, 1000 * 3 * 8 * 128 * 2)
    with pytest.raises(TensorMapError, match="contiguous last dim"):
        TensorMapSpec.of_tensor(q.transpose(2, 3), (1, 128, 1, 64))
    with pytest.raises(TensorMapError, match="one entry per dim"):
        TensorMapSpec.of_tensor(q, (128, 64))


@pytest.mark.parametrize("change, field", REFUSED, ids=[f"{i}-{f}" for i, (_, f) in enumerate(REFUSED)])
def test_each_driver_rule_is_enforced_and_names_the_field(change, field):
    with pytest.raises(TensorMapError, match=rf"tensor map {field}="):
        dataclasses.replace(Q_MAP, **change).check(0x1000)


def test_the_global_address_alignment():
    Q_MAP.check(0x1010)
    with pytest.raises(TensorMapError, match="global_address=.*16-byte aligned"):
        Q_MAP.check(0x1008)
    interleaved = dataclasses.replace(Q_MAP, interleave=Interleave.B32, swizzle=Swizzle.B32, box_dims=(16, 128, 1, 1),
                                      global_strides=(8 * 128 * 2, 128 * 2, 1000 * 8 * 128 * 2))
    interleaved.check(0x1020)
    with pytest.raises(TensorMapError, match="32-byte aligned"):
        interleaved.check(0x1010)


def test_strides_need_no_order():
    # The driver takes (d, N, H, B) of a (B, N, H, d) tensor: the heads' stride (256 B) is below
    # the rows' (4096 B). A rule that sorted strides would refuse FlashAttention-3's own maps.
    assert Q_MAP.global_strides[1] < Q_MAP.global_strides[0]
    Q_MAP.check(0)


def test_the_emulated_encoding_round_trips():
    data = Q_MAP.emulated_bytes(0x7F0000001000)
    assert len(data) == MAP_BYTES
    fields = decode_emulated(data)
    assert fields["magic"] == MAGIC and fields["global_address"] == 0x7F0000001000 and fields["rank"] == 4
    assert fields["global_dims"] == (128, 1000, 8, 2, 1)
    assert fields["global_strides"] == (*Q_MAP.global_strides, 0)
    assert fields["box_dims"] == (64, 128, 1, 1, 1) and fields["element_strides"] == (1, 1, 1, 1, 1)
    assert (fields["dtype"], fields["element_bytes"], fields["swizzle"]) == (DataType.BFLOAT16, 2, Swizzle.B128)
    assert data[-13:] == bytes(13)   # the padding
    with pytest.raises(TensorMapError, match="not an emulated tensor map"):
        decode_emulated(bytes(MAP_BYTES))
    with pytest.raises(TensorMapError, match="box_dims"):   # encoding checks first
        dataclasses.replace(Q_MAP, box_dims=(64, 512, 1, 1)).emulated_bytes(0)


OFFSETS_PROGRAM = """
#include <cstdio>
#include <fagen_emulate/tensor_map.h>
using fagen_emu::EmulatedTensorMap;
#define FIELD(name) std::printf(#name " %zu\\n", offsetof(EmulatedTensorMap, name));
int main() {
  %FIELDS%
  std::printf("sizeof %zu\\nmagic_value %u\\n", sizeof(EmulatedTensorMap), fagen_emu::kTensorMapMagic);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler the emulator uses")
def test_the_c_header_has_the_python_layout(tmp_path):
    source = OFFSETS_PROGRAM.replace("%FIELDS%", " ".join(f"FIELD({name})" for name, _, _ in LAYOUT))
    (tmp_path / "offsets.cpp").write_text(source)
    include = Path(fagen.emulate.__file__).parent / "include"
    subprocess.run(["g++", "-std=c++17", f"-I{include}", "offsets.cpp", "-o", "offsets"], cwd=tmp_path, check=True)
    printed = dict(line.split() for line in subprocess.run(
        [str(tmp_path / "offsets")], check=True, capture_output=True, text=True).stdout.splitlines())
    assert {name: int(printed[name]) for name, _, _ in LAYOUT} == layout_offsets()
    assert int(printed["sizeof"]) == MAP_BYTES and int(printed["magic_value"]) == MAGIC


def test_a_map_made_from_a_tensor_carries_it():
    """emulated_bytes(tensor): the same bytes as of its address, carrying the tensor, which the
    emulator's checked build copies into its helper process; the address sits where the emulator's
    ABI says (the helper re-points it there)."""
    from fagen.emulate import abi
    from fagen.kernels.tensor_map import MappedBytes

    q = torch.zeros(2, 1000, 8, 128, dtype=torch.bfloat16)
    spec = TensorMapSpec.of_tensor(q, (1, 128, 1, 64), swizzle=Swizzle.B128)
    mapped = spec.emulated_bytes(q)
    assert isinstance(mapped, MappedBytes) and mapped.tensor is q
    assert bytes(mapped) == spec.emulated_bytes(q.data_ptr())
    assert layout_offsets()["global_address"] == abi.TENSOR_MAP_ADDRESS_OFFSET


def test_the_driver_bindings_take_the_encoding_s_arguments():
    """cuTensorMapEncodeTiled as cuda.bindings declares it: its arrays take cuuint64_t / cuuint32_t
    elements (cuda-bindings 12.9 refuses plain ints with a TypeError, which would fail every sm90
    forward on a GPU). Here, without a GPU driver, the call gets past the argument conversion to
    the driver's loading; with one, the driver encodes the map."""
    driver = pytest.importorskip("cuda.bindings.driver")
    from fagen.kernels.tensor_map import driver_arguments

    q = torch.zeros(1, 256, 2, 64, dtype=torch.bfloat16)
    spec = TensorMapSpec.of_tensor(q, (1, 128, 1, 64), swizzle=Swizzle.B128)
    arguments = driver_arguments(spec, q.data_ptr())
    assert all(isinstance(n, driver.cuuint64_t) for n in arguments[3] + arguments[4])
    assert all(isinstance(n, driver.cuuint32_t) for n in arguments[5] + arguments[6])
    try:
        result, _ = driver.cuTensorMapEncodeTiled(*arguments)
    except Exception as exc:  # noqa: BLE001 - no driver on this machine: past the conversion
        assert not isinstance(exc, TypeError) and "cuda" in str(exc).lower(), exc
    else:
        assert result == driver.CUresult.CUDA_SUCCESS


def test_cupy_takes_a_tensor_map_by_value():
    """launch.struct_argument: the form CuPy's `_pointer` (cupy/cuda/function.pyx) passes by value
    in 10.0 through 14.x, a NumPy array of size one (CuPy 13 refuses the numpy.void record that
    14 also takes, which failed every sm90 launch). Then the installed CuPy's own conversion, on a
    function with no module: an argument after the map that CuPy cannot convert stops the call
    with CuPy's TypeError naming that argument, so the map was converted, before any CUDA call."""
    from fagen.kernels.launch import struct_argument

    data = bytes(range(MAP_BYTES))
    argument = struct_argument(data)
    assert isinstance(argument, np.ndarray) and argument.size == 1 and argument.tobytes() == data
    cupy_function = pytest.importorskip("cupy.cuda.function")

    class Unconvertible:
        pass

    function = cupy_function.Function.__new__(cupy_function.Function)
    with pytest.raises(TypeError, match="Unsupported type.*Unconvertible"):
        function((1, 1, 1), (1, 1, 1), (struct_argument(data), Unconvertible()), 0,
                 types.SimpleNamespace(ptr=0))


def test_the_cuda_extras_admit_no_cupy_that_cannot_pass_a_tensor_map():
    """pyproject.toml's cuda12 / cuda13 extras: each names CuPy with a floor no older than the first
    release that takes struct_argument's form by value (launch.CUPY_STRUCT_BY_VALUE)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    from fagen.kernels.launch import CUPY_STRUCT_BY_VALUE

    tomllib = pytest.importorskip("tomllib")   # Python 3.11's TOML reader
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    oldest = Version(".".join(map(str, CUPY_STRUCT_BY_VALUE)))
    for extra in ("cuda12", "cuda13"):
        cupys = [Requirement(line) for line in project["optional-dependencies"][extra]
                 if Requirement(line).name.startswith("cupy")]
        assert len(cupys) == 1, (extra, cupys)
        floors = [Version(s.version) for s in cupys[0].specifier if s.operator in (">=", "==", "~=")]
        assert floors and min(floors) >= oldest, (extra, str(cupys[0]))


def test_the_launcher_encodes_a_driver_map_once_per_address_and_layout(monkeypatch):
    """launch._driver_map: a warm call's maps come from the cache (a map holds only an address and a
    layout), and any change of address, shape, strides, dtype or box encodes a new one."""
    from fagen.kernels import launch, tensor_map

    encoded = []

    def encode(spec, address):
        encoded.append((spec, address))
        return 0, bytes([len(encoded)]) * MAP_BYTES

    monkeypatch.setattr(tensor_map, "driver_encode", encode)
    monkeypatch.setattr(launch, "_driver_maps", {})
    q = torch.zeros(2, 256, 4, 128, dtype=torch.float16)
    box = (1, 128, 1, 64)
    first = launch._driver_map(box, q)
    assert bytes(launch._driver_map(box, q).tobytes()) == bytes(first.tobytes()) and len(encoded) == 1
    others = [(box, q[1:]), (box, q[:, :128]), (box, q.transpose(1, 2)), (box, q.view(torch.bfloat16)),
              ((1, 64, 1, 64), q), ((1, PageBox(128), 1, 64), q)]
    for other_box, tensor in others:
        launch._driver_map(other_box, tensor)
    assert len(encoded) == 1 + len(others)
    assert [spec.box_dims for spec, _ in encoded][-2:] == [(64, 1, 64, 1), (64, 1, 128, 1)]
    assert encoded[1][1] == q[1:].data_ptr() != encoded[0][1]
    monkeypatch.setattr(launch, "MAX_DRIVER_MAPS", 2)
    launch._driver_map(box, q.clone())   # a full cache starts over, and stays bounded
    assert len(launch._driver_maps) == 1


@pytest.mark.parametrize("shape, box, rows", [
    ((2, 0, 4, 128), (1, 128, 1, 64), 128),               # dense keys, seqlen_k = 0
    ((0, 4, 128), (1, 128, 1, 64), 128),                  # packed keys, total_k = 0: (1, 0, 4, 128)
    ((0, 48, 4, 128), (1, PageBox(128), 1, 64), 16),      # a paged cache of no pages: the box follows its pages
])
def test_a_tensor_without_elements_is_mapped_over_a_placeholder_row(monkeypatch, shape, box, rows):
    """launch._encoded (issue 42): the driver refuses a zero dim, and a kernel reads nothing through
    the map of an empty tensor (its sizes give it no tile), so the map is encoded over one zero row
    of the tensor's width, kept for the process; the box is resolved on the tensor's own shape.
    Both backends encode the same map."""
    from fagen.kernels import launch, tensor_map

    encoded = []

    def encode(spec, address):
        encoded.append((spec, address))
        return 0, bytes(MAP_BYTES)

    monkeypatch.setattr(tensor_map, "driver_encode", encode)
    monkeypatch.setattr(launch, "_driver_maps", {})
    empty = torch.empty(shape, dtype=torch.float16)
    launch._driver_map(box, empty)
    launch._driver_map(box, empty)   # a warm call: from the cache
    (spec, address), = encoded
    assert spec.global_dims == (128, 1, 1, 1) and spec.box_dims == (64, 1, rows, 1)
    placeholder = launch._placeholders[(empty.device, empty.dtype, 4, 128)]
    assert address == placeholder.data_ptr() and torch.equal(placeholder, torch.zeros(1, 1, 1, 128).half())
    fields = decode_emulated(launch._emulated_map(box, empty))
    assert fields["global_address"] == address and fields["global_dims"][:4] == spec.global_dims
    assert fields["box_dims"][:4] == spec.box_dims

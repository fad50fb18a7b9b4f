"""wgmma's descriptors, swizzles, operand layouts and fragments against CuTe's own definitions.

CuTe (the nvidia-cutlass wheel's headers) is compiled for the host with g++ into a small
program, tests/support/cute_wgmma_oracle.cpp, that prints: GmmaDescriptor's bit encodings,
Swizzle<B,4,3>, the byte offsets of its canonical smem layouts (Layout_{K,MN}_{INTER,SW32,SW64,
SW128}_Atom tiled to rows x 16 fp16 operands) with make_gmma_desc's descriptor of each k-slice,
and the accumulator / A-register layouts CLayout_64xN and ALayout_64x16. fagen's builders and
the emulator's twin are compared with that: an independent second reading of the ISA. Skipped
only where the wheel is not installed.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import isa_wgmma
import wgmma_probe
import wgmma_tiles as tiles
from fagen.emulate import load_module

ORACLE = Path(__file__).resolve().parent.parent / "support" / "cute_wgmma_oracle.cpp"
I32 = np.int32
MODES = {"none": 0, "128B": 1, "64B": 2, "32B": 3}  # CuTe's LayoutType numbering is the ISA's


def cute_include() -> Path:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        pytest.skip("the nvidia-cutlass wheel (CuTe's headers, the oracle) is not installed")
    include = Path(spec.origin).parent / "source" / "include"
    assert (include / "cute" / "arch" / "mma_sm90_desc.hpp").is_file(), f"no CuTe headers under {include}"
    return include


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    from fagen.emulate.build import compiler, cuda_include_dir

    cuda = cuda_include_dir()
    binary = tmp_path_factory.mktemp("cute") / "oracle"
    command = [compiler(), "-std=c++17", "-O0", f"-I{cute_include()}", f"-I{cuda}", str(ORACLE), "-o", str(binary)]
    if (cuda / "cccl").is_dir():  # CUDA 13 keeps libcu++ (cuda/std/...) there
        command.insert(3, f"-I{cuda / 'cccl'}")
    subprocess.run(command, check=True, capture_output=True, text=True)
    run = subprocess.run([str(binary)], check=True, capture_output=True, text=True)
    return parse(run.stdout)


# On the host, make_gmma_desc's smem address cast prints this and gives 0 (the tile records
# carry the start offset instead).
HOST_CAST_NOTE = "ERROR: cast_smem_ptr_to_uint not supported but used."


def parse(text: str) -> dict:
    records = {"desc": [], "swz": [], "tile": [], "acc": {}, "afrag": {}}
    for line in text.splitlines():
        if line == HOST_CAST_NOTE:
            continue
        kind, *fields = line.split()
        if kind == "tile":
            name, rows, kmajor, mode, slice_, desc, start, size, *offsets = fields
            records["tile"].append(dict(name=name, rows=int(rows), k_major=kmajor == "1", mode=int(mode),
                                        slice=int(slice_), desc=int(desc), start=int(start), size=int(size),
                                        offsets=np.array(offsets, dtype=np.int64).reshape(int(rows), -1)))
        elif kind == "acc":
            n, thread, value, row, col = map(int, fields)
            records["acc"].setdefault(n, {})[(thread, value)] = (row, col)
        elif kind == "afrag":
            size, thread, value, row, col = map(int, fields)
            records["afrag"].setdefault(size, {})[(thread, value)] = (row, col)
        else:
            records[kind].append(tuple(int(f) for f in fields))
    return records


BUILDERS = r"""
#include <fagen/prelude.cuh>
#include <fagen/smem_desc.cuh>
extern "C" __global__ void build_descriptors(const unsigned* fields, int count, unsigned long long* out) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const unsigned* f = fields + 5 * i;
    out[i] = fagen::make_smem_desc(f[0], f[1], f[2], f[4], f[3]);
  }
}
FAGEN_EXPORT(build_descriptors)
extern "C" __global__ void swizzle_addresses(const unsigned* in, int count, unsigned mode, unsigned* out) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) out[i] = fagen::swizzle_address(in[i], mode);
}
FAGEN_EXPORT(swizzle_addresses)
"""


@functools.lru_cache(maxsize=None)
def builders():
    return load_module(BUILDERS)


def test_descriptor_bits_match_cute(oracle):
    fields = np.array([case[:5] for case in oracle["desc"]], dtype=np.uint32)
    out = torch.zeros(len(fields), dtype=torch.int64)
    builders().get_function("build_descriptors")((1, 1, 1), (32, 1, 1),
                                                 (torch.from_numpy(fields.view(np.int32)), I32(len(fields)), out))
    expected = [case[5] for case in oracle["desc"]]
    assert [int(v) & (2**64 - 1) for v in out.tolist()] == expected


@pytest.mark.parametrize("mode, bits", [(1, 3), (2, 2), (3, 1)], ids=["128B", "64B", "32B"])
def test_swizzle_matches_cute(oracle, mode, bits):
    cases = [(address, swizzled) for b, address, swizzled in oracle["swz"] if b == bits]
    addresses = np.array([a for a, _ in cases], dtype=np.uint32)
    out = torch.zeros(len(cases), dtype=torch.int32)
    builders().get_function("swizzle_addresses")((1, 1, 1), (64, 1, 1),
                                                 (torch.from_numpy(addresses.view(np.int32)), I32(len(cases)),
                                                  np.uint32(mode), out))
    assert out.tolist() == [s for _, s in cases]
    assert [tiles.swizzle(a, mode) for a, _ in cases] == [s for _, s in cases]


def descriptor_fields(desc: int) -> tuple[int, int, int]:
    """(LBO, SBO, swizzle) of a descriptor, as the ISA's format puts them."""
    return (desc >> 16 & 0x3FFF) << 4, (desc >> 32 & 0x3FFF) << 4, desc >> 62


def test_tests_layout_reading_matches_cute(oracle):
    """tests/support/wgmma_tiles.py, given make_gmma_desc's LBO and SBO, puts every element where
    CuTe's canonical layout does (1024-aligned buffer, so the absolute swizzle is the same)."""
    for tile in oracle["tile"]:
        lbo, sbo, mode = descriptor_fields(tile["desc"])
        assert mode == tile["mode"]
        size = tile["size"]
        ours = [[tiles.swizzle(tile["start"] + tiles.element_offset(mn, k, not tile["k_major"], mode, lbo, sbo, size),
                               mode) for k in range(32 // size)] for mn in range(tile["rows"])]
        np.testing.assert_array_equal(np.array(ours), tile["offsets"], err_msg=f"{tile['name']} rows {tile['rows']}")


def test_fragment_tables_match_cute(oracle):
    for n, where in oracle["acc"].items():
        assert where == isa_wgmma.accumulator(n), f"CLayout_64x{n}"
    assert oracle["afrag"][2] == isa_wgmma.a_fragment(), "ALayout_64x16"
    assert oracle["afrag"][1] == isa_wgmma.a_fragment_8bit(), "ALayout_64x32"


@pytest.fixture(scope="module")
def probes():
    return load_module(wgmma_probe.probe_source())


def pick(oracle, rows: int, k_major: bool, mode: int, slice_: str, size: int = 2):
    found = [t for t in oracle["tile"]
             if t["rows"] == rows and t["k_major"] == k_major and t["mode"] == mode and t["size"] == size]
    if not found:
        return None
    return found[-1] if slice_ == "last" else found[0]


def image_of(tile: dict, values: np.ndarray, image: np.ndarray, at: int) -> list[int]:
    """Writes `values` (rows x K, uint16 or uint8) where CuTe's layout puts them, `at` bytes into
    the image; returns the probe's (offset, LBO, SBO, swizzle) from make_gmma_desc's descriptor."""
    size = values.dtype.itemsize
    for mn in range(tile["rows"]):
        for k in range(values.shape[1]):
            offset = at + int(tile["offsets"][mn, k])
            image[offset:offset + size] = np.frombuffer(values[mn, k].tobytes(), dtype=np.uint8)
    lbo, sbo, mode = descriptor_fields(tile["desc"])
    return [at + tile["start"], lbo, sbo, mode]


@pytest.mark.parametrize("slice_", ["first", "last"])
@pytest.mark.parametrize("mode", list(MODES.values()), ids=list(MODES))
def test_twin_reads_cute_tiles(oracle, probes, mode, slice_):
    """Operands laid out by CuTe's canonical layouts, described by make_gmma_desc's LBO / SBO /
    swizzle: the twin's product is exactly A @ B^T + C, for both major-nesses of A and B."""
    rng = np.random.default_rng(mode)
    ran = 0
    for probe in wgmma_probe.PROBES:
        n, bf16, regs, ta, tb = probe
        a_tile = pick(oracle, 64, not ta, mode, slice_)
        b_tile = pick(oracle, n, not tb, mode, slice_)
        if bf16 or b_tile is None or a_tile is None:
            continue
        A = rng.integers(-4, 5, (64, 16)).astype(np.float64)
        B = rng.integers(-4, 5, (n, 16)).astype(np.float64)
        C = rng.integers(-50, 51, (64, n)).astype(np.float64)
        a_bits, b_bits = wgmma_probe.bits16(A, False), wgmma_probe.bits16(B, False)
        b_at = 64 * 64 * 2 * 2  # past the widest A tile (64 x 64 fp16), 1024-aligned
        image = wgmma_probe.bits16(rng.integers(-3, 4, b_at + 256 * 64 * 2) + 0.5, False).view(np.uint8).copy()
        params = image_of(a_tile, a_bits, image, 0) + image_of(b_tile, b_bits, image, b_at) + [1]
        d = wgmma_probe.launch(probes, probe, image, params, a_bits, C)
        np.testing.assert_array_equal(d, A @ B.T + C, err_msg=f"{wgmma_probe.probe_name(*probe)}")
        ran += 1
    assert ran >= 8


@pytest.mark.parametrize("slice_", ["first", "last"])
@pytest.mark.parametrize("mode", list(MODES.values()), ids=list(MODES))
def test_twin_reads_cute_fp8_tiles(oracle, probes, mode, slice_):
    """The same for e4m3 / e5m2 operands (K-major, K = 32), A from shared memory or from
    registers packed by the table test_fragment_tables_match_cute holds to ALayout_64x32."""
    rng = np.random.default_rng(10 + mode)
    for probe in wgmma_probe.FP8_PROBES:
        n, a_type, b_type, _ = probe
        a_tile, b_tile = pick(oracle, 64, True, mode, slice_, 1), pick(oracle, n, True, mode, slice_, 1)
        A = rng.integers(-4, 5, (64, 32)).astype(np.float64)
        B = rng.integers(-4, 5, (n, 32)).astype(np.float64)
        C = rng.integers(-50, 51, (64, n)).astype(np.float64)
        a_bits, b_bits = wgmma_probe.bits8(A, a_type), wgmma_probe.bits8(B, b_type)
        b_at = 64 * 128  # past the widest A tile (64 x 128 bytes)
        image = wgmma_probe.bits8(rng.integers(-3, 4, b_at + 256 * 128) + 0.5, "e4m3")
        params = image_of(a_tile, a_bits, image, 0) + image_of(b_tile, b_bits, image, b_at) + [1]
        d = wgmma_probe.launch(probes, probe, image, params, a_bits, C)
        np.testing.assert_array_equal(d, A @ B.T + C, err_msg=f"{wgmma_probe.fp8_probe_name(*probe)}")

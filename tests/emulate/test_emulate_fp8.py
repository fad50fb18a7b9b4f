"""fagen/fp8.cuh on the emulator: the 8-bit conversions against torch's float8 casts, and P packed
as a k32 wgmma's A operand times V^T with its keys in fp8.cuh's order, against NumPy.

The conversions' twin is NVIDIA's own host code in cuda_fp8.h (the GPU runs cvt.rn.satfinite);
torch's casts are the independent reading. torch's cast does not saturate (a value past the
largest finite one becomes NaN, or infinity in e5m2), so the reference clamps first:
satfinite is the clamp, then round to nearest even.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import wgmma_probe
import wgmma_tiles as tiles
from fagen.emulate import load_module
from fagen.kernels.fp8_operands import SLOT_OF_KEY, v_in_slot_order

MAX = {"e4m3": 448.0, "e5m2": 57344.0}
DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

SOURCE = r"""
#include <fagen/prelude.cuh>
#include <fagen/proxy_fence.cuh>
#include <fagen/wgmma.cuh>
#include <fagen/fp8.cuh>

// Pairs of x as two e4m3 and two e5m2 bytes (the low 16 bits of each output), and e4m3x4 of each four.
extern "C" __global__ void convert(const float* x, uint32_t* e4m3, uint32_t* e5m2, uint32_t* quads, int pairs) {
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    e4m3[i] = fagen::e4m3x2(x[2 * i], x[2 * i + 1]);
    e5m2[i] = fagen::e5m2x2(x[2 * i], x[2 * i + 1]);
    if (i % 2 == 0) quads[i / 2] = fagen::e4m3x4(x[2 * i], x[2 * i + 1], x[2 * i + 2], x[2 * i + 3]);
  }
}
FAGEN_EXPORT(convert)

// P, an m64 x 64 fp32 accumulator (p_in: each thread's 32 registers), packed by pack_p into two
// k32 steps of A, times V^T's two k32 slices (B: K-major e4m3 tiles at p[0] and p[4], each with
// LBO p[1], SBO p[2], swizzle p[3]): O (m64 x 64) dumped to out, the A registers to a_out.
extern "C" __global__ void p_times_v(const unsigned char* image, int image_bytes, const int* p, const float* p_in,
                                     float* out, uint32_t* a_out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t window = fagen::shared_window_address(smem);
  unsigned char* tile = smem + (1024 - window % 1024) % 1024;
  const uint32_t base = fagen::shared_window_address(tile);
  for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) tile[i] = image[i];
  fagen::fence_proxy_async_shared();
  __syncthreads();
  const int t = threadIdx.x;
  float acc[32];
  for (int i = 0; i < 32; ++i) acc[i] = p_in[t * 32 + i];
  uint32_t a[2][4];
  fagen::pack_p<64>(acc, a);
  for (int s = 0; s < 2; ++s)
    for (int r = 0; r < 4; ++r) a_out[t * 8 + 4 * s + r] = a[s][r];
  float o[32];
  for (int i = 0; i < 32; ++i) o[i] = 0.f;
  fagen::wgmma_fence();
  fagen::wgmma_rs_fp8<64, false, false>(o, a[0], fagen::make_smem_desc(base + p[0], p[1], p[2], p[3]), 0);
  fagen::wgmma_rs_fp8<64, false, false>(o, a[1], fagen::make_smem_desc(base + p[4], p[1], p[2], p[3]), 1);
  fagen::wgmma_commit();
  fagen::wgmma_wait<0>();
  fagen::wgmma_fence_operands<64>(o);
  for (int i = 0; i < 32; ++i) out[t * 32 + i] = o[i];
}
FAGEN_EXPORT(p_times_v)
"""


@pytest.fixture(scope="module")
def module():
    return load_module(SOURCE)


def satfinite(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The reference: clamp to the largest finite value (NaN stays NaN), then torch's RNE cast."""
    return torch.clamp(x, -MAX[kind], MAX[kind]).to(DTYPE[kind])


def inputs() -> torch.Tensor:
    """Every finite e4m3 and e5m2 value, the midpoints between neighbours (ties to even), values
    just past those, past the largest finite ones, the infinities, NaN, signed zeros and
    subnormals, and a spread of random magnitudes."""
    grid = []
    for dtype in DTYPE.values():
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        finite = codes[torch.isfinite(codes)].unique()
        middle = (finite[1:] + finite[:-1]) / 2
        grid += [finite, middle, torch.nextafter(middle, finite[1:]), torch.nextafter(middle, finite[:-1])]
    specials = torch.tensor([0.0, -0.0, 440.0, 447.9, 448.0, 449.0, 464.0, 465.0, 1e6, -1e6, 57343.0, 57344.0,
                             61439.0, 61440.0, 70000.0, float("inf"), float("-inf"), float("nan"), 2.0 ** -9,
                             2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -16, 2.0 ** -17, 3 * 2.0 ** -18, 1e-30, -1e-30])
    rng = np.random.default_rng(3)
    spread = torch.from_numpy((rng.choice([-1.0, 1.0], 4096) * 2.0 ** rng.uniform(-20, 17, 4096)).astype(np.float32))
    x = torch.cat(grid + [specials, spread]).float()
    return torch.cat([x, x.new_zeros((-x.numel()) % 4)])   # whole quads


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_the_conversions_round_to_nearest_even_and_saturate_as_torch_casts_the_clamped_value(module, kind):
    x = inputs()
    pairs = x.numel() // 2
    outs = {k: torch.zeros(pairs, dtype=torch.int32) for k in ("e4m3", "e5m2")}
    quads = torch.zeros(pairs // 2, dtype=torch.int32)
    module.get_function("convert")((1, 1, 1), (128, 1, 1), (x, outs["e4m3"], outs["e5m2"], quads, np.int32(pairs)))
    words = outs[kind].numpy().astype(np.uint32)
    got = np.stack([words & 0xFF, words >> 8 & 0xFF], axis=1).reshape(-1).astype(np.uint8)
    assert not (words >> 16).any(), "two bytes, the rest zero"
    expected = satfinite(x, kind).view(torch.uint8).numpy()
    nan = torch.isnan(x).numpy()
    decoded = torch.from_numpy(got.copy()).view(DTYPE[kind]).float()
    assert torch.isnan(decoded[nan]).all(), "NaN stays NaN"
    mismatch = np.flatnonzero((got != expected) & ~nan)
    assert mismatch.size == 0, [(x[i].item(), hex(got[i]), hex(expected[i])) for i in mismatch[:8]]
    assert torch.isfinite(decoded[~nan]).all(), "satfinite: no infinity"
    if kind == "e4m3":   # e4m3x4: the pairs' bytes in order, the first value lowest
        q = quads.numpy().astype(np.uint32)
        by_quads = np.stack([q >> s & 0xFF for s in (0, 8, 16, 24)], axis=1).reshape(-1).astype(np.uint8)
        np.testing.assert_array_equal(by_quads[~nan], got[~nan])


def test_the_key_orders_are_inverse_and_match_the_fragments():
    """fp8.cuh's key_of_slot, read here from the two fragment tables: slot 4 q + e of an 8-bit A
    register holds the accumulator's column 8 j + 2 q + e % 2 of block j = 2 h + e / 2."""
    key_of_slot = [2 * (s // 4) + s % 2 + 8 * (s % 4 // 2) for s in range(16)]
    assert sorted(key_of_slot) == list(range(16))
    assert [SLOT_OF_KEY[key_of_slot[s]] for s in range(16)] == list(range(16))   # the op's order is its inverse
    import isa_wgmma
    accumulator, fragment = isa_wgmma.accumulator(64), isa_wgmma.a_fragment_8bit()
    for thread in range(128):
        for element in range(16):
            row, slot = fragment[(thread, element)]
            register, e = element // 4, element % 4
            i = 4 * (2 * (register // 2) + e // 2) + 2 * (register % 2) + e % 2   # pack_p's register of P
            assert accumulator[(thread, i)] == (row, 16 * (slot // 16) + key_of_slot[slot % 16])


@pytest.mark.parametrize("mode", [0, 1], ids=["interleave", "128B"])
def test_packed_p_times_v_in_the_slot_order_is_p_v(module, mode):
    """P (64 x 64, fp32 values that e4m3 must round, some past 448) packed by pack_p, times V^T
    (64 columns of V x 64 keys, e4m3) as fagen.kernels.fp8_operands.v_in_slot_order lays it out,
    equals e4m3(P) V: the packing's key order and V's agree, and P is rounded as the cast rounds it."""
    rng = np.random.default_rng(11 + mode)
    P = (rng.uniform(0, 300, (64, 64)) * rng.choice([1, 1, 1, 2], (64, 64))).astype(np.float32)
    V = rng.integers(-3, 4, (64, 64)).astype(np.float64) / 2   # exact in e4m3; rows are keys
    # V^T as the op makes it: a row per column of V, key k of each group of 16 at its slot.
    vt = v_in_slot_order(torch.from_numpy(V).view(1, 64, 1, 64).to(torch.float8_e4m3fn))[0, 0].double().numpy()
    placements = [tiles.canonical(64, False, mode, 0), tiles.canonical(64, False, mode, 8192)]
    image = np.zeros(16384, dtype=np.uint8)
    for step, placement in enumerate(placements):
        tiles.place(image, wgmma_probe.bits8(vt[:, 32 * step:32 * step + 32].copy(), "e4m3"), placement)
    params = [placements[0].offset, placements[0].lbo, placements[0].sbo, placements[0].mode, placements[1].offset]
    p_in = torch.from_numpy(wgmma_probe.c_registers(P, 64))
    out, a_out = torch.full((128, 32), float("nan")), torch.zeros(128, 8, dtype=torch.int32)
    module.get_function("p_times_v")((1, 1, 1), (128, 1, 1),
                                     (torch.from_numpy(image), np.int32(image.size),
                                      torch.tensor(params, dtype=torch.int32), p_in, out, a_out),
                                     shared_mem=image.size + 1024)
    quantised = satfinite(torch.from_numpy(P), "e4m3").double().numpy()
    np.testing.assert_array_equal(wgmma_probe.d_from_registers(out.numpy(), 64), quantised @ V)


def test_the_gpu_build_converts_with_cvt_satfinite_and_packs_without_spills(tmp_path, monkeypatch):
    """NVRTC for sm_90a: each pair is one cvt.rn.satfinite (F2FP ... E4M3 / E5M2 in SASS, where
    cuobjdump is installed), pack_p and the fp8 wgmma build with no spills and no serialisation."""
    from fagen.kernels.compile import compile_source
    from fagen.sass.listing import disassemble, find_cuobjdump

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path))
    compiled = compile_source(SOURCE, "sm_90a")   # fails on a serialised wgmma pipeline
    for kernel in ("convert", "p_times_v"):
        assert compiled.resources[kernel].spill_bytes == 0
    if find_cuobjdump() is not None:
        sass = disassemble(*compiled.cubins)
        assert "F2FP.SATFINITE.E4M3.F32.PACK_AB" in sass and "F2FP.SATFINITE.E5M2.F32.PACK_AB" in sass, \
            sorted({line.split()[1] for line in sass.splitlines() if "F2FP" in line})
        # Its two e4m3 wgmmas are QGMMA.64x64x32 in SASS, tensor work of 64 / 4 HMMA-equivalents each.
        from fagen.sass.classes import classify, tensor_equivalents
        from fagen.sass.listing import parse_listing

        body = parse_listing(sass)["p_times_v"]
        products = [i for i in body if classify(i) == "HGMMA"]
        assert [i.base for i in products] == ["QGMMA", "QGMMA"] and sum(map(tensor_equivalents, products)) == 32


def test_v_in_slot_order_pads_past_the_last_key_and_keeps_each_key_whole():
    v = torch.arange(2 * 21 * 3 * 5, dtype=torch.float32).view(2, 21, 3, 5) % 200
    vt = v_in_slot_order(v.to(torch.float8_e4m3fn))
    assert vt.shape == (2, 3, 5, 32) and vt.dtype == torch.float8_e4m3fn
    for key in range(21):
        slot = 16 * (key // 16) + SLOT_OF_KEY[key % 16]
        assert torch.equal(vt[..., slot].float(), v[:, key].to(torch.float8_e4m3fn).float())
    filled = {16 * (k // 16) + SLOT_OF_KEY[k % 16] for k in range(21)}
    assert not vt[..., [s for s in range(32) if s not in filled]].float().any()
    with pytest.raises(ValueError, match=r"v must be \(batch, seqlen_k, kv_heads, head_dim_v\)"):
        v_in_slot_order(v[0])

"""Philox4x32-10: Random123's known answers, the NumPy version against the
header compiled for the host, the header compiled for the device by NVRTC,
and the dropout counter layout."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from fagen.reference import (dropout_keep_mask, dropout_key, dropout_threshold, dropout_words,
                             philox4x32_10)

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "templates" / "include"

# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter, key, expected.
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

HOST_DRIVER = r"""
#include <cstdio>
#include <fagen/philox.cuh>

// Reads commands from stdin, one a line:
//   P c0 c1 c2 c3 k0 k1            -> the 4 output words of philox4x32_10
//   D seed offset b h H i j thr    -> the element's word, and the keep decision
int main() {
  char op;
  while (std::scanf(" %c", &op) == 1) {
    if (op == 'P') {
      fagen::PhiloxWords ctr;
      fagen::PhiloxKey key;
      std::scanf("%x %x %x %x %x %x", &ctr.w[0], &ctr.w[1], &ctr.w[2], &ctr.w[3], &key.w[0], &key.w[1]);
      const fagen::PhiloxWords out = fagen::philox4x32_10(ctr, key);
      std::printf("%08x %08x %08x %08x\n", out.w[0], out.w[1], out.w[2], out.w[3]);
    } else {
      unsigned long long seed;
      unsigned int offset, b, h, H, i, j, thr;
      std::scanf("%llx %x %u %u %u %u %u %x", &seed, &offset, &b, &h, &H, &i, &j, &thr);
      const fagen::PhiloxWords words = fagen::dropout_words(seed, offset, b, h, H, i, j);
      const unsigned int word = words.w[fagen::dropout_word_index(i, j)];
      std::printf("%08x %d\n", word, fagen::dropout_keep(seed, offset, b, h, H, i, j, thr) ? 1 : 0);
    }
  }
  return 0;
}
"""

DEVICE_KERNEL = r"""
#include <fagen/philox.cuh>

extern "C" __global__ void draw(unsigned int* out, unsigned long long seed, unsigned int offset,
                                unsigned int threshold) {
  const unsigned int i = threadIdx.x, j = threadIdx.y;
  const fagen::PhiloxWords w = fagen::dropout_words(seed, offset, blockIdx.x, blockIdx.y, gridDim.y, i, j);
  out[threadIdx.x] = w.w[fagen::dropout_word_index(i, j)]
      + fagen::dropout_keep(seed, offset, 0, 0, 1, i, j, threshold);
}
"""


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_numpy_reproduces_random123_known_answers(counter, key, expected):
    assert [int(x) for x in philox4x32_10(counter, key)] == list(expected)


def test_numpy_broadcasts_counters_against_one_key():
    counters = np.array([kat[0] for kat in KNOWN_ANSWERS], dtype=np.uint32)
    keys = np.array([kat[1] for kat in KNOWN_ANSWERS], dtype=np.uint32)
    expected = np.array([kat[2] for kat in KNOWN_ANSWERS], dtype=np.uint32)
    assert np.array_equal(philox4x32_10(counters, keys), expected)
    # One key broadcast over many counters equals calling it counter by counter.
    many = np.random.default_rng(0).integers(0, 2**32, size=(5, 4), dtype=np.uint32)
    batched = philox4x32_10(many, keys[2])
    assert np.array_equal(batched, np.stack([philox4x32_10(c, keys[2]) for c in many]))


@pytest.fixture(scope="module")
def host_driver(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no host C++ compiler (g++ or c++) on PATH to compile philox.cuh")
    build = tmp_path_factory.mktemp("philox_host")
    source = build / "driver.cpp"
    source.write_text(HOST_DRIVER)
    binary = build / "driver"
    subprocess.run([compiler, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{INCLUDE}", str(source),
                    "-o", str(binary)], check=True, capture_output=True, text=True)

    def run(lines):
        done = subprocess.run([str(binary)], input="\n".join(lines) + "\n", capture_output=True,
                              text=True, check=True)
        return [line.split() for line in done.stdout.splitlines()]
    return run


def test_host_header_reproduces_known_answers_and_matches_numpy(host_driver):
    rng = np.random.default_rng(2024)
    counters = rng.integers(0, 2**32, size=(500, 4), dtype=np.uint32)
    keys = rng.integers(0, 2**32, size=(500, 2), dtype=np.uint32)
    counters = np.concatenate([np.array([k[0] for k in KNOWN_ANSWERS], dtype=np.uint32), counters])
    keys = np.concatenate([np.array([k[1] for k in KNOWN_ANSWERS], dtype=np.uint32), keys])
    lines = ["P " + " ".join(f"{x:x}" for x in (*c, *k)) for c, k in zip(counters, keys)]
    host = np.array([[int(w, 16) for w in row] for row in host_driver(lines)], dtype=np.uint32)
    assert host.shape == (len(lines), 4)
    assert [tuple(int(x) for x in row) for row in host[:3]] == [k[2] for k in KNOWN_ANSWERS]
    assert np.array_equal(host, philox4x32_10(counters, keys))


def test_host_dropout_helpers_match_numpy_mask(host_driver):
    B, H, Nq, Nk, p = 2, 3, 35, 21, 0.4
    seed, offset = 0x1234_5678_9ABC_DEF0, 77
    threshold = dropout_threshold(p)
    words = dropout_words(seed, offset, B, H, Nq, Nk)
    keep = dropout_keep_mask(seed, offset, B, H, Nq, Nk, p)
    rng = np.random.default_rng(7)
    picks = [tuple(int(x) for x in (rng.integers(B), rng.integers(H), rng.integers(Nq), rng.integers(Nk)))
             for _ in range(400)]
    lines = [f"D {seed:x} {offset:x} {b} {h} {H} {i} {j} {threshold:x}" for b, h, i, j in picks]
    for (b, h, i, j), (word, kept) in zip(picks, host_driver(lines)):
        assert int(word, 16) == words[b, h, i, j]
        assert bool(int(kept)) == bool(keep[b, h, i, j])


def test_header_compiles_as_device_code_with_nvrtc():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC bindings) not installed")
    err, prog = nvrtc.nvrtcCreateProgram(DEVICE_KERNEL.encode(), b"philox_device.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    options = [b"-arch=sm_80", b"-std=c++17", f"-I{INCLUDE}".encode()]
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        # Fresh buffers: `b" " * 1` is CPython's one shared b" " object, which NVRTC would
        # overwrite with the log's NUL (every later b" " in the process, print's separator
        # included, would then be b"\x00"; fagen/kernels/compile.py's `_fetch` says the same).
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS, bytes(log).decode(errors="replace")
        err, ptx_size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = bytearray(ptx_size)
        nvrtc.nvrtcGetPTX(prog, ptx)
        ptx = bytes(ptx)
        # The device path multiplies with the hardware's mul.hi rather than 64-bit products.
        assert b".entry draw" in ptx and b"mul.hi.u32" in ptx
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def test_dropout_words_follow_the_documented_counter_layout():
    B, H, Nq, Nk = 2, 3, 20, 9
    seed, offset = 2**40 + 5, 3
    words = dropout_words(seed, offset, B, H, Nq, Nk)
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)
    assert np.array_equal(dropout_key(seed), key)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 19, 8), (0, 1, 8, 1), (1, 0, 17, 5), (1, 1, 11, 6)]:
        counter = (j // 2, (i // 16) * 8 + i % 8, b * H + h, offset)
        word = 2 * ((i // 8) % 2) + j % 2
        assert words[b, h, i, j] == philox4x32_10(counter, key)[word]


def test_one_philox_call_serves_an_mma_accumulator_quad():
    # (i, j), (i, j+1), (i+8, j), (i+8, j+1) for even j and i & 8 == 0 are words 0..3 of one call.
    words = dropout_words(11, 0, 1, 1, 32, 8)[0, 0]
    key = dropout_key(11)
    for i in (0, 5, 16, 23):
        for j in (0, 6):
            quad = [words[i, j], words[i, j + 1], words[i + 8, j], words[i + 8, j + 1]]
            counter = (j // 2, (i // 16) * 8 + i % 8, 0, 0)
            assert quad == [int(x) for x in philox4x32_10(counter, key)]


def test_mask_depends_on_absolute_coordinates_only():
    big = dropout_keep_mask(5, 9, 2, 4, 70, 90, 0.25)
    small = dropout_keep_mask(5, 9, 2, 4, 33, 41, 0.25)
    assert torch.equal(small, big[:, :, :33, :41])
    assert not torch.equal(big, dropout_keep_mask(6, 9, 2, 4, 70, 90, 0.25)), "seed must matter"
    assert not torch.equal(big, dropout_keep_mask(5, 10, 2, 4, 70, 90, 0.25)), "offset must matter"
    assert not torch.equal(big[0, 0], big[0, 1]) and not torch.equal(big[0, 0], big[1, 0])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_is_one_minus_p(p):
    keep = dropout_keep_mask(31337, 0, 2, 4, 64, 128, p)
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.double().mean().item() - (1 - p)) < 5 * sigma


def test_threshold_is_floor_of_one_minus_p_times_2_pow_32():
    assert dropout_threshold(0.5) == 2**31
    assert dropout_threshold(0.25) == 3 * 2**30
    assert dropout_threshold(0.1) == 3865470566  # floor(0.9 * 2**32) = floor(3865470566.4)
    assert 0 <= dropout_threshold(1 - 2**-40) < dropout_threshold(2**-40) < 2**32
    with pytest.raises(ValueError, match="uint32"):
        dropout_threshold(0.0)
    with pytest.raises(ValueError):
        dropout_threshold(1.0)
    assert dropout_keep_mask(1, 0, 1, 1, 4, 4, 0.0).all()


def test_seed_and_offset_must_fit_their_words():
    with pytest.raises(ValueError, match="seed"):
        dropout_words(2**64, 0, 1, 1, 2, 2)
    with pytest.raises(ValueError, match="offset"):
        dropout_words(0, 2**32, 1, 1, 2, 2)

"""fagen/exact_sum.cuh and fagen.kernels.exact_sum: order-free sums (deterministic=True's gradients
of captured tensors).

The reference is independent of the header's digits: Python's exact rationals (Fraction) sum the
same float terms, and the read-back value must be that sum rounded (through float64, as `value`
documents) to fp32. The order-freedom is checked on the digits themselves: the same terms in other
orders, threads and schedules leave bit-identical int64 words.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fagen.emulate import load_module
from fagen.kernels import exact_sum
from nvrtc_ptx import nvrtc_ptx

SOURCE = r"""
#include <fagen/prelude.cuh>
#include <fagen/exact_sum.cuh>
// Term i goes into sum slots[i]: many threads and blocks add into each slot at once.
extern "C" __global__ void add_terms(const float* __restrict__ terms, const int* __restrict__ slots,
                                     long long* __restrict__ words, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) fagen::exact_sum_add(words + (long long)slots[i] * fagen::kExactSumWords, terms[i]);
}
FAGEN_EXPORT(add_terms)
"""


@pytest.fixture(scope="module")
def add_terms():
    return load_module(SOURCE).get_function("add_terms")


def summed(add_terms, terms: torch.Tensor, slots: torch.Tensor, count: int) -> torch.Tensor:
    words = exact_sum.zeros((count,), "cpu")
    add_terms(((terms.numel() + 127) // 128,), (128,), (terms, slots.int(), words, np.int32(terms.numel())))
    return words


def half_ulp(x: float) -> Fraction:
    """Half of fp32's unit in the last place at |x| (subnormals' spacing below 2^-126)."""
    exponent = max(math.frexp(x)[1] - 24, -149) if x else -149
    return Fraction(2) ** exponent / 2


def wide_terms(n: int, seed: int) -> torch.Tensor:
    """fp32 terms of every sign and of exponents across fp32's range, subnormals, zeros and -0
    included: any bit pattern but inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2 ** 31, (n,), generator=g, dtype=torch.int64)
    bits = torch.where((bits >> 23) & 0xFF == 0xFF, bits & ~(1 << 30), bits)   # no inf / NaN
    signed = bits | (torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << 31)
    terms = signed.to(torch.int32).view(torch.float32)   # int32 two's complement: the sign bit
    terms[:4] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])
    return terms


def test_the_read_back_sum_is_the_exact_sum_rounded_to_fp32(add_terms):
    # Small terms against the smallest ones, a sum past fp32's range, cancellations that float
    # addition gets wrong in one order or another.
    cases = [
        [1e30, 1.0, -1e30],
        [3e38, 3e38, -1e38],
        [1e-45] * 1000 + [2.0 ** -126, -2.0 ** -126],
        [16777216.0] + [1.0] * 1000,
        [0.1] * 3000,
    ]
    g = torch.Generator().manual_seed(0)
    cases += [wide_terms(2000, 1).tolist(), (torch.randn(2000, generator=g) * 1e-3).tolist()]
    cases += [[1e35] + (torch.randn(500, generator=g) * 1e-20).tolist() + [-1e35]]
    terms = torch.tensor([t for case in cases for t in case], dtype=torch.float32)
    slots = torch.tensor([i for i, case in enumerate(cases) for _ in case])
    got = exact_sum.value(summed(add_terms, terms, slots, len(cases)))
    for i, case in enumerate(cases):
        exact = sum((Fraction(float(np.float32(t))) for t in case), Fraction(0))
        value = got[i].item()
        if abs(exact) > Fraction(float(np.finfo(np.float32).max)):
            assert math.isinf(value) and (value > 0) == (exact > 0), (i, value)
            continue
        # float64 then fp32: the double rounding errs past half an fp32 ulp by 2^-29 ulp at most.
        assert abs(Fraction(value) - exact) <= half_ulp(value) * (1 + Fraction(1, 2 ** 28)), (i, value, float(exact))
    assert got[0].item() == 1.0                 # float addition in the given order: 0.0
    assert got[3].item() == 16777216.0 + 1000   # left to right in fp32: 16777216.0


def test_the_digits_are_the_same_in_every_order(add_terms, monkeypatch):
    terms = wide_terms(6000, 2) * torch.tensor(2.0 ** -100)   # many subnormals, many digits
    terms = torch.cat([terms, wide_terms(6000, 3)])
    slots = torch.arange(terms.numel()) % 5
    first = summed(add_terms, terms, slots, 5)
    assert bool((first[:, :exact_sum.DIGITS] != 0).sum(0).gt(0).sum() >= 8)   # the terms reach most digits
    for threads, schedule, seed in ((1, "forward", 0), (4, "random", 7), (2, "reverse", 0)):
        monkeypatch.setenv("FAGEN_EMULATE_THREADS", str(threads))
        monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
        order = torch.randperm(terms.numel(), generator=torch.Generator().manual_seed(seed))
        again = summed(add_terms, terms[order], slots[order], 5)
        assert torch.equal(again, first), (threads, schedule)
    # Positive control: float addition of such terms (normal ones, where fp32's sum stays finite)
    # depends on the order.
    normal = torch.randn(terms.numel(), generator=torch.Generator().manual_seed(4))
    forward = torch.zeros(5).index_add_(0, slots, normal)
    backward = torch.zeros(5).index_add_(0, slots.flip(0), normal.flip(0))
    assert not torch.equal(forward, backward)


@pytest.mark.parametrize(("case", "expected"), [
    ([math.inf, 1.0, -5.0], math.inf),
    ([-math.inf, 1e38, 1e38], -math.inf),
    ([math.inf, -math.inf, 2.0], math.nan),
    ([math.nan, 1.0], math.nan),
    ([-0.0, -0.0], 0.0),
])
def test_infinities_and_nans_sum_as_floats_do(add_terms, case, expected):
    got = exact_sum.value(summed(add_terms, torch.tensor(case), torch.zeros(len(case), dtype=torch.int64), 1))
    value = got[0].item()
    assert (math.isnan(value) if math.isnan(expected) else value == expected), value


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_the_header_compiles_to_integer_atomics_under_nvrtc(arch):
    ptx = nvrtc_ptx(SOURCE, arch)
    assert "add.u64" in ptx and ("atom.global" in ptx or "red.global" in ptx)

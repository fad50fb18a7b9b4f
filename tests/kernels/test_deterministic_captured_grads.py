"""deterministic=True with a captured tensor's gradient, in both families' backward: the terms go
into an order-free sum (fagen/exact_sum.cuh) instead of float atomics. Checked on the emulator:
the gradient against the float64 oracle (FlashAttention-2's rule, as every captured gradient), and
q's, k's, v's and the tensor's gradients bit-identical whichever order the blocks run in and under
the schedules that reorder a block's threads; with a positive control, the same call without
deterministic=True, whose float atomics give other bits in another block order."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

import fagen
from fagen.kernels import attention_kernels, exact_sum
from fagen.kernels.families import KERNEL_FAMILIES
from fagen.spec import Spec
from fagen.variants import custom_mod, trace_score_mod
from kernel_cases import Shape
from sm90_cases import BIAS, relative_bias
from variant_cases import run_variant_case

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

FAMILIES = ("sm80", "sm90")
INTERLEAVE = "FAGEN_EMULATE_BLOCK_INTERLEAVE"
# One block resident in grid order; all resident, started in reverse, interleaved in a fixed order
# (then freely, in parallel), producer-first (consumer-first); two resident in parallel with a
# block's threads in a random order.
RUNS = ({"FAGEN_EMULATE_BLOCK_ORDER": "forward", "FAGEN_EMULATE_THREADS": "1", INTERLEAVE: "serial"},
        {"FAGEN_EMULATE_BLOCK_ORDER": "reverse", "FAGEN_EMULATE_THREADS": "64", INTERLEAVE: "serial",
         "FAGEN_EMULATE_SCHEDULE": "producer-first"},
        {"FAGEN_EMULATE_BLOCK_ORDER": "reverse", "FAGEN_EMULATE_THREADS": "64", INTERLEAVE: "parallel",
         "FAGEN_EMULATE_SCHEDULE": "consumer-first"},
        {"FAGEN_EMULATE_BLOCK_ORDER": "forward", "FAGEN_EMULATE_THREADS": "2", INTERLEAVE: "parallel",
         "FAGEN_EMULATE_SCHEDULE": "random", "FAGEN_EMULATE_SEED": "5"})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_captured_gradient_matches_the_oracle(family):
    """BIAS (4, 400) read at [h, q - k + 199]: each entry takes the terms of a diagonal of every
    batch entry's scores, from many blocks."""
    base = Spec(64, mask="causal", deterministic=True, arch_family=family)
    spec = base.replace(score_mod=custom_mod(trace_score_mod(relative_bias)))
    assert KERNEL_FAMILIES[family].backward_of(spec) is KERNEL_FAMILIES[family].backward[0]   # the family's own
    run_variant_case(base, Shape(2, 150, 200, heads=4, kv_heads=2), {"score_mod": relative_bias}, captures=(BIAS,))


def _gradients(family: str, deterministic: bool, runs) -> list[tuple]:
    """q's, k's, v's and the bias's gradients of one causal GQA call under each of `runs`."""
    generator = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, n, h, 64, generator=generator).to(torch.float16).requires_grad_()
               for n, h in ((150, 2), (260, 1), (260, 1)))
    bias = (torch.randn(2, 512, generator=generator) * 0.5).requires_grad_()
    dout = torch.randn(q.shape, generator=generator).to(q.dtype)
    found = []
    for run in runs:
        with mock.patch.dict(os.environ, {**run, "FAGEN_ARCH_FAMILY": family}):
            out = fagen.flash_attn_func(q, k, v, causal=True, deterministic=deterministic,
                                        score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 256])
            found.append(torch.autograd.grad(out, (q, k, v, bias), dout))
    return found


def _differing(found: list[tuple]) -> list[str]:
    return [f"{name} ({run})" for run, grads in zip(RUNS[1:], found[1:])
            for name, first, again in zip(("dq", "dk", "dv", "dbias"), found[0], grads)
            if not torch.equal(first, again)]


@pytest.mark.parametrize("family", FAMILIES)
def test_repeats_are_bit_identical_in_any_block_order_and_schedule(family):
    assert _differing(_gradients(family, True, RUNS)) == []


def test_without_deterministic_the_captured_gradient_depends_on_the_block_order():
    """The positive control: float atomics sum the bias's terms in the order the blocks run."""
    assert any(d.startswith("dbias") for d in _differing(_gradients("sm80", False, RUNS[:2])))


def test_a_call_past_the_sums_range_is_refused_before_any_launch(monkeypatch):
    """The digits hold fewer than exact_sum.MAX_TERMS terms (2^39; here lowered to 2^13, below
    this call's 2 heads x 150 x 260 scores): the backward refuses, naming deterministic=True,
    before it launches anything, and no gradient is written."""
    monkeypatch.setattr(exact_sum, "MAX_TERMS", 2 ** 13)
    q, k, v = (torch.randn(1, n, h, 64).to(torch.float16).requires_grad_() for n, h in ((150, 2), (260, 1), (260, 1)))
    bias = torch.zeros(2, 512, requires_grad=True)
    with mock.patch.dict(os.environ, {"FAGEN_ARCH_FAMILY": "sm80"}):
        out = fagen.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                    score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 256])
        monkeypatch.setattr(attention_kernels, "launch_all", None)   # a launch would raise a TypeError
        with pytest.raises(ValueError, match=r"deterministic=True .* fewer than 2\^13 scores; this call has 78000"):
            out.sum().backward()
    assert q.grad is None and bias.grad is None

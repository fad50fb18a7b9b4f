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
import kernel_checks as checks
from fagen.kernels import attention_kernels, exact_sum
from fagen.kernels.families import KERNEL_FAMILIES
from fagen.spec import Spec
from fagen.variants import custom_mod, trace_score_mod
from kernel_cases import Shape
from sm90_cases import BIAS, relative_bias
from variant_cases import run_variant_case

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

FAMILIES = ("sm80", "sm90")
RUNS = checks.SCHEDULE_RUNS   # one block in grid order, ... a random schedule (kernel_checks)


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
    return checks.op_gradients(lambda: (fagen.flash_attn_func(q, k, v, causal=True, deterministic=deterministic,
                                                              score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 256]),
                                        (q, k, v, bias)), family, runs)


def _differing(found: list[tuple], runs=RUNS) -> list[str]:
    return checks.differing(found, ("dq", "dk", "dv", "dbias"), runs)


@pytest.mark.parametrize("family", FAMILIES)
def test_repeats_are_bit_identical_in_any_block_order_and_schedule(family):
    assert _differing(_gradients(family, True, RUNS)) == []


def test_without_deterministic_the_captured_gradient_depends_on_the_block_order():
    """The positive control: float atomics sum the bias's terms in the order the blocks run."""
    assert any(d.startswith("dbias") for d in _differing(_gradients("sm80", False, RUNS[:2]), RUNS[:2]))


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

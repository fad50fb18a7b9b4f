"""deterministic=True on the sm90 family's backward (templates/sm90/hopper_bwd_dq_order.j2): the
key blocks' reductions into each query block of dQ's fp32 accumulator take turns, counted by a
semaphore per query block (fagen/semaphore.cuh). Checked on the emulator: the gradients against the
float64 oracle, under the schedules with racecheck; dQ, dK and dV bit-identical whichever order the
blocks start in, whether they interleave at their waits in a fixed order or run in parallel, and
under the schedules that reorder a block's threads; with a positive control, the same check failing
on the spec without turns. GQA (REPEAT_SHAPE: two query heads per K/V head), key padding, a window
(a variant's walk: the turns counted over query_range) and packed sequences (through the ops)."""

from __future__ import annotations


import pytest
import torch

import fagen
import kernel_checks as checks
from fagen.kernels.families import KERNEL_FAMILIES
from fagen.spec import Spec
from kernel_cases import Shape, run_and_check

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

RUNS = checks.SCHEDULE_RUNS   # one block in grid order, ... a random schedule (kernel_checks)

DENSE = Spec(64, mask="causal", deterministic=True, arch_family="sm90")


@pytest.mark.parametrize("spec, shape", [(DENSE, Shape(2, 150, 200, heads=4, kv_heads=2)),
                                         (Spec(128, dtype="bf16", deterministic=True, arch_family="sm90"),
                                          Shape(1, 130, 300, heads=2, kv_heads=1))],
                         ids=lambda x: getattr(x, "name", ""))
def test_it_matches_the_oracle(spec, shape):
    assert KERNEL_FAMILIES["sm90"].backward_of(spec) is not KERNEL_FAMILIES["sm80"].backward[0]   # its own
    run_and_check(spec, shape)


def test_every_schedule_is_race_free():
    """Producer-first, consumer-first, a seeded random order and the plain one, with the happens-before
    racecheck (a semaphore's arrive releases the block's global writes, a wait acquires them)."""
    checks.sm90_backward_check(DENSE)


@pytest.mark.parametrize("spec", [DENSE, Spec(64, dtype="fp16", key_padding=True, deterministic=True,
                                              arch_family="sm90")], ids=lambda s: s.name)
def test_repeats_are_bit_identical_in_any_block_order_and_schedule(spec):
    """REPEAT_SHAPE: four key blocks (eight warpgroups' partials) into each query block, whose sum
    in another order differs in its last bits."""
    checks.repeat_check(spec, runs=RUNS)


def test_the_repeat_check_fails_without_turns():
    """The positive control: the same spec without deterministic=True sums dQ in the order the
    blocks run, so reversing them changes its bits."""
    with pytest.raises(AssertionError, match="dq differs between block orders"):
        checks.sm90_turns_check(DENSE.replace(deterministic=False))


def _gradients(call) -> list[tuple]:
    """call() -> (out, leaves) under each of RUNS (the sm90 family on the emulator)."""
    return checks.op_gradients(call, "sm90", RUNS)


def _assert_identical(found: list[tuple]) -> None:
    assert checks.differing(found, ("dq", "dk", "dv"), RUNS) == []


def test_a_windows_turns_are_counted_over_its_query_ranges():
    """A window: each key block walks the query blocks its query_range gives, so a query block's
    turns start past the key blocks that do not see it (dq_turn counts them)."""
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, n, h, 64, generator=generator).to(torch.float16).requires_grad_()
               for n, h in ((300, 2), (520, 1), (520, 1)))
    found = _gradients(lambda: (fagen.flash_attn_func(q, k, v, window_size=(150, 40), deterministic=True),
                                (q, k, v)))
    _assert_identical(found)


def test_packed_sequences_repeat_bit_for_bit():
    """flash_attn_varlen_func: each sequence's query blocks have turns of their own (the counters
    are (B, H, padded max_seqlen_q) as D's rows); a sequence shorter than a key block, one of four."""
    generator = torch.Generator().manual_seed(12)
    lengths = [300, 40, 410]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), h, 64, generator=generator).to(torch.float16).requires_grad_()
               for h in (2, 1, 1))
    found = _gradients(lambda: (fagen.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                             causal=True, deterministic=True), (q, k, v)))
    _assert_identical(found)

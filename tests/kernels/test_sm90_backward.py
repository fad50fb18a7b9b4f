"""The sm90 family's backward (templates/sm90/hopper_bwd.cu.j2: a TMA producer streaming Q, dO, L and
D, two wgmma consumer warpgroups of 64 keys, dQ summed by cp.reduce.async.bulk) rendered from Specs
and run by the emulator after the sm90 forward: dQ, dK and dV against the float64 oracle under
FlashAttention-2's rule (kernel_cases.run_and_check), every output buffer poisoned; d 64 and 128,
ragged blocks, Nq > Nk under causal, GQA and MQA, key padding, dropout; under the schedules that
reorder producer and consumers, with the happens-before racecheck; through flash_attn_func;
compiled by NVRTC for sm_90a without spills or serialised wgmma. Packed sequences: tests/ops/
test_varlen.py. The specs it does not take yet run the sm80 family's backward, as before."""

from __future__ import annotations

import pytest
import torch

import fagen
import kernel_checks as checks
from fagen.arch_families import sm90_backward_refusal, sm90_backward_tiles
from fagen.kernels.families import KERNEL_FAMILIES
from fagen.kernels.render import render
from fagen.reference import attention_gradients, attention_same_dtype
from fagen.spec import Spec
from fagen.variants import custom_mod, trace_score_mod
from kernel_cases import Shape, run_and_check
from sm90_cases import ALIBI_SOFTCAP, BIAS, check_sm90_kernel_compiles, gated, relative_bias
from variant_cases import run_variant_case

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

SM90 = KERNEL_FAMILIES["sm90"]
SPECS = [Spec(64, dtype=dtype, mask=mask, arch_family="sm90") for dtype in ("bf16", "fp16")
         for mask in ("none", "causal")]
# d = 128: two 64-column boxes per row (loads, S^T's and dP^T's k-steps, dV's and dK's N by LBO,
# dQ a box at a time); both dtypes, both masks, in two specs.
SPECS_128 = [Spec(128, dtype="bf16", arch_family="sm90"), Spec(128, dtype="fp16", mask="causal", arch_family="sm90")]
# Two key blocks (the second ragged) and three query blocks (the last ragged), GQA over two batches
# (the maps' coordinates, the group's dK and dV summed); Nq > Nk under causal (rows that see no key,
# key blocks whose walk starts past the first query block), MQA; Nk > Nq, where a causal key block
# walks masked blocks on the diagonal, then unmasked ones (Consumer::walk); the last key block, ragged, masks all.
SHAPES = {"ragged_gqa": Shape(2, 150, 200, heads=4, kv_heads=2), "more_queries_mqa": Shape(1, 300, 130, 2, 1),
          "diagonal_then_unmasked": Shape(1, 256, 320, heads=2, kv_heads=2)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
@pytest.mark.parametrize("spec", SPECS + SPECS_128, ids=lambda s: s.name)
def test_the_sm90_backward_matches_the_oracle(spec, shape):
    assert SM90.backward_of(spec) is not KERNEL_FAMILIES["sm80"].backward[0]   # its own
    run_and_check(spec, shape)


# Dropout (d = 64): each thread's keep bits of the transposed tile, half drawn by its partner lane;
# with coordinate offsets (a shard's), and with key padding.
DROPOUT = [Spec(64, dtype="bf16", mask="causal", dropout=True, arch_family="sm90"),
           Spec(64, dtype="fp16", dropout=True, coord_offsets=True, arch_family="sm90"),
           Spec(64, dtype="fp16", mask="causal", dropout=True, key_padding=True, arch_family="sm90")]


@pytest.mark.parametrize("spec", DROPOUT, ids=lambda s: s.name)
def test_dropout_replays_the_forwards_keep_bits(spec):
    assert SM90.backward_of(spec) is not KERNEL_FAMILIES["sm80"].backward[0]
    run_and_check(spec, SHAPES["ragged_gqa"])


def _documents(head_dim: int = 64, **fields) -> Spec:
    """A mask_mod over captured document ids (summaries: tile classes from per-group bounds)."""
    from fagen.variants import custom_mod, trace_mask_mod

    return Spec(head_dim, mask_mod=custom_mod(trace_mask_mod(checks.document_mask)), arch_family="sm90", **fields)


# Masks and sinks: the variant's walk (query_range), tile classes (full blocks unmasked) and
# element test; sinks only through L (their gradient is the op's). The softcap alone (in units of
# the cap, dS times 1 - t^2) and ALiBi alone (its bias on the raw score). d 64 and 128.
VARIANTS = [Spec(64, window=True, dtype="bf16", arch_family="sm90"),
            Spec(128, window=True, mask="causal", arch_family="sm90"),
            Spec(64, sinks=True, mask="causal", arch_family="sm90"),
            _documents(dtype="bf16"),
            Spec(64, softcap=True, arch_family="sm90"),
            Spec(128, softcap=True, mask="causal", window=True, dtype="bf16", arch_family="sm90"),
            Spec(64, alibi=True, mask="causal", dtype="bf16", arch_family="sm90"),
            Spec(128, alibi=True, sinks=True, arch_family="sm90")]


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_masks_sinks_softcap_and_alibi_match_the_oracle(spec):
    assert SM90.backward_of(spec) is not KERNEL_FAMILIES["sm80"].backward[0]
    checks.variant_check(spec)


# Score chains in natural-log units (d = 64): a score_mod whose derivative is not 1 (ds'/dx per
# element), a captured tensor's gradient (added from dS before the chain's derivative), ALiBi with a
# softcap.
CHAINS = {"relative_bias": (Spec(64, mask="causal", arch_family="sm90"), {"score_mod": relative_bias}, (BIAS,)),
          "gated": (Spec(64, dtype="bf16", arch_family="sm90"), {"score_mod": gated}, ()),
          "alibi_softcap": (Spec(64, mask="causal", dtype="bf16", arch_family="sm90"), ALIBI_SOFTCAP, ()),
          # under dropout: the chain's derivative and the captured gradient beside the keep bits
          "softcap_dropout": (Spec(64, mask="causal", dropout=True, arch_family="sm90"), {"softcap": 5.0}, ()),
          "relative_bias_dropout": (Spec(64, dropout=True, dtype="bf16", arch_family="sm90"),
                                    {"score_mod": relative_bias}, (BIAS,))}


@pytest.mark.parametrize("case", CHAINS.values(), ids=CHAINS)
def test_score_chains_and_captured_gradients_match_the_oracle(case):
    base, variant, captures = case
    run_variant_case(base, Shape(2, 150, 200, heads=4, kv_heads=2), variant, captures=captures)


def test_a_wide_window_runs_its_full_blocks_unmasked():
    """A window wider than a tile: blocks the tile class calls full run without the element test
    (Consumer::walk), beside the partial ones; causal aligned bottom-right within it."""
    base = Spec(64, mask="causal", arch_family="sm90")
    run_variant_case(base, Shape(1, 400, 450, heads=2, kv_heads=1), {"window_size": (300, 0)})


@pytest.mark.parametrize("spec", [Spec(64, dtype="fp16", key_padding=True, arch_family="sm90"),
                                  Spec(64, dtype="bf16", mask="causal", key_padding=True, arch_family="sm90"),
                                  Spec(128, dtype="bf16", mask="causal", key_padding=True, arch_family="sm90")],
                         ids=lambda s: s.name)
def test_key_padding_aligns_causal_to_each_entrys_own_keys(spec):
    """Entries of Nk, Nk - 37, 1 and 0 keys (kernel_cases.key_lengths): key blocks past an entry's
    keys walk nothing and store zeros; a ragged one masks its keys; causal is each entry's own."""
    assert SM90.backward_of(spec) is not KERNEL_FAMILIES["sm80"].backward[0]
    checks.uneven_lengths_check(spec)


@pytest.mark.parametrize("spec", SPECS[2:] + SPECS_128[1:], ids=lambda s: s.name)
def test_keys_past_nk_stay_masked_where_every_score_is_very_negative(spec):
    """K's rows past Nk are TMA's zeros (S = 0): unmasked, they would weigh 2^270 against an L near
    -270 and make dQ NaN (kernel_checks.negative_scores_check)."""
    checks.negative_scores_check(spec)


@pytest.mark.parametrize("spec", [SPECS[1], SPECS_128[1]], ids=lambda s: s.name)
def test_every_schedule_is_race_free(spec):
    """Producer-first, consumer-first, a seeded random order and the plain one, racecheck on."""
    checks.sm90_backward_check(spec)


def test_what_it_does_not_take_runs_the_sm80_backward():
    """A spec its backward refuses (named in the refusal) keeps the sm80 family's backward: the
    same kernels by name and threads as before it had one."""
    for spec, field in [(Spec(320, arch_family="sm90"), "head_dim"),
                        (Spec(128, dropout=True, arch_family="sm90", sm80_backward=True), "sm80_backward=True")]:
        assert field in sm90_backward_refusal(spec)
        assert SM90.backward_of(spec) is KERNEL_FAMILIES["sm80"].backward[0]
        assert render(spec).kernels.bwd_main.threads != sm90_backward_tiles(spec).threads
    assert render(SPECS[0]).kernels.bwd_main.threads == sm90_backward_tiles(SPECS[0]).threads == 384


def test_flash_attn_func_trains_on_it(monkeypatch):
    """The ops' path (FAGEN_ARCH_FAMILY=sm90 on the emulator): the gradients of a causal GQA call,
    by FlashAttention-2's rule (3x the same-dtype PyTorch error, the suite's floor)."""
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", "sm90")
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, n, h, 64, generator=generator).to(torch.bfloat16).requires_grad_()
               for n, h in ((170, 4), (140, 2), (140, 2)))
    out = fagen.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn(out.shape, generator=generator).to(out.dtype)
    out.backward(dout)
    exact = attention_gradients(*(t.detach().double() for t in (q, k, v, dout)), causal=True)
    same = attention_same_dtype(q.detach(), k.detach(), v.detach(), dout, causal=True)[1:]
    for name, grad, torch_grad in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), same):
        error = (grad.double() - exact[name]).abs().max().item()
        bound = 3 * (torch_grad.double() - exact[name]).abs().max().item() + 1e-5
        assert error <= bound, f"{name}: {error:.3g} > {bound:.3g}"


# Features together, at the head dims that take them: each compiles without a spill (the refusals
# keep the combinations that spilled, dropout or a mask_mod at d = 128, on the sm80 backward).
COMBINATIONS = [Spec(64, mask="causal", dropout=True, window=True, sinks=True, arch_family="sm90"),
                Spec(64, mask="causal", dropout=True, softcap=True, window=True, arch_family="sm90"),
                Spec(64, dropout=True, alibi=True, softcap=True, key_padding=True, arch_family="sm90"),
                _documents(mask="causal", dropout=True, varlen=True),
                _documents(mask="causal", key_padding=True),
                Spec(128, mask="causal", window=True, sinks=True, varlen=True, dtype="bf16", arch_family="sm90"),
                Spec(128, mask="causal", window=True, key_padding=True, arch_family="sm90"),
                # d128's score chains, at the register file's edge (the dQ writer's barrier moved once
                # to keep them spill-free)
                Spec(128, mask="causal", softcap=True, arch_family="sm90"),
                Spec(128, alibi=True, arch_family="sm90"),
                # deterministic: dQ's turns (the counter's pointer kept, the warpgroup's index not)
                Spec(128, mask="causal", deterministic=True, arch_family="sm90"),
                Spec(64, mask="causal", window=True, dropout=True, deterministic=True, arch_family="sm90"),
                # ... with a captured tensor's gradient in an order-free sum (fagen/exact_sum.cuh)
                Spec(64, mask="causal", deterministic=True, arch_family="sm90",
                     score_mod=custom_mod(trace_score_mod(relative_bias)))]


@pytest.mark.parametrize("spec", SPECS[:2] + SPECS_128 + COMBINATIONS, ids=lambda s: s.name)
def test_it_compiles_for_sm90a_without_spills(spec):
    """NVRTC for sm_90a: ptxas does not serialise its wgmma (C7510-C7520 raise), and the main kernel
    spills nothing within 384 threads' 168 registers (the consumers' setmaxnreg takes 240)."""
    source = check_sm90_kernel_compiles(spec, "bwd_main")
    assert source.kernels.bwd_main.shared_bytes == sm90_backward_tiles(spec).shared_bytes <= 227 * 1024

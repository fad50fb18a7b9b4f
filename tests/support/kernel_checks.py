"""Named kernel checks: the tests run them on fagen's own sources, the mutation harness
(tests/support/kernel_mutants.py) on mutated ones. Each raises (AssertionError or EmulationError) when
the kernel is wrong; `source` is a rendered source of `spec` (default: its own render).
"""

from __future__ import annotations

import contextlib
import os
import re
from unittest import mock

import torch

from fagen.kernels import attention_kernels
from fagen.kernels.render import Source, render
from fagen.spec import Spec
from kernel_cases import (DROPOUT_P, OFFSET, SEED, Shape, assert_no_atomic_calls, make_inputs,
                          run_and_check, uneven_lengths)

LARGE_LOGITS_QK_SCALE = 12.0   # q and k times 12: |S| reaches ~300 at d = 64
LARGE_LOGITS_SHAPE = Shape(1, 130, 150, heads=2, kv_heads=2)
OTHER_SOFTMAX_SCALES = (0.05, 0.4)
ATOMIC_SASS = re.compile(r"\b(RED|REDG|ATOM|ATOMS|ATOMG)\b")   # sm_90 has REDG and ATOMG


SM90_SCHEDULES = ("forward", "producer-first", "consumer-first", "random")


def sm90_pipeline_check(spec: Spec, source: Source | None = None) -> None:
    """The sm90 family's forward pipeline: four key tiles through its two stages (each stage reused,
    both parities of its barriers), a ragged last one, MQA, under the schedules that reorder the
    producer and the consumers, with the happens-before racecheck."""
    for schedule in SM90_SCHEDULES:
        with mock.patch.dict(os.environ, {"FAGEN_EMULATE_SCHEDULE": schedule, "FAGEN_EMULATE_SEED": "0",
                                          "FAGEN_EMULATE_RACECHECK": "1"}):
            run_and_check(spec, Shape(1, 150, 400, heads=2, kv_heads=1), backward=False, source=source)


def sm90_backward_check(spec: Spec, source: Source | None = None) -> None:
    """The sm90 family's backward pipeline (templates/sm90/hopper_bwd.cu.j2): five query blocks
    through its two Q/dO stages (each reused, both parities), two key blocks (the last ragged), a
    ragged last query block, MQA (the group's dK and dV summed by the op); and Nk > Nq, where a
    causal key block's walk has masked blocks on the diagonal, then unmasked ones (a ragged key
    block masks all); under the schedules that reorder the producer and the consumers, with the
    racecheck."""
    for schedule in SM90_SCHEDULES:
        with mock.patch.dict(os.environ, {"FAGEN_EMULATE_SCHEDULE": schedule, "FAGEN_EMULATE_SEED": "0",
                                          "FAGEN_EMULATE_RACECHECK": "1"}):
            for shape in (Shape(1, 300, 200, heads=2, kv_heads=1), Shape(1, 256, 320, heads=2, kv_heads=2)):
                run_and_check(spec, shape, source=source)


def negative_scores_check(spec: Spec, source: Source | None = None) -> None:
    """Every score of every row strongly negative (q along -u, k along u, a little noise): L in log2
    units near -270, so a key past Nk (S = 0 there: TMA's zeros) left unmasked would weigh about
    2^270, inf in fp32, and turn dQ into NaN. Nk = 150 leaves a ragged key block of 22 keys."""
    shape = Shape(1, 70, 150, heads=1, kv_heads=1)

    def directed(spec, shape, seed=0, **_):
        q, k, v, dout, seqlens_k = make_inputs(spec, shape, seed)
        u = torch.full((spec.head_dim,), 40.0 / spec.head_dim ** 0.5)   # q . k ~ -1600: S scale ~ -200
        return ((0.1 * q.float() - u).to(q.dtype), (0.1 * k.float() + u).to(k.dtype), v, dout, seqlens_k)

    with mock.patch("kernel_cases.make_inputs", directed):
        run_and_check(spec, shape, source=source)


def uneven_lengths_check(spec: Spec, source: Source | None = None) -> None:
    """Key lengths [Nk, Nk - 37, 1, 0]: causal aligns to each entry's own length."""
    for seqlen_q, seqlen_k in ((100, 150), (150, 100)):
        run_and_check(spec, Shape(4, seqlen_q, seqlen_k, heads=2, kv_heads=1), lengths=uneven_lengths(seqlen_k),
                      source=source)


def large_logits_check(spec: Spec, source: Source | None = None) -> None:
    run_and_check(spec, LARGE_LOGITS_SHAPE, qk_scale=LARGE_LOGITS_QK_SCALE, source=source)


def softmax_scale_check(spec: Spec, source: Source | None = None, *, backward: bool = True) -> None:
    for scale in OTHER_SOFTMAX_SCALES:
        run_and_check(spec, Shape(2, 97, 130, heads=2, kv_heads=1), softmax_scale=scale, backward=backward,
                      source=source)


def softmax_scale_forward_check(spec: Spec, source: Source | None = None) -> None:
    softmax_scale_check(spec, source, backward=False)


def ragged_check(spec: Spec, source: Source | None = None) -> None:
    """Lengths off every tile size, more keys than queries and fewer."""
    for shape in (Shape(1, 17, 200), Shape(2, 200, 17), Shape(1, 77, 131)):
        run_and_check(spec, shape, source=source)


def packed_forward_check(spec: Spec, source: Source | None = None) -> None:
    """Packed sequences (Spec.varlen), the forward: each sequence's O and L against the oracle on it
    alone (FlashAttention-2's rule), with an empty query sequence, Nq > Nk and Nq < Nk, GQA."""
    from fagen.reference import attention_gradients, attention_same_dtype
    from kernel_cases import ABS_FLOOR, OUTPUT_FACTOR, max_error

    lengths_q, lengths_k = [70, 0, 130, 33], [90, 40, 20, 33]
    gen = torch.Generator().manual_seed(7)
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    q = torch.randn(sum(lengths_q), 4, spec.head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(sum(lengths_k), 2, spec.head_dim, generator=gen).to(dtype) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (lengths_q, lengths_k))
    out, stats = attention_kernels.forward(source or render(spec), q, k, v,
                                           varlen=(cu_q, cu_k, max(lengths_q), max(lengths_k)))
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        if lq == 0:
            continue
        one = [t[None] for t in (q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]])]
        ref = attention_gradients(*one, torch.zeros_like(one[0]), causal=spec.causal)
        same = attention_same_dtype(*one, torch.zeros_like(one[0]), causal=spec.causal)[0]
        bound = OUTPUT_FACTOR * max_error(same, ref["out"]) + ABS_FLOOR
        assert max_error(out[cu_q[b]:cu_q[b + 1]][None], ref["out"]) <= bound, f"sequence {b}: O"
        finite = torch.isfinite(ref["lse"][0])
        assert torch.equal(torch.isfinite(stats[0][b, :, :lq]), finite), f"sequence {b}: rows with no key"
        assert max_error(stats[0][b, :, :lq][finite], ref["lse"][0][finite]) < 1e-3, f"sequence {b}: L"


def gqa_check(spec: Spec, source: Source | None = None) -> None:
    run_and_check(spec, Shape(2, 64, 80, heads=6, kv_heads=3), source=source)
    run_and_check(spec, Shape(1, 64, 80, heads=4, kv_heads=1), source=source)


def empty_rows_check(spec: Spec, source: Source | None = None) -> None:
    """More queries than keys, causal: the first rows see no key (run_and_check holds them to
    L = +inf exactly, FA-1 to m = -inf and l = 0)."""
    run_and_check(spec, Shape(1, 70, 20, heads=1, kv_heads=1), source=source)


def no_atomics_check(spec: Spec, source: Source | None = None, *, sass_arch: str | None = None) -> None:
    """A deterministic variant calls no atomic in its source and, with `sass_arch`, has no
    RED/ATOM instruction in its machine code."""
    source = render(spec) if source is None else source
    assert spec.deterministic
    assert_no_atomic_calls(source)
    if sass_arch:
        from fagen.kernels.compile import compile_source
        from fagen.sass.listing import disassemble

        sass = disassemble(*compile_source(source, sass_arch).cubins)
        found = sorted(set(ATOMIC_SASS.findall(sass)))
        assert not found, f"{spec.name} on {sass_arch}: atomic instructions {found}"


# Orders a repeat runs under: the emulator's block order (reversal reorders float atomics
# from different blocks into one dq element) with one OS thread, and with all of them.
# Seven K/V blocks add into each dq row: two addends commute exactly, more do not.
REPEAT_SHAPE = Shape(1, 150, 400, heads=2, kv_heads=1)
REPEAT_RUNS = ({"FAGEN_EMULATE_BLOCK_ORDER": "forward", "FAGEN_EMULATE_THREADS": "1"},
               {"FAGEN_EMULATE_BLOCK_ORDER": "reverse", "FAGEN_EMULATE_THREADS": "1"},
               {"FAGEN_EMULATE_BLOCK_ORDER": "reverse"})


def repeat_check(spec: Spec, source: Source | None = None, runs: tuple = REPEAT_RUNS,
                 shape: Shape = REPEAT_SHAPE) -> None:
    """Backward repeats are bit-identical (a deterministic variant), with the blocks run in
    opposite orders: a variant that accumulates dq with atomics fails it every time. `runs`: the
    emulator settings of each repeat."""
    source = render(spec) if source is None else source
    q, k, v, dout, seqlens_k = make_inputs(spec, shape)
    drop = attention_kernels.dropout_args(DROPOUT_P, SEED, OFFSET) if spec.dropout else None
    out, stats = attention_kernels.forward(source, q, k, v, dropout_p=DROPOUT_P if spec.dropout else 0.0, seed=SEED,
                                           philox_offset=OFFSET, seqlens_k=seqlens_k)
    grads = []
    for run in runs:
        with mock.patch.dict(os.environ, run):
            grads.append(attention_kernels.backward(source, q, k, v, out, stats, dout, dropout_args=drop,
                                                    seqlens_k=seqlens_k))
    for run, repeat in zip(runs[1:], grads[1:]):
        for name, first, again in zip(("dq", "dk", "dv"), grads[0], repeat):
            assert torch.equal(first.view(torch.int16), again.view(torch.int16)), (
                f"{spec.name}: {name} differs between block orders ({run})")


# The sm90 backward's deterministic dQ (its turns): one block resident, in grid order; then every
# block resident, started in reverse and interleaved at their waits in a fixed order. A sum whose
# order follows the blocks' differs between the two; a turn that waits on a later block deadlocks
# the first.
TURN_RUNS = ({"FAGEN_EMULATE_BLOCK_ORDER": "forward", "FAGEN_EMULATE_THREADS": "1",
              "FAGEN_EMULATE_BLOCK_INTERLEAVE": "serial"},
             {"FAGEN_EMULATE_BLOCK_ORDER": "reverse", "FAGEN_EMULATE_THREADS": "64",
              "FAGEN_EMULATE_BLOCK_INTERLEAVE": "serial"})


def sm90_turns_check(spec: Spec, source: Source | None = None) -> None:
    """dQ, dK and dV the same bits in both of TURN_RUNS (REPEAT_SHAPE: eight partials per query block)."""
    repeat_check(spec, source, runs=TURN_RUNS)


# Every order a deterministic backward must not depend on: TURN_RUNS's two, the second with the
# blocks' threads producer-first; every block resident, started in reverse and running in parallel,
# consumer-first; two resident in parallel under a random thread schedule.
SCHEDULE_RUNS = (TURN_RUNS[0], {**TURN_RUNS[1], "FAGEN_EMULATE_SCHEDULE": "producer-first"},
                 {"FAGEN_EMULATE_BLOCK_ORDER": "reverse", "FAGEN_EMULATE_THREADS": "64",
                  "FAGEN_EMULATE_BLOCK_INTERLEAVE": "parallel", "FAGEN_EMULATE_SCHEDULE": "consumer-first"},
                 {"FAGEN_EMULATE_BLOCK_ORDER": "forward", "FAGEN_EMULATE_THREADS": "2",
                  "FAGEN_EMULATE_BLOCK_INTERLEAVE": "parallel", "FAGEN_EMULATE_SCHEDULE": "random",
                  "FAGEN_EMULATE_SEED": "5"})


def op_gradients(call, family: str, runs: tuple = SCHEDULE_RUNS) -> list[tuple]:
    """call() -> (out, leaves), an op's call on the emulator, under each of `runs` with `family`'s
    kernels (FAGEN_ARCH_FAMILY): the leaves' gradients of one fixed dout."""
    found = []
    for run in runs:
        with mock.patch.dict(os.environ, {**run, "FAGEN_ARCH_FAMILY": family}):
            out, leaves = call()
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
            found.append(torch.autograd.grad(out, leaves, dout))
    return found


def differing(found: list[tuple], names: tuple, runs: tuple = SCHEDULE_RUNS) -> list[str]:
    """The gradients (by name) of op_gradients' later runs whose bits differ from the first run's."""
    return [f"{name} ({run})" for run, grads in zip(runs[1:], found[1:])
            for name, first, again in zip(names, found[0], grads) if not torch.equal(first, again)]


# -- variants -----------------------------------------------------------------------------------------

VARIANT_SHAPE = Shape(2, 150, 170, heads=2, kv_heads=1)
# Packed documents whose boundaries fall inside tiles and on them.
DOCUMENTS = torch.tensor([[0] * 64 + [1] * 7 + [2] * 41 + [3] * 58, [4] * 32 + [5] * 100 + [6] * 38],
                         dtype=torch.int32)


def document_mask(b, h, q_idx, kv_idx):
    return DOCUMENTS[b, q_idx] == DOCUMENTS[b, kv_idx]


CUSTOM_MASKS = {"documents": document_mask}


def builtin_variant(spec: Spec) -> dict:
    """flash_attn_func's keywords for a spec's built-ins (values chosen so each one matters)."""
    variant = {}
    if spec.window:
        variant["window_size"] = (20, 7)
    if spec.softcap:
        variant["softcap"] = 2.5
    if spec.alibi:
        variant["alibi_slopes"] = torch.tensor([0.25, 0.0625])
    if spec.sinks:
        variant["sinks"] = torch.tensor([0.5, -1.0])
    return variant


def variant_check(spec: Spec, source: Source | None = None) -> None:
    """The variant's outputs and gradients (L's too) against the oracle on a ragged GQA shape;
    a custom mask_mod must be one of CUSTOM_MASKS."""
    from fagen.variants import custom_mod, trace_mask_mod
    from variant_cases import run_variant_case

    variant = builtin_variant(spec)
    if spec.mask_mod is not None:
        (variant["mask_mod"],) = [fn for fn in CUSTOM_MASKS.values()
                                  if custom_mod(trace_mask_mod(fn)) == spec.mask_mod]
    base = spec.replace(window=False, softcap=False, alibi=False, sinks=False, score_mod=None, mask_mod=None)
    run_variant_case(base, VARIANT_SHAPE, variant, source=source)


# -- decoding against a KV cache ----------------------------------------------------------------

@contextlib.contextmanager
def decode_steps_run(spec: Spec, source: Source | None):
    """Inside: every decoding step `flash_attn_with_kvcache` plans runs `source` (default: the
    spec's own render), and must build `spec` to get it (an sm90 spec with FAGEN_ARCH_FAMILY=sm90);
    no plan of an earlier step is reused."""
    from fagen.ops import kvcache

    source = render(spec) if source is None else source

    def step_source(built: Spec) -> Source:
        assert built == spec, f"the case builds {built.name}, not {spec.name}"
        return source

    family = {"FAGEN_ARCH_FAMILY": spec.arch_family} if spec.arch_family != "sm80" else {}
    with mock.patch.object(kvcache, "source_for", step_source), mock.patch.object(kvcache, "_plans", {}), \
            mock.patch.dict(os.environ, family):
        yield


def kv_cache_check(spec: Spec, source: Source | None = None) -> None:
    """A decoding step through `flash_attn_with_kvcache` with `source` as the step's kernels: the
    append (with rotary), the attention over the cache in three splits merged by the combine
    kernel, and the cache left behind, against the oracle (tests/support/kvcache_cases.py). A paged spec
    runs a paged cache of pages of 48 rows (three 16-key tiles each: a tile past a page's first
    row is read too); a contiguous one takes cache_batch_idx and leftpad."""
    from kvcache_cases import Case, check_call

    dims = dict(head_dim=spec.head_dim, head_dim_v=spec.head_dim_v)
    if spec.kv_cache == "paged":
        case, rotary = Case(nq=2, new=2, page=48, capacity=96, seed=11, **dims), (32, False)
    else:
        case, rotary = Case(nq=2, new=2, batch_idx=True, leftpad=True, seed=12, **dims), (32, True)
    with decode_steps_run(spec, source):
        check_call(case, causal=spec.causal, rotary=rotary, num_splits=3)


def checked_kv_cache_check(spec: Spec, source: Source | None = None) -> None:
    """kv_cache_check in the emulator's checked build (AddressSanitizer): a write past a tensor's
    end stops the step at that access, before it corrupts the host process's memory."""
    with mock.patch.dict(os.environ, {"FAGEN_EMULATE_CHECKED": "1"}):
        kv_cache_check(spec, source)


def long_cache_check(spec: Spec, source: Source | None = None) -> None:
    """Long entries in three splits (kvcache_cases.check_long_cache: several tiles per split): a
    contiguous spec through cache_batch_idx and leftpad, a paged one in pages of 48 rows with two
    causal queries per head."""
    from kvcache_cases import check_long_cache

    with decode_steps_run(spec, source):
        if spec.kv_cache == "paged":
            check_long_cache(3, page=48, nq=2, causal=True)
        else:
            check_long_cache(3)


def mla_check(spec: Spec, source: Source | None = None) -> None:
    """Absorbed MLA decoding (Spec.v_from_k): one cache of 576-wide rows whose first 512 columns
    are V, paged (64-row pages) with two splits, the step's kernels `source`."""
    from kvcache_cases import check_mla

    with decode_steps_run(spec, source):
        check_mla(page=64 if spec.kv_cache == "paged" else None, num_splits=2)


def paged_varlen_check(spec: Spec, source: Source | None = None) -> None:
    """Packed queries over a paged cache (flash_attn_varlen_func with a block_table, whose spec is
    `spec` and kernels `source`): ragged and empty sequences in pages of 16, a window, the softcap
    and ALiBi, causal, each sequence against the oracle (tests/support/varlen_paged_cases.py)."""
    import fagen
    from fagen.ops import varlen as varlen_ops
    from varlen_paged_cases import LENGTHS_K, LENGTHS_Q, check_against_the_oracle, cu, paged

    source = render(spec) if source is None else source

    def step_source(built: Spec) -> Source:
        assert built == spec, f"the case builds {built.name}, not {spec.name}"
        return source

    variant = {"window_size": (9, 0), "softcap": 20.0, "alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05])}
    q, k, v, table = paged(16, seed=16)
    with mock.patch.object(varlen_ops, "source_for", step_source), \
            mock.patch.dict(os.environ, {"FAGEN_ARCH_FAMILY": spec.arch_family}):
        out, lse = fagen.flash_attn_varlen_func(q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), max(LENGTHS_Q),
                                                max(LENGTHS_K), causal=True, block_table=table, return_lse=True,
                                                **variant)
    check_against_the_oracle(out, lse, q, k, v, table, True, variant)


def table_width_check(spec: Spec, source: Source | None = None) -> None:
    """Keys past the pages of a row of a one-column block table (issue 42), refused by the kernels'
    guard (max_pages): for a decoding spec, flash-attn's case through `flash_attn_with_kvcache` in
    pages of 48 (cache_seqlens 49, no append: only the attention's guard sees it); for every paged
    spec, the forward alone told of two pages' keys (kvcache_cases.forward_past_the_table: packed
    sequences reach the guard only so, the host bounding max_seqlen_k by the table)."""
    import fagen
    from kvcache_cases import forward_past_the_table, one_column, refused_past_the_table, table_seqlens

    source = render(spec) if source is None else source
    if not spec.varlen:
        case = one_column(48)
        with decode_steps_run(spec, source):
            refused_past_the_table(lambda: fagen.flash_attn_with_kvcache(
                case.q, case.k_cache, case.v_cache, causal=spec.causal, num_splits=2,
                **case.kwargs(cache_seqlens=table_seqlens(case, 1))), f"{spec.name}: a decoding step")
    forward_past_the_table(spec, source)


def packed_window_check(spec: Spec, source: Source | None = None) -> None:
    """One query per head, a window (5, 0) and two query heads per K/V head (GQA packing): every
    head of an entry sees the same last six keys, whatever row of the tile it was packed into."""
    from kvcache_cases import Case, check_call

    with decode_steps_run(spec, source):
        check_call(Case(nq=1, seed=14), num_splits=2, window_size=(5, 0))

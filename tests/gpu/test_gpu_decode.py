"""Decoding (`flash_attn_with_kvcache`) and paged prefill on a real GPU: the same cases as the
emulator's (tests/support/kvcache_cases.py), checked against the float64 oracle, and the emulator's
result for the same call, plus a decoding step captured in a CUDA graph (no host read: the kernels'
guards check the index values) and replayed at new lengths.

Marked `gpu` and skipped without CUDA; the GPU check's correctness section runs them.
FAGEN_GPU_TESTS_DEVICE=cpu runs them through the emulator instead (the CUDA graph's capture and
replay as a step run with host reads refused).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import fagen
from fagen.bench.gpu_cases import DECODE_CASES, DECODE_GRAPH_CASE
from fagen.dtypes import TORCH_DTYPE
from host_reads import no_host_reads
from kvcache_cases import Case, check_call, rotary_tables

DEVICE = os.environ.get("FAGEN_GPU_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def case_of(args: dict) -> Case:
    """tests/kvcache_cases.Case from a gpu_cases entry (dtypes named as fagen names them)."""
    return Case(**{**args, **({"dtype": TORCH_DTYPE[args["dtype"]]} if "dtype" in args else {})})


def fp32_slack(case: Case) -> float:
    """How far the GPU's fp32 result may be from the emulator's before the 16-bit rounding, on the
    same input bits. Each p = 2^x is an ex2.approx (relative error at most 2^-22, PTX ISA) where the
    emulator calls exp2f, of an x that FMA contraction may round differently (an fp32 ulp of |x| at
    most, so a relative ln 2 2^-24 |x| in p; |x| <= log2(e) d max|q| max|k| / sqrt(d)); twice, for
    the split-KV merge's rescaling. Contraction and another accumulation order (the split count may
    differ: the heuristic sees other SMs) reorder sums of at most N = capacity + new terms: at most
    (N + 2) 2^-24 of their absolute sum. out = sum_j p_j v_j / sum_j p_j: all relative to max|v|."""
    d = case.q.shape[-1]
    keys = case.k_cache if case.k is None else torch.cat([case.k_cache.flatten(), case.k.flatten()])
    values = case.v_cache if case.v is None else torch.cat([case.v_cache.flatten(), case.v.flatten()])
    x = math.log2(math.e) * d ** 0.5 * case.q.abs().max().item() * keys.abs().max().item()
    per_p = 2.0 ** -22 + math.log(2) * 2.0 ** -24 * x
    n = case.capacity + (0 if case.k is None else case.k.shape[1])
    return (2 * 2 * per_p + (n + 2) * 2.0 ** -24) * values.abs().max().item()


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_matches_the_oracle_and_the_emulator(name):
    case_args, call_args = DECODE_CASES[name]
    gpu_case, emulated_case = case_of(case_args), case_of(case_args)
    on_gpu = check_call(gpu_case, device=DEVICE, **call_args)[0]   # each within FA-2's rule of the oracle
    emulated = check_call(emulated_case, device="cpu", **call_args)[0]
    if call_args.get("rotary") is not None:
        # The rotary rounds q and the new keys to the 16-bit type from fp32 values that FMA
        # contraction changes, so a tie may round the other way on the GPU: the two calls then solve
        # two roundings of the problem, and FA-2's rule against the oracle (above) is the bound.
        return
    # The same bits in and the same kernels: the fp32 results differ by the GPU's own rounding
    # (fp32_slack), and their 16-bit roundings by at most one ulp more (eps |out|). A fixed 2e-3 was
    # below one bf16 ulp at |out| ~ 1 (3.9e-3).
    limit = torch.finfo(gpu_case.dtype).eps * emulated.float().abs() + fp32_slack(gpu_case)
    gap = (on_gpu.float() - emulated.float()).abs()
    assert bool((gap <= limit).all()), f"{gap.max().item():.3g} apart, beyond one ulp + {fp32_slack(gpu_case):.2g}"


def capture(step):
    """(the step's outputs, replay): a CUDA graph on a GPU. The emulator has no graphs: there the
    step runs again on replay, with every host read refused (what capture refuses), into the
    captured outputs; the test's own logic runs as on the GPU."""
    if DEVICE == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        return out, graph.replay
    with no_host_reads():
        out = step()

    def replay():
        with no_host_reads():
            for captured, fresh in zip(out, step()):
                captured.copy_(fresh)
    return out, replay


def test_a_decoding_step_captured_in_a_cuda_graph_replays_new_lengths_as_eager():
    """Append + rotary + split-KV + combine, captured once (no host read of cache_seqlens or the
    block table: the kernels' guards check them) and replayed at new lengths written into the
    captured cache_seqlens: each replay equals an eager step on a copy of the cache it started
    from, its output and the cache it leaves, bit for bit (the same kernels and split count)."""
    case_args, call_args = DECODE_GRAPH_CASE
    case = case_of(case_args)
    q, k_new, v_new = (t.to(DEVICE) for t in (case.q, case.k, case.v))
    k_cache, v_cache, table = case.k_cache.to(DEVICE), case.v_cache.to(DEVICE), case.block_table.to(DEVICE)
    cos, sin = (t.to(DEVICE) for t in rotary_tables(case.capacity, 32, case.dtype))
    seqlens = case.seqlens.to(DEVICE)
    args = dict(rotary_cos=cos, rotary_sin=sin, block_table=table, causal=True, return_softmax_lse=True, **call_args)
    step = lambda: fagen.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,  # noqa: E731
                                                 cache_seqlens=seqlens, **args)
    step()   # compile, load and warm outside the graph
    out, replay = capture(step)
    for lengths in ([40, 0, 90], [41, 1, 91], [7, 126, 0]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        replay()
        eager = fagen.flash_attn_with_kvcache(q, k_before, v_before, k_new, v_new, cache_seqlens=seqlens.clone(),
                                              **args)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        for got, expected in zip(out, eager):
            assert torch.equal(got, expected), lengths
        assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before), lengths

"""Decoding (`flash_attn_with_kvcache`) and paged prefill on a real GPU: the same cases as the
emulator's (tests/kvcache_cases.py), checked against the float64 oracle, and the emulator's
result for the same call, plus a decoding step captured in a CUDA graph (its value checks are
skipped under capture) and replayed.

Marked `gpu` and skipped without CUDA; the GPU check's correctness section runs them.
FAGEN_GPU_TESTS_DEVICE=cpu runs them through the emulator instead.
"""

from __future__ import annotations

import os

import pytest
import torch

import fagen
from kvcache_cases import Case, check_call, run_call

DEVICE = os.environ.get("FAGEN_GPU_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = {
    "contiguous, no append, split 3": (dict(), dict(num_splits=3)),
    "append + rotary, causal, heuristic": (dict(nq=3, new=3, seed=1), dict(causal=True, rotary=(32, True))),
    "paged 16, append + rotary, split 2": (dict(nq=2, new=2, page=16, seed=2),
                                           dict(causal=True, rotary=(64, False), num_splits=2)),
    "batch_idx + leftpad, bf16": (dict(dtype=torch.bfloat16, nq=2, new=2, batch_idx=True, leftpad=True, seed=4),
                                  dict(causal=True, rotary=(16, True), num_splits=3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_the_oracle_and_the_emulator(name):
    case_args, call_args = CASES[name]
    on_gpu = check_call(Case(**case_args), device=DEVICE, **call_args)
    emulated = run_call(Case(**case_args), "cpu", call_args.get("causal", False), call_args.get("rotary"),
                        call_args.get("num_splits", 1), {})
    # Same inputs, same kernels; the split count may differ (the heuristic sees other SMs).
    torch.testing.assert_close(on_gpu[0], emulated[0], atol=2e-3, rtol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_a_decoding_step_captured_in_a_cuda_graph_replays():
    case = Case(new=1, page=16, seed=5)
    q, k_new, v_new = (t.cuda() for t in (case.q, case.k, case.v))
    k_cache, v_cache, table = case.k_cache.cuda(), case.v_cache.cuda(), case.block_table.cuda()
    seqlens = case.seqlens.cuda()
    step = lambda: fagen.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,  # noqa: E731
                                                 block_table=table, num_splits=2)
    step()   # compile, load and warm outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    seqlens += 1   # the next step: the replay reads the new lengths from the tensor
    k_before, v_before = k_cache.clone(), v_cache.clone()
    graph.replay()
    eager = fagen.flash_attn_with_kvcache(q, k_before, v_before, k_new, v_new, cache_seqlens=seqlens,
                                          block_table=table, num_splits=2)
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)

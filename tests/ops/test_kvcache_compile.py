"""flash_attn_with_kvcache under torch.compile (issue 26, section 1): one custom op,
fagen::flash_attn_with_kvcache, with a fake implementation and declared writes to the caches.

A step with an append, rotary, a paged (or a contiguous, indexed and left-padded) cache and two
splits traces with no graph break, and its compiled runs equal the eager ones bit for bit: the
outputs and the caches they leave, step after step with new cache_seqlens values.
"""

import pytest
import torch

import fagen
from fagen.ops.kvcache import _step_op
from kvcache_cases import Case, rotary_tables

LAYOUTS = {"paged": dict(page=16), "contiguous": dict(batch_idx=True, leftpad=True)}


def _step(cos, sin):
    def step(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table):
        return fagen.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                             cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                                             cache_leftpad=cache_leftpad, block_table=block_table, causal=True,
                                             num_splits=2, return_softmax_lse=True)
    return step


def _args(case):
    return (case.q, case.k_cache, case.v_cache, case.k, case.v, case.seqlens, case.batch_idx, case.leftpad,
            case.block_table)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_compiles_without_graph_breaks_and_equals_eager(layout):
    torch._dynamo.reset()
    eager_case, compiled_case = (Case(nq=1, new=1, seed=60, **LAYOUTS[layout]) for _ in range(2))
    cos, sin = rotary_tables(eager_case.capacity, 32, eager_case.dtype)
    step = _step(cos, sin)
    explained = torch._dynamo.explain(step)(*_args(Case(nq=1, new=1, seed=60, **LAYOUTS[layout])))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for _ in range(2):   # the second step appends after the first, at the new lengths
        expected, got = step(*_args(eager_case)), compiled(*_args(compiled_case))
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert torch.equal(compiled_case.k_cache, eager_case.k_cache)
        assert torch.equal(compiled_case.v_cache, eager_case.v_cache)
        for case in (eager_case, compiled_case):
            case.seqlens += 1


def test_inductor_writes_the_callers_cache_as_eager_does():
    """Inductor's own handling of the declared mutation (reinplaced or copied back)."""
    torch._dynamo.reset()
    eager_case, compiled_case = (Case(nq=1, new=1, seed=61, page=16) for _ in range(2))
    cos, sin = rotary_tables(eager_case.capacity, 32, eager_case.dtype)
    step = _step(cos, sin)
    expected, got = step(*_args(eager_case)), torch.compile(step, fullgraph=True)(*_args(compiled_case))
    assert torch.equal(got[0], expected[0]) and torch.equal(compiled_case.k_cache, eager_case.k_cache)


def test_the_custom_op_passes_opcheck():
    """Schema (it writes exactly k_cache and v_cache), fake implementation, autograd registration."""
    case = Case(nq=1, new=1, seed=62, page=16)
    args = (case.q, case.k_cache, case.v_cache, case.k, case.v, None, None, case.seqlens, None, None, None,
            case.block_table, None, True, -1, -1, 0.0, True, None, 2)
    torch.library.opcheck(_step_op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))

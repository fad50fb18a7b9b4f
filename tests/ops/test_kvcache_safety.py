"""The KV cache's safety and flash-attn compatibility (issue 25, items 10 and 11) on the emulator.

An append is an in-place write: it bumps the caches' version counters and refuses memory that
two written elements share, as torch's in-place ops do. Inputs that require grad run the
forward (as in flash-attn) and only a backward raises. A head_dim that is not a multiple of 8
runs on padded copies and copies the appended rows back last, so a failed call leaves the
caller's cache as it was. window_size takes any integer scalars; input errors are both
ValueError and RuntimeError (flash-attn's tests catch RuntimeError).
"""

import numpy as np
import pytest
import torch

import fagen
from fagen.kernels import kv_kernels
from fagen.ops.variant_args import variant_call
from kvcache_cases import D, Case, check_call


def _step(case, q=None, **extra):
    return fagen.flash_attn_with_kvcache(case.q if q is None else q, case.k_cache, case.v_cache,
                                         return_softmax_lse=True, **case.kwargs(**extra))


# -- item 10: the in-place append ------------------------------------------------------------------

def test_an_append_bumps_the_caches_version_counters():
    """As after torch's own in-place ops, a backward that saved the cache's old values raises."""
    case = Case(new=1, seed=20)
    w = torch.ones_like(case.k_cache, requires_grad=True)
    y = (case.k_cache * w).sum()   # saves k_cache for w's gradient
    versions = case.k_cache._version, case.v_cache._version
    _step(case)
    assert case.k_cache._version > versions[0] and case.v_cache._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def _expanded(case):
    base = case.k_cache[:1].clone()
    return dict(k_cache=base.expand_as(case.k_cache)), (base,)


def _shared(case):
    return dict(v_cache=case.k_cache), ()


@pytest.mark.parametrize("overlap, message", [(_expanded, "more than one element .* single memory location"),
                                              (_shared, "k_cache and v_cache share memory")])
def test_an_overlapping_cache_is_refused_before_anything_is_written(overlap, message):
    case = Case(new=2, seed=21)
    change, extra = overlap(case)
    args = {**dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, **case.kwargs()), **change}
    before = [t.clone() for t in (args["k_cache"], args["v_cache"], *extra)]
    with pytest.raises(ValueError, match=message):
        fagen.flash_attn_with_kvcache(**args)
    for t, was in zip((args["k_cache"], args["v_cache"], *extra), before):
        assert torch.equal(t, was)


def test_interleaved_slices_of_one_buffer_are_two_caches():
    """kv[:, :, 0] and kv[:, :, 1] share a buffer but no element: accepted, as torch accepts them."""
    case = Case(nq=2, new=2, seed=22)
    kv = torch.stack([case.k_cache, case.v_cache], dim=2)   # (B, N, 2, Hk, d)
    case.k_cache, case.v_cache = kv[:, :, 0], kv[:, :, 1]
    check_call(case, causal=True)


def test_a_cache_that_requires_grad_is_refused_for_an_append():
    """torch refuses an in-place write to a leaf that requires grad (fagen also under no_grad)."""
    case = Case(new=1, seed=23)
    case.k_cache.requires_grad_(True)
    before = case.k_cache.detach().clone()
    for grad_mode in (torch.enable_grad, torch.no_grad):
        with grad_mode(), pytest.raises(ValueError, match="k_cache requires grad"):
            _step(case)
    assert torch.equal(case.k_cache.detach(), before)


def test_q_that_requires_grad_runs_the_forward_and_refuses_a_backward():
    case, twin = Case(nq=2, new=2, seed=24), Case(nq=2, new=2, seed=24)
    with torch.no_grad():
        expected, expected_lse = _step(twin)
    q = case.q.clone().requires_grad_(True)
    out, lse = _step(case, q=q)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert torch.equal(case.k_cache, twin.k_cache) and torch.equal(case.v_cache, twin.v_cache)
    assert out.requires_grad and lse.requires_grad
    with pytest.raises(RuntimeError, match="flash_attn_with_kvcache is forward only"):
        out.float().sum().backward()
    assert q.grad is None


def test_without_autograd_no_function_is_recorded(monkeypatch):
    """no_grad, inference_mode, and inputs that need no grad: the call as is, no autograd Function."""
    from fagen import errors

    def refuse(*args):
        raise AssertionError("an autograd Function where autograd records nothing")

    monkeypatch.setattr(errors._ForwardOnly, "apply", refuse)
    case = Case(seed=25)
    q = case.q.clone().requires_grad_(True)
    with torch.no_grad():
        assert _step(case, q=q)[0].grad_fn is None
    with torch.inference_mode():
        assert _step(case, q=case.q)[0].grad_fn is None
    assert _step(case)[0].grad_fn is None


# -- item 11: head dims that are not a multiple of 8 -----------------------------------------------

@pytest.mark.parametrize("layout", [dict(batch_idx=True, leftpad=True), dict(page=16)], ids=["contiguous", "paged"])
def test_head_dim_59_is_padded_and_the_appended_rows_land_in_the_callers_cache(layout):
    """check_call checks the caller's cache (appended rows equal the oracle's, the rest untouched
    bit for bit) and each entry's output (the caller's d) against the float64 oracle at scale
    1 / sqrt(59)."""
    case = Case(nq=2, new=2, head_dim=59, seed=26, **layout)
    versions = case.k_cache._version, case.v_cache._version
    out, _ = check_call(case, causal=True, rotary=(32, False), num_splits=2)
    assert out.shape == case.q.shape
    assert case.k_cache._version > versions[0] and case.v_cache._version > versions[1]


def test_a_failure_after_padding_leaves_the_callers_cache_as_it_was(monkeypatch):
    """The append lands in the padded copies; the forward fails; the caller's cache is untouched
    (bit for bit, and never written: its version counter has not moved)."""
    def fail(*args, **kwargs):
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(kv_kernels, "bind_kv_cache", fail)   # the step's attention, after its append
    case = Case(new=2, head_dim=59, page=16, seed=27)
    before = case.k_cache.clone(), case.v_cache.clone()
    versions = case.k_cache._version, case.v_cache._version
    with pytest.raises(RuntimeError, match="injected"):
        _step(case)
    assert torch.equal(case.k_cache, before[0]) and torch.equal(case.v_cache, before[1])
    assert (case.k_cache._version, case.v_cache._version) == versions


# -- item 11: window_size's scalars, and errors catchable as flash-attn's --------------------------

def test_window_size_takes_integer_scalars_of_any_kind():
    """flash-attn's tests draw window_size with torch.randint(0, n, (2,)) or NumPy."""
    case = Case(nq=2, seed=28)
    expected = _step(case, window_size=(20, 0), causal=True)
    for window in (torch.tensor([20, 0]), np.array([20, 0]), (np.int64(20), np.int32(0)), (torch.tensor(20), 0)):
        got = _step(case, window_size=window, causal=True)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), repr(window)


@pytest.mark.parametrize("window", [(True, 0), (20.0, 0), torch.tensor([20.0, 0.0]), (np.bool_(True), 0),
                                    torch.tensor([1, 2, 3]), (-2, 0), 20], ids=repr)
def test_window_size_refuses_what_is_not_a_pair_of_ints(window):
    q = torch.zeros(1, 2, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="window_size must be a pair"):
        variant_call(q, q, causal=False, window_size=window)


def test_a_python_int_window_traces_without_graph_breaks():
    torch._dynamo.reset()

    def window_left(q):
        return q * variant_call(q, q, causal=False, window_size=(3, 0)).values["window_left"]

    q = torch.ones(1, 2, 2, 8)
    assert torch.equal(torch.compile(window_left, fullgraph=True, backend="eager")(q), 3 * q)


@pytest.mark.parametrize("seqlens", [torch.tensor([37, 0, 128], dtype=torch.int32), 128], ids=["tensor", "int"])
def test_an_out_of_range_cache_seqlens_with_a_block_table_raises_what_flash_attn_raises(seqlens):
    """flash-attn's test: pytest.raises(RuntimeError, match="block_table"); Python code catches
    ValueError."""
    case = Case(new=1, page=16, seed=29)
    before = case.k_cache.clone()
    for error in (RuntimeError, ValueError):
        with pytest.raises(error, match="cache_seqlens.*block_table"):
            _step(case, cache_seqlens=seqlens)
    assert torch.equal(case.k_cache, before)


def test_input_errors_of_packed_sequences_are_runtime_errors_too():
    q = torch.zeros(4, 2, D, dtype=torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="max_seqlen_q"):
        fagen.flash_attn_varlen_func(q, q, q, cu, cu, 2, 4)

"""A warm dense call (issue 26 §5): a call with no tensors of its own beyond q, k, v (no
seqlens_k, dropout or variant) whose signature was seen reuses its checked options and values
(ops.dense.DenseCall). These tests pin what that must not change: results equal a fresh call's
bit for bit, and every argument the checks refuse is refused after a warm call too."""

import pytest
import torch

import fagen
from fagen.ops import autograd, dense
from call_counts import count_calls


@pytest.fixture
def checks(monkeypatch):
    """Counts `_checked_call` (the checks, the options and values of a call), from no kept calls."""
    monkeypatch.setattr(dense, "_calls", {})
    return count_calls(monkeypatch, dense, "_checked_call")


def _inputs(head_dim=64, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 40, 2, head_dim, generator=gen).half().requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("head_dim", [64, 60], ids=["d64", "d60-padded"])
def test_a_warm_call_equals_a_fresh_one_forward_and_backward(checks, head_dim):
    results = []
    for _ in range(3):
        if len(results) == 2:
            dense._calls.clear()   # the third call checks afresh
        q, k, v = _inputs(head_dim, requires_grad=True)
        out, lse = fagen.flash_attn_func(q, k, v, causal=True, return_lse=True)
        (out.float().square().sum() + lse.sum()).backward()
        results.append((out, lse, q.grad, k.grad, v.grad))
    assert len(checks) == 2
    for warm, fresh in zip(results[1], results[2]):
        assert torch.equal(warm, fresh)


@pytest.mark.parametrize("kv_heads, version", [(2, 2), (1, 2), (2, 1)], ids=["mha", "gqa", "fa1"])
def test_a_warm_backward_without_a_gradient_of_l_equals_a_fresh_one(checks, kv_heads, version):
    """The warm path of a plain call (attention_kernels.Memo.forward / Memo.backward: kept plans, no gradient of
    L), with GQA's dK and dV summed over each group and FlashAttention-1's statistics, against the
    general path of a call checked afresh."""
    results = []
    for _ in range(3):
        if len(results) == 2:
            dense._calls.clear()   # the third call checks and plans afresh
        gen = torch.Generator().manual_seed(3)
        q = torch.randn(1, 40, 2, 64, generator=gen).half().requires_grad_()
        k, v = (torch.randn(1, 40, kv_heads, 64, generator=gen).half().requires_grad_() for _ in range(2))
        out = fagen.flash_attn_func(q, k, v, causal=True, version=version)
        out.float().square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    assert len(checks) == 2
    for warm, fresh in zip(results[1], results[2]):
        assert torch.equal(warm, fresh)


def test_an_eager_call_skips_function_apply_s_python_wrapper_with_the_same_gradients(monkeypatch):
    """autograd._apply (torch's C++ apply where no functorch transform is active) against
    Attention.apply itself, with a variant tensor that takes a gradient (sinks)."""
    wrapper_calls = []
    apply = autograd.Attention.apply
    monkeypatch.setattr(autograd.Attention, "apply", staticmethod(lambda *a: wrapper_calls.append(1) or apply(*a)))
    results = []
    for eager_apply in (autograd._apply, autograd.Attention.apply):
        monkeypatch.setattr(autograd, "_apply", eager_apply)
        q, k, v = _inputs(requires_grad=True)
        sinks = torch.linspace(-1.0, 1.0, 2).requires_grad_()
        out = fagen.flash_attn_func(q, k, v, causal=True, sinks=sinks)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v, sinks))))
    assert wrapper_calls == [1]   # the second pass only
    for fast, wrapped in zip(*results):
        assert torch.equal(fast, wrapped)


def test_the_eager_apply_hands_the_call_to_functorch_while_a_transform_is_active(monkeypatch):
    seen = []
    monkeypatch.setattr(torch._C, "_are_functorch_transforms_active", lambda: True)
    monkeypatch.setattr(autograd.Attention, "apply", staticmethod(lambda *a: seen.append(a) or "functorch's"))
    assert autograd._eager_apply()("q", "k", "v", "prepared", "sinks") == "functorch's"
    assert seen == [("q", "k", "v", "prepared", "sinks")]


@pytest.mark.parametrize("change, message", [
    (dict(causal=1), "causal must be True or False"),
    (dict(softmax_scale=-1.0), "softmax_scale must be a positive finite float"),
    (dict(dropout_p=1.5), "dropout_p"),
    (dict(version=3), "version must be 1 or 2"),
], ids=["causal-int", "negative-scale", "dropout-p", "version"])
def test_what_the_checks_refuse_is_refused_after_a_warm_call(checks, change, message):
    q, k, v = _inputs()
    fagen.flash_attn_func(q, k, v, causal=True, softmax_scale=0.5)
    with pytest.raises((ValueError, TypeError), match=message):
        fagen.flash_attn_func(q, k, v, **{"causal": True, "softmax_scale": 0.5, **change})


def test_other_tensors_are_checked_again(checks):
    q, k, v = _inputs()
    fagen.flash_attn_func(q, k, v)
    with pytest.raises(TypeError, match="must share a dtype"):
        fagen.flash_attn_func(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match="same head_dim"):
        fagen.flash_attn_func(q, k[..., :32], v[..., :32])
    assert len(checks) == 3


def test_calls_with_tensors_of_their_own_are_not_kept(checks):
    """seqlens_k, dropout's Philox pair and a variant's values are the call's: each call checks."""
    q, k, v = _inputs()
    lengths = torch.tensor([30], dtype=torch.int32)
    for _ in range(2):
        fagen.flash_attn_func(q, k, v, seqlens_k=lengths)
        fagen.flash_attn_func(q, k, v, dropout_p=0.1)
        fagen.flash_attn_func(q, k, v, window_size=(8, 0))
    assert len(checks) == 6 and dense._calls == {}


def test_one_signature_aligned_then_copied_into_alignment_and_back(checks):
    """Views with one signature (shape, strides, dtype) whose rows start aligned or not: a
    misaligned one reaches the kernels as an aligned copy with other strides (common.aligned_rows),
    so the call's kept launch plans (attention_kernels.Memo) must tell them apart. Each call equals the same
    call on contiguous copies, forward and backward, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(1 * 40 * 2 * 72 + 8, generator=gen).half() for _ in range(3)]
    dout = torch.randn(1, 40, 2, 64, generator=gen).half()
    for offset in (0, 1, 0):   # 2-byte offset: rows misaligned for cp.async's 16 bytes
        views = [torch.as_strided(b, (1, 40, 2, 64), (40 * 2 * 72, 2 * 72, 72, 1), offset).requires_grad_()
                 for b in base]
        copies = [t.detach().contiguous().requires_grad_() for t in views]
        got, want = (fagen.flash_attn_func(*ts, causal=True) for ts in (views, copies))
        assert torch.equal(got, want), offset
        for mine, theirs in zip(torch.autograd.grad(got, views, dout), torch.autograd.grad(want, copies, dout)):
            assert torch.equal(mine, theirs), offset
    assert len(checks) == 2   # the views' one signature, and the copies'

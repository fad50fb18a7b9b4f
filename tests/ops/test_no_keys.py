"""Calls with no keys at all (issue 42): seqlen_k = 0, packed keys with total_k = 0, an empty
contiguous or paged cache. Every row sees no key, so O = 0 and L = +inf (flash-attn's answer),
with zero gradients to q, on both kernel families. The sm90 family's forward takes K and V as TMA
maps, and a map of a tensor with no rows has a zero dim, which the driver refuses: the launcher
encodes such a map over a placeholder row (kernels/launch.py `_encoded`), which the kernel never
reads (as it is for packed sequences without a query, total_q = 0). Outputs start poisoned, so the
kernels must write every element they return.

The calls' options are those of other default-tier tests (bf16 dense calls, causal paged ones with a
window, softcap and ALiBi, ...): their specs are built already (each new one costs CI about 10 s), and
rows without keys give O = 0 and L = +inf whatever the mask and the variant."""

import math

import pytest
import torch

import fagen
from fagen.kernels import launch
from fagen.kernels import attention_kernels
from kernel_cases import poisoned_empty

B, NQ, H, HK, D = 2, 5, 4, 2, 64
PAGE = 16
SINKS = torch.tensor([0.3171, -1.2345, 0.0, 2.5])
VARIANT = {"causal": True, "window_size": (9, 0), "softcap": 20.0, "alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05])}


@pytest.fixture(params=["sm80", "sm90"])
def family(request, monkeypatch):
    """FAGEN_ARCH_FAMILY for the test's calls, outputs poisoned; afterwards, that every forward that
    ran was that family's kernel (the recorded launches' names)."""
    monkeypatch.setenv("FAGEN_ARCH_FAMILY", request.param)
    monkeypatch.setattr(attention_kernels, "_empty", poisoned_empty)
    launched = _recorded_launches(monkeypatch)
    yield request.param
    forwards = [name for name in launched if name.endswith("_fwd")]
    assert forwards and all(("_sm90_" in name) == (request.param == "sm90") for name in forwards), launched


def _recorded_launches(monkeypatch) -> list:
    """The names of the kernels launched from now on (each kernel's name says its family)."""
    launched, real = [], launch.BoundLaunch.__call__

    def recorded(self, values, converted=None):
        launched.append(self.name)
        return real(self, values, converted)

    monkeypatch.setattr(launch.BoundLaunch, "__call__", recorded)
    return launched


def _tensors(*shapes, seed=0, requires_grad=False, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(dtype).requires_grad_(requires_grad) for s in shapes]


def assert_no_key_result(out, lse, out_shape, lse_shape, dtype=torch.float16):
    """O = 0 and L = +inf exactly, in the dtypes and shapes every call returns."""
    assert out.dtype == dtype and tuple(out.shape) == out_shape
    assert lse.dtype == torch.float32 and tuple(lse.shape) == lse_shape
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, math.inf))


# -- dense and packed: forward and backward ---------------------------------------------------------

def test_dense_forward_and_backward(family):
    q, k, v = _tensors((B, NQ, H, D), (B, 0, HK, D), (B, 0, HK, D), requires_grad=True, dtype=torch.bfloat16)
    out, lse = fagen.flash_attn_func(q, k, v, return_lse=True)
    assert_no_key_result(out, lse, (B, NQ, H, D), (B, H, NQ), torch.bfloat16)
    assert out.is_contiguous() and lse.is_contiguous()
    dout, = _tensors((B, NQ, H, D), seed=1, dtype=torch.bfloat16)
    dlse, = _tensors((B, H, NQ), seed=2, dtype=torch.float32)   # L's gradient too: it enters as D - dL
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape


def test_packed_forward_and_backward(family):
    cu_q, cu_k = torch.tensor([0, 3, NQ], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    q, k, v = _tensors((NQ, H, D), (0, HK, D), (0, HK, D), requires_grad=True)
    out, lse = fagen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 0, return_lse=True)
    assert_no_key_result(out, lse, (NQ, H, D), (H, NQ))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), *_tensors((NQ, H, D), seed=1))
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape


def test_packed_sequences_without_a_query(family):
    """total_q = 0 under a grid of max_seqlen_q rows: the sm90 family's Q map is a placeholder too."""
    cu_q, cu_k = torch.zeros(3, dtype=torch.int32), torch.tensor([0, 3, NQ], dtype=torch.int32)
    q, k, v = _tensors((0, H, D), (NQ, HK, D), (NQ, HK, D))
    out, lse = fagen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, return_lse=True)
    assert out.shape == (0, H, D) and lse.shape == (H, 0)


# -- decoding: an empty contiguous or paged cache, or one whose entries hold no key yet ------------------

def _decode(k_cache, v_cache, nq=1, **kwargs):
    q, = _tensors((B, nq, H, D))
    return fagen.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kwargs)


@pytest.mark.parametrize("appended", [False, True], ids=["", "append_nothing"])
def test_an_empty_contiguous_cache(family, appended):
    """A cache of (B, 0, Hk, d): no row to hold a key, none to append (k and v of 0 new tokens)."""
    k_cache, v_cache = torch.empty(B, 0, HK, D).half(), torch.empty(B, 0, HK, D).half()
    new = dict(zip("kv", _tensors((B, 0, HK, D), (B, 0, HK, D)))) if appended else {}
    out, lse = _decode(k_cache, v_cache, cache_seqlens=0, **new)
    assert_no_key_result(out, lse, (B, 1, H, D), (B, H, 1))


def test_an_empty_paged_cache(family):
    """No pages, and a block table of none per entry (two causal queries per entry)."""
    pages = torch.empty(0, PAGE, HK, D).half()
    out, lse = _decode(pages, pages.clone(), nq=2, block_table=torch.empty(B, 0, dtype=torch.int32), cache_seqlens=0,
                       causal=True)
    assert_no_key_result(out, lse, (B, 2, H, D), (B, H, 2))


@pytest.mark.parametrize("page", [None, PAGE], ids=["contiguous", "paged"])
def test_caches_whose_entries_hold_no_key_yet(family, page):
    """Rows to hold keys, but cache_seqlens = 0 everywhere (the maps have rows: no placeholder)."""
    rows = (B * 2, PAGE, HK, D) if page else (B, 32, HK, D)
    k_cache, v_cache = _tensors(rows, rows)
    paged = {"block_table": torch.arange(B * 2, dtype=torch.int32).view(B, 2), "nq": 2, "causal": True} if page else {}
    out, lse = _decode(k_cache, v_cache, cache_seqlens=torch.zeros(B, dtype=torch.int32), **paged)
    nq = 2 if page else 1
    assert_no_key_result(out, lse, (B, nq, H, D), (B, H, nq))


def test_packed_queries_over_an_empty_paged_cache(family):
    cu_q, cu_k = torch.tensor([0, 3, NQ], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    q, = _tensors((NQ, H, D))
    pages = torch.empty(0, PAGE, HK, D).half()
    out, lse = fagen.flash_attn_varlen_func(q, pages, pages.clone(), cu_q, cu_k, 3, 0, return_lse=True,
                                            block_table=torch.empty(B, 0, dtype=torch.int32), **VARIANT)
    assert_no_key_result(out, lse, (NQ, H, D), (H, NQ))


# -- the families agree bit for bit, where the answer is the kernel's own --------------------------------

def _both_families(monkeypatch, run) -> dict:
    """`run()` under each family, outputs poisoned; its results by family."""
    monkeypatch.setattr(attention_kernels, "_empty", poisoned_empty)
    results = {}
    for name in ("sm80", "sm90"):
        monkeypatch.setenv("FAGEN_ARCH_FAMILY", name)
        results[name] = run()
    return results


def _identical(results: dict) -> None:
    for a, b in zip(results["sm80"], results["sm90"]):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_sinks_and_dropout_give_the_same_answer_on_both_families(monkeypatch, causal):
    """With sinks, a row without keys has L = its sink as the kernel rounds it (its logit in score
    units and back), O = 0; dropout changes nothing there. The sm90 family runs its own kernel on the
    placeholder maps, so its answer is bit for bit the sm80 family's, and so is the backward's."""
    q, k, v = _tensors((B, NQ, H, D), (B, 0, HK, D), (B, 0, HK, D), requires_grad=True)
    sinks = SINKS.clone().requires_grad_()
    dout, = _tensors((B, NQ, H, D), seed=1)

    def run():
        out, lse = fagen.flash_attn_func(q, k, v, dropout_p=0.25, causal=causal, sinks=sinks, softmax_scale=0.3,
                                         return_lse=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v, sinks), dout))

    launched = _recorded_launches(monkeypatch)
    results = _both_families(monkeypatch, run)
    assert any(name.endswith("_sm90_fwd") for name in launched), launched   # the sm90 family takes the call
    _identical(results)
    out, lse = results["sm90"][:2]
    assert torch.equal(out, torch.zeros_like(out))
    assert (lse - SINKS.view(1, H, 1)).abs().max() < 1e-6

"""fagen.merge_attention: merging the (out, lse) of attention over disjoint key sets is
attention over their union (against the float64 oracle), with fagen's empty-row
convention, in any order, differentiably; and the sympy proofs behind it."""

from __future__ import annotations

import itertools

import pytest
import sympy as sp
import torch

import fagen
from fagen import identities
from fagen.ops import merge as merge_module
from fagen.identities import IDENTITIES, MERGE_IDENTITIES, for_spec, run
from fagen.reference import EMPTY_ROW_LSE, attention_forward
from fagen.spec import Spec

merge_attention = fagen.merge_attention
F64 = torch.float64


def _problem(B=2, Nq=3, Nk=7, H=4, Hk=2, d=8, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Nq, H, d, generator=g, dtype=dtype)
    k = torch.randn(B, Nk, Hk, d, generator=g, dtype=dtype)
    v = torch.randn(B, Nk, Hk, d, generator=g, dtype=dtype)
    return q, k, v


def _cuts(nk: int, sizes: tuple) -> list[tuple[int, int]]:
    assert sum(sizes) == nk
    starts = list(itertools.accumulate((0,) + sizes))
    return list(itertools.pairwise(starts))


def _parts(q, k, v, sizes, seqlens_k=None):
    """Each part's oracle (out, lse) over its key range; seqlens_k (of the whole key axis)
    becomes each part's own key-padding lengths, 0 where a batch sees none of its keys."""
    outs, lses = [], []
    for a, b in _cuts(k.shape[1], sizes):
        lengths = None if seqlens_k is None else tuple(min(max(n - a, 0), b - a) for n in seqlens_k)
        out, lse = attention_forward(q, k[:, a:b], v[:, a:b], seqlens_k=lengths)
        outs.append(out)
        lses.append(lse)
    return outs, lses


def _assert_same(actual, expected, tol):
    """Equal within tol where finite; the same infinities elsewhere."""
    assert actual.shape == expected.shape
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    assert torch.equal(actual[torch.isinf(actual)], expected[torch.isinf(expected)])
    finite = torch.isfinite(expected)
    assert torch.isfinite(actual[finite]).all()
    assert (actual[finite] - expected[finite]).abs().max().item() <= tol if finite.any() else True


# ---------------------------------------------------------------- exactness against the oracle


@pytest.mark.parametrize("sizes", [(7,), (3, 4), (1, 5, 1), (2, 2, 3)])
def test_merged_parts_equal_attention_over_all_keys(sizes):
    q, k, v = _problem()
    full_out, full_lse = attention_forward(q, k, v)
    outs, lses = _parts(q, k, v, sizes)
    out, lse = merge_attention(outs, lses)
    assert out.dtype == F64 and lse.dtype == F64
    _assert_same(out, full_out, 1e-10)
    _assert_same(lse, full_lse, 1e-10)
    # The same parts stacked along a leading dim.
    out_s, lse_s = merge_attention(torch.stack(outs), torch.stack(lses))
    assert torch.equal(out_s, out) and torch.equal(lse_s, lse)


def test_a_softmax_scale_and_padding_that_empties_whole_parts():
    """Batch 0 sees 6 of 7 keys, batch 1 only 2: the second part (keys 3..6) is empty for
    batch 1 (its lse is +inf, its out 0), and the merge still equals the oracle."""
    q, k, v = _problem(seed=1)
    seqlens = (6, 2)
    full_out, full_lse = attention_forward(q, k, v, seqlens_k=seqlens, softmax_scale=0.7)
    outs, lses = [], []
    for a, b in _cuts(7, (3, 4)):
        lengths = tuple(min(max(n - a, 0), b - a) for n in seqlens)
        o, s = attention_forward(q, k[:, a:b], v[:, a:b], seqlens_k=lengths, softmax_scale=0.7)
        outs.append(o)
        lses.append(s)
    assert torch.isposinf(lses[1][1]).all() and (outs[1][1] == 0).all()
    out, lse = merge_attention(outs, lses)
    _assert_same(out, full_out, 1e-10)
    _assert_same(lse, full_lse, 1e-10)
    assert torch.isfinite(lse).all()


def test_rows_that_see_no_key_in_any_part():
    """seqlens_k = 0 for batch 1: every part is empty there, and the merge gives fagen's
    convention, O = 0 and L = +inf (what the oracle gives over all the keys)."""
    q, k, v = _problem(seed=2)
    seqlens = (7, 0)
    full_out, full_lse = attention_forward(q, k, v, seqlens_k=seqlens)
    outs, lses = _parts(q, k, v, (2, 2, 3), seqlens_k=seqlens)
    out, lse = merge_attention(outs, lses)
    _assert_same(out, full_out, 1e-10)
    _assert_same(lse, full_lse, 1e-10)
    assert torch.isposinf(lse[1]).all() and (out[1] == 0).all()
    assert merge_module.EMPTY_ROW_LSE == EMPTY_ROW_LSE


def test_minus_inf_is_empty_too_and_an_empty_part_is_not_read():
    """L = -inf (the logsumexp of no key) is empty like +inf, and an empty part's O is
    never read: garbage there (NaN, inf) changes nothing."""
    q, k, v = _problem(seed=3)
    seqlens = (5, 1)
    outs, lses = _parts(q, k, v, (3, 4), seqlens_k=seqlens)
    expected = merge_attention(outs, lses)
    empty = torch.isposinf(lses[1])                                   # (B, H, N)
    assert empty.any()
    lses_neg = [lses[0], torch.where(empty, torch.full_like(lses[1], float("-inf")), lses[1])]
    garbage = outs[1].clone()
    garbage[empty.transpose(1, 2)] = float("nan")
    garbage[1, 0, 0, 0] = float("inf")
    for L in (lses, lses_neg):
        out, lse = merge_attention([outs[0], garbage], L)
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    # All empty, with -inf: still O = 0 and L = +inf.
    out, lse = merge_attention([garbage[:1] * 0 + float("nan")] * 2,
                               [torch.full_like(lses[0][:1], float("-inf"))] * 2)
    assert (out == 0).all() and torch.isposinf(lse).all()


def test_a_nan_lse_is_not_empty():
    out, lse = merge_attention([torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2)],
                               [torch.tensor([[[float("nan")]]]), torch.zeros(1, 1, 1)])
    assert torch.isnan(lse).all() and torch.isnan(out).all()


# ---------------------------------------------------------------- order independence


def test_the_merge_is_order_independent_and_associative():
    q, k, v = _problem(B=1, Nk=9, seed=4)
    outs, lses = _parts(q, k, v, (2, 3, 4), seqlens_k=(4,))   # the last part is empty
    parts = list(zip(outs, lses))
    flat = merge_attention(outs, lses)
    for order in itertools.permutations(range(3)):
        o, s = merge_attention([outs[i] for i in order], [lses[i] for i in order])
        _assert_same(o, flat[0], 1e-12)
        _assert_same(s, flat[1], 1e-12)
    (a, b, c) = parts
    ab = merge_attention([a[0], b[0]], [a[1], b[1]])
    bc = merge_attention([b[0], c[0]], [b[1], c[1]])
    left = merge_attention([ab[0], c[0]], [ab[1], c[1]])
    right = merge_attention([a[0], bc[0]], [a[1], bc[1]])
    for merged in (left, right):
        _assert_same(merged[0], flat[0], 1e-12)
        _assert_same(merged[1], flat[1], 1e-12)


# ---------------------------------------------------------------- gradients


def _random_parts(P=3, B=1, N=2, H=2, d=3, seed=5, empty=False):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(P, B, N, H, d, generator=g, dtype=F64)
    lses = 2 * torch.randn(P, B, H, N, generator=g, dtype=F64)
    if empty:
        lses[1, 0, 0, 0] = float("inf")      # one part empty for one row
        lses[2, 0, 1, 1] = float("-inf")     # one part empty, the -inf way
        lses[:, 0, 1, 0] = float("inf")      # a row empty in every part
        outs[1, 0, 0, 0] = 0.0
    return [t.requires_grad_() for t in outs.unbind(0)], [t.requires_grad_() for t in lses.unbind(0)]


def _finite_merge(*tensors):
    """merge_attention with +inf lse rows set to 0, so finite differences are defined."""
    P = len(tensors) // 2
    out, lse = merge_attention(list(tensors[:P]), list(tensors[P:]))
    return out, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


@pytest.mark.parametrize("empty", [False, True])
def test_gradcheck_float64(empty):
    outs, lses = _random_parts(empty=empty)
    assert torch.autograd.gradcheck(_finite_merge, (*outs, *lses), eps=1e-6, atol=1e-8)


def test_gradgradcheck_float64():
    outs, lses = _random_parts(P=2, seed=6)
    assert torch.autograd.gradgradcheck(_finite_merge, (*outs, *lses), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("empty", [False, True])
def test_gradients_are_the_proved_closed_form(empty):
    """dO_i = exp(L_i - L) dO and dL_i = exp(L_i - L) (dL + <dO, O_i - O>), with exp = 0
    for an empty part; finite (no NaN) even on rows that see no key."""
    outs, lses = _random_parts(P=3, B=2, N=3, H=2, d=4, seed=7, empty=empty)
    out, lse = merge_attention(outs, lses)
    g = torch.Generator().manual_seed(8)
    d_out = torch.randn(out.shape, generator=g, dtype=F64)
    d_lse = torch.randn(lse.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad((out * d_out).sum() + (torch.where(torch.isinf(lse), 0, lse) * d_lse).sum(),
                                [*outs, *lses])
    assert all(torch.isfinite(x).all() for x in grads)
    with torch.no_grad():
        for i, (O_i, L_i) in enumerate(zip(outs, lses)):
            w = torch.where(torch.isinf(L_i) | torch.isinf(lse), 0.0, torch.exp(L_i - lse))       # (B, H, N)
            w_q = w.transpose(1, 2).unsqueeze(-1)                                               # (B, N, H, 1)
            inner = (d_out * (O_i - out)).sum(-1).transpose(1, 2)                               # (B, H, N)
            torch.testing.assert_close(grads[i], w_q * d_out, rtol=0, atol=1e-12)
            torch.testing.assert_close(grads[3 + i], w * (d_lse + inner), rtol=0, atol=1e-12)


def test_gradients_flow_to_half_precision_inputs():
    outs = [torch.randn(1, 2, 2, 4, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    lses = [torch.randn(1, 2, 2, requires_grad=True) for _ in range(2)]
    out, lse = merge_attention(outs, lses)
    (out.float().sum() + lse.sum()).backward()
    assert outs[0].grad.dtype == torch.bfloat16 and lses[0].grad.dtype == torch.float32
    assert all(torch.isfinite(t.grad).all() for t in (*outs, *lses))


# ---------------------------------------------------------------- low precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_fp32_accurate_results(dtype):
    """bf16/fp16 parts with fp32 lses, as the kernels return them: lse is fp32 and as
    accurate as fp32 arithmetic, out is the exact merge (of the same rounded inputs) up to
    one rounding to the dtype."""
    g = torch.Generator().manual_seed(9)
    P, shape = 4, (2, 5, 3, 16)
    outs = [torch.randn(shape, generator=g).to(dtype) for _ in range(P)]
    lses = [(6 * torch.randn(2, 3, 5, generator=g)).float() for _ in range(P)]
    lses[2][0, 0, 0] = float("inf")
    out, lse = merge_attention(outs, lses)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = merge_attention([o.double() for o in outs], [s.double() for s in lses])
    assert ((lse.double() - ref_lse).abs() <= 1e-6 * ref_lse.abs().clamp(min=1)).all()
    eps = torch.finfo(dtype).eps
    err = (out.double() - ref_out).abs()
    assert (err <= eps / 2 * ref_out.abs() + 1e-6).all(), err.max()
    # fp16/bf16 lses are read in fp32 too.
    out_h, lse_h = merge_attention(outs, [s.to(dtype) for s in lses])
    assert lse_h.dtype == torch.float32 and out_h.dtype == dtype


# ---------------------------------------------------------------- devices


def test_device_agnostic_on_the_meta_device():
    """No tensor is made on a fixed device: the merge runs on meta tensors (as on CUDA)."""
    outs = torch.empty(2, 1, 3, 2, 4, device="meta", dtype=torch.bfloat16)
    lses = torch.empty(2, 1, 2, 3, device="meta")
    out, lse = merge_attention(outs, lses)
    assert out.device.type == "meta" and out.shape == (1, 3, 2, 4) and out.dtype == torch.bfloat16
    assert lse.device.type == "meta" and lse.shape == (1, 2, 3) and lse.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_matches_cpu():
    outs, lses = _random_parts(P=3, B=2, N=3, H=2, d=4, seed=10, empty=True)
    cpu = merge_attention([o.detach().float() for o in outs], [s.detach().float() for s in lses])
    gpu = merge_attention([o.detach().float().cuda() for o in outs], [s.detach().float().cuda() for s in lses])
    for a, b in zip(cpu, gpu):
        _assert_same(b.cpu().double(), a.double(), 1e-5)


# ---------------------------------------------------------------- bad inputs


def _ok(P=2):
    return [torch.zeros(1, 3, 2, 4) for _ in range(P)], [torch.zeros(1, 2, 3) for _ in range(P)]


@pytest.mark.parametrize("make, error, message", [
    (lambda o, s: (o, s[:1]), ValueError, "2 outs and 1 lses"),
    (lambda o, s: ([], []), ValueError, "outs is empty"),
    (lambda o, s: (o, []), ValueError, "lses is empty"),
    (lambda o, s: ([o[0], torch.zeros(1, 3, 2, 5)], s), ValueError, r"outs\[1\] has shape"),
    (lambda o, s: (o, [s[0], torch.zeros(1, 3, 2)]), ValueError, r"lses\[1\] must be \(B, H, N\)"),
    (lambda o, s: (o, [s[0], torch.zeros(1, 2, 3, dtype=torch.int64)]), TypeError,
     r"lses\[1\] must be a floating-point tensor, got torch.int64"),
    (lambda o, s: ([o[0], o[1].int()], s), TypeError, r"outs\[1\] must be a floating-point tensor"),
    (lambda o, s: (o, [s[0], torch.zeros(1, 2, 3, device="meta")]), ValueError, r"lses\[1\] is on meta"),
    (lambda o, s: ([o[0], torch.zeros(1, 3, 2, 4, device="meta")], s), ValueError, r"outs\[1\] is on meta"),
    (lambda o, s: ([o[0], torch.zeros(3, 2, 4)], s), ValueError, r"outs\[1\] must be \(B, N, H, d\)"),
    (lambda o, s: (torch.stack(o)[0], s), ValueError, r"outs as a stacked tensor must be \(P, B, N, H, d\)"),
    (lambda o, s: (o, torch.stack(s)[0]), ValueError, r"lses as a stacked tensor must be \(P, B, H, N\)"),
    (lambda o, s: (o, [s[0], 1.0]), TypeError, r"lses\[1\] must be a tensor"),
    (lambda o, s: (o, None), TypeError, "lses must be a list of tensors or a stacked tensor"),
])
def test_bad_inputs_are_named(make, error, message):
    outs, lses = make(*_ok())
    with pytest.raises(error, match=message):
        merge_attention(outs, lses)


# ---------------------------------------------------------------- the proofs


def test_exported_from_fagen():
    from fagen.ops.merge import merge_attention as from_decode
    assert fagen.merge_attention is from_decode and "merge_attention" in fagen.__all__


def test_the_merge_identities_are_proved_and_registered():
    results = run(MERGE_IDENTITIES)
    assert all(r.ok for r in results), [(r.name, r.shapes, r.detail) for r in results if not r.ok]
    assert all(i in IDENTITIES for i in MERGE_IDENTITIES)
    names = " | ".join(i.name for i in MERGE_IDENTITIES)
    for needed in ("merge of key blocks", "merge backward", "associative", "L = -inf adds nothing"):
        assert needed in names
    assert all(i in for_spec(Spec(64)) for i in MERGE_IDENTITIES)


def _unweighted_average(states, shift=0):
    """A wrong merge: O = mean of the O_i, without the exp(L_i - L) weights."""
    _, lse = _right_merge(states, shift)
    return sum((O for O, _ in states), sp.zeros(*states[0][0].shape)) / len(states), lse


def _unweighted_sum(states, shift=0):
    _, lse = _right_merge(states, shift)
    return sum((O for O, _ in states), sp.zeros(*states[0][0].shape)), lse


def _lse_as_max(states, shift=0):
    """A wrong merge: L = max L_i, forgetting log(sum exp(L_i - max))."""
    out, _ = _right_merge(states, shift)
    return out, sp.Max(*[L for _, L in states])


_right_merge = identities.merge.merge_states
_PROOFS = {"blocks": lambda: identities.merge.merge_blocks((2, 3), 2),
           "blocks3": lambda: identities.merge.merge_blocks((2, 3, 2), 2),
           "gradient": lambda: identities.merge.merge_gradient(2, 2),
           "associative": lambda: identities.merge.merge_associative(3, 2),
           "empty": lambda: identities.merge.merge_empty_part(2, 2)}


@pytest.mark.parametrize("wrong, fails", [
    (_unweighted_average, ["blocks", "blocks3", "gradient", "associative", "empty"]),
    (_unweighted_sum, ["blocks", "blocks3", "gradient", "empty"]),   # a plain sum is associative
    (_lse_as_max, ["blocks", "blocks3", "gradient", "associative"]),
])
def test_the_merge_proofs_fail_for_a_wrong_merge(monkeypatch, wrong, fails):
    monkeypatch.setattr(identities.merge, "merge_states", wrong)
    for name in fails:
        assert _PROOFS[name]() is False, name


def test_the_gradient_proof_fails_for_a_wrong_backward(monkeypatch):
    right = identities.merge.merge_gradient_claim

    def without_the_output_term(states, out, lse, d_out, d_lse):   # dL_i = w_i dL
        return [(dO_i, sp.exp(L_i - lse) * d_lse) for (dO_i, _), (_, L_i) in zip(right(states, out, lse, d_out, d_lse),
                                                                                  states)]

    def unweighted(states, out, lse, d_out, d_lse):                # dO_i = dO
        return [(d_out, dL_i) for _, dL_i in right(states, out, lse, d_out, d_lse)]

    for wrong in (without_the_output_term, unweighted):
        monkeypatch.setattr(identities.merge, "merge_gradient_claim", wrong)
        assert identities.merge.merge_gradient(2, 2) is False

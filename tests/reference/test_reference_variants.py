"""The oracle's attention variants (flash-attn 2.8 semantics): sliding window,
softcap, ALiBi, attention sinks and FlexAttention's score_mod / mask_mod,
against brute-force loops and hand-written formulas; `attention_gradients`
against finite differences and the closed form dS = P * (dP - (D - dL));
plain calls unchanged bit for bit; bad arguments rejected by name."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fagen.reference import (attention_backward, attention_forward, attention_gradients,
                             attention_same_dtype, dropout_keep_mask)
from fagen.reference.empty_rows import lse_from_stats, safe_max, safe_reciprocal
from fagen.reference.hbm import blocks
from fagen.reference.problem import make_problem
from reference_cases import case_kwargs, make_inputs

F64 = torch.float64
TOL = 1e-12
INF = math.inf


# --------------------------------------------------------------------------- helpers

def brute_visible(Nq, Nk, lengths, causal, window):
    """(B, Nq, Nk) bool, one pair at a time, from the definitions."""
    left, right = window
    if causal:
        right = 0
    vis = torch.zeros(len(lengths), Nq, Nk, dtype=torch.bool)
    for b, nk in enumerate(lengths):
        off = nk - Nq
        for i in range(Nq):
            for j in range(Nk):
                vis[b, i, j] = (j < nk and (left < 0 or j >= i + off - left)
                                and (right < 0 or j <= i + off + right))
    return vis


def scalar(x):
    return torch.tensor(x, dtype=torch.int64)


def loop_forward(q, k, v, *, softmax_scale=None, causal=False, seqlens_k=None, dropout_p=0.0,
                 keep_mask=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 score_mod=None, mask_mod=None, sinks=None):
    """Attention one scalar at a time (0-d tensors, so autograd can run through
    it as a second, independent graph); score_mod and mask_mod are called per
    element on 0-d index tensors."""
    B, Nq, H, d = q.shape
    Nk, Hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    out = [[[torch.zeros(d, dtype=F64) for _ in range(H)] for _ in range(Nq)] for _ in range(B)]
    lse_rows = {}
    for b, h, i in itertools.product(range(B), range(H), range(Nq)):
        kvh = h // (H // Hk)
        nk = Nk if seqlens_k is None else int(seqlens_k[b])
        off = nk - Nq
        scores = {}
        for j in range(Nk):
            seen = j < nk and (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
            if mask_mod is not None:
                seen = seen and bool(mask_mod(scalar(b), scalar(h), scalar(i), scalar(j)))
            if not seen:
                continue
            s = scale * (q[b, i, h].double() @ k[b, j, kvh].double())
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                s = s - float(slope) * abs(i + off - j)
            if score_mod is not None:
                s = score_mod(s, scalar(b), scalar(h), scalar(i), scalar(j))
            scores[j] = s
        terms = list(scores.values()) + ([sinks[h].double()] if sinks is not None else [])
        if not terms:
            lse_rows[b, h, i] = torch.tensor(INF, dtype=F64)
            continue
        row_lse = torch.logsumexp(torch.stack(terms), 0)
        lse_rows[b, h, i] = row_lse
        for j, s in scores.items():
            weight = torch.exp(s - row_lse)
            if keep_mask is not None:
                weight = weight * (float(keep_mask[b, h, i, j]) / (1 - dropout_p))
            out[b][i][h] = out[b][i][h] + weight * v[b, j, kvh].double()
    out = torch.stack([torch.stack([torch.stack(row) for row in batch]) for batch in out])
    lse = torch.stack([lse_rows[b, h, i] for b in range(B) for h in range(H) for i in range(Nq)]).view(B, H, Nq)
    return out, lse


def assert_lse_equal(got, want, tol=TOL):
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=0, atol=tol), (got - want)[finite].abs().max()


def variant(name, B, H, Nq, Nk, grad=False):
    """(kwargs, captures) of a named variant case; captured tables require grad if `grad`."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    captures = []

    def table():
        t = torch.randn(H, Nq + Nk - 1, generator=gen, dtype=F64)
        captures.append(t.requires_grad_(grad))
        return t

    width = max(Nq, Nk)
    doc = torch.stack([torch.arange(width) // 2, torch.arange(width) // 3] * B)[:B]
    prefix = torch.tensor([2, 0, 3, 1] * B)[:B]
    sinks = torch.randn(H, generator=gen, dtype=F64).requires_grad_(grad)
    if name == "window":
        return {"window_size": (2, 1), "seqlens_k": torch.tensor([Nk, 3] * B)[:B]}, captures
    if name == "window_causal":
        return {"window_size": (1, -1), "causal": True}, captures
    if name == "window_left_open":
        return {"window_size": (-1, 2), "seqlens_k": torch.tensor([Nk - 1, 0] * B)[:B]}, captures
    if name == "softcap":
        return {"softcap": 0.7, "softmax_scale": 1.5}, captures
    if name == "alibi_h":
        return {"alibi_slopes": torch.rand(H, generator=gen).float()}, captures
    if name == "alibi_bh":
        return {"alibi_slopes": torch.rand(B, H, generator=gen).float(), "causal": True,
                "seqlens_k": torch.tensor([Nk, 2] * B)[:B]}, captures
    if name == "sinks":
        return {"sinks": sinks, "seqlens_k": torch.tensor([Nk, 0] * B)[:B]}, captures
    if name == "relbias":
        bias = table()
        return {"score_mod": lambda s, b, h, qi, kv: s + bias[h, qi - kv + (Nk - 1)]}, captures
    if name == "document":
        return {"mask_mod": lambda b, h, qi, kv: doc[b, qi] == doc[b, kv]}, captures
    if name == "prefix_lm":
        return {"mask_mod": lambda b, h, qi, kv: (kv <= qi) | (kv < prefix[b])}, captures
    if name == "head_mask":  # per-head band widths: some heads leave rows empty
        return {"mask_mod": lambda b, h, qi, kv: (qi - kv).abs() <= h - 1}, captures
    if name == "nonlinear":
        return {"score_mod": lambda s, b, h, qi, kv: s * torch.sigmoid(s), "softmax_scale": 1.3}, captures
    if name == "everything":
        bias = table()
        return {"window_size": (3, 2), "softcap": 1.5, "softmax_scale": 0.9,
                "alibi_slopes": torch.rand(H, generator=gen).float(),
                "score_mod": lambda s, b, h, qi, kv: s * torch.sigmoid(s) + bias[h, qi - kv + (Nk - 1)],
                "mask_mod": lambda b, h, qi, kv: (doc[b, qi] == doc[b, kv]) | (h == 0),
                "sinks": sinks, "seqlens_k": torch.tensor([Nk - 1, 0] * B)[:B],
                "dropout_p": 0.25, "keep_mask": dropout_keep_mask(3, 1, B, H, Nq, Nk, 0.25)}, captures
    raise ValueError(name)


VARIANTS = ("window", "window_causal", "window_left_open", "softcap", "alibi_h", "alibi_bh", "sinks",
            "relbias", "document", "prefix_lm", "head_mask", "nonlinear", "everything")
# (Nq, Nk, H, Hk): more keys, more queries (causal and windows leave empty rows), GQA in both.
SHAPES = [(5, 6, 4, 2), (6, 4, 2, 1)]


# --------------------------------------------------------------------------- window and blocks

WINDOWS = [(-1, -1), (0, 0), (2, -1), (-1, 1), (3, 2), (0, 4), (9, 9)]


@pytest.mark.parametrize("Nq, Nk", [(7, 7), (5, 9), (9, 5)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_window_visibility_and_block_skipping_match_brute_force(Nq, Nk, causal, padded):
    lengths = [Nk, 0, Nk // 2 + 1] if padded else [Nk] * 3
    q, k, v, _ = make_inputs(B=3, Nq=Nq, Nk=Nk, d=2)
    for window in WINDOWS:
        prob = make_problem(q, k, v, causal=causal, window_size=window,
                            seqlens_k=torch.tensor(lengths) if padded else None)
        want = brute_visible(Nq, Nk, lengths, causal, window)
        got = prob.visible_all()
        assert got.shape == (3, 1, Nq, Nk)
        assert torch.equal(got[:, 0], want), (window, causal)
        for b, bm, bn in itertools.product(range(3), (1, 3, 4), (1, 2, 5)):
            for rows in blocks(Nq, bm):
                for cols in blocks(Nk, bn):
                    block = want[b, rows.start:rows.stop, cols.start:cols.stop]
                    assert prob.block_is_masked(b, rows, cols) == (not block.any()), (window, b, rows, cols)
        assert torch.equal(prob.visible(1, range(2, 5), range(1, 4)), want[1, 2:5, 1:4])


def test_causal_forces_the_right_side_of_the_window_to_zero():
    q, k, v, _ = make_inputs(B=1, Nq=6, Nk=8, d=2)
    for right in (-1, 0, 3):
        prob = make_problem(q, k, v, causal=True, window_size=(2, right))
        assert prob.window == (2, 0)
        assert torch.equal(prob.visible_all()[:, 0], brute_visible(6, 8, [8], False, (2, 0)))
    # The window alone with right = 0 is causal.
    assert torch.equal(make_problem(q, k, v, window_size=(-1, 0)).visible_all(),
                       make_problem(q, k, v, causal=True).visible_all())


def test_block_skipping_stays_sound_with_a_mask_mod():
    Nq, Nk, H = 9, 11, 3
    q, k, v, _ = make_inputs(B=2, Nq=Nq, Nk=Nk, H=H, Hk=1, d=2)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [0] * 4 + [1] * 7])
    lengths = torch.tensor([Nk, 6])
    kwargs = {"window_size": (4, 1), "seqlens_k": lengths}
    plain = make_problem(q, k, v, **kwargs)
    prob = make_problem(q, k, v, mask_mod=lambda b, h, qi, kv: (doc[b, qi] == doc[b, kv]) & (kv >= h), **kwargs)
    vis = prob.visible_all()
    assert vis.shape == (2, H, Nq, Nk)
    for b, h, i, j in itertools.product(range(2), range(H), range(Nq), range(Nk)):
        assert bool(vis[b, h, i, j]) == (bool(plain.visible_all()[b, 0, i, j])
                                         and int(doc[b, i]) == int(doc[b, j]) and j >= h)
    for h in range(H):
        assert torch.equal(prob.visible(1, range(3, 8), range(2, 9), h), vis[1, h, 3:8, 2:9])
    with pytest.raises(ValueError, match="pass h"):
        prob.visible(0, range(Nq), range(Nk))
    skipped_with_mask_visible = 0
    for b, bm, bn in itertools.product(range(2), (1, 2, 4), (1, 3)):
        for rows in blocks(Nq, bm):
            for cols in blocks(Nk, bn):
                masked = prob.block_is_masked(b, rows, cols)
                assert masked == plain.block_is_masked(b, rows, cols)
                if masked:
                    assert not vis[b, :, rows.start:rows.stop, cols.start:cols.stop].any()
                skipped_with_mask_visible += not masked and not vis[b, :, rows.start:rows.stop,
                                                                    cols.start:cols.stop].any()
    assert skipped_with_mask_visible > 0, "the case must have blocks only the mask_mod empties"


# --------------------------------------------------------------------------- forward against loops

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", VARIANTS)
def test_forward_matches_scalar_loop(name, shape):
    Nq, Nk, H, Hk = shape
    q, k, v, _ = make_inputs(B=2, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=4, seed=3)
    kwargs, _ = variant(name, 2, H, Nq, Nk)
    out, lse = attention_forward(q, k, v, **kwargs)
    with torch.no_grad():
        want_out, want_lse = loop_forward(q, k, v, **kwargs)
    assert out.dtype == F64 and out.shape == q.shape and lse.shape == (2, H, Nq)
    assert torch.allclose(out, want_out, rtol=0, atol=TOL), (out - want_out).abs().max()
    assert_lse_equal(lse, want_lse)


def test_softcap_and_alibi_equal_the_hand_written_formula():
    B, Nq, Nk, H, d = 2, 5, 7, 2, 4
    q, k, v, _ = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=H, d=d, seed=5)
    lengths = torch.tensor([Nk, 4])
    tau, c = 2.0, 1.2
    i = torch.arange(Nq).view(1, 1, -1, 1)
    j = torch.arange(Nk).view(1, 1, 1, -1)
    off = (lengths - Nq).view(-1, 1, 1, 1)
    for slopes in (torch.tensor([0.5, 0.25]), torch.tensor([[0.5, 0.125], [1.0, 0.375]])):
        slopes = slopes.float()
        s = tau * torch.einsum("bihd,bjhd->bhij", q, k)
        s = c * torch.tanh(s / c)
        s = s - slopes.double().view(-1 if slopes.dim() == 2 else 1, H, 1, 1) * (i + off - j).abs()
        s = s.masked_fill(j >= lengths.view(-1, 1, 1, 1), -INF)
        want = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v)
        out, lse = attention_forward(q, k, v, softmax_scale=tau, softcap=c, alibi_slopes=slopes,
                                     seqlens_k=lengths)
        assert torch.allclose(out, want, rtol=0, atol=TOL)
        assert torch.allclose(lse, torch.logsumexp(s, -1), rtol=0, atol=TOL)
        # softcap bounds every score: |S| <= c before ALiBi.
        capped, _ = attention_forward(q * 100, k, v, softmax_scale=tau, softcap=c)
        assert torch.isfinite(capped).all()
    # The two modifications really change the result.
    assert not torch.allclose(out, attention_forward(q, k, v, softmax_scale=tau, seqlens_k=lengths)[0])


# --------------------------------------------------------------------------- sinks

def test_a_sink_is_an_extra_key_with_score_sink_and_a_zero_value_row():
    B, Nq, Nk, H, Hk, d = 2, 5, 6, 4, 2, 4
    q, k, v, _ = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=d, seed=6)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = attention_forward(q, k, v, sinks=sinks)
    # Hand-written: a sink column concatenated to the scores.
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(2, 2)) / 2.0
    s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, Nq, 1)], -1)
    p = torch.softmax(s, -1)[..., :Nk]
    assert torch.allclose(out, torch.einsum("bhij,bjhd->bihd", p, v.repeat_interleave(2, 2)), rtol=0, atol=TOL)
    assert torch.allclose(lse, torch.logsumexp(s, -1), rtol=0, atol=TOL)
    # The oracle itself, given one more key (zero k, zero v) whose score score_mod sets to sinks[h].
    zero = torch.zeros(B, 1, Hk, d, dtype=F64)
    sink64 = sinks.double()
    out_x, lse_x = attention_forward(q, torch.cat([k, zero], 1), torch.cat([v, zero], 1), softmax_scale=0.5,
                                     score_mod=lambda sc, b, h, qi, kv: torch.where(kv == Nk, sink64[h], sc))
    assert torch.allclose(out, out_x, rtol=0, atol=TOL) and torch.allclose(lse, lse_x, rtol=0, atol=TOL)
    # And it does change the output (it takes softmax mass).
    assert not torch.allclose(out, attention_forward(q, k, v)[0])


def test_rows_without_keys_give_zero_output_and_the_sink_as_lse():
    B, Nq, Nk, H = 2, 7, 4, 2
    q, k, v, dout = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=H, d=4)
    sinks = torch.tensor([0.75, -0.5])
    kwargs = {"causal": True, "seqlens_k": torch.tensor([Nk, 0]), "sinks": sinks}
    out, lse = attention_forward(q, k, v, **kwargs)
    empty = torch.zeros(B, Nq, dtype=torch.bool)
    empty[0, : Nq - Nk] = True  # causal with Nq > Nk
    empty[1] = True  # no keys at all
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    for b, i in empty.nonzero().tolist():
        assert torch.equal(lse[b, :, i], sinks.double())
    assert torch.isfinite(lse).all()
    dlse = torch.randn(B, H, Nq, dtype=F64)
    g = attention_gradients(q, k, v, dout, dlse=dlse, **kwargs)
    for name in ("dq", "dk", "dv", "dsinks"):
        assert torch.isfinite(g[name]).all(), name
    assert torch.equal(g["dq"][empty], torch.zeros_like(g["dq"][empty]))
    assert torch.equal(g["dk"][1], torch.zeros_like(g["dk"][1]))
    # d s_h = -sum_{b,i} exp(s_h - L) (D - dL), D = rowsum(dO * O); on an empty row exp(s_h - L) = 1, D = 0.
    D = (dout * out).sum(-1).transpose(1, 2)
    want = -(torch.exp(sinks.double().view(1, H, 1) - lse) * (D - dlse)).sum((0, 2))
    assert torch.allclose(g["dsinks"], want, rtol=0, atol=TOL)


# --------------------------------------------------------------------------- score_mod / mask_mod

def test_score_mod_and_mask_mod_are_evaluated_once_on_broadcast_indices():
    B, Nq, Nk, H = 2, 3, 5, 2
    q, k, v, _ = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=1, d=4)
    calls = []

    def score_mod(s, b, h, qi, kv):
        calls.append(("score", tuple(s.shape), s.dtype, tuple(b.shape), tuple(h.shape),
                      tuple(qi.shape), tuple(kv.shape), b.dtype, kv.dtype))
        return s + 0.25 * (qi - kv)

    def mask_mod(b, h, qi, kv):
        calls.append(("mask", tuple(b.shape), tuple(h.shape), tuple(qi.shape), tuple(kv.shape), qi.dtype))
        return kv <= qi + h

    attention_forward(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    assert sorted(calls) == sorted([
        ("score", (B, H, Nq, Nk), F64, (B, 1, 1, 1), (1, H, 1, 1), (1, 1, Nq, 1), (1, 1, 1, Nk),
         torch.int64, torch.int64),
        ("mask", (B, 1, 1, 1), (1, H, 1, 1), (1, 1, Nq, 1), (1, 1, 1, Nk), torch.int64)])


GRAD_VARIANTS = ("relbias", "nonlinear", "softcap", "alibi_bh", "window_causal", "head_mask", "everything")


def directional_check(loss, tensors, grads, gen, eps=1e-6):
    """<grad, u> against the central difference of `loss` along u, for two random u per tensor."""
    for n, (t, g) in enumerate(zip(tensors, grads)):
        for _ in range(2):
            u = torch.randn(t.shape, generator=gen, dtype=F64)
            with torch.no_grad():
                t += eps * u
                up = loss()
                t -= 2 * eps * u
                down = loss()
                t += eps * u
            fd = (up - down) / (2 * eps)
            analytic = float((g * u).sum())
            assert abs(analytic - fd) <= 1e-7 * (1 + abs(fd)), (n, analytic, fd)


@pytest.mark.parametrize("name", GRAD_VARIANTS)
def test_gradients_match_finite_differences(name):
    B, Nq, Nk, H, Hk, d = 2, 5, 6, 4, 2, 4
    q, k, v, dout = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=d, seed=11)
    kwargs, captures = variant(name, B, H, Nq, Nk, grad=True)
    gen = torch.Generator().manual_seed(4)
    _, lse = attention_forward(q, k, v, **kwargs)
    dlse = torch.randn(B, H, Nq, generator=gen, dtype=F64).masked_fill(torch.isinf(lse), 0.0)
    g = attention_gradients(q, k, v, dout, dlse=dlse, captures=captures, **kwargs)
    assert set(g) >= {"dq", "dk", "dv", "captures"}
    assert ("dsinks" in g) == ("sinks" in kwargs)
    assert len(g["captures"]) == len(captures)
    for c, gc in zip(captures, g["captures"]):
        assert gc.shape == c.shape and gc.dtype == F64 and (gc != 0).any()
        assert c.grad is None, "attention_gradients must not accumulate into .grad"
    q, k, v = (t.clone() for t in (q, k, v))
    tensors = [q, k, v] + captures + ([kwargs["sinks"]] if "sinks" in kwargs else [])
    grads = [g["dq"], g["dk"], g["dv"]] + list(g["captures"]) + ([g["dsinks"]] if "sinks" in kwargs else [])

    def loss():
        out, lse = attention_forward(q, k, v, **kwargs)
        return float((out * dout).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * dlse).sum())

    for name_, t in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(t).all(), name_
    directional_check(loss, tensors, grads, gen)


def test_gradients_match_an_independent_autograd_through_the_loop():
    """The relative-position table's gradient, through the scalar loop (a different graph)."""
    B, Nq, Nk, H = 1, 3, 4, 2
    q, k, v, dout = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=1, d=2, seed=2)
    kwargs, (bias,) = variant("relbias", B, H, Nq, Nk, grad=True)
    sinks = torch.tensor([0.3, -0.2], dtype=F64, requires_grad=True)
    g = attention_gradients(q, k, v, dout, captures=[bias], sinks=sinks, window_size=(1, 1), **kwargs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = loop_forward(*leaves, sinks=sinks, window_size=(1, 1), **kwargs)
    want = torch.autograd.grad((out * dout).sum(), leaves + [bias, sinks])
    got = [g["dq"], g["dk"], g["dv"], g["captures"][0], g["dsinks"]]
    for name, a, b in zip(("dq", "dk", "dv", "bias", "sinks"), got, want):
        assert torch.allclose(a, b, rtol=0, atol=TOL), name


# --------------------------------------------------------------------------- dlse closed form

def sum_groups(x, Hk):
    B, H, N, d = x.shape
    return x.reshape(B, Hk, H // Hk, N, d).sum(2)


@pytest.mark.parametrize("case", ["plain", "everything"])
def test_dlse_gradients_equal_the_closed_form(case):
    B, Nq, Nk, H, Hk, d = 2, 7, 5, 4, 2, 4
    q, k, v, dout = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=d, seed=8)
    kwargs = case_kwargs(case, B, H, Nq, Nk)  # "everything": causal (empty rows), padding, dropout
    dlse = torch.randn(B, H, Nq, dtype=F64)
    g = attention_gradients(q, k, v, dout, dlse=dlse, **kwargs)
    # By hand, head-major.
    tau = kwargs.get("softmax_scale", 1 / math.sqrt(d))
    lengths = [int(x) for x in kwargs["seqlens_k"]] if "seqlens_k" in kwargs else [Nk] * B
    vis = brute_visible(Nq, Nk, lengths, kwargs.get("causal", False), (-1, -1)).unsqueeze(1)
    Q, K, V, dO = (t.transpose(1, 2) for t in (q, k, v, dout))
    K, V = K.repeat_interleave(H // Hk, 1), V.repeat_interleave(H // Hk, 1)
    S = (tau * Q @ K.transpose(-1, -2)).masked_fill(~vis, -INF)
    P = torch.softmax(S, -1).nan_to_num(0.0)  # rows that see no key: P = 0
    Z = torch.ones_like(P) if "keep_mask" in kwargs else None
    if Z is not None:
        Z = kwargs["keep_mask"].double() / (1 - kwargs["dropout_p"])
    PZ = P if Z is None else P * Z
    O = PZ @ V
    dP = dO @ V.transpose(-1, -2)
    if Z is not None:
        dP = dP * Z
    D = (dO * O).sum(-1, keepdim=True)  # = rowsum(P * dP)
    dS = P * (dP - (D - dlse.unsqueeze(-1)))
    want = {"dq": tau * dS @ K, "dk": sum_groups(tau * dS.transpose(-1, -2) @ Q, Hk),
            "dv": sum_groups(PZ.transpose(-1, -2) @ dO, Hk)}
    for name, w in want.items():
        got = g[name]
        assert torch.isfinite(got).all()
        assert torch.allclose(got, w.transpose(1, 2), rtol=0, atol=TOL), (name, (got - w.transpose(1, 2)).abs().max())
    # dlse matters, and without it the closed forms of attention_backward come back.
    plain = attention_gradients(q, k, v, dout, **kwargs)
    assert not torch.allclose(plain["dq"], g["dq"])
    closed = attention_backward(q, k, v, plain["out"], dout, **kwargs)
    for name, c in zip(("dq", "dk", "dv"), closed):
        assert torch.allclose(plain[name], c, rtol=0, atol=TOL), name


# --------------------------------------------------------------------------- unchanged plain calls

def old_attention_forward(q, k, v, *, softmax_scale=None, causal=False, seqlens_k=None,
                          dropout_p=0.0, keep_mask=None):
    """A copy of the oracle before the variants, inlined."""
    B, Nq, H, d = q.shape
    Nk, Hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    lengths = [Nk] * B if seqlens_k is None else [int(x) for x in seqlens_k]
    i, j = torch.arange(Nq).unsqueeze(1), torch.arange(Nk).unsqueeze(0)
    vis = []
    for b in range(B):
        seen = j < lengths[b]
        if causal:
            seen = seen & (j <= i + (lengths[b] - Nq))
        vis.append(seen.expand(Nq, Nk))
    vis = torch.stack(vis).unsqueeze(1)
    qh, kh, vh = (t.to(F64).transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(H // Hk, dim=1), vh.repeat_interleave(H // Hk, dim=1)
    scores = (scale * qh @ kh.transpose(-1, -2)).masked_fill(~vis, float("-inf"))
    m = scores.amax(-1)
    un = torch.exp(scores - safe_max(m).unsqueeze(-1))
    l = un.sum(-1)
    probs = un * safe_reciprocal(l).unsqueeze(-1)
    if keep_mask is not None and dropout_p > 0:
        probs = probs * (keep_mask.to(F64) / (1.0 - dropout_p))
    return (probs @ vh).transpose(1, 2).contiguous(), lse_from_stats(m, l), vis


def old_attention_same_dtype(q, k, v, dout, vis, scale, z=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(1, 2) for t in leaves)
    g = q.shape[2] // k.shape[2]
    kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
    scores = ((qh @ kh.transpose(-1, -2)) * scale).masked_fill(~vis, float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~vis.any(-1, keepdim=True), 0.0)
    if z is not None:
        probs = probs * z.to(probs.dtype)
    out = (probs @ vh).transpose(1, 2)
    out.backward(dout.to(out.dtype))
    return (out.detach(), *(t.grad for t in leaves))


DEFAULTS = {"window_size": (-1, -1), "softcap": 0.0, "alibi_slopes": None, "score_mod": None,
            "mask_mod": None, "sinks": None}


@pytest.mark.parametrize("case", ["plain", "causal", "everything"])
def test_plain_calls_are_bit_identical_to_before(case):
    B, Nq, Nk, H, Hk = 2, 9, 6, 4, 2
    q, k, v, dout = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=8, seed=9)
    kwargs = case_kwargs(case, B, H, Nq, Nk)
    out, lse = attention_forward(q, k, v, **kwargs)
    old_out, old_lse, vis = old_attention_forward(q, k, v, **kwargs)
    assert torch.equal(out, old_out) and torch.equal(lse, old_lse)
    assert torch.equal(make_problem(q, k, v, **kwargs).visible_all(), vis)
    out2, lse2 = attention_forward(q, k, v, **kwargs, **DEFAULTS)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    # attention_gradients without variants = the closed forms.
    g = attention_gradients(q, k, v, dout, **kwargs)
    for name, c in zip(("dq", "dk", "dv"), attention_backward(q, k, v, out, dout, **kwargs)):
        assert torch.allclose(g[name], c, rtol=0, atol=TOL), name
    # The same-dtype yardstick, in bf16.
    qb, kb, vb, db = (t.bfloat16() for t in (q, k, v, dout))
    prob = make_problem(qb, kb, vb, **kwargs)
    old = old_attention_same_dtype(qb, kb, vb, db, vis, prob.scale, prob.dropout_factor_all())
    new = attention_same_dtype(qb, kb, vb, db, **kwargs)
    new2 = attention_same_dtype(qb, kb, vb, db, **kwargs, **DEFAULTS)
    assert len(new) == 4
    for a, b, c in zip(old, new, new2):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b) and torch.equal(a, c)


# --------------------------------------------------------------------------- same-dtype yardstick

@pytest.mark.parametrize("name", ["everything", "relbias", "alibi_bh", "window_causal", "prefix_lm"])
def test_same_dtype_in_float64_equals_the_oracle(name):
    """Run in float64 the yardstick computes the oracle's values: the variants
    mean the same thing in both (its ALiBi bias is computed in the wider of
    fp32 and the dtype)."""
    B, Nq, Nk, H, Hk = 2, 5, 6, 4, 2
    q, k, v, dout = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=4, seed=12)
    kwargs, captures = variant(name, B, H, Nq, Nk, grad=True)
    _, lse = attention_forward(q, k, v, **kwargs)
    dlse = torch.randn(B, H, Nq, dtype=F64).masked_fill(torch.isinf(lse), 0.0)
    want = attention_gradients(q, k, v, dout, dlse=dlse, captures=captures, **kwargs)
    out, dq, dk, dv, extra = attention_same_dtype(q, k, v, dout, dlse=dlse, captures=captures,
                                                  return_extra=True, **kwargs)
    for nm, a in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.allclose(a, want[nm], rtol=0, atol=1e-10), nm
    assert_lse_equal(extra["lse"], want["lse"], tol=1e-10)
    assert (extra["dsinks"] is None) == ("sinks" not in kwargs)
    if "sinks" in kwargs:
        assert torch.allclose(extra["dsinks"], want["dsinks"], rtol=0, atol=1e-10)
    assert len(extra["captures"]) == len(captures)
    for a, b in zip(extra["captures"], want["captures"]):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_same_dtype_variants_in_bf16_are_close_and_finite():
    B, Nq, Nk, H, Hk = 2, 5, 6, 4, 2
    q, k, v, dout = make_inputs(B=B, Nq=Nq, Nk=Nk, H=H, Hk=Hk, d=8, seed=13)
    kwargs, captures = variant("everything", B, H, Nq, Nk, grad=True)
    kwargs["sinks"] = kwargs["sinks"].detach().float()
    lo = [t.bfloat16() for t in (q, k, v, dout)]
    out, dq, dk, dv, extra = attention_same_dtype(*lo, captures=captures, return_extra=True, **kwargs)
    want = attention_gradients(*(t.double() for t in lo), captures=captures, **kwargs)
    assert out.dtype == dq.dtype == extra["lse"].dtype == torch.bfloat16
    assert extra["dsinks"].dtype == torch.float32 and extra["dsinks"].shape == (H,)
    for nm, a in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("lse", extra["lse"]),
                  ("dsinks", extra["dsinks"]), ("captures", extra["captures"][0])):
        w = want[nm] if nm != "captures" else want["captures"][0]
        assert torch.isfinite(a).all(), nm
        assert (a.double() - w).abs().max() < 0.1 * (1 + w.abs().max()), nm
    # Without sinks a row that sees no key has lse +inf here too.
    _, _, _, _, extra = attention_same_dtype(*lo, causal=True, seqlens_k=torch.tensor([Nk, 0]),
                                             return_extra=True)
    assert torch.isinf(extra["lse"][1]).all() and (extra["lse"][1] > 0).all()


# --------------------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("bad, message", [
    ({"window_size": (1,)}, "window_size"),
    ({"window_size": (1, 2, 3)}, "window_size"),
    ({"window_size": (-2, 0)}, "window_size"),
    ({"window_size": (0, -5)}, "window_size"),
    ({"window_size": (1.5, 2)}, "window_size"),
    ({"window_size": (True, 2)}, "window_size"),
    ({"window_size": 3}, "window_size"),
    ({"softcap": -1.0}, "softcap"),
    ({"softcap": float("nan")}, "softcap"),
    ({"softcap": "1"}, "softcap"),
    ({"alibi_slopes": torch.ones(3)}, "alibi_slopes"),
    ({"alibi_slopes": torch.ones(2, 2, 1)}, "alibi_slopes"),
    ({"alibi_slopes": torch.ones(3, 2)}, "alibi_slopes"),
    ({"alibi_slopes": torch.ones(2, dtype=F64)}, "alibi_slopes"),
    ({"alibi_slopes": [0.5, 0.25]}, "alibi_slopes"),
    ({"sinks": torch.ones(3)}, "sinks"),
    ({"sinks": torch.ones(2, 1)}, "sinks"),
    ({"sinks": torch.ones(2, dtype=torch.int32)}, "sinks"),
    ({"score_mod": 3}, "score_mod"),
    ({"mask_mod": "causal"}, "mask_mod"),
    ({"mask_mod": lambda b, h, qi, kv: (kv <= qi).float()}, "mask_mod"),
    ({"score_mod": lambda s, b, h, qi, kv: s[..., :1, :2]}, "score_mod"),
])
def test_bad_variant_arguments_are_rejected_by_name(bad, message):
    q, k, v, dout = make_inputs(B=2, Nq=4, Nk=5, H=2, Hk=2, d=4)
    with pytest.raises(ValueError, match=message):
        attention_forward(q, k, v, **bad)
    with pytest.raises(ValueError, match=message):
        attention_same_dtype(q, k, v, dout, **bad)
    with pytest.raises(ValueError, match=message):
        attention_gradients(q, k, v, dout, **bad)


def test_bad_gradient_arguments_are_rejected_by_name():
    q, k, v, dout = make_inputs(B=2, Nq=4, Nk=5, H=2, Hk=2, d=4)
    with pytest.raises(ValueError, match="dlse"):
        attention_gradients(q, k, v, dout, dlse=torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match="dout"):
        attention_gradients(q, k, v, dout[:, :3])
    with pytest.raises(ValueError, match="captures"):
        attention_gradients(q, k, v, dout, captures=[torch.zeros(3)])
    with pytest.raises(ValueError, match="dlse"):
        attention_same_dtype(q, k, v, dout, dlse=torch.zeros(2, 2))

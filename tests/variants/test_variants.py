"""The variant language (fagen.variants): tracing, canonical specs, clear errors, and the
tile classification's soundness on small symbolic tiles."""

import random

import pytest
import sympy as sp
import torch

import fagen
from fagen.kernels.render import render
from fagen.spec import Spec
from fagen.ops.variant_args import variant_call
from fagen.variants import ModError, custom_mod, trace_mask_mod, trace_score_mod, variant_math
from fagen.variants.compose import KEYS, SEQLEN_Q, WINDOW_LEFT, WINDOW_RIGHT
from fagen.variants.language import B, KV_IDX, Q_IDX, SCORE
from fagen.variants.tiles import KV_HI, KV_LO, Q_HI, Q_LO, classify, key_range, query_range, summaries


def q_k(heads=2, d=64):
    return torch.randn(1, 8, heads, d, dtype=torch.float16), torch.randn(1, 8, heads, d, dtype=torch.float16)


# -- tracing ------------------------------------------------------------------------------------

def test_traced_expressions():
    bias = torch.randn(4, 100)
    doc = torch.zeros(2, 50, dtype=torch.int32)
    assert trace_score_mod(lambda s, b, h, q, k: s * torch.sigmoid(s)).expr == SCORE / (1 + sp.exp(-SCORE))
    traced = trace_score_mod(lambda s, b, h, q, k: s + bias[h, q - k + 49])
    assert traced.tensors == (bias,) and str(traced.expr) == "score + cap0(h, -kv_idx + q_idx + 49)"
    assert str(trace_mask_mod(lambda b, h, q, k: doc[b, q] == doc[b, k]).expr) == "Eq(cap0(b, q_idx), cap0(b, kv_idx))"
    assert trace_mask_mod(lambda b, h, q, k: (k <= q) | ~(k > 3)).expr == sp.Or(KV_IDX <= Q_IDX, sp.Not(KV_IDX > 3))
    assert trace_score_mod(lambda s, b, h, q, k: fagen.where(q >= k, s, s - 1.0)).expr == \
        sp.Piecewise((SCORE, Q_IDX >= KV_IDX), (SCORE - 1.0, True))
    assert trace_score_mod(lambda s, b, h, q, k: fagen.maximum(s, 0.0) + abs(s) + s.tanh()).expr == \
        sp.Max(SCORE, 0.0) + sp.Abs(SCORE) + sp.tanh(SCORE)
    assert trace_score_mod(lambda s, b, h, q, k: torch.exp(s) - torch.log(s) + torch.sqrt(s)).expr == \
        sp.exp(SCORE) - sp.log(SCORE) + sp.sqrt(SCORE)


def test_equal_expressions_give_one_spec_and_values_never_recompile():
    a, b = torch.randn(4, 100), torch.randn(4, 100)
    one = custom_mod(trace_score_mod(lambda s, b_, h, q, k: s + a[h, q - k]))
    two = custom_mod(trace_score_mod(lambda score, batch, head, i, j: score + b[head, i - j]))
    assert one == two and Spec(64, score_mod=one).name == Spec(64, score_mod=two).name
    assert Spec(64, score_mod=one).name.startswith("fa2_d64_smod")
    other_dtype = custom_mod(trace_score_mod(lambda s, b_, h, q, k: s + a.half()[h, q - k]))
    assert other_dtype != one   # the captured tensor's dtype is part of the variant
    graded = custom_mod(trace_score_mod(lambda s, b_, h, q, k: s + a.requires_grad_()[h, q - k]))
    assert graded != one and graded.grads == (True,)


def test_builtin_names_round_trip_and_custom_names_say_why_not():
    spec = Spec(64, mask="causal", window=True, softcap=True, dtype="bf16")
    assert spec.name == "fa2_d64_causal_window_softcap_bf16" and Spec.from_name(spec.name) == spec
    full = Spec(128, version=1, window=True, softcap=True, alibi=True, sinks=True, dropout=True)
    assert Spec.from_name(full.name) == full
    custom = Spec(64, mask_mod=custom_mod(trace_mask_mod(lambda b, h, q, k: q >= k)))
    with pytest.raises(ValueError, match="custom mask_mod by its hash"):
        Spec.from_name(custom.name)


def test_specs_without_variants_read_as_before():
    assert "window" not in Spec(64).to_dict() and "score_mod" not in Spec(64).to_dict()
    assert Spec.from_dict(Spec(64, softcap=True).to_dict()) == Spec(64, softcap=True)


def test_generated_cuda_carries_the_users_expression():
    code = render(Spec(64, score_mod=custom_mod(trace_score_mod(lambda s, b, h, q, k: s * torch.sigmoid(s))))).code
    assert "(score_mod: score/(1 + exp(-score)))" in code
    assert "__device__ __forceinline__ float score_mod_grad(" in code


# -- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("mod", "message"), [
    (lambda s, b, h, q, k: s if q > k else 0.0, "fagen.where"),
    (lambda s, b, h, q, k: max(s, 0.0), "fagen.where"),
    (lambda s, b, h, q, k: torch.cos(s), "unsupported operation in a mod: torch.cos"),
    (lambda s, b, h, q, k: s.cosh(), r"unsupported operation in a mod: \.cosh\(\)"),
    (lambda s, b, h, q, k: q > k, "must return a score"),
    (lambda s, b, h, q, k: torch.ones(3), "returned a tensor of shape"),
    (lambda s, b, h, q, k: torch.ones(3, dtype=torch.complex64)[q], "dtype torch.complex64"),
    (lambda s, b, h, q, k: torch.ones(3, 3)[q], "index every dimension"),
    (lambda s, b, h, q, k: torch.ones(3)[s], "not an integer expression"),
])
def test_score_mod_errors(mod, message):
    with pytest.raises(ModError, match=message):
        trace_score_mod(mod)


def test_mask_mod_must_be_boolean():
    with pytest.raises(ModError, match="not a boolean"):
        trace_mask_mod(lambda b, h, q, k: q - k)
    with pytest.raises(ModError, match="fagen.where"):
        trace_mask_mod(lambda b, h, q, k: q >= k and k > 0)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"window_size": (3,)}, ValueError, "window_size must be a pair"),
    ({"window_size": (-2, 0)}, ValueError, "window_size must be a pair"),
    ({"softcap": -1.0}, ValueError, "softcap must be a float >= 0"),
    ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes must have shape \(2,\) or \(1, 2\)"),
    ({"alibi_slopes": torch.ones(2, dtype=torch.float64)}, TypeError, "alibi_slopes must be float32"),
    ({"alibi_slopes": [0.5, 0.25]}, TypeError, "alibi_slopes must be a torch.Tensor"),
    ({"sinks": torch.ones(1, 2)}, ValueError, r"sinks must have shape \(2,\)"),
    ({"sinks": torch.ones(2, device="meta")}, ValueError, "sinks must be on q's device"),
    ({"score_mod": lambda s, b, h, q, k: s + torch.ones(8, device="meta")[h]}, ValueError,
     "captured tensors must be on q's device"),
])
def test_bad_variant_arguments(kwargs, error, message):
    q, k = q_k()
    with pytest.raises(error, match=message):
        variant_call(q, k, causal=False, **kwargs)


def test_bad_arguments_reach_the_user_from_the_op():
    q, k = q_k()
    with pytest.raises(ValueError, match="softcap must be a float >= 0"):
        fagen.flash_attn_func(q, k, k, softcap=-2.0)


def test_causal_sets_the_right_window_to_zero_and_unbounded_windows_vanish():
    q, k = q_k()
    assert variant_call(q, k, causal=True, window_size=(-1, 5)) is None
    assert variant_call(q, k, causal=False, window_size=(-1, -1)) is None
    call = variant_call(q, k, causal=True, window_size=(3, 5))
    assert call.values == {"window_left": 3, "window_right": 0} and call.spec_fields["window"]


# -- tile classification ----------------------------------------------------------------------------

def _mask(spec):
    return variant_math(spec).mask


PREFIX = sp.Function("mask_cap0", integer=True)


@pytest.mark.parametrize("mask", [
    _mask(Spec(64, mask="causal", window=True)),
    pytest.param(_mask(Spec(64, window=True)), marks=pytest.mark.slow),   # the causal window's two bounds, one here
    sp.And(KV_IDX < KEYS, sp.Or(KV_IDX <= Q_IDX, KV_IDX < PREFIX(B))),   # prefix-LM
    pytest.param(sp.And(KV_IDX < KEYS, sp.Not(sp.Eq(Q_IDX, KV_IDX))), marks=pytest.mark.slow),
], ids=["causal_window", "window", "prefix_lm", "not_diagonal"])
def test_tile_classes_and_ranges_are_sound_on_small_tiles(mask):
    """Exhaustively over random small problems and tiles: a tile classified full has every
    pair visible, one classified empty none; the key and query ranges contain every visible
    pair; for these masks of linear atoms the classes are also exact."""
    full, empty = classify(mask)
    keys, queries = key_range(mask), query_range(mask)
    rng = random.Random(0)
    for _ in range(150):
        nq, nk = rng.randint(1, 24), rng.randint(1, 24)
        env = {SEQLEN_Q: nq, KEYS: nk, WINDOW_LEFT: rng.randint(0, 9), WINDOW_RIGHT: rng.randint(0, 9)}
        prefix = rng.randint(0, nk)
        concrete = mask.replace(PREFIX, lambda b: sp.Integer(prefix)).subs(env)
        at = sp.lambdify((Q_IDX, KV_IDX), concrete)
        visible = [[bool(at(i, j)) for j in range(nk)] for i in range(nq)]
        q_lo, k_lo = rng.randrange(nq), rng.randrange(nk)
        q_hi, k_hi = min(nq - 1, q_lo + rng.randint(0, 6)), min(nk - 1, k_lo + rng.randint(0, 6))
        box = {**env, Q_LO: q_lo, Q_HI: q_hi, KV_LO: k_lo, KV_HI: k_hi}
        subs = lambda e: e.replace(PREFIX, lambda b: sp.Integer(prefix)).subs(box)  # noqa: E731
        cells = [visible[i][j] for i in range(q_lo, q_hi + 1) for j in range(k_lo, k_hi + 1)]
        assert bool(subs(full)) == all(cells) and bool(subs(empty)) == (not any(cells))
        first, last = int(subs(keys.first)), int(subs(keys.last))
        assert all(first <= j <= last for i in range(q_lo, q_hi + 1) for j in range(nk) if visible[i][j])
        first, last = int(subs(queries.first)), int(subs(queries.last))
        assert all(first <= i <= last for j in range(k_lo, k_hi + 1) for i in range(nq) if visible[i][j])


def test_document_masks_are_classified_from_per_tile_id_ranges():
    """An id equality across q_idx and kv_idx is decided from the tile's id ranges: all one id
    is full, disjoint ranges are empty, anything else partial (sound for any ids)."""
    doc = sp.Function("mask_cap0", integer=True)
    mask = sp.And(KV_IDX < KEYS, sp.Eq(doc(B, Q_IDX), doc(B, KV_IDX)))
    (summary,) = summaries(mask)
    assert (summary.capture, summary.dim, summary.others) == ("mask_cap0", 1, (B,))
    full, empty = classify(mask)
    bounds = [summary.bound(side, which) for side in ("q", "kv") for which in ("min", "max")]
    rng = random.Random(1)
    for _ in range(300):
        ids = sorted(rng.randint(0, 3) for _ in range(12))
        q_lo, k_lo = rng.randrange(12), rng.randrange(12)
        q_hi, k_hi = min(11, q_lo + rng.randint(0, 4)), min(11, k_lo + rng.randint(0, 4))
        rows, cols = ids[q_lo:q_hi + 1], ids[k_lo:k_hi + 1]
        box = {KEYS: 12, Q_LO: q_lo, Q_HI: q_hi, KV_LO: k_lo, KV_HI: k_hi,
               **dict(zip(bounds, (min(rows), max(rows), min(cols), max(cols))))}
        cells = [a == b for a in rows for b in cols]
        assert bool(full.subs(box)) == all(cells) and (not bool(empty.subs(box)) or not any(cells))
    assert summaries(sp.Eq(doc(B, Q_IDX), doc(Q_IDX, KV_IDX))) == []   # not the document pattern


def test_masks_no_tile_bound_decides_are_reported(caplog):
    table = torch.zeros(4, 4, dtype=torch.bool)
    mod = custom_mod(trace_mask_mod(lambda b, h, q, k: table[q % 4, k % 4] | (q * q > k)))
    with caplog.at_level("WARNING", logger="fagen"):
        render(Spec(64, mask_mod=mod))
    assert "not decided per tile" in caplog.text and "q_idx**2" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fagen"):
        render(Spec(64, window=True))
    assert "not decided per tile" not in caplog.text


def test_verify_proves_the_derivative_the_cuda_computes(monkeypatch):
    from fagen import identities
    from fagen.variants import cuda

    bias = torch.zeros(2, 64, requires_grad=True)
    spec = Spec(64, softcap=True, score_mod=custom_mod(trace_score_mod(
        lambda s, b, h, q, k: s * torch.sigmoid(s) + bias[h, q - k + 32])))
    emitted = [i for i in identities.for_spec(spec) if i.name.startswith("emitted score chain")]
    assert any("score_cap0" in i.name for i in emitted) and len(emitted) >= 2
    assert all(r.ok for r in identities.run(emitted))
    real = cuda.emitted_score_grad
    monkeypatch.setattr(cuda, "emitted_score_grad", lambda math: (real(math)[0] * 2, real(math)[1]))
    wrong = [i for i in identities.for_spec(spec) if i.name.startswith("emitted score chain") and "ds'/dx" in i.name]
    assert [r.ok for r in identities.run(wrong)] == [False]


@pytest.mark.parametrize("text", ["x / (y + 1)**2", "exp(-x) / (exp(-x) + 1)**2", "x * y**-3 - 1 / (x * y)**2",
                                  "1 - tanh(x / 3)**2", "(x + y)**4 / (2 + y**2)"])
def test_printed_cuda_keeps_the_expression_s_value(text):
    # The identities prove the sympy expressions; this checks that their C text computes them
    # (a printed `a/(t1) * (t1)` for a / t1**2 once made sigmoid's derivative exp(-t0)).
    import math

    from fagen.variants.cuda import CudaPrinter

    x, y = sp.symbols("x y", real=True)
    expr = sp.sympify(text, locals={"x": x, "y": y})
    printed = CudaPrinter().doprint(expr)
    python = (printed.replace("expf", "math.exp").replace("tanhf", "math.tanh").replace("powf", "math.pow")
              .replace("1.0f", "1.0").replace("F", ""))
    for xv, yv in ((0.3, 1.7), (-1.2, 0.4), (2.5, -0.8)):
        want = float(expr.subs({x: xv, y: yv}))
        got = eval(python, {"math": math, "x": xv, "y": yv})
        assert got == pytest.approx(want, rel=1e-12), (printed, got, want)


def _python_of_printed_c(printed: str) -> str:
    """CudaPrinter's C text as Python (the same precedence for + - * /): functions renamed and
    float literals' suffixes dropped."""
    import re

    for c, py in (("expf", "math.exp"), ("tanhf", "math.tanh"), ("fabsf", "abs"), ("fmaxf", "max"),
                  ("fminf", "min"), ("powf", "math.pow"), ("logf", "math.log"), ("sqrtf", "math.sqrt")):
        printed = printed.replace(c + "(", py + "(")
    return re.sub(r"(\d\.?\d*(?:e[-+]?\d+)?)[fF]\b", r"\1", printed)


def test_printed_cuda_of_random_expressions_keeps_their_values():
    # Insurance for the printer, whose output the identities do not see: random expressions of
    # the shapes score chains take (quotients, small powers, exp, tanh, abs, min/max).
    import math

    from fagen.variants.cuda import CudaPrinter

    x, y = sp.symbols("x y", real=True)
    rng = random.Random(11)

    def leaf():
        return rng.choice([x, y, sp.Rational(rng.randint(1, 9), rng.randint(1, 4))])

    def grow(depth):
        if depth == 0:
            return leaf()
        a, b = grow(depth - 1), grow(depth - 1)
        kind = rng.randrange(8)
        return [a + b, a - b, a * b, a / (b ** 2 + 1), (a + 2) ** rng.choice([-3, -2, -1, 2, 3, 4]),
                sp.exp(-sp.Abs(a)), sp.tanh(a) * b, sp.Max(a, b) - sp.Min(a, 2 * b)][kind]

    checked = 0
    for _ in range(150):
        expr = grow(3)
        printed = _python_of_printed_c(CudaPrinter().doprint(expr))
        for xv, yv in ((0.3, 1.7), (-1.2, 0.4)):
            want = complex(expr.subs({x: xv, y: yv}).evalf())
            if want.imag or not math.isfinite(want.real) or abs(want.real) > 1e12:
                continue
            got = eval(printed, {"math": math, "x": xv, "y": yv})
            assert got == pytest.approx(want.real, rel=1e-9, abs=1e-12), (expr, printed)
            checked += 1
    assert checked > 200

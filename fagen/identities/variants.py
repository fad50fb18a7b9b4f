"""Symbolic proofs of what the attention variants rely on (flash-attn 2.8 semantics).

The forward of every variant is one computation: S' = f(X) entrywise on the
scaled score X = tau Q K^T (f: softcap, ALiBi, a traced score_mod; masked
entries -inf), L_i = log(sum_j exp(S'_ij) [+ exp(sink)]), P = exp(S' - L),
O = P V. Its backward, with upstream gradients dO on O and dL on L, is

    dS' = P o (dP - (D - dL) 1^T),  D = rowsum(dO o O),  dP = dO V^T
    dX  = f'(X) o dS'               (then dQ = tau dX K, dK = tau dX^T Q)
    dsink = -sum_i P_sink,i (D_i - dL_i),  P_sink,i = exp(sink - L_i)

and a captured tensor element c = bias[idx] gets the sum of dS'_ij ds'/dc over
the (i, j) that load it. The identities here prove each part on fully
symbolic small matrices, as `core`'s do. `mod_identities` proves, for one
score mod, that the derivative the CUDA code emits is the derivative of the
forward's expression, and instantiates the chain rule with it.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Callable

import sympy as sp
from sympy.core.function import AppliedUndef

from fagen.spec import Spec
from fagen.variants.builtins import ALIBI, SINKS, SOFTCAP

from .core import Identity, _masking, equal, frobenius, gradient, is_zero, matrix, rowsum, softmax_rows

__all__ = ["NUMERIC_POINTS", "VARIANT_IDENTITIES", "attention_backward", "attention_forward", "derivative_is",
           "mod_identities", "numerically_equal", "sink_gradient", "sink_is_extra_key"]

NUMERIC_POINTS = 8  # random rational points of a numeric check

# ---------------------------------------------------------------- forward and backward of the variants


def _delta(D: sp.Matrix, dL: sp.Matrix) -> sp.Matrix:
    """The row term the kernel subtracts from dP: D - dL (D alone without an lse gradient)."""
    return D - dL


def attention_forward(X: sp.Matrix, V: sp.Matrix, *, mod: Callable | None = None, sink=None,
                      mask: Callable | None = None):
    """S' = mod(X) entrywise, -inf where mask(i, j) is False; L_i = log(sum_j exp(S'_ij)
    [+ exp(sink)]); P = exp(S' - L); O = P V. Returns (S', P, L, O, P_sink), P_sink a
    column of exp(sink - L_i) (None without a sink)."""
    n, m = X.shape
    scores = sp.Matrix(n, m, lambda i, j: (mod(X[i, j]) if mod else X[i, j])
                       if mask is None or mask(i, j) else sp.S.NegativeInfinity)
    extra = sp.exp(sink) if sink is not None else sp.Integer(0)
    L = sp.Matrix(n, 1, lambda i, _: sp.log(sum(sp.exp(s) for s in scores.row(i)) + extra))
    P = sp.Matrix(n, m, lambda i, j: sp.exp(scores[i, j] - L[i]))
    P_sink = sp.Matrix(n, 1, lambda i, _: sp.exp(sink - L[i])) if sink is not None else None
    return scores, P, L, P * V, P_sink


# The -inf masks the identities use: causal (every row sees a key), and strictly
# causal, whose first row sees none (with a sink, such a row has L = sink and P = 0).
MASKS = {"causal": lambda i, j: j <= i, "empty first row": lambda i, j: j < i}


def _problem(n: int, d: int, *, mod=False, sink=False, lse=False, masked=None):
    """A fully symbolic n x n problem: X, V, dO (and dL, sink where asked), the forward,
    the loss <dO, O> + <dL, L>, and the kernel's dS' = P o (dP - (D - dL) 1^T)."""
    X, V, dO = matrix("X", n, n), matrix("V", n, d), matrix("dO", n, d)
    dL = matrix("dL", n, 1) if lse else sp.zeros(n, 1)
    sink_logit = sp.Symbol("sink", real=True) if sink else None
    f = sp.Function("f") if mod else None
    mask = MASKS[masked] if masked else None
    _, P, L, O, P_sink = attention_forward(X, V, mod=f, sink=sink_logit, mask=mask)
    loss = frobenius(dO, O) + frobenius(dL, L)
    D = rowsum(dO.multiply_elementwise(O))
    dS = P.multiply_elementwise(dO * V.T - _delta(D, dL) * sp.ones(1, n))
    return {"X": X, "V": V, "dO": dO, "dL": dL, "sink": sink_logit, "f": f, "P": P, "L": L, "O": O,
            "P_sink": P_sink, "loss": loss, "D": D, "dS": dS}


def attention_backward(n: int, d: int, *, mod=False, sink=False, lse=False, masked=None) -> bool:
    """The gradient of <dO, O> + <dL, L> wrt X is f'(X) o P o (dP - (D - dL) 1^T) with
    D = rowsum(dO o O): for f an undefined function (mod), a sink logit in every row's
    denominator (sink), a nonzero dL (lse) and a mask of -inf entries (masked: a MASKS key),
    each as asked; without them it is the plain softmax backward."""
    pr = _problem(n, d, mod=mod, sink=sink, lse=lse, masked=masked)
    X = pr["X"]
    chain = X.applyfunc(lambda x: sp.diff(pr["f"](x), x)) if mod else sp.ones(n, n)
    return equal(gradient(pr["loss"], X), chain.multiply_elementwise(pr["dS"]))


def sink_gradient(n: int, d: int, masked=None) -> bool:
    """d(<dO, O> + <dL, L>)/d sink = -sum_i P_sink,i (D_i - dL_i), D = rowsum(dO o O)
    (under a MASKS mask where asked)."""
    pr = _problem(n, d, sink=True, lse=True, masked=masked)
    claimed = -sum(pr["P_sink"][i] * _delta(pr["D"], pr["dL"])[i] for i in range(n))
    return equal(sp.diff(pr["loss"], pr["sink"]), claimed)


def sink_is_extra_key(n: int, d: int) -> bool:
    """A sink is one more key with score sink and a zero value row: softmax over the
    extended row gives the same O and L, and the extra key's column of the extended
    problem's dS sums to the kernel's dsink."""
    pr = _problem(n, d, sink=True, lse=True)
    scores = pr["X"].row_join(sp.ones(n, 1) * pr["sink"])
    values = pr["V"].col_join(sp.zeros(1, d))
    P_ext = softmax_rows(scores)
    O_ext = P_ext * values
    L_ext = sp.Matrix(n, 1, lambda i, _: sp.log(sum(sp.exp(s) for s in scores.row(i))))
    D = rowsum(pr["dO"].multiply_elementwise(O_ext))
    dS_ext = P_ext.multiply_elementwise(pr["dO"] * values.T - _delta(D, pr["dL"]) * sp.ones(1, n + 1))
    dsink = -sum(pr["P_sink"][i] * _delta(pr["D"], pr["dL"])[i] for i in range(n))
    return (equal(O_ext, pr["O"]) and equal(L_ext.applyfunc(sp.exp), pr["L"].applyfunc(sp.exp))
            and equal(sum(dS_ext.col(n)), dsink))


# ---------------------------------------------------------------- one score mod's derivatives


def _substitute(expr, substitutions: dict | None):
    """Replace the emitted code's names for subexpressions by those expressions (nested too)."""
    expr = sp.sympify(expr)
    for _ in range(8):
        if not substitutions:
            break
        new = expr.subs(substitutions)
        if new == expr:
            break
        expr = new
    return expr


_HYPERBOLIC = (sp.tanh, sp.sinh, sp.cosh, sp.coth, sp.sech, sp.csch)


def _with_real_exps(expr):
    """Hyperbolic functions written with exp (of real arguments, as `is_zero` expects)."""
    return sp.sympify(expr).rewrite(_HYPERBOLIC, sp.exp)


def _exp_decides(diff) -> bool:
    """Zero by `is_zero`'s exp-to-symbols canonical form, directly or once hyperbolic
    functions are rewritten with exp."""
    if is_zero(diff):
        return True
    rewritten = _with_real_exps(diff)
    return not rewritten.has(sp.I) and is_zero(rewritten)


def _simplify_decides(diff) -> bool:
    return sp.count_ops(diff) <= 300 and sp.simplify(diff) == 0


def _random_value(symbol: sp.Symbol, rng: random.Random):
    if symbol.is_integer:
        low = 1 if symbol.is_positive else 0 if symbol.is_nonnegative else -6
        return sp.Integer(rng.randint(low, 6))
    value = sp.Rational(rng.randint(1, 60), rng.randint(1, 12))
    negative_ok = not (symbol.is_positive or symbol.is_nonnegative)
    return -value if negative_ok and rng.random() < 0.5 else value


def numerically_equal(lhs, rhs, points: int = NUMERIC_POINTS, seed: int = 0) -> bool:
    """lhs = rhs at `points` random rational points (30 digits); points where either side
    is not a finite real number are redrawn. Evidence, not proof."""
    lhs, rhs = sp.sympify(lhs), sp.sympify(rhs)
    symbols = sorted((lhs.free_symbols | rhs.free_symbols), key=sp.default_sort_key)
    rng = random.Random(seed)
    agreed = 0
    for _ in range(10 * points):
        values = {s: _random_value(s, rng) for s in symbols}
        a, b = lhs.evalf(30, subs=values), rhs.evalf(30, subs=values)
        if not all(v.is_number and v.is_real and v.is_finite for v in (a, b)):
            continue
        if abs(a - b) > sp.Float("1e-18", 30) * (1 + abs(a) + abs(b)):
            return False
        agreed += 1
        if agreed == points:
            return True
    return False


def _how_decided(lhs, rhs) -> str:
    """'exp' or 'simplify' if sympy proves lhs = rhs that way, else 'numeric'."""
    diff = sp.sympify(lhs) - sp.sympify(rhs)
    for how, decides in (("exp", _exp_decides), ("simplify", _simplify_decides)):
        try:
            if decides(diff):
                return how
        except Exception:  # sympy could not handle it that way: try the next
            continue
    return "numeric"


def derivative_is(lhs, rhs, how: str) -> bool:
    """lhs = rhs, proved the way `_how_decided` found (re-run, so `run` times it)."""
    if how == "exp":
        return _exp_decides(sp.sympify(lhs) - sp.sympify(rhs))
    if how == "simplify":
        return _simplify_decides(sp.sympify(lhs) - sp.sympify(rhs))
    return numerically_equal(lhs, rhs)


def _shapes(how: str) -> str:
    if how == "numeric":
        return f"scalar, numeric ({NUMERIC_POINTS} random rational points)"
    return "scalar, symbolic"


def _short(expr, width: int = 48) -> str:
    text = sp.sstr(expr)
    return text if len(text) <= width else text[:width - 3] + "..."


def _positions(expr, positions):
    """The (q_idx, kv_idx) symbols: as given, else the free symbols of those names."""
    if positions is not None:
        return tuple(positions)
    by_name = {s.name: s for s in expr.free_symbols}
    found = tuple(by_name[n] for n in ("q_idx", "kv_idx") if n in by_name)
    return found if len(found) == 2 else ()


def _chain_instance(x, score, grad, load_dummies, load_grads, positions, n: int, d: int):
    """The n x n problem with f = this score mod: per entry, x -> X_ij, (q_idx, kv_idx) ->
    (i, j), each load -> one symbol per element it reads. Returns the loss <dO, O>, X, the
    emitted ds'/dx per entry, dS' = P o (dP - D 1^T), and per element symbol c the
    kernel's gradient: the sum of dS'_ij times the emitted ds'/d load over the loads of c."""
    X, V, dO = matrix("X", n, n), matrix("V", n, d), matrix("dO", n, d)
    elements: dict = {}

    def entry(expr, i, j):
        at = dict(zip(positions, (sp.Integer(i), sp.Integer(j))))
        reads = {u: elements.setdefault(load.subs(at), sp.Dummy(f"c{len(elements)}", real=True))
                 for u, load in load_dummies.items()}
        return expr.xreplace({**reads, x: X[i, j]}).subs(at), reads

    scores = sp.Matrix(n, n, lambda i, j: entry(score, i, j)[0])
    P = softmax_rows(scores)
    O = P * V
    D = rowsum(dO.multiply_elementwise(O))
    dS = P.multiply_elementwise(dO * V.T - D * sp.ones(1, n))
    emitted = sp.Matrix(n, n, lambda i, j: entry(grad, i, j)[0])
    element_grads = {c: sp.Integer(0) for c in elements.values()}
    for i in range(n):
        for j in range(n):
            for u, g in load_grads.items():
                value, reads = entry(g, i, j)
                element_grads[reads[u]] += dS[i, j] * value
    return frobenius(dO, O), X, emitted, dS, element_grads


def _chain_rule_holds(build) -> bool:
    loss, X, emitted, dS, _ = build()
    return _exp_decides(gradient(loss, X) - emitted.multiply_elementwise(dS))


def _load_gradients_hold(build) -> bool:
    loss, _, _, _, element_grads = build()
    return all(_exp_decides(sp.diff(loss, c) - g) for c, g in element_grads.items())


_FAST = (sp.exp, sp.log, AppliedUndef)


def _tractable(expr, x) -> bool:
    """Small and, once hyperbolic functions are written with exp, built from x, exp, log
    and atoms free of x by arithmetic: what `is_zero` decides fast."""
    expr = _with_real_exps(expr)
    if expr.has(sp.I) or sp.count_ops(expr) > 60:
        return False
    for node in sp.preorder_traversal(expr):
        if isinstance(node, sp.Function) and not isinstance(node, _FAST) and node.has(x):
            return False
    return True


def mod_identities(score_symbol, score_expr, emitted_grad, loads=(), name: str = "score_mod",
                   substitutions: dict | None = None, positions=None,
                   relied_on_by: Callable[[Spec], bool] = lambda spec: True,
                   n: int = 2, d: int = 2) -> list[Identity]:
    """The identities one score mod s' = score_expr(x, ...) relies on.

    score_symbol   the sympy Symbol x, the scaled score
    score_expr     s' as a sympy expression of x, other symbols (b, h, q_idx, kv_idx,
                   constants) and captured loads (applied undefined Functions, cap0(h, ...))
    emitted_grad   the expression the CUDA code uses for ds'/dx; it may name
                   subexpressions by symbols that `substitutions` maps back ({t: tanh(x/c)})
    loads          (load_expr, emitted_load_grad) pairs: the code's ds'/d(load)
    positions      (q_idx, kv_idx) symbols for the chain-rule instance; default the free
                   symbols named q_idx and kv_idx, () for none
    relied_on_by   the predicate the identities carry (default: always, for the variant
                   they were made for)

    Returns: emitted_grad = d score_expr / dx and, per load, emitted_load_grad =
    d score_expr / d load (each proved symbolically where sympy decides it, else checked
    at random rational points, "numeric" in the shapes column); where every one of those
    is decided by `is_zero` and the expression is small, the chain rule dX = ds'/dx(X) o
    P o (dP - D 1^T) with this f on an n x n problem, and with loads the gradient of each
    captured element as the sum over the (i, j) that read it of dS'_ij ds'/dc.
    """
    x = score_symbol
    score = sp.sympify(score_expr)
    grad = _substitute(emitted_grad, substitutions)
    load_pairs = [(sp.sympify(load), _substitute(g, substitutions)) for load, g in loads]
    if len({load for load, _ in load_pairs}) != len(load_pairs):
        raise ValueError("mod_identities: a load is listed twice; give each load expression once")
    # Each load becomes a dummy: sympy differentiates wrt a symbol, and the element it
    # reads is independent of x and of the other loads.
    load_dummies = {sp.Dummy(f"load{k}", real=True): load for k, (load, _) in enumerate(load_pairs)}
    to_dummy = {load: u for u, load in load_dummies.items()}
    score_d, grad_d = score.xreplace(to_dummy), grad.xreplace(to_dummy)
    identities, decided = [], []

    how = _how_decided(grad_d, sp.diff(score_d, x))
    decided.append(how)
    identities.append(Identity(f"{name}: emitted ds'/dx = d/dx s' ({_short(emitted_grad)} = d/dx "
                               f"{_short(score)})", _shapes(how),
                               partial(derivative_is, grad_d, sp.diff(score_d, x), how), relied_on_by))
    load_grads = {}
    for (u, load), (_, load_grad) in zip(load_dummies.items(), load_pairs):
        emitted = load_grad.xreplace(to_dummy)
        load_grads[u] = emitted
        how = _how_decided(emitted, sp.diff(score_d, u))
        decided.append(how)
        identities.append(Identity(f"{name}: emitted ds'/d{_short(load, 32)} = d s'/d{_short(load, 32)} "
                                   f"({_short(load_grad)})", _shapes(how),
                                   partial(derivative_is, emitted, sp.diff(score_d, u), how), relied_on_by))
    pos = _positions(score, positions)
    fast = all(_tractable(e, x) for e in (score_d, grad_d, *load_grads.values()))
    if fast and all(h == "exp" for h in decided):
        build = partial(_chain_instance, x, score_d, grad_d, load_dummies, load_grads, pos, n, d)
        where = f"N={n}, d={d}" + (f", {pos[0]} = i, {pos[1]} = j" if pos else "")
        identities.append(Identity(f"{name}: dX = (ds'/dx)(X) o P o (dP - D 1^T)", where,
                                   partial(_chain_rule_holds, build), relied_on_by))
        if load_grads:
            identities.append(Identity(f"{name}: d element = sum over its loads of dS' ds'/d load", where,
                                       partial(_load_gradients_hold, build), relied_on_by))
    return identities


# ---------------------------------------------------------------- the built-ins


def _softcap_expr(x, c):
    return c * sp.tanh(x / c)


def capped_units_hold() -> bool:
    """The softcap alone in units of the cap (the kernels' capped_score): with t = tanh(S tau / c)
    from the raw score S, P = 2^(t c log2(e) - L log2(e)) is exp(c tanh(tau S / c) - L), the
    derivative c tanh(x / c)' at x = tau S is 1 - t^2, and L = m c + log(l) for a running max m
    kept in these units (a sink's logit entering as logit / c)."""
    S, L, m, logit = sp.symbols("S L m logit", real=True)
    S2 = sp.Symbol("S2", real=True)
    tau, c = sp.symbols("tau c", positive=True)
    x = sp.Symbol("x", real=True)
    log2e = 1 / sp.log(2)
    t, t2 = sp.tanh(S * (tau / c)), sp.tanh(S2 * (tau / c))
    chain = _softcap_expr(x, c)
    probability = sp.Integer(2) ** (t * (c * log2e) - L * log2e)
    # Two keys and a sink, summed against any running max m (in units of the cap).
    total = sum(sp.Integer(2) ** (u * (c * log2e) - m * (c * log2e)) for u in (t, t2, logit / c))
    exact = sp.log(sp.exp(chain.subs(x, tau * S)) + sp.exp(chain.subs(x, tau * S2)) + sp.exp(logit))
    return (is_zero(sp.simplify(probability - sp.exp(chain.subs(x, tau * S) - L)))
            and is_zero(sp.simplify(sp.diff(chain, x).subs(x, tau * S) - (1 - t ** 2)))
            and numerically_equal(m * c + sp.log(total), exact))


def builtin_mod_identities() -> list[Identity]:
    """softcap (s' = c tanh(x/c), c > 0), ALiBi (s' = x - slope a, a = |i + Nk - Nq - j| >= 0)
    and softcap then ALiBi, each with the derivative the kernels emit from the forward's s'."""
    x = sp.Symbol("x", real=True)
    c = sp.Symbol("c", positive=True)
    slope = sp.Symbol("slope", real=True)
    a = sp.Symbol("a", nonnegative=True)
    s = sp.Symbol("s'", real=True)  # the forward's output, as the kernel keeps it
    capped = _softcap_expr(x, c)
    return [
        *mod_identities(x, capped, 1 - (s / c) ** 2, substitutions={s: capped}, name="softcap",
                        relied_on_by=_softcap),
        Identity("softcap in units of the cap: P, ds'/dx, L and a sink's logit (capped_score)", "scalars",
                 capped_units_hold, relied_on_by=_softcap_alone),
        *mod_identities(x, x - slope * a, sp.Integer(1), name="ALiBi", relied_on_by=_alibi),
        *mod_identities(x, capped - slope * a, 1 - ((s + slope * a) / c) ** 2,
                        substitutions={s: capped - slope * a}, name="softcap + ALiBi",
                        relied_on_by=_softcap_and_alibi),
    ]


# ---------------------------------------------------------------- the registry


def _always(spec: Spec) -> bool:
    return True


# The built-ins' rows (fagen.variants.builtins) say which specs use each.
_sinks, _softcap, _alibi = SINKS.used, SOFTCAP.used, ALIBI.used


def _softcap_alone(spec: Spec) -> bool:   # variants.cuda.capped: the chain is the softcap only
    return spec.softcap and not spec.alibi and spec.score_mod is None


def _softcap_and_alibi(spec: Spec) -> bool:
    return spec.softcap and spec.alibi


def _score_modded(spec: Spec) -> bool:
    return spec.softcap or spec.alibi or spec.score_mod is not None


def _score_modded_with_sinks(spec: Spec) -> bool:
    return _score_modded(spec) and spec.sinks


def _masked_score_mod(spec: Spec) -> bool:
    return _score_modded(spec) and _masking(spec)


def _masked_sinks(spec: Spec) -> bool:
    return spec.sinks and _masking(spec)


_LSE = "differentiable lse: dS = P o (dP - (D - dL) 1^T)"
_SINK_DS = "sinks: dS = P o (dP - (D - dL) 1^T), sink in the denominator"
_SINK_D = "sinks: dsink = -sum_i P_sink,i (D_i - dL_i)"
_SINK_KEY = "sinks: sink = one extra key (score sink, zero value row): same O, L, dsink"
_CHAIN = "score mod chain rule: dX = f'(X) o P o (dP - D 1^T)"
_CHAIN_ALL = "score mod chain rule with dL: dX = f'(X) o P o (dP - (D - dL) 1^T)"

VARIANT_IDENTITIES: list[Identity] = [
    Identity(_LSE, "N=2, d=2", partial(attention_backward, 2, 2, lse=True), _always),
    Identity(_LSE, "N=3, d=2", partial(attention_backward, 3, 2, lse=True), _always),
    Identity(_LSE, "causal -inf mask, N=3, d=2", partial(attention_backward, 3, 2, lse=True, masked="causal"),
             _masking),
    Identity(_SINK_DS, "N=2, d=2", partial(attention_backward, 2, 2, sink=True, lse=True), _sinks),
    Identity(_SINK_DS, "N=3, d=2", partial(attention_backward, 3, 2, sink=True, lse=True), _sinks),
    Identity(_SINK_D, "N=2, d=2", partial(sink_gradient, 2, 2), _sinks),
    Identity(_SINK_D, "N=3, d=2", partial(sink_gradient, 3, 2), _sinks),
    Identity(_SINK_DS, "-inf mask, first row sees no key, N=3, d=2",
             partial(attention_backward, 3, 2, sink=True, lse=True, masked="empty first row"), _masked_sinks),
    Identity(_SINK_D, "-inf mask, first row sees no key, N=3, d=2",
             partial(sink_gradient, 3, 2, masked="empty first row"), _masked_sinks),
    Identity(_SINK_KEY, "N=2, d=2", partial(sink_is_extra_key, 2, 2), _sinks),
    Identity(_SINK_KEY, "N=3, d=2", partial(sink_is_extra_key, 3, 2), _sinks),
    Identity(_CHAIN, "N=2, d=2, f undefined", partial(attention_backward, 2, 2, mod=True), _score_modded),
    Identity(_CHAIN, "N=3, d=2, f undefined", partial(attention_backward, 3, 2, mod=True), _score_modded),
    Identity(_CHAIN_ALL, "N=2, d=2, f undefined", partial(attention_backward, 2, 2, mod=True, lse=True),
             _score_modded),
    Identity(_CHAIN_ALL, "causal -inf mask, N=3, d=2, f undefined",
             partial(attention_backward, 3, 2, mod=True, lse=True, masked="causal"), _masked_score_mod),
    Identity(_CHAIN_ALL, "sink, N=2, d=2, f undefined",
             partial(attention_backward, 2, 2, mod=True, lse=True, sink=True), _score_modded_with_sinks),
    *builtin_mod_identities(),
]

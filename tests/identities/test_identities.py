"""The sympy proofs: all of them pass, a wrong identity is reported as failing,
and each spec gets the identities it relies on."""

from __future__ import annotations

import sympy as sp

from fagen import identities
from fagen.identities import (BASE_IDENTITIES, IDENTITIES, MERGE_IDENTITIES, VARIANT_IDENTITIES, Identity,
                              attention_backward,
                              attention_forward, equal, for_spec, format_table, frobenius, gradient, matrix,
                              mod_identities, rowsum, run, sink_gradient, sink_is_extra_key, softmax_rows,
                              variants)
from fagen.spec import Spec


def test_every_identity_is_proved():
    results = run()
    failed = [(r.name, r.shapes, r.detail) for r in results if not r.ok]
    assert not failed
    assert len(results) == len(IDENTITIES)
    assert all(r.seconds >= 0 for r in results)


def test_registry_covers_the_issue_and_names_are_unique():
    keys = [(i.name, i.shapes) for i in IDENTITIES]
    assert len(keys) == len(set(keys))
    names = " | ".join(i.name for i in IDENTITIES)
    for needed in ("dV = P^T dO", "softmax Jacobian", "rowsum(dO o O)", "dQ = tau dS K", "online softmax",
                   "FA1 rescaled", "FA2 unscaled", "P from L", "dropout: dP", "E[dropped O]",
                   "masked block", "no key", "differentiable lse", "sinks: dS", "sinks: dsink",
                   "one extra key", "score mod chain rule", "softcap:", "ALiBi:", "softcap + ALiBi:"):
        assert needed in names, needed
    assert IDENTITIES == [*BASE_IDENTITIES, *VARIANT_IDENTITIES, *MERGE_IDENTITIES]
    # Concrete shapes N = 2 and 3, and symbolic shapes where sympy can.
    shapes = {i.shapes for i in IDENTITIES}
    assert {"N=2, d=2", "N=3, d=2", "symbolic n, d_v", "symbolic Nq, Nk, d"} <= shapes


def test_a_value_head_dim_of_its_own_has_its_identity():
    """V's head dim below Q's (Spec.head_dim_v): the blocked gradients are proved with dO's
    d_v columns apart from Q's and K's d, and only such specs rely on that proof."""
    from fagen.spec import Spec

    split = [i for i in IDENTITIES if "d_v=" in i.shapes and "d=3" in i.shapes]
    assert [i.name for i in split] == ["dQ, dK, dV accumulate block by block"] and split[0].check()
    assert split[0].relied_on_by(Spec(192, head_dim_v=128)) and not split[0].relied_on_by(Spec(128))


def _dq_without_tau() -> bool:
    """A deliberately wrong identity: dQ = dS K, forgetting the scale."""
    tau = sp.Symbol("tau", positive=True)
    Q, K, dS = matrix("Q", 2, 2), matrix("K", 2, 2), matrix("dS", 2, 2)
    return equal(gradient(frobenius(dS, tau * Q * K.T), Q), dS * K)


def test_a_wrong_identity_is_reported_as_failing():
    wrong = Identity("dQ = dS K (no tau)", "N=2, d=2", _dq_without_tau)
    crashing = Identity("crashes", "-", lambda: 1 / 0)
    not_a_bool = Identity("returns an expression", "-", lambda: sp.Symbol("x"))
    right = IDENTITIES[0]
    results = run([right, wrong, crashing, not_a_bool])
    assert [r.ok for r in results] == [True, False, False, False]
    assert "ZeroDivisionError" in results[2].detail
    table = format_table(results)
    assert "dQ = dS K (no tau)" in table and "FAILED" in table
    assert "1/4 proved" in table and "3 FAILED" in table


def test_wrong_softmax_jacobian_is_not_proved():
    # dS = P o dP drops the D term: the prover must reject it.
    S, dP = matrix("S", 2, 2), matrix("dP", 2, 2)
    P = softmax_rows(S)
    assert not equal(gradient(frobenius(dP, P), S), P.multiply_elementwise(dP))


def test_online_softmax_proof_fails_for_a_merge_without_rescaling(monkeypatch):
    def merge_without_rescale(a, b):
        return sp.Max(a[0], b[0]), a[1] + b[1]
    monkeypatch.setattr(identities.core, "merge_stats", merge_without_rescale)
    assert identities.online_softmax((2, 1)) is False
    assert identities.online_softmax_symbolic() is False


def test_empty_row_proof_fails_without_the_guarded_max(monkeypatch):
    # Without safe_max the arithmetic meets exp(-inf - (-inf)): NaN, so no proof.
    monkeypatch.setattr(identities.core, "_safe_max", lambda m: m)
    (result,) = run([Identity("empty row, unguarded", "3 blocks", lambda: identities.empty_row_convention(3, 2))])
    assert not result.ok


def test_dropout_expectation_needs_the_inverse_keep_scale(monkeypatch):
    monkeypatch.setattr(identities.core, "_dropout_factor",
                        lambda n: (sp.Symbol("p", positive=True), matrix("keep", n, n), matrix("keep", n, n)))
    assert identities.dropout_expectation(2, 2) is False


def test_for_spec_selects_what_the_variant_relies_on():
    v1 = {i.name for i in for_spec(Spec(head_dim=64, version=1))}
    v2 = {i.name for i in for_spec(Spec(head_dim=64, version=2))}
    full = {i.name for i in for_spec(Spec(head_dim=64, version=2, mask="causal", dropout=True))}
    padded = {i.name for i in for_spec(Spec(head_dim=64, version=1, key_padding=True))}
    assert any(n.startswith("FA1") for n in v1) and not any(n.startswith("FA2") for n in v1)
    assert any(n.startswith("FA2") for n in v2) and not any(n.startswith("FA1") for n in v2)
    for plain in (v1, v2):
        assert not any(n.startswith("dropout") or "masked block" in n or "no key" in n for n in plain)
        assert any(n.startswith("softmax Jacobian") for n in plain)
    assert any(n.startswith("dropout") for n in full) and any("masked block" in n for n in full)
    assert any("masked block" in n for n in padded) and any("no key" in n for n in padded)


def test_run_with_a_spec_proves_only_its_identities():
    spec = Spec(head_dim=64, version=1)
    results = run(spec=spec)
    assert [(r.name, r.shapes) for r in results] == [(i.name, i.shapes) for i in for_spec(spec)]
    assert all(r.ok for r in results)


# ---------------------------------------------------------------- the variants


def test_the_package_keeps_the_old_module_names():
    for name in ("run", "for_spec", "format_table", "is_zero", "equal", "gradient", "softmax_rows", "rowsum",
                 "matrix", "frobenius", "Identity", "Result", "IDENTITIES", "online_softmax",
                 "empty_row_convention", "dropout_expectation", "merge_stats", "mod_identities"):
        assert hasattr(identities, name), name


def test_run_reads_the_registry_at_call_time(monkeypatch):
    # fagen verify's test swaps identities.IDENTITIES: run() and for_spec() must see the swap.
    wrong = Identity("deliberately wrong", "N=1", lambda: False)
    monkeypatch.setattr(identities, "IDENTITIES", [wrong])
    assert [r.ok for r in run()] == [False]
    assert for_spec(Spec(head_dim=64)) == [wrong]


def test_variant_identities_are_proved():
    results = run(VARIANT_IDENTITIES)
    assert [(r.name, r.shapes) for r in results if not r.ok] == []


def test_sink_proofs_need_the_lse_gradient_term(monkeypatch):
    # The kernel's row term is D - dL; with D alone the proofs must fail under a nonzero dL ...
    monkeypatch.setattr(variants, "_delta", lambda D, dL: D)
    assert attention_backward(2, 2, sink=True, lse=True) is False
    assert sink_gradient(2, 2) is False
    assert attention_backward(2, 2, lse=True) is False
    assert attention_backward(3, 2, lse=True, masked="causal") is False
    assert attention_backward(2, 2, mod=True, lse=True) is False
    # ... and still hold when no lse gradient flows (dL = 0).
    assert attention_backward(2, 2, sink=True) is True
    assert attention_backward(2, 2, mod=True) is True


def test_sink_gradient_sign_and_denominator_matter():
    n, d = 2, 2
    X, V, dO, dL = matrix("X", n, n), matrix("V", n, d), matrix("dO", n, d), matrix("dL", n, 1)
    sink = sp.Symbol("sink", real=True)
    _, _, L, O, P_sink = attention_forward(X, V, sink=sink)
    loss = frobenius(dO, O) + frobenius(dL, L)
    D = rowsum(dO.multiply_elementwise(O))
    # dsink with the sign flipped is wrong.
    assert not equal(sp.diff(loss, sink), sum(P_sink[i] * (D[i] - dL[i]) for i in range(n)))
    # dS from the softmax without the sink (P renormalised over the keys only) is wrong.
    P_keys = softmax_rows(X)
    wrong = P_keys.multiply_elementwise(dO * V.T - (D - dL) * sp.ones(1, n))
    assert not equal(gradient(loss, X), wrong)


def test_a_sink_is_not_a_key_with_a_nonzero_value_row():
    assert sink_is_extra_key(2, 2) is True
    n, d = 2, 2
    X, V = matrix("X", n, n), matrix("V", n, d)
    sink = sp.Symbol("sink", real=True)
    _, _, _, O, _ = attention_forward(X, V, sink=sink)
    with_value = softmax_rows(X.row_join(sp.ones(n, 1) * sink)) * V.col_join(matrix("Vsink", 1, d))
    assert not equal(with_value, O)


def test_masked_sink_row_without_keys_has_l_equal_to_the_sink():
    V, X = matrix("V", 3, 2), matrix("X", 3, 3)
    sink = sp.Symbol("sink", real=True)
    _, P, L, O, P_sink = attention_forward(X, V, sink=sink, mask=variants.MASKS["empty first row"])
    assert L[0] == sink and list(P.row(0)) == [0, 0, 0] and list(O.row(0)) == [0, 0] and P_sink[0] == 1


def test_chain_rule_needs_f_prime():
    n, d = 2, 2
    f = sp.Function("f")
    X, V, dO = matrix("X", n, n), matrix("V", n, d), matrix("dO", n, d)
    _, P, _, O, _ = attention_forward(X, V, mod=f)
    D = rowsum(dO.multiply_elementwise(O))
    dS = P.multiply_elementwise(dO * V.T - D * sp.ones(1, n))
    loss = frobenius(dO, O)
    assert not equal(gradient(loss, X), dS)
    assert equal(gradient(loss, X), X.applyfunc(lambda x: sp.diff(f(x), x)).multiply_elementwise(dS))


_x = sp.Symbol("x", real=True)
_c = sp.Symbol("c", positive=True)
_s = sp.Symbol("s'", real=True)
_slope = sp.Symbol("slope", real=True)
_a = sp.Symbol("a", nonnegative=True)


def _derivative_result(ids):
    (result,) = [r for r in run(ids) if "emitted ds'/dx" in r.name]
    return result


def test_softcap_derivative_needs_the_cap():
    capped = _c * sp.tanh(_x / _c)
    right = mod_identities(_x, capped, 1 - (_s / _c) ** 2, substitutions={_s: capped}, name="softcap")
    assert all(r.ok for r in run(right))
    assert [i.shapes for i in right] == ["scalar, symbolic", "N=2, d=2"]
    wrong = mod_identities(_x, capped, 1 - _s ** 2, substitutions={_s: capped}, name="softcap")
    result = _derivative_result(wrong)
    assert not result.ok and "numeric" in result.shapes
    # No chain-rule instance is built on a derivative sympy could not prove.
    assert len(wrong) == 1


def test_alibi_derivatives_need_the_slope_term_back():
    after = _c * sp.tanh(_x / _c) - _slope * _a
    assert not _derivative_result(mod_identities(_x, after, 1 - (_s / _c) ** 2,
                                                 substitutions={_s: after})).ok
    assert _derivative_result(mod_identities(_x, after, 1 - ((_s + _slope * _a) / _c) ** 2,
                                             substitutions={_s: after})).ok
    assert not _derivative_result(mod_identities(_x, _x - _slope * _a, 1 - _slope)).ok


def test_mod_identities_for_a_user_function():
    sig = sp.Symbol("sig", real=True)
    silu = _x / (1 + sp.exp(-_x))
    right = mod_identities(_x, silu, sig * (1 + _x * (1 - sig)), substitutions={sig: 1 / (1 + sp.exp(-_x))},
                           name="silu")
    assert [r.ok for r in run(right)] == [True, True]
    assert right[0].shapes == "scalar, symbolic" and right[1].name.startswith("silu: dX =")
    wrong = mod_identities(_x, silu, sig * (1 + _x * sig), substitutions={sig: 1 / (1 + sp.exp(-_x))},
                           name="silu")
    assert [r.ok for r in run(wrong)] == [False]


def _bias():
    h, q_idx, kv_idx = sp.symbols("h q_idx kv_idx", integer=True)
    return sp.Function("cap0")(h, q_idx - kv_idx + 7)


def test_mod_identities_with_a_captured_tensor():
    load = _bias()
    ids = mod_identities(_x, _x + load, 1, loads=[(load, 1)], name="bias")
    results = run(ids)
    assert all(r.ok for r in results), [(r.name, r.detail) for r in results if not r.ok]
    assert len(ids) == 4 and "q_idx = i, kv_idx = j" in ids[2].shapes
    assert "d element = sum over its loads" in ids[3].name
    # A multiplicative bias: ds'/dx reads the load, ds'/d load is x.
    assert all(r.ok for r in run(mod_identities(_x, _x * load, load, loads=[(load, _x)])))


def test_mod_identities_refuse_a_load_listed_twice():
    load = _bias()
    try:
        mod_identities(_x, _x + load, 1, loads=[(load, 1), (load, 1)])
    except ValueError as exc:
        assert "twice" in str(exc)
    else:
        raise AssertionError("a load listed twice was accepted")


def test_mod_identities_reject_a_wrong_load_gradient():
    load = _bias()
    ids = mod_identities(_x, _x * load, load, loads=[(load, 1)], name="bias")
    results = run(ids)
    assert [r.ok for r in results] == [True, False]
    assert "numeric" in results[1].shapes


def test_chain_and_load_instances_catch_wrong_emitted_gradients(monkeypatch):
    # Force the instances to be built even for wrong gradients: they must fail too.
    monkeypatch.setattr(variants, "_how_decided", lambda lhs, rhs: "exp")
    load = _bias()
    wrong_x = mod_identities(_x, _x * load, 1, loads=[(load, _x)], name="bias")
    assert [r.ok for r in run(wrong_x)] == [False, True, False, True]
    wrong_load = mod_identities(_x, _x * load, load, loads=[(load, 1)], name="bias")
    assert [r.ok for r in run(wrong_load)] == [True, False, True, False]


def test_mod_identities_fall_back_to_numeric_points():
    relu_grad = sp.Piecewise((1, _x > 0), (0, True))
    (right,) = mod_identities(_x, sp.Max(_x, 0), relu_grad, name="relu")
    assert "numeric" in right.shapes and run([right])[0].ok
    (wrong,) = mod_identities(_x, sp.Max(_x, 0), sp.Piecewise((1, _x < 0), (0, True)), name="relu")
    assert "numeric" in wrong.shapes and not run([wrong])[0].ok


def test_for_spec_selects_the_variant_identities():
    def names(spec):
        return {i.name for i in for_spec(spec)}

    plain = Spec(head_dim=64)
    variant_plain = [i for i in for_spec(plain) if i in VARIANT_IDENTITIES]
    assert for_spec(plain) == [i for i in BASE_IDENTITIES if i.relied_on_by(plain)] + variant_plain \
        + [i for i in MERGE_IDENTITIES if i.relied_on_by(plain)]
    assert {(i.name, i.shapes) for i in variant_plain} == {
        ("differentiable lse: dS = P o (dP - (D - dL) 1^T)", "N=2, d=2"),
        ("differentiable lse: dS = P o (dP - (D - dL) 1^T)", "N=3, d=2")}
    sinks = names(Spec(head_dim=64, sinks=True))
    assert any(n.startswith("sinks: dS") for n in sinks) and any(n.startswith("sinks: dsink") for n in sinks)
    assert any("one extra key" in n for n in sinks)
    assert not any(n.startswith(("softcap", "ALiBi", "score mod")) for n in sinks)
    softcap = names(Spec(head_dim=64, softcap=True))
    assert any(n.startswith("score mod chain rule") for n in softcap)
    assert any(n.startswith("softcap: emitted") for n in softcap)
    assert not any(n.startswith(("sinks", "ALiBi", "softcap + ALiBi")) for n in softcap)
    both = names(Spec(head_dim=64, softcap=True, alibi=True))
    assert any(n.startswith("softcap + ALiBi") for n in both) and any(n.startswith("ALiBi:") for n in both)
    masked_sinks = [i.shapes for i in for_spec(Spec(head_dim=64, sinks=True, mask="causal"))
                    if i.name.startswith("sinks")]
    assert "-inf mask, first row sees no key, N=3, d=2" in masked_sinks
    window = [i.shapes for i in for_spec(Spec(head_dim=64, window=True))
              if i.name.startswith("differentiable")]
    assert "causal -inf mask, N=3, d=2" in window

"""The sympy proofs: all of them pass, a wrong identity is reported as failing,
and each spec gets the identities it relies on."""

from __future__ import annotations

import sympy as sp

from fagen import identities
from fagen.identities import (IDENTITIES, Identity, equal, for_spec, format_table, frobenius, gradient,
                              matrix, run, softmax_rows)
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
                   "masked block", "no key"):
        assert needed in names, needed
    # Concrete shapes N = 2 and 3, and symbolic shapes where sympy can.
    shapes = {i.shapes for i in IDENTITIES}
    assert {"N=2, d=2", "N=3, d=2", "symbolic n, d"} <= shapes


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
    monkeypatch.setattr(identities, "merge_stats", merge_without_rescale)
    assert identities.online_softmax((2, 1)) is False
    assert identities.online_softmax_symbolic() is False


def test_empty_row_proof_fails_without_the_guarded_max(monkeypatch):
    # Without safe_max the arithmetic meets exp(-inf - (-inf)): NaN, so no proof.
    monkeypatch.setattr(identities, "_safe_max", lambda m: m)
    (result,) = run([Identity("empty row, unguarded", "3 blocks", lambda: identities.empty_row_convention(3, 2))])
    assert not result.ok


def test_dropout_expectation_needs_the_inverse_keep_scale(monkeypatch):
    monkeypatch.setattr(identities, "_dropout_factor",
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

"""Tile classification from the mask's algebra.

A thread block works on a box of query rows [q_lo, q_hi] and keys [kv_lo, kv_hi]. Every
atom of the mask (a comparison) whose two sides are linear in q_idx and kv_idx, with
numeric coefficients (causal, windows, key padding, prefix-LM with a per-batch length,
chunked attention), is decided over the whole box exactly: a linear form takes its
extremes at the box's corners. The atoms combine in Kleene's three-valued logic, so a
tile is empty (skipped), full (no mask evaluated) or partial. Atoms that are not linear
(a mask over captured tensors indexed by q_idx or kv_idx, say) are "unknown" over a box:
their tiles are partial, which is correct and slower.

The loop bounds come from the top-level conjunction: each linear atom with coefficient
+-1 on kv_idx bounds the keys any row of [q_lo, q_hi] may see (forward), and with
coefficient +-1 on q_idx the queries any key of [kv_lo, kv_hi] may meet (backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .compose import SEQLEN_Q, KEYS
from .language import KV_IDX, Q_IDX

Q_LO, Q_HI, KV_LO, KV_HI = sp.symbols("q_lo q_hi kv_lo kv_hi", integer=True)


def linear_form(e: sp.Basic):
    """(a_q, a_kv, c) with e == a_q q_idx + a_kv kv_idx + c, numeric a's; None otherwise."""
    e = sp.expand(e)
    a_q, a_kv = sp.diff(e, Q_IDX), sp.diff(e, KV_IDX)
    if not (a_q.is_number and a_kv.is_number):
        return None
    c = sp.expand(e - a_q * Q_IDX - a_kv * KV_IDX)
    if c.has(Q_IDX) or c.has(KV_IDX):
        return None
    return a_q, a_kv, c


def _extremes(form):
    """(min, max) of a linear form over the box."""
    a_q, a_kv, c = form
    q_min, q_max = (Q_LO, Q_HI) if a_q >= 0 else (Q_HI, Q_LO)
    k_min, k_max = (KV_LO, KV_HI) if a_kv >= 0 else (KV_HI, KV_LO)
    return c + a_q * q_min + a_kv * k_min, c + a_q * q_max + a_kv * k_max


def _atom(atom) -> tuple[sp.Basic, sp.Basic]:
    """(always true over the box, always false over the box) for one comparison."""
    e = atom.lhs - atom.rhs
    if not (e.has(Q_IDX) or e.has(KV_IDX)):   # constant over the box: b, h, run-time values
        return atom, sp.Not(atom)
    form = linear_form(e)
    if form is None:
        return sp.false, sp.false
    low, high = _extremes(form)
    if isinstance(atom, sp.Ge):
        return sp.Ge(low, 0), sp.Lt(high, 0)
    if isinstance(atom, sp.Gt):
        return sp.Gt(low, 0), sp.Le(high, 0)
    if isinstance(atom, sp.Le):
        return sp.Le(high, 0), sp.Gt(low, 0)
    if isinstance(atom, sp.Lt):
        return sp.Lt(high, 0), sp.Ge(low, 0)
    equal = sp.And(sp.Eq(low, 0), sp.Eq(high, 0)), sp.Or(sp.Gt(low, 0), sp.Lt(high, 0))
    return equal if isinstance(atom, sp.Eq) else (equal[1], equal[0])


def classify(mask: sp.Basic) -> tuple[sp.Basic, sp.Basic]:
    """(the box is all visible, the box is all masked), as conditions on the box bounds."""
    if mask is sp.true:
        return sp.true, sp.false
    if mask is sp.false:
        return sp.false, sp.true
    if isinstance(mask, sp.And):
        parts = [classify(a) for a in mask.args]
        return sp.And(*(t for t, _ in parts)), sp.Or(*(f for _, f in parts))
    if isinstance(mask, sp.Or):
        parts = [classify(a) for a in mask.args]
        return sp.Or(*(t for t, _ in parts)), sp.And(*(f for _, f in parts))
    if isinstance(mask, sp.Not):
        full, empty = classify(mask.args[0])
        return empty, full
    if isinstance(mask, sp.core.relational.Relational):
        return _atom(mask)
    return sp.false, sp.false   # anything else: unknown, every tile partial


def _at_least_zero(atom) -> list[sp.Basic]:
    """The atom as forms e with e >= 0 (integers), or [] if it is not of that kind."""
    e = atom.lhs - atom.rhs
    if isinstance(atom, sp.Ge):
        return [e]
    if isinstance(atom, sp.Gt):
        return [e - 1]
    if isinstance(atom, sp.Le):
        return [-e]
    if isinstance(atom, sp.Lt):
        return [-e - 1]
    if isinstance(atom, sp.Eq):
        return [e, -e]
    return []


@dataclass(frozen=True)
class IndexRange:
    """Inclusive bounds [first, last] of the keys (or queries) a box can see."""

    first: sp.Basic
    last: sp.Basic
    derived: bool   # whether any atom bounded it beyond the sequence


def _range(mask, index, other, other_lo, other_hi, lowest, highest) -> IndexRange:
    lowers, uppers = [lowest], [highest]
    atoms = mask.args if isinstance(mask, sp.And) else (mask,)
    for atom in atoms:
        if not isinstance(atom, sp.core.relational.Relational):
            continue
        for e in _at_least_zero(atom):
            form = linear_form(e)
            if form is None:
                continue
            a_q, a_kv, c = form
            a_index, a_other = (a_q, a_kv) if index == Q_IDX else (a_kv, a_q)
            if a_index not in (1, -1):
                continue
            # a_index * index + a_other * other + c >= 0
            bound = -(a_other * other + c) / a_index        # index >= bound (a = 1) or <= (a = -1)
            # The loosest bound over the box's other side: a lower bound's minimum, an upper one's
            # maximum; the bound's slope in `other` is -a_other / a_index.
            rising = a_other * a_index <= 0
            loosest = (other_lo if rising else other_hi) if a_index > 0 else (other_hi if rising else other_lo)
            value = sp.expand(bound.subs(other, loosest))
            (lowers if a_index > 0 else uppers).append(value)
    return IndexRange(sp.Max(*lowers), sp.Min(*uppers), len(lowers) + len(uppers) > 2)


def key_range(mask: sp.Basic) -> IndexRange:
    """The keys any query of [q_lo, q_hi] may see."""
    return _range(mask, KV_IDX, Q_IDX, Q_LO, Q_HI, sp.Integer(0), KEYS - 1)


def query_range(mask: sp.Basic) -> IndexRange:
    """The queries any key of [kv_lo, kv_hi] may meet."""
    return _range(mask, Q_IDX, KV_IDX, KV_LO, KV_HI, sp.Integer(0), SEQLEN_Q - 1)

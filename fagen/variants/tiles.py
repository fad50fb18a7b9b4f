"""Tile classification from the mask's algebra.

A thread block works on a box of query rows [q_lo, q_hi] and keys [kv_lo, kv_hi]. Every
atom of the mask (a comparison) whose two sides are linear in q_idx and kv_idx, with
numeric coefficients (causal, windows, key padding, prefix-LM with a per-batch length,
chunked attention), is decided over the whole box exactly: a linear form takes its
extremes at the box's corners. The atoms combine in Kleene's three-valued logic, so a
tile is empty (skipped), full (no mask evaluated) or partial. An equality of a captured
integer tensor indexed by q_idx on one side and kv_idx on the other (document ids) is decided
from per-16-row summaries, the min and max id of the tile's rows and of its keys (`Summary`).
Other atoms are "unknown" over a box: their tiles are partial, which is correct and slower.

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


SUMMARY_ROWS = 16   # rows per summary group: the kernels' tiles are whole groups


@dataclass(frozen=True)
class Summary:
    """Per-group min and max of a captured integer tensor along the dim a mask indexes by
    q_idx on one side of an equality and kv_idx on the other (document ids): computed on the
    device, O(N / 16) work, they decide such atoms over a whole tile."""

    capture: str    # the capture's name, e.g. mask_cap0
    dim: int        # the dim indexed by q_idx / kv_idx
    others: tuple   # the other dims' index expressions (free of q_idx and kv_idx)

    def bound(self, side: str, which: str) -> sp.Symbol:
        """The symbol of this summary's min or max over the box's rows (side "q") or keys ("kv")."""
        return sp.Symbol(f"{self.capture}_{side}{which}", integer=True)


def summary_of(atom) -> Summary | None:
    """The Summary an Eq/Ne atom `cap(.., q_idx, ..) == cap(.., kv_idx, ..)` needs, else None."""
    if not isinstance(atom, (sp.Eq, sp.Ne)):
        return None
    lhs, rhs = atom.lhs, atom.rhs
    undef = sp.core.function.AppliedUndef
    if not (isinstance(lhs, undef) and isinstance(rhs, undef) and lhs.func == rhs.func and lhs.is_integer):
        return None
    differing = [i for i, (a, b) in enumerate(zip(lhs.args, rhs.args)) if a != b]
    if len(differing) != 1 or {lhs.args[differing[0]], rhs.args[differing[0]]} != {Q_IDX, KV_IDX}:
        return None
    dim = differing[0]
    others = tuple(a for i, a in enumerate(lhs.args) if i != dim)
    if any(a.has(Q_IDX) or a.has(KV_IDX) for a in others):
        return None
    return Summary(lhs.func.__name__, dim, others)


def summaries(mask: sp.Basic) -> list[Summary]:
    """Every Summary the mask's atoms use, each once."""
    found = []
    for atom in mask.atoms(sp.Eq, sp.Ne):
        summary = summary_of(atom)
        if summary is not None and summary not in found:
            found.append(summary)
    return sorted(found, key=lambda s: (s.capture, s.dim))


def _summarized(atom, summary: Summary) -> tuple[sp.Basic, sp.Basic]:
    q_min, q_max = summary.bound("q", "min"), summary.bound("q", "max")
    k_min, k_max = summary.bound("kv", "min"), summary.bound("kv", "max")
    equal = sp.And(sp.Eq(q_min, q_max), sp.Eq(k_min, k_max), sp.Eq(q_min, k_min))
    disjoint = sp.Or(sp.Lt(q_max, k_min), sp.Lt(k_max, q_min))
    return (equal, disjoint) if isinstance(atom, sp.Eq) else (disjoint, equal)


def _atom(atom) -> tuple[sp.Basic, sp.Basic]:
    """(always true over the box, always false over the box) for one comparison."""
    summary = summary_of(atom)
    if summary is not None:
        return _summarized(atom, summary)
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


def undecided_atoms(mask: sp.Basic) -> list[sp.Basic]:
    """The mask's atoms that no tile bound decides (their tiles are partial): neither linear in
    q_idx and kv_idx nor a summarized equality."""
    found = []
    for atom in mask.atoms(sp.core.relational.Relational):
        if _atom(atom) == (sp.false, sp.false):
            found.append(atom)
    return sorted(found, key=sp.default_sort_key)

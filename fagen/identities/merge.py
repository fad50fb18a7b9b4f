"""Symbolic proofs behind `fagen.merge_attention` (split-KV decoding, context parallelism).

Attention over a key set split into disjoint parts can be computed part by part: part i
gives O_i = softmax(s_i) V_i and L_i = logsumexp(s_i) for each query row, and

    L = c + log(sum_i exp(L_i - c)),   O = sum_i exp(L_i - L) O_i

recovers the attention output and logsumexp over the union of the parts, for any shift
c (the code takes c = max_i L_i, detached from autograd: the result does not depend on
it). With upstream gradients dO on O and dL on L,

    dO_i = exp(L_i - L) dO,   dL_i = exp(L_i - L) (dL + <dO, O_i - O>).

(dL_i: dL/dL_i = w_i and dO_j/dL_i = w_i (delta_ij - w_j) O_j with w_i = exp(L_i - L), so
<dO, dO/dL_i> = w_i <dO, O_i> - w_i <dO, O>.) The merge is associative and commutative,
so split-KV and ring attention may merge parts in any order and bracketing, and a part
with L_i = -inf (no key: the logsumexp of an empty set) has weight 0 and changes
nothing.

Every identity is proved on fully symbolic rows (a fresh real symbol per score, value,
statistic and gradient entry) with `core.is_zero`; L is compared through exp(L), which is
injective. `merge_states` is the merge these proofs use, written as the code computes it;
`merge_gradient_claim` is the closed-form backward above.
"""

from __future__ import annotations

import itertools
from functools import partial

import sympy as sp

from .core import Identity, equal, frobenius, gradient, matrix

__all__ = ["MERGE_IDENTITIES", "merge_associative", "merge_blocks", "merge_empty_part", "merge_gradient",
           "merge_gradient_claim", "merge_states"]


def merge_states(states: list, shift=0) -> tuple:
    """Merge [(O_i (1 x d), L_i)] as fagen.ops.merge does: w_i = exp(L_i - c),
    L = c + log(sum w_i), O = sum (w_i / sum w) O_i."""
    shift = sp.sympify(shift)
    weights = [sp.exp(L_i - shift) for _, L_i in states]
    total = sum(weights, sp.Integer(0))
    out = sum((w / total * O_i for w, (O_i, _) in zip(weights, states)), sp.zeros(*states[0][0].shape))
    return out, shift + sp.log(total)


def merge_gradient_claim(states: list, out: sp.Matrix, lse, d_out: sp.Matrix, d_lse) -> list:
    """The closed-form backward: [(dO_i, dL_i)] for each part."""
    grads = []
    for O_i, L_i in states:
        w = sp.exp(L_i - lse)
        grads.append((w * d_out, w * (d_lse + frobenius(d_out, O_i - out))))
    return grads


def _part(scores: list, values: sp.Matrix) -> tuple:
    """One part's (O_i, L_i): softmax over its scores times its values, and its logsumexp."""
    exps = [sp.exp(s) for s in scores]
    total = sum(exps)
    return sp.Matrix([[e / total for e in exps]]) * values, sp.log(total)


def _same_state(a: tuple, b: tuple) -> bool:
    return equal(a[0], b[0]) and equal(sp.exp(a[1]), sp.exp(b[1]))


def _states(parts: int, d: int) -> list:
    return [(matrix(f"O{i}", 1, d), sp.Symbol(f"L_{i}", real=True)) for i in range(parts)]


def merge_blocks(sizes: tuple, d: int) -> bool:
    """Merging the (O_i, L_i) of disjoint key blocks, with a symbolic shift c and with
    c = 0, gives softmax(s) V and logsumexp(s) over all the keys."""
    n = sum(sizes)
    s = [sp.Symbol(f"s_{j}", real=True) for j in range(n)]
    V = matrix("V", n, d)
    starts = list(itertools.accumulate((0,) + tuple(sizes)))
    states = [_part(s[a:b], V.extract(list(range(a, b)), list(range(d)))) for a, b in itertools.pairwise(starts)]
    full = _part(s, V)
    c = sp.Symbol("c", real=True)
    return all(_same_state(merge_states(states, shift), full) for shift in (c, sp.Integer(0)))


def merge_gradient(parts: int, d: int) -> bool:
    """loss = <dO, O> + dL L of the merge: its gradients w.r.t. each O_i and L_i are
    dO_i = exp(L_i - L) dO and dL_i = exp(L_i - L) (dL + <dO, O_i - O>)."""
    states = _states(parts, d)
    d_out, d_lse = matrix("dO", 1, d), sp.Symbol("dL", real=True)
    out, lse = merge_states(states, sp.Symbol("c", real=True))
    loss = frobenius(d_out, out) + d_lse * lse
    claimed = merge_gradient_claim(states, out, lse, d_out, d_lse)
    return all(equal(gradient(loss, O_i), dO_i) and equal(sp.diff(loss, L_i), dL_i)
               for (O_i, L_i), (dO_i, dL_i) in zip(states, claimed))


def _all_merges(states: list) -> list:
    """Every way to merge the states two at a time: all orders, all bracketings."""
    if len(states) == 1:
        return [states[0]]
    results = []
    for split in range(1, len(states)):
        for left in itertools.combinations(range(len(states)), split):
            rest = [states[t] for t in range(len(states)) if t not in left]
            for a in _all_merges([states[t] for t in left]):
                for b in _all_merges(rest):
                    results.append(merge_states([a, b]))
    return results


def merge_associative(parts: int, d: int) -> bool:
    """merge(merge(a, b), c) = merge(a, merge(b, c)) = merge(a, b, c), and likewise for
    every order and bracketing: the merge is associative and commutative."""
    states = _states(parts, d)
    flat = merge_states(states)
    return all(_same_state(merged, flat) for merged in _all_merges(states))


def merge_empty_part(parts: int, d: int) -> bool:
    """A part with L = -inf (no key) gets weight 0: adding it, at any position, changes
    neither O nor L, whatever its O holds."""
    states = _states(parts, d)
    empty = (matrix("E", 1, d), sp.S.NegativeInfinity)
    flat = merge_states(states)
    for position in range(parts + 1):
        merged = merge_states(states[:position] + [empty] + states[position:])
        if any(x.has(sp.nan) for x in (*merged[0], merged[1])) or not _same_state(merged, flat):
            return False
    return True


def _always(spec) -> bool:
    return True  # split-KV decoding and context parallelism merge the output of any variant


_BLOCKS = "merge of key blocks = attention over their union"
_GRAD = "merge backward: dO_i = w_i dO, dL_i = w_i (dL + <dO, O_i - O>)"
_ASSOC = "merge is associative and commutative"
_EMPTY = "merge: a part with L = -inf adds nothing"
MERGE_IDENTITIES: list[Identity] = [
    Identity(_BLOCKS, "2 blocks (2+3), d=2", partial(merge_blocks, (2, 3), 2), _always),
    Identity(_BLOCKS, "3 blocks (2+3+2), d=2", partial(merge_blocks, (2, 3, 2), 2), _always),
    Identity(_GRAD, "2 parts, d=2", partial(merge_gradient, 2, 2), _always),
    Identity(_GRAD, "3 parts, d=2", partial(merge_gradient, 3, 2), _always),
    Identity(_ASSOC, "3 parts, every order and bracketing, d=2", partial(merge_associative, 3, 2), _always),
    Identity(_EMPTY, "2 parts + 1 empty, d=2", partial(merge_empty_part, 2, 2), _always),
]

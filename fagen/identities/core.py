"""Symbolic proofs of the identities the attention kernels rely on.

Each identity is a small function that builds both sides of an equation in
sympy and returns True when their difference simplifies to exactly zero.
Concrete shapes (N = 2 and 3 rows or blocks, d = 2) use a fresh real symbol
for every matrix entry, so the proof holds for all inputs of that shape;
where sympy's matrix calculus allows, the identity is also proved for
symbolic shapes (MatrixSymbol n x d).

Exponentials are handled soundly and fast by `is_zero`: every exp(a + b) is
split into exp(a) exp(b), each exp(atom) becomes an independent positive
symbol (and each symbolic-length Sum, once index-free factors are pulled out,
an opaque symbol), and the result is a rational function that `cancel`
decides. An identity proved for independent positive symbols holds in
particular for the real exponentials.

This module holds the records (Identity, Result), the table `fagen verify`
prints, the proof tools shared by every identity, and the identities of plain
attention (BASE_IDENTITIES). The variants' ones (sinks, a differentiable lse,
score mods) are in `fagen.identities.variants`; the package joins both into
`IDENTITIES` and proves them with `run()`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Callable

import sympy as sp

from fagen.spec import Spec

# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class Identity:
    name: str  # what is proved, short
    shapes: str  # the shapes it is proved for
    check: Callable[[], bool]  # True if proved; False or an exception if not
    relied_on_by: Callable[[Spec], bool] = lambda spec: True


@dataclass(frozen=True)
class Result:
    name: str
    shapes: str
    ok: bool
    seconds: float
    detail: str = ""


def format_table(results: list[Result]) -> str:
    """A plain-text table: identity, shapes, result, seconds (and why a proof failed)."""
    header = ("identity", "shapes", "result", "seconds")
    rows = [(r.name, r.shapes, "ok" if r.ok else "FAILED", f"{r.seconds:.2f}") for r in results]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(4)]
    line = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()  # noqa: E731
    out = [line(header), line(tuple("-" * w for w in widths))]
    for result, row in zip(results, rows):
        out.append(line(row))
        if result.detail:
            out.append(f"    {result.detail}")
    failed = sum(not r.ok for r in results)
    total = sum(r.seconds for r in results)
    out.append(f"{len(results) - failed}/{len(results)} proved in {total:.1f} s"
               + (f"; {failed} FAILED" if failed else ""))
    return "\n".join(out)


# ---------------------------------------------------------------- proof tools


def matrix(name: str, rows: int, cols: int, **assumptions) -> sp.Matrix:
    """A rows x cols matrix of independent real symbols name_ij."""
    return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}_{i}{j}", real=True, **assumptions))


def _exp_atoms_to_symbols(expr: sp.Expr) -> sp.Expr:
    """Replace exp(c * atom) by X_atom ** c with one positive symbol per atom,
    after pulling factors that do not depend on the index out of every Sum and
    replacing each remaining Sum by a symbol of its own."""
    expr = sp.expand_power_exp(expr)
    expr = expr.replace(lambda x: isinstance(x, sp.Sum),
                        lambda x: sp.factor_terms(sp.Sum(sp.expand_power_exp(x.function), *x.limits)))
    opaque = {x: sp.Dummy("sum") for x in expr.atoms(sp.Sum)}
    expr = expr.xreplace(opaque)
    bases: dict = {}
    replacements = {}
    for e in expr.atoms(sp.exp):
        coeff, atom = e.args[0].as_coeff_Mul()
        base = bases.setdefault(atom, sp.Dummy(f"exp({atom})", positive=True))
        replacements[e] = base ** coeff
    return expr.xreplace(replacements)


def is_zero(expr) -> bool:
    """True if expr (a scalar or a matrix) is identically zero."""
    if isinstance(expr, sp.MatrixBase):
        return all(is_zero(entry) for entry in expr)
    return sp.cancel(sp.together(_exp_atoms_to_symbols(sp.sympify(expr)))) == 0


def equal(lhs, rhs) -> bool:
    return is_zero(lhs - rhs)


def gradient(loss: sp.Expr, variables: sp.Matrix) -> sp.Matrix:
    """d loss / d variables, entry by entry."""
    return variables.applyfunc(lambda x: sp.diff(loss, x))


def frobenius(a: sp.Matrix, b: sp.Matrix) -> sp.Expr:
    """sum_ij a_ij b_ij: the loss whose gradient wrt b is the upstream gradient a."""
    return sum((a.multiply_elementwise(b)), sp.Integer(0))


def softmax_rows(scores: sp.Matrix) -> sp.Matrix:
    rows = []
    for i in range(scores.rows):
        exps = [sp.exp(s) for s in scores.row(i)]
        total = sum(exps)
        rows.append([e / total for e in exps])
    return sp.Matrix(rows)


def rowsum(a: sp.Matrix) -> sp.Matrix:
    return a * sp.ones(a.cols, 1)


def _split_columns(n: int, sizes: tuple) -> list[list[int]]:
    if sum(sizes) != n:
        raise ValueError(f"block sizes {sizes} do not cover {n} columns")
    starts = list(itertools.accumulate((0,) + tuple(sizes)))
    return [list(range(starts[t], starts[t + 1])) for t in range(len(sizes))]


# ---------------------------------------------------------------- gradients of O = P V


def pv_gradients(n: int, d_v: int) -> bool:
    """O = P V, loss = <dO, O>: dV = P^T dO and dP = dO V^T (V, O and dO have d_v columns)."""
    P, V, dO = matrix("P", n, n), matrix("V", n, d_v), matrix("dO", n, d_v)
    loss = frobenius(dO, P * V)
    return equal(gradient(loss, V), P.T * dO) and equal(gradient(loss, P), dO * V.T)


def pv_gradients_symbolic() -> bool:
    n, d_v = sp.symbols("n d_v", integer=True, positive=True)
    P, V, dO = sp.MatrixSymbol("P", n, n), sp.MatrixSymbol("V", n, d_v), sp.MatrixSymbol("dO", n, d_v)
    loss = sp.Trace(dO.T * P * V)
    return loss.diff(V) == P.T * dO and loss.diff(P) == dO * V.T


# ---------------------------------------------------------------- softmax


def softmax_jacobian(n: int) -> bool:
    """P = softmax(S) by rows, loss = <dP, P>: dS = P o (dP - D 1^T), D_i = sum_j P_ij dP_ij."""
    S, dP = matrix("S", n, n), matrix("dP", n, n)
    P = softmax_rows(S)
    D = rowsum(P.multiply_elementwise(dP))
    claimed = P.multiply_elementwise(dP - D * sp.ones(1, n))
    return equal(gradient(frobenius(dP, P), S), claimed)


def delta_from_output(n: int, d_v: int) -> bool:
    """With O = P V and dP = dO V^T: rowsum(P o dP) = rowsum(dO o O), for any P (d_v columns)."""
    P, V, dO = matrix("P", n, n), matrix("V", n, d_v), matrix("dO", n, d_v)
    return equal(rowsum(P.multiply_elementwise(dO * V.T)), rowsum(dO.multiply_elementwise(P * V)))


def delta_from_output_symbolic() -> bool:
    """rowsum(A o B) = diag(A B^T), and P dP^T = P V dO^T = (dO O^T)^T, so the diagonals agree."""
    n, d_v = sp.symbols("n d_v", integer=True, positive=True)
    i = sp.Symbol("i", integer=True)
    A, B = sp.MatrixSymbol("A", n, d_v), sp.MatrixSymbol("B", n, d_v)
    diagonal = (A * B.T)[i, i]  # sympy writes it as a Sum over a dummy index k
    k = diagonal.variables[0]
    rowsum_is_diagonal = diagonal == sp.Sum(sp.HadamardProduct(A, B)[i, k], (k, 0, d_v - 1))
    P, V, dO = sp.MatrixSymbol("P", n, n), sp.MatrixSymbol("V", n, d_v), sp.MatrixSymbol("dO", n, d_v)
    dP, O = dO * V.T, P * V
    same_matrix = (P * dP.T) == (dO * O.T).T
    return bool(rowsum_is_diagonal) and bool(same_matrix)


# ---------------------------------------------------------------- S = tau Q K^T


def score_gradients(nq: int, nk: int, d: int) -> bool:
    """S = tau Q K^T, loss = <dS, S>: dQ = tau dS K and dK = tau dS^T Q."""
    tau = sp.Symbol("tau", positive=True)
    Q, K, dS = matrix("Q", nq, d), matrix("K", nk, d), matrix("dS", nq, nk)
    loss = frobenius(dS, tau * Q * K.T)
    return equal(gradient(loss, Q), tau * dS * K) and equal(gradient(loss, K), tau * dS.T * Q)


def score_gradients_symbolic() -> bool:
    n, m, d = sp.symbols("n m d", integer=True, positive=True)
    tau = sp.Symbol("tau", positive=True)
    Q, K, dS = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("dS", n, m)
    loss = sp.Trace(dS.T * (tau * Q * K.T))
    return loss.diff(Q) == tau * dS * K and loss.diff(K) == tau * dS.T * Q


def blocked_accumulation(sizes: tuple, d: int, d_v: int) -> bool:
    """Per-block sums give the full products: dQ_i = sum_j tau dS_ij K_j,
    dK_j = sum_i tau dS_ij^T Q_i, dV_j = sum_i P_ij^T dO_i (ragged blocks; Q, K have d
    columns, dO has d_v)."""
    n = sum(sizes)
    tau = sp.Symbol("tau", positive=True)
    Q, K, dO = matrix("Q", n, d), matrix("K", n, d), matrix("dO", n, d_v)
    dS, P = matrix("dS", n, n), matrix("P", n, n)
    parts = _split_columns(n, sizes)
    sub = lambda m, r, c: m.extract(r, c)  # noqa: E731
    all_d = list(range(d))
    dq = sp.Matrix.vstack(*[
        sum((tau * sub(dS, rows, cols) * sub(K, cols, all_d) for cols in parts), sp.zeros(len(rows), d))
        for rows in parts])
    dk = sp.Matrix.vstack(*[
        sum((tau * sub(dS, rows, cols).T * sub(Q, rows, all_d) for rows in parts), sp.zeros(len(cols), d))
        for cols in parts])
    dv = sp.Matrix.vstack(*[
        sum((sub(P, rows, cols).T * sub(dO, rows, list(range(d_v))) for rows in parts), sp.zeros(len(cols), d_v))
        for cols in parts])
    return equal(dq, tau * dS * K) and equal(dk, tau * dS.T * Q) and equal(dv, P.T * dO)


# ---------------------------------------------------------------- online softmax


def merge_stats(a: tuple, b: tuple) -> tuple:
    """Combine the (max, sum of exp(s - max)) of two disjoint parts of a row."""
    (m_a, l_a), (m_b, l_b) = a, b
    m = sp.Max(m_a, m_b)
    return m, l_a * sp.exp(m_a - m) + l_b * sp.exp(m_b - m)


def block_stats(entries) -> tuple:
    m = sp.Max(*entries)
    return m, sum(sp.exp(s - m) for s in entries)


def _merge_orders(states: list) -> list:
    """Every way to merge the block states: all orders, all bracketings."""
    if len(states) == 1:
        return [states[0]]
    results = []
    for split in range(1, len(states)):
        for left_blocks in itertools.combinations(range(len(states)), split):
            left = [states[t] for t in left_blocks]
            right = [states[t] for t in range(len(states)) if t not in left_blocks]
            for a in _merge_orders(left):
                for b in _merge_orders(right):
                    results.append(merge_stats(a, b))
    return results


def online_softmax(sizes: tuple) -> bool:
    """Merging per-block (m, l) in any order and bracketing gives the row's max and sum."""
    n = sum(sizes)
    s = [sp.Symbol(f"s_{j}", real=True) for j in range(n)]
    states = [block_stats([s[j] for j in cols]) for cols in _split_columns(n, sizes)]
    m_row, l_row = block_stats(s)
    return all(m == m_row and equal(l, l_row) for m, l in _merge_orders(states))


def online_softmax_symbolic() -> bool:
    """Block states merge to the row's (max, sum) for any number of blocks of any
    size, in any order: (1) a single score s has state (s, 1); (2) appending a
    score t to a block of n scores (n symbolic) by merging (t, 1) gives the
    state of the longer block, so by induction a block's state is the merge of
    its scores'; (3) the merge is commutative and associative, so every order
    and bracketing of the merges gives the same result."""
    s_one = sp.Symbol("s", real=True)
    single = block_stats([s_one]) == (s_one, 1)
    # (2) with the block's state written out: m_A is its max, l_A = sum_k exp(s_k - m_A).
    n = sp.Symbol("n", integer=True, positive=True)
    k = sp.Symbol("k", integer=True)
    s = sp.IndexedBase("s", real=True)
    m_a, t = sp.Symbol("m_A", real=True), sp.Symbol("t", real=True)
    m_new, l_new = merge_stats((m_a, sp.Sum(sp.exp(s[k] - m_a), (k, 1, n))), (t, sp.Integer(1)))
    appended = (m_new == sp.Max(m_a, t)
                and equal(l_new, sp.Sum(sp.exp(s[k] - m_new), (k, 1, n)) + sp.exp(t - m_new)))
    # (3)
    m = sp.symbols("m_0:3", real=True)
    l = sp.symbols("l_0:3", positive=True)
    a, b, c = zip(m, l)
    ab, ba = merge_stats(a, b), merge_stats(b, a)
    left, right = merge_stats(merge_stats(a, b), c), merge_stats(a, merge_stats(b, c))
    algebra = (ab[0] == ba[0] and equal(ab[1], ba[1])
               and left[0] == right[0] and equal(left[1], right[1]))
    return bool(single and appended and algebra)


def _attention_row_problem(nq: int, sizes: tuple, d: int):
    n = sum(sizes)
    S, V = matrix("S", nq, n), matrix("V", n, d)
    return S, V, _split_columns(n, sizes)


def fa1_rescaled_output(nq: int, sizes: tuple, d: int) -> bool:
    """FlashAttention-1 Algorithm 1, lines 10-13: O, l, m updated and rescaled at
    every block end as softmax(S) V, sum exp(S - m), rowmax(S)."""
    S, V, parts = _attention_row_problem(nq, sizes, d)
    ok = True
    for i in range(nq):
        O, l, m = sp.zeros(1, d), sp.Integer(0), sp.S.NegativeInfinity
        for cols in parts:
            s = [S[i, j] for j in cols]
            m_tile, l_tile = block_stats(s)
            p_tile = sp.Matrix([[sp.exp(x - m_tile) for x in s]])
            m_new = sp.Max(m, m_tile)
            l_new = sp.exp(m - m_new) * l + sp.exp(m_tile - m_new) * l_tile
            O = (l * sp.exp(m - m_new) * O + sp.exp(m_tile - m_new) * p_tile * V.extract(cols, list(range(d)))) / l_new
            l, m = l_new, m_new
        m_row, l_row = block_stats(list(S.row(i)))
        ok = ok and m == m_row and equal(l, l_row) and equal(O, softmax_rows(S.row(i)) * V)
    return ok


def fa2_unscaled_output(nq: int, sizes: tuple, d: int) -> bool:
    """FlashAttention-2 Algorithm 1, lines 9-13: an unscaled accumulator, one final
    division by l, gives softmax(S) V; L = m + log l is the row's logsumexp."""
    S, V, parts = _attention_row_problem(nq, sizes, d)
    ok = True
    for i in range(nq):
        acc, l, m = sp.zeros(1, d), sp.Integer(0), sp.S.NegativeInfinity
        for cols in parts:
            s = [S[i, j] for j in cols]
            m_new = sp.Max(m, *s)
            p_tile = sp.Matrix([[sp.exp(x - m_new) for x in s]])
            l = sp.exp(m - m_new) * l + sum(p_tile)
            acc = sp.exp(m - m_new) * acc + p_tile * V.extract(cols, list(range(d)))
            m = m_new
        # exp is injective, so exp(m + log l) = exp(logsumexp) proves L = logsumexp.
        logsumexp = sp.log(sum(sp.exp(x) for x in S.row(i)))
        ok = (ok and m == sp.Max(*S.row(i)) and equal(acc / l, softmax_rows(S.row(i)) * V)
              and equal(sp.exp(m + sp.log(l)), sp.exp(logsumexp)))
    return ok


def p_from_stats_and_lse(n: int) -> bool:
    """exp(S - m) / l = exp(S - L) = softmax(S) with m = rowmax S, l = sum exp(S - m), L = m + log l."""
    S = matrix("S", n, n)
    P = softmax_rows(S)
    for i in range(n):
        m, l = block_stats(list(S.row(i)))
        L = m + sp.log(l)
        for j in range(n):
            from_stats = sp.exp(S[i, j] - m) / l
            from_lse = sp.exp(S[i, j] - L)
            if not (equal(from_stats, P[i, j]) and equal(from_lse, P[i, j])):
                return False
    return True


def p_from_stats_and_lse_symbolic() -> bool:
    """For any real s, m and any l > 0: exp(s - m) / l = exp(s - (m + log l))."""
    s, m = sp.symbols("s m", real=True)
    l = sp.Symbol("l", positive=True)
    return equal(sp.exp(s - m) / l, sp.exp(s - (m + sp.log(l))))


# ---------------------------------------------------------------- dropout


def _dropout_factor(n: int):
    p = sp.Symbol("p", positive=True)
    keep = matrix("keep", n, n)
    return p, keep, keep / (1 - p)


def dropout_gradient(n: int, d: int) -> bool:
    """O = (P o Z) V: dP = (dO V^T) o Z, and D = rowsum(P o dP) is still rowsum(dO o O)."""
    P, V, dO = matrix("P", n, n), matrix("V", n, d), matrix("dO", n, d)
    _, _, Z = _dropout_factor(n)
    O = P.multiply_elementwise(Z) * V
    dP = (dO * V.T).multiply_elementwise(Z)
    return (equal(gradient(frobenius(dO, O), P), dP)
            and equal(rowsum(P.multiply_elementwise(dP)), rowsum(dO.multiply_elementwise(O))))


def dropout_expectation(n: int, d: int) -> bool:
    """keep_ij ~ Bernoulli(1 - p), independent: E[(P o Z) V] = P V, summing over every
    keep pattern of the entries each output depends on, weighted by its probability."""
    P, V = matrix("P", n, n), matrix("V", n, d)
    p, keep, Z = _dropout_factor(n)
    O = P.multiply_elementwise(Z) * V
    for entry, expected in zip(O, P * V):
        coins = sorted(entry.free_symbols & set(keep), key=str)
        mean = sp.Integer(0)
        for pattern in itertools.product((0, 1), repeat=len(coins)):
            weight = sp.prod([(1 - p) if kept else p for kept in pattern])
            mean += weight * entry.xreplace(dict(zip(coins, pattern)))
        if not equal(mean, expected):
            return False
    return True


# ---------------------------------------------------------------- masked blocks and empty rows


def _safe_max(m):
    """fagen.reference.empty_rows.safe_max: -inf -> 0."""
    return sp.Integer(0) if m == sp.S.NegativeInfinity else m


def _safe_reciprocal(l):
    return sp.Integer(0) if l == 0 else 1 / l


def masked_block_contributes_nothing(rows: int, cols: int, d: int) -> bool:
    """A block whose scores are all -inf leaves the forward state (O, l, m) of
    FlashAttention-1 and -2 unchanged, and adds 0 to dQ, dK and dV: so
    skipping it (causal block skipping) is exact."""
    masked = [sp.S.NegativeInfinity] * cols
    V, dO, Q, K = matrix("V", cols, d), matrix("dO", rows, d), matrix("Q", rows, d), matrix("K", cols, d)
    tau = sp.Symbol("tau", positive=True)
    ok = True
    for i in range(rows):
        m = sp.Symbol(f"m_{i}", real=True)
        l = sp.Symbol(f"l_{i}", positive=True)
        O = matrix(f"O{i}", 1, d)
        # FlashAttention-1, lines 10-12, with the tile max guarded as the reference does.
        m_tile = sp.Max(*masked)
        p_tile = sp.Matrix([[sp.exp(x - _safe_max(m_tile)) for x in masked]])
        m_new = sp.Max(m, m_tile)
        l_new = sp.exp(m - m_new) * l + sp.exp(m_tile - m_new) * sum(p_tile)
        O_new = (l * sp.exp(m - m_new) * O + sp.exp(m_tile - m_new) * p_tile * V) / l_new
        ok = ok and m_new == m and equal(l_new, l) and equal(O_new, O)
        # FlashAttention-2, lines 9-10.
        m2 = sp.Max(m, *masked)
        p2 = sp.Matrix([[sp.exp(x - m2) for x in masked]])
        ok = ok and m2 == m and equal(sp.exp(m - m2) * l + sum(p2), l)
        ok = ok and equal(sp.exp(m - m2) * O + p2 * V, O)
    # Backward: P recovered from (m, l) or from L is 0 on the block, hence so is every update.
    L = sp.Symbol("L", real=True)
    P = sp.Matrix(rows, cols, lambda i, j: sp.exp(sp.S.NegativeInfinity - L))
    dS = P.multiply_elementwise(matrix("dP", rows, cols) - matrix("D", rows, 1) * sp.ones(1, cols))
    return (ok and P == sp.zeros(rows, cols) and P.T * dO == sp.zeros(cols, d)
            and tau * dS * K == sp.zeros(rows, d) and tau * dS.T * Q == sp.zeros(cols, d))


def empty_row_convention(blocks: int, d: int) -> bool:
    """A row that sees no key ends with m = -inf, l = 0, O = 0 in both algorithms, under
    the guarded arithmetic of fagen.reference.empty_rows (no NaN on the way); its
    stored L = +inf gives P = exp(S - L) = 0, and (m, l) give P = 0 too."""
    V = matrix("V", 2, d)
    masked = [sp.S.NegativeInfinity] * 2
    # FlashAttention-1.
    O, l, m = sp.zeros(1, d), sp.Integer(0), sp.S.NegativeInfinity
    for _ in range(blocks):
        m_tile = sp.Max(*masked)
        p_tile = sp.Matrix([[sp.exp(x - _safe_max(m_tile)) for x in masked]])
        m_new = sp.Max(m, m_tile)
        w_old, w_tile = sp.exp(m - _safe_max(m_new)), sp.exp(m_tile - _safe_max(m_new))
        l_new = w_old * l + w_tile * sum(p_tile)
        O = _safe_reciprocal(l_new) * (l * w_old * O + w_tile * p_tile * V)
        l, m = l_new, m_new
    fa1_ok = m == sp.S.NegativeInfinity and l == 0 and O == sp.zeros(1, d)
    # FlashAttention-2.
    acc, l2, m2 = sp.zeros(1, d), sp.Integer(0), sp.S.NegativeInfinity
    for _ in range(blocks):
        m_new = sp.Max(m2, *masked)
        p_tile = sp.Matrix([[sp.exp(x - _safe_max(m_new)) for x in masked]])
        rescale = sp.exp(m2 - _safe_max(m_new))
        l2 = rescale * l2 + sum(p_tile)
        acc = rescale * acc + p_tile * V
        m2 = m_new
    fa2_ok = _safe_reciprocal(l2) * acc == sp.zeros(1, d) and l2 == 0
    L = sp.S.Infinity  # the stored statistic of an empty row
    s = sp.Symbol("s", real=True)  # any unmasked score, were there one
    recover_ok = (sp.exp(sp.S.NegativeInfinity - L) == 0 and sp.exp(s - L) == 0
                  and sp.exp(sp.S.NegativeInfinity - _safe_max(m)) * _safe_reciprocal(l) == 0)
    values = [*O, l, m, *acc, l2, m2]
    no_nan = not any(v.has(sp.nan) for v in values)
    return fa1_ok and fa2_ok and recover_ok and no_nan


# ---------------------------------------------------------------- the registry


def _v1(spec: Spec) -> bool:
    return spec.version == 1


def _v2(spec: Spec) -> bool:
    return spec.version == 2


def _dropout(spec: Spec) -> bool:
    return spec.dropout


def _masking(spec: Spec) -> bool:
    """Any mask that can give -inf scores: causal, key padding, a sliding window, a mask_mod."""
    return spec.causal or spec.key_padding or spec.window or spec.mask_mod is not None


def _always(spec: Spec) -> bool:
    return True


def _head_dim_v(spec: Spec) -> bool:
    """V's head dim differs from Q's and K's."""
    return spec.head_dim_v != spec.head_dim


BASE_IDENTITIES: list[Identity] = [
    Identity("dV = P^T dO, dP = dO V^T (O = P V)", "N=2, d_v=2", partial(pv_gradients, 2, 2), _always),
    Identity("dV = P^T dO, dP = dO V^T (O = P V)", "N=3, d_v=2", partial(pv_gradients, 3, 2), _always),
    Identity("dV = P^T dO, dP = dO V^T (O = P V)", "symbolic n, d_v", pv_gradients_symbolic, _always),
    Identity("softmax Jacobian: dS = P o (dP - D 1^T)", "N=2", partial(softmax_jacobian, 2), _always),
    Identity("softmax Jacobian: dS = P o (dP - D 1^T)", "N=3", partial(softmax_jacobian, 3), _always),
    Identity("D = rowsum(P o dP) = rowsum(dO o O)", "N=2, d_v=2", partial(delta_from_output, 2, 2), _always),
    Identity("D = rowsum(P o dP) = rowsum(dO o O)", "N=3, d_v=2", partial(delta_from_output, 3, 2), _always),
    Identity("D = rowsum(P o dP) = rowsum(dO o O)", "symbolic n, d_v", delta_from_output_symbolic, _always),
    Identity("dQ = tau dS K, dK = tau dS^T Q (S = tau Q K^T)", "N=2, d=2",
             partial(score_gradients, 2, 2, 2), _always),
    Identity("dQ = tau dS K, dK = tau dS^T Q (S = tau Q K^T)", "Nq=3, Nk=2, d=2",
             partial(score_gradients, 3, 2, 2), _always),
    Identity("dQ = tau dS K, dK = tau dS^T Q (S = tau Q K^T)", "symbolic Nq, Nk, d",
             score_gradients_symbolic, _always),
    Identity("dQ, dK, dV accumulate block by block", "blocks 2+1, d=2",
             partial(blocked_accumulation, (2, 1), 2, 2), _always),
    Identity("dQ, dK, dV accumulate block by block", "blocks 2+1, d=3, d_v=2",
             partial(blocked_accumulation, (2, 1), 3, 2), _head_dim_v),
    Identity("online softmax: merged (m, l) = row max, row sum", "2 blocks (2+1)",
             partial(online_softmax, (2, 1)), _always),
    Identity("online softmax: merged (m, l) = row max, row sum", "3 blocks (2+2+1), any order",
             partial(online_softmax, (2, 2, 1)), _always),
    Identity("online softmax: merged (m, l) = row max, row sum", "any number and size of blocks, any order",
             online_softmax_symbolic, _always),
    Identity("FA1 rescaled O update = softmax(S) V", "2 blocks (2+1), 3 rows, d_v=2",
             partial(fa1_rescaled_output, 3, (2, 1), 2), _v1),
    Identity("FA1 rescaled O update = softmax(S) V", "3 blocks (2+2+1), 2 rows, d_v=2",
             partial(fa1_rescaled_output, 2, (2, 2, 1), 2), _v1),
    Identity("FA2 unscaled O, final rescale = softmax(S) V", "2 blocks (2+1), 3 rows, d_v=2",
             partial(fa2_unscaled_output, 3, (2, 1), 2), _v2),
    Identity("FA2 unscaled O, final rescale = softmax(S) V", "3 blocks (2+2+1), 2 rows, d_v=2",
             partial(fa2_unscaled_output, 2, (2, 2, 1), 2), _v2),
    Identity("P from (m, l) = P from L = m + log l", "N=2", partial(p_from_stats_and_lse, 2), _always),
    Identity("P from (m, l) = P from L = m + log l", "N=3", partial(p_from_stats_and_lse, 3), _always),
    Identity("P from (m, l) = P from L = m + log l", "any m, l > 0", p_from_stats_and_lse_symbolic, _always),
    Identity("dropout: dP = dP_dropped o Z, D = rowsum(dO o O)", "N=2, d=2",
             partial(dropout_gradient, 2, 2), _dropout),
    Identity("dropout: dP = dP_dropped o Z, D = rowsum(dO o O)", "N=3, d=2",
             partial(dropout_gradient, 3, 2), _dropout),
    Identity("dropout: E[dropped O] = O", "N=2, d=2", partial(dropout_expectation, 2, 2), _dropout),
    Identity("dropout: E[dropped O] = O", "N=3, d=2", partial(dropout_expectation, 3, 2), _dropout),
    Identity("masked block adds nothing to O, l, dQ, dK, dV", "block 2x2, d=2",
             partial(masked_block_contributes_nothing, 2, 2, 2), _masking),
    Identity("masked block adds nothing to O, l, dQ, dK, dV", "block 3x3, d=2",
             partial(masked_block_contributes_nothing, 3, 3, 2), _masking),
    Identity("row with no key: O = 0, l = 0, L = +inf, P = 0", "3 blocks, d=2",
             partial(empty_row_convention, 3, 2), _masking),
]

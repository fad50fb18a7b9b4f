"""A Spec's variant as mathematics: the score chain, the mask, their symbols and loads.

The score chain follows flash-attn 2.8: the scaled score x = tau q.k, then softcap
(c tanh(x / c)), then ALiBi (- slope |i + Nk - Nq - j|), then the user's score_mod. The
mask is key padding (j < Nk of the entry), causal (j <= i + Nk - Nq), the window
(i + Nk - Nq - left <= j <= i + Nk - Nq + right) and the user's mask_mod, applied last.
Sinks change no expression: they join the softmax's denominator (the kernels start each
row's running max and sum from the sink).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import sympy as sp

from ..spec import CustomMod, Spec
from .builtins import ALIBI, SOFTCAP as BUILTIN_SOFTCAP, WINDOW
from .language import B, H, KV_IDX, Q_IDX, SCORE, Traced

# Run-time quantities the expressions use besides the language's symbols.
SEQLEN_Q = sp.Symbol("seqlen_q", integer=True, nonnegative=True)
KEYS = sp.Symbol("keys", integer=True, nonnegative=True)        # this batch entry's key count
# The built-ins' values, named as their kernel parameters (builtins: the rows' first params).
SOFTCAP = sp.Symbol(BUILTIN_SOFTCAP.params[0][0], positive=True)
WINDOW_LEFT, WINDOW_RIGHT = (sp.Symbol(name, integer=True, nonnegative=True) for name, _, _ in WINDOW.params)
ALIBI_SLOPES = sp.Function(ALIBI.params[0][0], real=True)


def custom_mod(traced: Traced) -> CustomMod:
    """The canonical, hashable form of a traced mod (what a Spec stores)."""
    from .language import CAPTURE_DTYPES

    captures = tuple((CAPTURE_DTYPES[t.dtype], t.dim()) for t in traced.tensors)
    grads = tuple(traced.kind == "score" and _wants_grad(t) for t in traced.tensors)
    return CustomMod(traced.kind, sp.srepr(traced.expr), str(traced.expr), captures, grads,
                     tuple(kind for _, kind in traced.params))


def _wants_grad(t) -> bool:
    """A captured tensor (or a rebuilt mod's placeholder for one) whose gradient is accumulated."""
    from .language import CapturePlaceholder

    return t.grad if isinstance(t, CapturePlaceholder) else t.requires_grad and t.is_floating_point()


@lru_cache(maxsize=256)
def mod_expression(mod: CustomMod, prefix: str) -> sp.Basic:
    """The mod's expression with its captures renamed `<prefix>_cap<i>` and its lifted numbers
    `<prefix>_par<i>`."""
    from .language import FLOAT_DTYPES, param_symbol

    floating = set(FLOAT_DTYPES.values())
    # The numbers first: xreplace does not look inside what it puts in, and a capture's index
    # may hold one (bias[h, q_idx - kv_idx + n]).
    expr = sp.sympify(mod.expression).xreplace(
        {param_symbol(i, kind): param_symbol(i, kind, f"{prefix}_") for i, kind in enumerate(mod.params)})
    renames = {}
    for f in expr.atoms(sp.core.function.AppliedUndef):
        name = f.func.__name__
        if name.startswith("cap"):   # srepr drops a Function's assumptions: the capture's dtype restores them
            dtype = mod.captures[int(name[3:])][0]
            assumptions = {"real": True} if dtype in floating else {"integer": True}
            renames[f] = sp.Function(f"{prefix}_{name}", **assumptions)(*f.args)
    return expr.xreplace(renames)


@dataclass(frozen=True)
class Capture:
    """A captured tensor as the kernel sees it: `<prefix>_cap<i>`, its dtype, dims, gradient."""

    name: str
    dtype: str
    ndim: int
    grad: bool


@dataclass(frozen=True)
class VariantMath:
    score: sp.Basic            # s' as an expression of SCORE (x = tau q.k)
    mask: sp.Basic             # the whole visibility condition (padding, causal, window, mask_mod)
    masks: bool                # whether the mask differs from plain padding + causal
    sinks: bool
    captures: tuple            # Capture, score's then mask's
    params: tuple              # (name, "int" | "float") of the mods' lifted numbers, score's then mask's
    score_source: str          # the user's expressions, for comments
    mask_source: str

    @property
    def score_grad(self) -> sp.Basic:
        return sp.diff(self.score, SCORE)

    @property
    def has_score_grad(self) -> bool:
        """Whether ds'/dx differs from 1 (softcap, a nonlinear score_mod)."""
        return self.score_grad != 1

    @property
    def grad_loads(self) -> list:
        """The loads of captured tensors that receive gradients, each once."""
        wanted = {c.name for c in self.captures if c.grad}
        loads = [f for f in self.score.atoms(sp.core.function.AppliedUndef) if f.func.__name__ in wanted]
        return sorted(loads, key=sp.default_sort_key)


def offset() -> sp.Basic:
    """Nk - Nq: bottom-right alignment of causal masks, windows and ALiBi."""
    return KEYS - SEQLEN_Q


# ALiBi's distance |i + Nk - Nq - j| (variants.cuda prints it in 32-bit integers).
ALIBI_DISTANCE = sp.Abs(Q_IDX + offset() - KV_IDX)


@lru_cache(maxsize=256)
def variant_math(spec: Spec) -> VariantMath:
    score = SCORE
    if spec.softcap:
        score = SOFTCAP * sp.tanh(score / SOFTCAP)
    if spec.alibi:
        score = score - ALIBI_SLOPES(B, H) * ALIBI_DISTANCE
    captures, params = [], []
    for prefix, mod in (("score", spec.score_mod), ("mask", spec.mask_mod)):
        if mod is not None:
            captures += [Capture(f"{prefix}_cap{i}", dtype, ndim, grad)
                         for i, ((dtype, ndim), grad) in enumerate(zip(mod.captures, mod.grads))]
            params += [(f"{prefix}_par{i}", kind) for i, kind in enumerate(mod.params)]
    if spec.score_mod is not None:
        score = mod_expression(spec.score_mod, "score").xreplace({SCORE: score})
    atoms = [sp.Lt(KV_IDX, KEYS)]
    if spec.causal:
        atoms.append(sp.Le(KV_IDX, Q_IDX + offset()))
    if spec.window:
        atoms += [sp.Ge(KV_IDX, Q_IDX + offset() - WINDOW_LEFT), sp.Le(KV_IDX, Q_IDX + offset() + WINDOW_RIGHT)]
    if spec.mask_mod is not None:
        atoms.append(mod_expression(spec.mask_mod, "mask"))
    return VariantMath(score=score, mask=sp.And(*atoms), masks=spec.window or spec.mask_mod is not None,
                       sinks=spec.sinks, captures=tuple(captures), params=tuple(params),
                       score_source=spec.score_mod.source if spec.score_mod else "",
                       mask_source=spec.mask_mod.source if spec.mask_mod else "")

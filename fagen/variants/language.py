"""The mod language: FlexAttention-style Python functions traced into sympy expressions.

Users write `score_mod(score, b, h, q_idx, kv_idx) -> score` and
`mask_mod(b, h, q_idx, kv_idx) -> bool`. `trace_score_mod` / `trace_mask_mod` call them
once with symbolic proxies (`Sym`, a sympy expression underneath) and return a `Traced`:
the expression and the torch tensors it captured. Supported: arithmetic, comparisons,
`&`, `|`, `~`, `fagen.where`, `abs`, `fagen.minimum`/`maximum` (and torch's), `exp`, `log`,
`tanh`, `sigmoid`, `sqrt` (as `fagen.*`, `torch.*` or tensor methods), numbers, and captured
tensors indexed by index expressions (`bias[h, q_idx - kv_idx + 7]`), which become symbolic
loads `cap0(h, q_idx - kv_idx + 7)` through `__torch_function__`.

Python control flow on a symbolic value (`if`, `and`, `or`, `min`, `max`) cannot be traced:
it raises a `ModError` that points to `fagen.where`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import sympy as sp
import torch

from ..errors import ModError
from .free_values import describe, has_opaque, rebuild

# The symbols of the language. The score is the scaled score tau * q.k (after softcap and
# ALiBi when the variant has them); the indices are absolute (batch, head, query, key).
SCORE = sp.Symbol("score", real=True)
B, H, Q_IDX, KV_IDX = sp.symbols("b h q_idx kv_idx", integer=True, nonnegative=True)
INDEX_SYMBOLS = (B, H, Q_IDX, KV_IDX)

# Captured tensors' dtypes: floating ones load as float, the others as integers.
FLOAT_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
INT_DTYPES = {torch.int32: "int32", torch.int64: "int64", torch.int16: "int16", torch.uint8: "uint8",
              torch.int8: "int8", torch.bool: "bool"}
CAPTURE_DTYPES = {**FLOAT_DTYPES, **INT_DTYPES}


CONTROL_FLOW = ("Python control flow on a symbolic value ({what}) cannot be traced: the mod is called "
                "once with symbols, not once per element. Write fagen.where(cond, a, b) instead of if/else "
                "or a conditional expression, & | ~ instead of and/or/not, and fagen.minimum/maximum "
                "instead of min/max.")


@dataclass
class _Tracer:
    """The captured tensors of one trace, in order of first use."""

    kind: str
    tensors: list = field(default_factory=list)
    functions: list = field(default_factory=list)

    def load(self, tensor, index) -> "Sym":
        """tensor[index]: a captured torch tensor, or a rebuilt mod's CapturePlaceholder."""
        if tensor.dtype not in CAPTURE_DTYPES:
            raise ModError(f"{self.kind}_mod captures a tensor of dtype {tensor.dtype}; captured tensors must be "
                           f"one of {', '.join(map(str, CAPTURE_DTYPES))}")
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != tensor.dim():
            raise ModError(f"{self.kind}_mod indexes a captured tensor of {tensor.dim()} dims with "
                           f"{len(index)} index(es); index every dimension with an index expression "
                           f"(e.g. bias[h, q_idx - kv_idx])")
        exprs = []
        for i in index:
            if isinstance(i, (slice, type(Ellipsis), type(None))) or isinstance(i, torch.Tensor):
                raise ModError(f"{self.kind}_mod indexes a captured tensor with {i!r}; only index expressions "
                               f"of b, h, q_idx, kv_idx and integers are supported")
            e = _expr(i)
            if SCORE in e.free_symbols or not e.is_integer:
                raise ModError(f"{self.kind}_mod indexes a captured tensor with {e}, which is not an integer "
                               f"expression of b, h, q_idx and kv_idx")
            exprs.append(e)
        slot = next((n for n, t in enumerate(self.tensors) if t is tensor), None)
        if slot is None:
            slot = len(self.tensors)
            self.tensors.append(tensor)
            real = tensor.dtype in FLOAT_DTYPES
            self.functions.append(sp.Function(f"cap{slot}", real=True) if real else
                                  sp.Function(f"cap{slot}", integer=True))
        return Sym(self.functions[slot](*exprs))


class CapturePlaceholder:
    """A captured tensor in a mod rebuilt from its signature (`free_values.rebuild`): its dtype
    and dims are known, its values are the kernel's argument. Indexing it is a load."""

    __slots__ = ("slot", "dtype", "ndim", "grad")

    def __init__(self, slot: int, dtype: torch.dtype, ndim: int, grad: bool):
        self.slot, self.dtype, self.ndim, self.grad = slot, dtype, ndim, grad

    def dim(self) -> int:
        return self.ndim

    @property
    def shape(self):
        raise ModError("a mod read a captured tensor's shape; under torch.compile, and for a kernel that "
                       "serves every tensor of that dtype, a mod may only index its captured tensors")

    def __getitem__(self, index):
        if not _active:
            raise ModError("a captured tensor was indexed outside a trace")
        return _active[-1].load(self, index)

    def __getattr__(self, name):
        raise ModError(f"a mod called .{name}() on a captured tensor; under torch.compile, and for a kernel "
                       f"that serves every tensor of that dtype, a mod may only index its captured tensors")


_active: list[_Tracer] = []


def _expr(value) -> sp.Basic:
    if isinstance(value, Sym):
        return value.expr
    if isinstance(value, bool):
        return sp.true if value else sp.false
    if isinstance(value, int):
        return sp.Integer(value)
    if isinstance(value, float):
        return sp.Float(value)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ModError("a mod used a 0-dim tensor as a value; index a captured tensor with index "
                           "expressions (t[h]), or use a Python number")
        raise ModError(f"a mod used a whole tensor of shape {tuple(value.shape)} as a value; a mod computes "
                       f"one element: index captured tensors with index expressions (t[h, q_idx])")
    if isinstance(value, sp.Basic):
        return value
    raise ModError(f"a mod used a value of type {type(value).__name__} ({value!r}); only numbers, the mod's "
                   f"arguments and captured tensors indexed by them are supported")


def _is_bool(e) -> bool:
    # Not sp.Boolean: sympy's Symbol is one too.
    return isinstance(e, (sp.core.relational.Relational, sp.logic.boolalg.BooleanFunction,
                          sp.logic.boolalg.BooleanAtom))


def _number(e) -> sp.Basic:
    if _is_bool(e):
        raise ModError(f"a mod used the condition {e} as a number; use fagen.where(cond, 1.0, 0.0)")
    return e


def _condition(e) -> sp.Basic:
    if _is_bool(e):
        return e
    if e.is_integer and e.func.__name__.startswith("cap"):   # a captured bool/int tensor used as a mask
        return sp.Ne(e, 0)
    raise ModError(f"a mod used {e} as a condition; compare it (==, <, ...) or combine conditions with & | ~")


def _binary(op):
    def method(self, other):
        return Sym(op(_number(self.expr), _number(_expr(other))))
    return method


def _reflected(op):
    def method(self, other):
        return Sym(op(_number(_expr(other)), _number(self.expr)))
    return method


def _compare(op):
    def method(self, other):
        return Sym(op(_number(self.expr), _number(_expr(other))))
    return method


def _logical(op):
    def method(self, other):
        return Sym(op(_condition(self.expr), _condition(_expr(other))))
    return method


def _sigmoid(x):
    return 1 / (1 + sp.exp(-x))


# name -> sympy function of one argument (fagen.*, torch.* and Tensor methods)
UNARY = {"exp": sp.exp, "log": sp.log, "tanh": sp.tanh, "sigmoid": _sigmoid, "sqrt": sp.sqrt, "abs": sp.Abs,
         "neg": lambda x: -x, "negative": lambda x: -x}


class Sym:
    """A symbolic value inside a traced mod: a sympy expression with Python's operators."""

    __slots__ = ("expr",)
    __hash__ = object.__hash__

    def __init__(self, expr):
        self.expr = expr

    def __repr__(self):
        return f"Sym({self.expr})"

    __add__, __sub__, __mul__ = _binary(sp.Add), _binary(lambda a, b: a - b), _binary(sp.Mul)
    __truediv__, __pow__ = _binary(lambda a, b: a / b), _binary(sp.Pow)
    __radd__, __rsub__, __rmul__ = _reflected(sp.Add), _reflected(lambda a, b: a - b), _reflected(sp.Mul)
    __rtruediv__, __rpow__ = _reflected(lambda a, b: a / b), _reflected(sp.Pow)
    __floordiv__, __mod__ = _binary(lambda a, b: sp.floor(a / b)), _binary(sp.Mod)
    __rfloordiv__, __rmod__ = _reflected(lambda a, b: sp.floor(a / b)), _reflected(sp.Mod)
    __lt__, __le__, __gt__, __ge__ = _compare(sp.Lt), _compare(sp.Le), _compare(sp.Gt), _compare(sp.Ge)
    __eq__, __ne__ = _compare(sp.Eq), _compare(sp.Ne)
    __and__, __or__, __xor__ = _logical(sp.And), _logical(sp.Or), _logical(sp.Xor)
    __rand__, __ror__, __rxor__ = _logical(sp.And), _logical(sp.Or), _logical(sp.Xor)

    def __neg__(self):
        return Sym(-_number(self.expr))

    def __pos__(self):
        return self

    def __abs__(self):
        return Sym(sp.Abs(_number(self.expr)))

    def __invert__(self):
        return Sym(sp.Not(_condition(self.expr)))

    def __bool__(self):
        raise ModError(CONTROL_FLOW.format(what=f"the truth value of {self.expr}"))

    def __int__(self):
        raise ModError(CONTROL_FLOW.format(what=f"int({self.expr})"))

    def __float__(self):
        raise ModError(CONTROL_FLOW.format(what=f"float({self.expr})"))

    def __index__(self):
        raise ModError(f"{self.expr} was used as a Python index; index captured torch tensors with it "
                       f"(t[q_idx]), not lists or tuples")

    def __iter__(self):
        raise ModError(f"{self.expr} is one element, not a sequence: a mod computes a single score")

    def __getattr__(self, name):
        if name in UNARY:
            return lambda: Sym(UNARY[name](_number(self.expr)))
        if name in BOOL_CONSTANTS:   # FlexAttention's and_masks / or_masks / noop_mask
            return lambda *args, **kwargs: bool_constant(name, self, args, kwargs)
        if name == "device":   # noop_mask passes device=b.device; a symbol has none
            return None
        raise ModError(f"unsupported operation in a mod: .{name}() (supported: {', '.join(sorted(UNARY))}, "
                       f"arithmetic, comparisons, & | ~, fagen.where)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__" and isinstance(args[0], torch.Tensor) and not _active:
            raise ModError("a captured tensor was indexed by a symbolic value outside a trace")
        if name == "__getitem__" and isinstance(args[0], torch.Tensor):
            return _active[-1].load(args[0], args[1])
        if name in UNARY and len(args) == 1 and not kwargs:
            return Sym(UNARY[name](_number(_expr(args[0]))))
        if name in BOOL_CONSTANTS and args:   # torch.ones_like(b, dtype=torch.bool)
            return bool_constant(name, args[0], args[1:], kwargs)
        if name == "where" and len(args) == 3:
            return where(*args)
        if name in ("minimum", "maximum", "min", "max") and len(args) == 2 and not kwargs:
            return (minimum if name in ("minimum", "min") else maximum)(*args)
        if name == "clamp":
            low, high = (args[1:] + (None, None))[:2] if len(args) > 1 else (kwargs.get("min"), kwargs.get("max"))
            value = args[0]
            value = maximum(value, low) if low is not None else value
            return minimum(value, high) if high is not None else value
        raise ModError(f"unsupported operation in a mod: torch.{name} (supported: {', '.join(sorted(UNARY))}, "
                       f"where, minimum, maximum, clamp, indexing captured tensors)")


# FlexAttention's mask combinators start from a constant made on an index argument:
# and_masks from b.new_ones((), dtype=torch.bool), or_masks from b.new_zeros(...), noop_mask
# returns b.new_ones(size=(), dtype=torch.bool, device=b.device) (torch 2.5 to 2.13 alike).
BOOL_CONSTANTS = {"new_ones": True, "new_zeros": False, "ones_like": True, "zeros_like": False}


def bool_constant(name: str, base, args: tuple, kwargs: dict) -> "Sym":
    """`base.new_ones((), dtype=torch.bool)` and its kin, on an index argument, as the constant
    True or False; any other shape, dtype or base is refused."""
    kwargs = dict(kwargs)
    kwargs.pop("device", None)   # one element has no device
    if name.startswith("new_") and args and "size" not in kwargs:
        size, rest = args[0], args[1:]
    else:   # ones_like(b) has b's shape: () for FlexAttention's index arguments
        size, rest = kwargs.pop("size", None if name.startswith("new_") else ()), args
    scalar = isinstance(size, (tuple, list)) and len(size) == 0   # torch.Size is a tuple
    index = isinstance(base, Sym) and base.expr in INDEX_SYMBOLS
    if not (index and scalar) or rest or kwargs.pop("dtype", None) is not torch.bool or kwargs:
        usage = f"b.{name}((), dtype=torch.bool)" if name.startswith("new_") else f"torch.{name}(b, dtype=torch.bool)"
        raise ModError(f"unsupported operation in a mod: {name}(): a mod may call it only as FlexAttention's "
                       f"and_masks / or_masks / noop_mask do, {usage} on an index argument (a constant True "
                       f"or False)")
    return Sym(sp.true if BOOL_CONSTANTS[name] else sp.false)


def where(condition, a, b):
    """`condition ? a : b` inside a mod (and torch.where on tensors outside one)."""
    if not any(isinstance(x, Sym) for x in (condition, a, b)):
        return torch.where(condition, a, b)
    cond = _condition(_expr(condition))
    return Sym(sp.Piecewise((_number(_expr(a)), cond), (_number(_expr(b)), True)))


def minimum(a, b):
    if not any(isinstance(x, Sym) for x in (a, b)):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return Sym(sp.Min(_number(_expr(a)), _number(_expr(b))))


def maximum(a, b):
    if not any(isinstance(x, Sym) for x in (a, b)):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return Sym(sp.Max(_number(_expr(a)), _number(_expr(b))))


def _unary(name):
    def function(x):
        if isinstance(x, Sym):
            return Sym(UNARY[name](_number(x.expr)))
        return getattr(torch, name)(x)
    function.__name__ = name
    function.__doc__ = f"{name} inside a mod (torch.{name} outside one)."
    return function


exp, log, tanh, sigmoid, sqrt = (_unary(n) for n in ("exp", "log", "tanh", "sigmoid", "sqrt"))


@dataclass(frozen=True)
class Traced:
    """A traced mod: its expression (in SCORE, B, H, Q_IDX, KV_IDX, the loads cap0(...), cap1(...)
    and the lifted numbers par0, par1, ...) and the tensors it captured, in the order of their
    cap numbers. `capture_slots` and `params` say where each capture and each par<i> comes from
    among the mod's free values (`free_values.free_values`): a capture reached some other way (an
    attribute of an object) has slot -1. `baked` holds the free numbers when the mod uses one as
    Python control flow or a Python index: then they are part of the expression instead."""

    kind: str
    expr: sp.Basic
    tensors: tuple
    functions: tuple
    capture_slots: tuple = ()
    params: tuple = ()        # per par<i>: (its slot among the free values, "int" or "float")
    baked: tuple = ()


def param_symbol(index: int, kind: str, prefix: str = "") -> sp.Symbol:
    """The symbol of a lifted free number (`<prefix>par<index>`): an integer one keeps index
    arithmetic exact."""
    name = f"{prefix}par{index}"
    return sp.Symbol(name, integer=True) if kind == "int" else sp.Symbol(name, real=True)


def _call(kind: str, fn, args):
    tracer = _Tracer(kind)
    _active.append(tracer)
    try:
        return fn(*args), tracer
    finally:
        _active.pop()


def _checked_result(kind: str, result) -> sp.Basic:
    if isinstance(result, torch.Tensor):
        raise ModError(f"{kind}_mod returned a tensor of shape {tuple(result.shape)}; it must return one "
                       f"{'score' if kind == 'score' else 'condition'} computed from its arguments")
    expr = _expr(result)
    if kind == "score":
        if _is_bool(expr):
            raise ModError(f"score_mod returned the condition {expr}; it must return a score (use "
                           f"fagen.where(cond, score, -inf) in a score_mod, or put masks in a mask_mod)")
        if {s for s in expr.free_symbols if not s.name.startswith("par")} - {SCORE, *INDEX_SYMBOLS}:
            raise ModError(f"score_mod returned {expr}, which uses unknown symbols")
        return expr
    if not _is_bool(expr):
        is_load = isinstance(expr, sp.core.function.AppliedUndef) and expr.is_integer
        if not is_load:   # a captured bool/int tensor's element is a mask; anything else is not
            raise ModError(f"mask_mod returned {expr}, not a boolean; return a comparison or a "
                           f"combination with & | ~ (e.g. q_idx >= kv_idx)")
        expr = _condition(expr)
    return expr


def _placeholders(signature_values: list) -> list:
    """Symbols par<slot> for the free numbers, capture placeholders for the free tensors."""
    out = []
    for slot, (kind, detail) in enumerate(signature_values):
        if kind == "number":
            out.append(Sym(param_symbol(slot, detail)))
        else:
            dtype, ndim, grad = detail
            out.append(CapturePlaceholder(slot, getattr(torch, dtype.split(".")[-1]), ndim, grad))
    return out


def _leaves(signature) -> list:
    """(kind, detail) of each free value of a signature, in order: ("number", "int"|"float") or
    ("tensor", (dtype, ndim, grad))."""
    found = []
    if isinstance(signature, tuple) and signature and signature[0] == "number":
        return [("number", signature[1])]
    if isinstance(signature, tuple) and signature and signature[0] == "tensor":
        return [("tensor", signature[1:])]
    if isinstance(signature, tuple):
        for part in signature:
            found.extend(_leaves(part))
    return found


def _finish(kind: str, result, tracer: _Tracer, number_kinds: dict, slots_of, baked=()) -> Traced:
    """The Traced of a call's result: lifted numbers renumbered par0.. in slot order, the ones the
    expression does not use dropped."""
    expr = _checked_result(kind, result)
    symbols = {slot: param_symbol(slot, k) for slot, k in number_kinds.items()}
    used = [s for s in symbols if symbols[s] in expr.free_symbols]
    expr = expr.xreplace({symbols[s]: param_symbol(i, number_kinds[s]) for i, s in enumerate(used)})
    return Traced(kind, expr, tuple(tracer.tensors), tuple(tracer.functions), tuple(slots_of(t) for t in tracer.tensors),
                  tuple((s, number_kinds[s]) for s in used), baked)


@lru_cache(maxsize=512)
def traced_structure(kind: str, signature: tuple) -> Traced | None:
    """The mod a signature describes (free_values.describe), traced with its free numbers as
    symbols and its tensors as capture slots: what any closure of that code with values of
    those kinds computes. None where that cannot stand for every such closure: the mod uses a
    free value as Python control flow or a Python index, transforms a captured tensor, or
    makes a tensor of its own (`trace_mod` then traces the real function)."""
    leaves = _leaves(signature)
    try:
        fn = rebuild(signature, _placeholders(leaves))
        result, tracer = _call(kind, fn, _ARGS[kind])
    except ModError:
        return None
    if any(not isinstance(t, CapturePlaceholder) for t in tracer.tensors):
        return None
    number_kinds = {slot: detail for slot, (k, detail) in enumerate(leaves) if k == "number"}
    return _finish(kind, result, tracer, number_kinds, lambda t: t.slot)


def trace_mod(kind: str, fn) -> tuple[Traced, list]:
    """(Traced, the free values) of a mod: traced once per signature; a mod that uses a free value
    structurally is traced as it is, its numbers baked (once per signature and values)."""
    if not callable(fn):
        raise TypeError(f"{kind}_mod must be a callable, got {type(fn).__name__}")
    signature, values = describe(fn)
    if not has_opaque(signature) and _hashable(signature):
        traced = traced_structure(kind, signature)
        if traced is not None:
            return replace(traced, tensors=tuple(values[slot] for slot in traced.capture_slots)), values
    numbers = tuple(v for v in values if not isinstance(v, torch.Tensor))
    return _traced_as_is(kind, fn, numbers), values


def _hashable(signature) -> bool:
    try:
        hash(signature)
    except TypeError:   # e.g. a default argument that is a list
        return False
    return True


def _traced_as_is(kind: str, fn, numbers: tuple) -> Traced:
    result, tracer = _call(kind, fn, _ARGS[kind])
    _, values = describe(fn)
    return _finish(kind, result, tracer, {}, lambda t: next((s for s, v in enumerate(values) if v is t), -1), numbers)


_ARGS = {"score": (Sym(SCORE), Sym(B), Sym(H), Sym(Q_IDX), Sym(KV_IDX)), "mask": (Sym(B), Sym(H), Sym(Q_IDX), Sym(KV_IDX))}


def trace_score_mod(fn) -> Traced:
    """Trace `score_mod(score, b, h, q_idx, kv_idx)` into an expression of the score."""
    return trace_mod("score", fn)[0]


def trace_mask_mod(fn) -> Traced:
    """Trace `mask_mod(b, h, q_idx, kv_idx)` into a condition."""
    return trace_mod("mask", fn)[0]

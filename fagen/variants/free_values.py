"""A mod's free values: the numbers and tensors it reads from outside its arguments.

A score_mod or mask_mod is usually a closure (`def make(bias, scale): def score_mod(...)`), reads
module globals (`document_id[b, q_idx]`), or is built by FlexAttention's combinators, which keep
other mods in their closure. Its free variables are a functools.partial's arguments, the module
globals its code names and its closure cells, and, in turn, those of the functions found there
(alone, or in a tuple or list, as `and_masks` keeps them).

Numbers (int, float; not bool) and tensors among them are its *free values*: kernel arguments (a
number inside a tuple is structure: a tuple of axes or sizes shapes the expression).
Everything else is its *structure*. `describe(fn)` returns both: a hashable signature (code
objects, modules, the kinds of the free values, other constants) and the free values, in one
fixed order. It only reads attributes, so torch.compile's Dynamo traces it: the values become
graph inputs, and a new closure of the same code (a changed constant, another captured tensor)
has the same signature, so nothing recompiles or re-renders. `rebuild(signature, placeholders)`
makes an equivalent function from a signature alone, the free values replaced by placeholders
(symbols, capture slots): what the tracer calls.

Under torch.compile, where Dynamo cannot read what a mod reads (the globals or closure cells of
a function made inside the compiled region) or fagen cannot describe it (a module, as in
`lambda ...: score + self.bias[h, kv_idx]`), the mod is recorded as Dynamo traces it instead
(`recording.py`): its structure is then the record, its free values the tensors it read.
"""

from __future__ import annotations

import functools
import sys
import types

import torch

from .recording import record, replayed

MAX_DEPTH = 4   # functions found in a mod's free variables, walked this deep (no recursion loops)
# Functions of these packages are tools a mod calls (fagen.where, torch.exp), not part of it.
LIBRARY_MODULES = ("fagen", "torch", "numpy", "math", "sympy", "builtins", "functools")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _walked_function(value) -> bool:
    """A user's Python function (or a partial), whose own free variables count too."""
    if isinstance(value, functools.partial):
        return True
    if not isinstance(value, types.FunctionType):
        return False
    return (value.__module__ or "").split(".")[0] not in LIBRARY_MODULES


def _hashable(value) -> bool:
    return value is None or isinstance(value, (bool, str, bytes, types.ModuleType, types.BuiltinFunctionType,
                                               types.FunctionType, type, torch.dtype, torch.device))


def _node(value, values: list, depth: int) -> tuple:
    """The signature of one free variable; its free values appended to `values`."""
    if isinstance(value, torch.Tensor):
        values.append(value)
        return ("tensor", str(value.dtype), value.dim(), bool(value.requires_grad and value.is_floating_point()))
    if _is_number(value):
        values.append(value)
        return ("number", "int" if isinstance(value, int) else "float")
    if _walked_function(value) and depth < MAX_DEPTH:
        return _describe(value, values, depth + 1)
    if isinstance(value, (tuple, list)) and any(_walked_function(v) for v in value):
        return ("sequence", type(value).__name__, tuple(_node(v, values, depth) for v in value))
    if isinstance(value, tuple) and all(_hashable(v) or isinstance(v, (int, float)) for v in value):
        return ("const", value)   # a tuple of constants (axes, sizes) is structure, not free values
    if _hashable(value):
        return ("const", value)
    return ("opaque", type(value).__name__)


def _describe(fn, values: list, depth: int) -> tuple:
    if isinstance(fn, functools.partial):
        args = tuple(_node(v, values, depth) for v in fn.args)
        keywords = tuple((name, _node(v, values, depth)) for name, v in fn.keywords.items())
        return ("partial", _describe(fn.func, values, depth + 1), args, keywords)
    if not isinstance(fn, types.FunctionType):   # a callable object, a bound method: traced as it is
        return ("opaque", type(fn).__name__)
    scope = _globals_of(fn)
    names = tuple((name, _node(scope[name], values, depth)) for name in fn.__code__.co_names if name in scope)
    cells = tuple(_node(cell.cell_contents, values, depth) for cell in _closure_of(fn))
    return ("function", fn.__code__, fn.__module__, fn.__defaults__, names, cells)


class Unreadable(Exception):
    """Dynamo does not let traced code read a function's globals or closure cells."""


def _globals_of(fn) -> dict:
    """The globals a function may read (none when its code names none). Dynamo cannot read the
    `__globals__` of a function made inside the compiled region: as for its closure
    (`_closure_of`), the mod is then recorded (`describe`)."""
    if not fn.__code__.co_names:
        return {}
    try:
        return fn.__globals__
    except AttributeError:
        raise Unreadable from None


def _closure_of(fn) -> tuple:
    """A function's closure cells. Dynamo cannot read those of a function made inside the
    compiled region (a lambda written in the compiled forward): the mod is then recorded as
    Dynamo traces it (`describe`). Mods made outside the compiled function, and those made
    inside that read only their arguments and literals, are read as they are."""
    if not fn.__code__.co_freevars:
        return ()
    try:
        return fn.__closure__ or ()
    except AttributeError:
        raise Unreadable from None


def describe(fn) -> tuple[tuple, list]:
    """(signature, free values) of a mod: the signature is hashable and holds no free value.
    Under torch.compile, a mod that Dynamo does not let fagen read, or that keeps an object
    fagen cannot describe, is recorded as Dynamo traces it (`recording.record`)."""
    values: list = []
    try:
        signature = _describe(fn, values, 0)
    except Unreadable:   # only under torch.compile: eagerly every attribute reads
        return record(fn)
    if torch.compiler.is_compiling() and has_opaque(signature):   # eagerly: traced as it is
        return record(fn)
    return signature, values


def rebuild(signature: tuple, placeholders: list):
    """A function equivalent to the one `signature` describes, its free values taken in order
    from `placeholders` (a signature with an opaque node cannot be rebuilt: `has_opaque`)."""
    return _rebuilt(signature, list(placeholders))


def has_opaque(signature) -> bool:
    if isinstance(signature, tuple):
        if signature[:1] == ("opaque",):
            return True
        return any(has_opaque(part) for part in signature)
    return False


def _rebuilt(node, queue: list):
    kind = node[0]
    if kind in ("tensor", "number"):
        return queue.pop(0)
    if kind == "const":
        return node[1]
    if kind == "sequence":
        items = [_rebuilt(n, queue) for n in node[2]]
        return tuple(items) if node[1] == "tuple" else items
    if kind == "recorded":   # recording.record: its captures lead, in order
        captures = [_rebuilt(n, queue) for n in node[2]]
        return replayed(node[1], captures, node[3], node[4])
    if kind == "partial":   # describe walks the arguments before the function: so does this
        args = [_rebuilt(n, queue) for n in node[2]]
        keywords = {name: _rebuilt(n, queue) for name, n in node[3]}
        return functools.partial(_rebuilt(node[1], queue), *args, **keywords)
    _, code, module, defaults, names, cells = node
    scope = dict(vars(sys.modules[module])) if module in sys.modules else {"__builtins__": __builtins__}
    for name, n in names:
        scope[name] = _rebuilt(n, queue)
    closure = tuple(types.CellType(_rebuilt(n, queue)) for n in cells) or None
    return types.FunctionType(code, scope, code.co_name, defaults, closure)

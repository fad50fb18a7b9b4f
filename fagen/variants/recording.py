"""A mod as torch.compile traces it, where fagen cannot read it (`free_values.describe`).

Dynamo does not let traced code read the closure cells or the globals of a function made inside
the compiled region (a lambda written in a compiled forward), and fagen cannot describe an
object a mod keeps (a module whose `self.bias` it reads). There `describe` calls the mod itself,
as FlexAttention's Dynamo rule does, under a TorchFunctionMode that Dynamo traces too: its
arguments are placeholder tensors, and each torch operation that takes one of them (or a
result of one) is recorded instead of run. Any other tensor such an operation takes is a
capture: a closure cell, a global, a module's parameter or buffer, or a tensor the mod computed
from those alone (which runs as it is, in the graph). The record is a hashable program (names
of operations, constants, references) with the captures' kinds, the mod's *structure*; the
captures are its free values, graph values handed to the kernels, so new values recompile
nothing. `replayed` turns a program back into a function of the tracer's symbols
(`language.traced_structure`): the same operations in the same order, so the same expression
as the eager trace of the real function.

Numbers the mod reads (closure cells, literals) are constants of the program: Dynamo
specializes them anyway. Dynamo runs `abs(x)` on a tensor without offering it to the mode, so
its result is unknown to the record; it is refused (write `torch.abs(x)`), found by its dtype:
placeholders are float64, a dtype no capture may have.
"""

from __future__ import annotations

import functools
import operator
import types

import torch
from torch.overrides import TorchFunctionMode

from ..errors import ModError

MARK = torch.float64   # placeholders' dtype: what an operation run without the mode leaves behind
# Tensors made from one number (fagen.minimum's torch.as_tensor(1.0)): the number itself.
FROM_NUMBER = ("as_tensor", "tensor", "scalar_tensor")
CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device, type(Ellipsis))


class _Recorder(TorchFunctionMode):
    """Records the operations a mod applies to its placeholder arguments (see the module doc)."""

    def __init__(self, placeholders: list):
        super().__init__()
        self.nodes = list(placeholders)   # node i: argument i, then each recorded operation's result
        self.captures: list = []
        self.program: list = []

    def _node(self, value):
        return next((i for i, node in enumerate(self.nodes) if node is value), None)

    def _touches(self, value) -> bool:
        if isinstance(value, torch.Tensor):
            return self._node(value) is not None
        if isinstance(value, (tuple, list)):
            return any(self._touches(v) for v in value)
        return False

    def _ref(self, value) -> tuple:
        if isinstance(value, torch.Tensor):
            node = self._node(value)
            if node is not None:
                return ("node", node)
            if value.dtype == MARK:
                return ("escaped",)
            slot = next((i for i, t in enumerate(self.captures) if t is value), None)
            if slot is None:
                slot = len(self.captures)
                self.captures.append(value)
            return ("cap", slot)
        if isinstance(value, (tuple, list)):
            return ("seq", type(value).__name__, tuple(self._ref(v) for v in value))
        if isinstance(value, CONSTANTS):
            return ("const", value)
        return ("odd", type(value).__name__)

    def __torch_function__(self, func, _types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        made_of_number = name in FROM_NUMBER and len(args) == 1 and type(args[0]) in (int, float)
        if not (made_of_number or self._touches(args) or self._touches(tuple(kwargs.values()))):
            return func(*args, **kwargs)   # the mod computing with its captures alone: as it is
        self.program.append(("op", name, tuple(self._ref(a) for a in args),
                             tuple(("kw", key, self._ref(v)) for key, v in kwargs.items())))
        result = torch.zeros((), dtype=MARK)
        self.nodes.append(result)
        return result


def _positional(fn) -> int:
    """How many positional arguments `fn` needs (a partial's keywords taken as binding some)."""
    if isinstance(fn, functools.partial):
        return _positional(fn.func) - len(fn.args) - len(fn.keywords)
    if isinstance(fn, types.MethodType):
        return _positional(fn.__func__) - 1
    return fn.__code__.co_argcount - len(fn.__defaults__ or ())


def record(fn) -> tuple[tuple, list]:
    """(signature, captures) of a mod, recorded as Dynamo traces it: ("recorded", its number of
    arguments, the captures' kinds, the program, the result's reference)."""
    count = _positional(fn) if isinstance(fn, (types.FunctionType, types.MethodType, functools.partial)) else -1
    if count not in (4, 5):
        raise ModError(f"under torch.compile, a mod fagen traces through Dynamo must be a function taking "
                       f"5 arguments (score_mod) or 4 (mask_mod); got a {type(fn).__name__} taking {count}")
    placeholders = [torch.zeros((), dtype=MARK) for _ in range(count)]
    recorder = _Recorder(placeholders)
    with recorder:
        result = fn(*placeholders)
    kinds = tuple(("tensor", str(t.dtype), t.dim(), bool(t.requires_grad and t.is_floating_point()))
                  for t in recorder.captures)
    signature = ("recorded", count, kinds, tuple(recorder.program), recorder._ref(result))
    _check(signature)
    return signature, list(recorder.captures)


def _check(node) -> None:
    """Refuse, with the reason, what a record cannot stand for: a value computed out of the
    mode's sight, an argument of another kind. What the tracer refuses (an unsupported function,
    a condition used as a number) it refuses on the replay (`language.traced_structure`)."""
    if isinstance(node, tuple) and node[:1] == ("escaped",):
        raise ModError(ESCAPED)
    if isinstance(node, tuple) and node[:1] == ("odd",):
        raise ModError(ODD.format(node[1]))
    if isinstance(node, tuple):
        for part in node:
            _check(part)


# -- replay (plain Python: the tracer's symbols stand for the arguments) -------------------------

BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
          "truediv": operator.truediv, "true_divide": operator.truediv, "floordiv": operator.floordiv,
          "floor_divide": operator.floordiv, "mod": operator.mod, "remainder": operator.mod, "pow": operator.pow,
          "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
          "ne": operator.ne, "and": operator.and_, "or": operator.or_, "xor": operator.xor}
UNARY = {"neg": operator.neg, "negative": operator.neg, "pos": operator.pos, "positive": operator.pos,
         "invert": operator.invert}
ODD = ("a mod passed a {} to a torch operation; only numbers, the mod's arguments and captured tensors "
       "indexed by them are supported")
ESCAPED = ("a mod used a value that torch.compile computed without showing fagen the operation: abs(x) on a "
           "mod's value (write torch.abs(x)), or a float64 tensor (captured tensors must be float32, float16, "
           "bfloat16 or integer)")


def replayed(count: int, captures: list, program: tuple, result: tuple):
    """The function a recorded program stands for, its captures taken from `captures`
    (language's capture placeholders)."""
    def mod(*args):
        if len(args) != count:
            raise ModError(f"a mod taking {count} arguments was given {len(args)}: a score_mod takes 5 "
                           f"(score, b, h, q_idx, kv_idx), a mask_mod 4")
        values = list(args)
        for _, name, arg_refs, kw_refs in program:
            values.append(_apply(name, [_value(r, values, captures) for r in arg_refs],
                                 {key: _value(r, values, captures) for _, key, r in kw_refs}))
        return _value(result, values, captures)
    return mod


def _value(ref: tuple, values: list, captures: list):
    kind = ref[0]
    if kind == "node":
        return values[ref[1]]
    if kind == "cap":
        return captures[ref[1]]
    if kind == "const":
        return ref[1]
    if kind == "seq":
        items = [_value(r, values, captures) for r in ref[2]]
        return tuple(items) if ref[1] == "tuple" else items
    if kind == "escaped":
        raise ModError(ESCAPED)
    raise ModError(ODD.format(ref[1]))


def _apply(name: str, args: list, kwargs: dict):
    """One recorded operation on symbols: Python's operators for the arithmetic ones, else what
    the tracer's __torch_function__ does for a torch function or Tensor method of that name."""
    base = name.strip("_")
    reflected = name == "rsub" or (name.startswith("__r") and base[1:] in BINARY)
    if name in FROM_NUMBER and len(args) == 1:
        return args[0]
    if name == "__getitem__" and len(args) == 2 and not kwargs:
        return args[0][args[1]]
    if (base in BINARY or reflected) and len(args) == 2 and not kwargs:
        op = BINARY[base[1:] if reflected else base]
        return op(args[1], args[0]) if reflected else op(args[0], args[1])
    if base in UNARY and len(args) == 1 and not kwargs:
        return UNARY[base](args[0])
    symbolic = next((type(a) for a in args if hasattr(type(a), "__torch_function__")
                     and not isinstance(a, torch.Tensor)), None)
    if symbolic is None:
        raise ModError(f"unsupported operation in a mod: {name} of constants")
    return symbolic.__torch_function__(types.SimpleNamespace(__name__=name), (), tuple(args), kwargs)

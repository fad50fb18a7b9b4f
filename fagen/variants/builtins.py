"""The built-in variants, one row each: window, softcap, ALiBi and sinks (flash-attn 2.8's).

A row holds all that fagen knows of a built-in outside its device functions:

  flag        its Spec field (spec.BUILTIN_MODS): only its presence selects kernels
  argument    the keyword a call passes it by (flash_attn_func's), named by every error
  check       the argument checked: its kernel values by parameter name, or None (off)
  params      its kernel parameters (name, C type, launcher kind), values then derived ones
  derive      the derived values (products, strides) from its values, so callers pass none
  reference   the field of fagen.reference's Problem that applies it in the float64 oracle
  identities  the prefix of the names of the sympy identities (fagen.identities.variants)
              that prove what its kernels rely on; () where it changes no score (a mask)
  option      its command-line option and help (fagen.spec_flags: build, verify, tune)

Adding a built-in: a row here, its Spec flag (spec.py: a field and BUILTIN_MODS), its
expression (compose.variant_math) and any device function; its reference field and
identities where the row names them (tests/variants/test_builtins.py checks that they exist).
The table lives with the variants (below identities, kernels and ops): each of those reads
its rows, and nothing here imports them.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..errors import InputError, InputTypeError


class CallShape(NamedTuple):
    """What a check reads of the call besides its own argument."""

    q: torch.Tensor
    causal: bool
    batch: int
    seqlen_q: int
    heads: int
    seqlen_k: int


@dataclass(frozen=True)
class Builtin:
    flag: str
    argument: str
    off: object                                  # the argument's default: the built-in is off
    check: Callable[[object, CallShape], dict | None]
    params: tuple                                # (name, ctype, kind) in the kernels' order
    param_slot: int                              # where its params stand among the built-ins'
    derive: Callable[[dict, float], dict] | None
    reference: str
    identities: tuple[str, ...]
    option: tuple[str, str]                      # (the command line's option, its help)
    grad: str | None = None                      # the gradient's name where its tensor gets one

    def used(self, spec) -> bool:
        """Whether `spec`'s kernels have it (an identity's `relied_on_by`)."""
        return getattr(spec, self.flag)


# -- window -----------------------------------------------------------------------------------

def _window_int(w) -> int | None:
    """An integer-valued scalar as an int: a Python int (the plain path, no graph break under
    torch.compile), a NumPy integer or a one-element integer tensor, as flash-attn's tests pass
    them; None for anything else (bools, floats)."""
    if isinstance(w, int):
        return None if isinstance(w, bool) else w
    if isinstance(w, torch.Tensor) and (w.dtype == torch.bool or w.is_floating_point() or w.is_complex()):
        return None
    try:
        return operator.index(w)   # NumPy integers, integer tensors; NumPy bools and floats refuse
    except (TypeError, RuntimeError):
        return None


def window_pair(window_size) -> tuple[int, int]:
    """flash-attn's window_size checked: (left, right), ints >= -1 (-1: unbounded). The pair may
    be a tuple, a list, or a 2-element tensor or array (flash-attn's tests draw it with
    torch.randint). The one parse of the argument: dense, packed and decoding calls and the ring
    (fagen.distributed.ring) each derive their bounds from it."""
    pair = window_size if isinstance(window_size, (tuple, list)) else \
        tuple(window_size) if isinstance(window_size, (torch.Tensor, np.ndarray)) and window_size.ndim == 1 else ()
    ints = [_window_int(w) for w in pair]
    if len(ints) != 2 or any(w is None or w < -1 for w in ints):
        raise InputError(f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded), "
                         f"got {window_size!r}")
    return ints[0], ints[1]


def _window(window_size, call: CallShape) -> dict | None:
    """The kernels' (left, right): causal means right = 0, an unbounded side reaches every key
    from every row; None where nothing is cut."""
    left, right = window_pair(window_size)
    if call.causal:
        right = 0
    if left == -1 and right == -1 or (left == -1 and call.causal):
        return None
    unbounded = call.seqlen_q + call.seqlen_k
    return {"window_left": unbounded if left == -1 else min(left, unbounded),
            "window_right": unbounded if right == -1 else min(right, unbounded)}


WINDOW = Builtin("window", "window_size", (-1, -1), _window,
                 (("window_left", "int", "int32"), ("window_right", "int", "int32")), 2, None,
                 reference="window", identities=(),
                 option=("--window", "flash-attn's sliding window; its sizes LEFT RIGHT (-1: unbounded) are run-time "
                                     "arguments, checked when given (`fagen profile` needs them: it runs the kernel)"))


# -- softcap ----------------------------------------------------------------------------------

def check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0:
        raise InputError(f"softcap must be a float >= 0 (0: off), got {softcap!r}")
    return softcap


def _softcap(softcap, call: CallShape) -> dict | None:
    return {"softcap": float(softcap)} if check_softcap(softcap) else None


def _softcap_derived(values: dict, softmax_scale: float) -> dict:
    """Products the kernels would otherwise hold in registers: 1 / c, tau / c, c log2(e)."""
    c = values["softcap"]
    return {"softcap_inv": 1.0 / c, "softcap_scale": softmax_scale / c, "softcap_log2": c * math.log2(math.e)}


SOFTCAP = Builtin("softcap", "softcap", 0.0, _softcap,
                  tuple((name, "float", "float32") for name in ("softcap", "softcap_inv", "softcap_scale",
                                                                "softcap_log2")), 1, _softcap_derived,
                  reference="softcap", identities=("softcap",),
                  option=("--softcap", "logit softcapping c tanh(s / c), c at run time"))


# -- ALiBi and sinks: fp32 tensors ------------------------------------------------------------

def check_float(name: str, t, q, shapes: tuple) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise InputTypeError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) not in shapes:
        raise InputError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise InputError(f"{name} must be on q's device {q.device}, got {t.device}")
    return t.contiguous()


def _alibi(slopes, call: CallShape) -> dict | None:
    if slopes is None:
        return None
    return {"alibi_slopes": check_float("alibi_slopes", slopes, call.q, ((call.heads,), (call.batch, call.heads)))}


def _alibi_derived(values: dict, softmax_scale: float) -> dict:
    """The slopes' batch stride: 0 for one slope per head."""
    slopes = values["alibi_slopes"]
    return {"alibi_stride_b": slopes.shape[-1] if slopes.dim() == 2 else 0}


ALIBI = Builtin("alibi", "alibi_slopes", None, _alibi,
                (("alibi_slopes", "const float* __restrict__", "tensor"), ("alibi_stride_b", "long long", "int64")),
                3, _alibi_derived, reference="alibi_slopes", identities=("ALiBi", "softcap + ALiBi"),
                option=("--alibi", "ALiBi biases, slopes at run time"))


def _sinks(sinks, call: CallShape) -> dict | None:
    if sinks is None:
        return None
    return {"sinks": check_float("sinks", sinks, call.q, ((call.heads,),))}   # an autograd input


SINKS = Builtin("sinks", "sinks", None, _sinks, (("sinks", "const float* __restrict__", "tensor"),), 0, None,
                reference="sinks", identities=("sinks",), option=("--sinks", "a learnable sink logit per head"),
                grad="dsinks")


# The rows in Spec.BUILTIN_MODS's (name) order: the order their arguments are checked in.
BUILTINS: tuple[Builtin, ...] = (WINDOW, SOFTCAP, ALIBI, SINKS)
# Their kernel parameters' order (Builtin.param_slot): each new row's go last.
IN_PARAM_ORDER: tuple[Builtin, ...] = tuple(sorted(BUILTINS, key=lambda row: row.param_slot))
BY_FLAG = {row.flag: row for row in BUILTINS}


def kernel_params(spec) -> list[tuple]:
    """The kernel parameters of `spec`'s built-ins (variants.cuda adds the mods')."""
    return [p for row in IN_PARAM_ORDER if getattr(spec, row.flag) for p in row.params]


def derived_values(values: dict, softmax_scale: float) -> dict:
    """What follows from the built-ins' values among `values` (a call's kernel arguments)."""
    out = {}
    for row in BUILTINS:
        if row.derive is not None and row.params[0][0] in values:
            out.update(row.derive(values, softmax_scale))
    return out

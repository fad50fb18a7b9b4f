"""How fagen reports a call it cannot run: `InputError` for a bad argument value and
`InputTypeError` for an argument of the wrong kind, `ModError` for a score_mod or mask_mod it
cannot trace (fagen.variants), `assert_lazily` for a bad value found on the device (no sync),
and `forward_only` for ops that run a forward pass but have no backward (decoding, paged caches).

Imports nothing of the pipeline, so every stage can use it.
"""

from __future__ import annotations

import functools

import torch


class InputError(ValueError, RuntimeError):
    """A bad argument value (its message names the argument and what was expected).

    It is a ValueError, what Python code expects of a bad value, and a RuntimeError, what
    flash-attn raises (its checks are C++ TORCH_CHECKs): code written against either, such
    as flash-attn's own tests (`pytest.raises(RuntimeError, match="block_table")`), catches it.
    """


class InputTypeError(TypeError, RuntimeError):
    """An argument of the wrong kind (a dtype, a type, a layout): a TypeError, what Python code
    expects, and a RuntimeError, what flash-attn's dtype and layout checks raise."""


class ModError(TypeError):
    """A mod that cannot be traced; the message says what to write instead."""


def assert_lazily(ok: torch.Tensor, message: str) -> None:
    """Raise InputError(message) unless the bool tensor `ok` is true, without a device sync:
    torch._assert_async, on a GPU a device-side assert that surfaces at the next synchronizing
    call, on the CPU at once."""
    try:
        torch._assert_async(ok, message)
    except RuntimeError:
        raise InputError(message) from None


class _ForwardOnly(torch.autograd.Function):
    """Runs `run()` with autograd off and gives its outputs a backward that raises: flash-attn
    runs these ops on inputs that require grad (its tests do), and only a backward is an error."""

    @staticmethod
    def forward(ctx, name, run, *inputs):
        ctx.name = name
        outputs = run()
        # Detached aliases: autograd refuses in-place writes to an output that is a view (a
        # sliced padded head dim) of a Function that returns several.
        if isinstance(outputs, torch.Tensor):
            return outputs.detach()
        return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.name} is forward only (as in flash-attn): it has no backward pass, so its "
                           f"output cannot be differentiated. Run it under torch.no_grad(), or detach its inputs")


def wanting_grad(values) -> list:
    """The tensors among `values` that autograd would record a call on (none under no_grad or
    inference_mode: one flag check, no scan)."""
    if not torch.is_grad_enabled():
        return []
    return [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad]


def run_forward_only(name: str, run, inputs):
    """`run()`'s outputs (a tensor or a tuple); where autograd would record the call (grad mode
    on and one of `inputs` requires grad) they carry a backward that raises, naming `name`.
    Otherwise the call as is: no Function, no graph."""
    wanting = wanting_grad(inputs)
    return _ForwardOnly.apply(name, run, *wanting) if wanting else run()


def forward_only(name: str):
    """Decorator: the function's outputs carry a backward that raises where one of its tensor
    arguments requires grad (`run_forward_only`)."""
    def wrap(function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            wanting = wanting_grad((*args, *kwargs.values()))
            if not wanting:
                return function(*args, **kwargs)
            return _ForwardOnly.apply(name, functools.partial(function, *args, **kwargs), *wanting)
        return call
    return wrap

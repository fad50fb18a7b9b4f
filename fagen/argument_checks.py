"""The argument checks every entry point shares: a flag is a bool, a tensor argument is a dense
tensor. Each error names the caller's own argument (`name`) and says what was expected.

Imports nothing of the pipeline but `errors`, so the checks of ops, packed sequences and
decoding all use these.
"""

from __future__ import annotations

import torch

from .errors import InputTypeError


def check_flag(name: str, value) -> bool:
    """A flag, as a Python bool: `causal="no"` or `causal=1` must not quietly mean causal=True.
    NumPy bools (np.True_, what `arr.any()` gives) are accepted. A tensor is refused: reading
    it would be a device sync eagerly and a graph break under torch.compile."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy":   # known by its module: NumPy need not be imported
        if torch.compiler.is_compiling():
            # dynamo traces np.True_ as a 0-d array whose value is data (like a tensor's)
            raise InputTypeError(f"{name}: under torch.compile pass a Python bool, not a NumPy one")
        item = value.item() if getattr(value, "ndim", None) == 0 else None
        if isinstance(item, bool):
            return item
    if isinstance(value, torch.Tensor):
        raise InputTypeError(f"{name} must be True or False, got a tensor ({value.dtype}, shape "
                             f"{tuple(value.shape)}): pass a Python bool, e.g. bool({name}) outside the "
                             f"compiled region")
    raise InputTypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def check_dense_tensor(name: str, t) -> None:
    """`t` is a torch.Tensor with the strided layout (a sparse one reports stride 0, which would
    read as a broadcast: say what it is instead)."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise InputTypeError(f"{name} must be a dense (torch.strided) tensor, got layout {t.layout}: pass "
                             f"{name}.to_dense()")

"""The self-test's yardstick: flash-attn's tolerance rule, as fagen's kernel tests apply it.

A result passes when its largest error against the float64 oracle (fagen.reference, on the CPU:
float64 on some GPUs is slow or not IEEE-exact, as tuning's check notes) is at most `factor`
times the error of the same computation done by PyTorch in the inputs' dtype on the same device
(fagen.reference.attention_same_dtype), plus a floor for problems PyTorch happens to get exact.
The factor is 2 for outputs and 3 for gradients (docs/testing.md). L, fp32 in the kernels, is
held to an absolute bound instead: the same-dtype yardstick rounds it to fp16 or bf16.
"""

from __future__ import annotations

import math

import torch

OUTPUT_FACTOR, GRADIENT_FACTOR = 2.0, 3.0
ABS_FLOOR = 1e-5
LSE_TOLERANCE = 1e-3   # relative to max(1, |L|)


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in float64 on the CPU; inf when either holds a NaN or they differ in shape."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    diff = (got.detach().to("cpu", torch.float64) - want.detach().to("cpu", torch.float64)).abs()
    if diff.numel() == 0:
        return 0.0
    return float(diff.max()) if not torch.isnan(diff).any() else math.inf


class Checks:
    """The problems a case finds, as lines; none means it passed."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def rule(self, name: str, got, oracle, same_dtype, factor: float) -> None:
        """`got` within `factor` x the same-dtype computation's error against the oracle."""
        error, yardstick = max_error(got, oracle), max_error(same_dtype, oracle)
        bound = factor * yardstick + ABS_FLOOR
        if not error <= bound:
            self.problems.append(f"{name}: max error {error:.3g} against the float64 oracle, above {factor:g} x "
                                 f"same-dtype torch's {yardstick:.3g} + {ABS_FLOOR:g}")

    def output(self, name: str, got, oracle, same_dtype) -> None:
        self.rule(name, got, oracle, same_dtype, OUTPUT_FACTOR)

    def gradient(self, name: str, got, oracle, same_dtype) -> None:
        self.rule(name, got, oracle, same_dtype, GRADIENT_FACTOR)

    def lse(self, name: str, got, oracle) -> None:
        """L: +inf exactly where the oracle's is (rows that see no key), else within LSE_TOLERANCE."""
        got, oracle = got.detach().to("cpu", torch.float64), oracle.detach().to("cpu", torch.float64)
        if tuple(got.shape) != tuple(oracle.shape):
            self.problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(oracle.shape)}")
            return
        finite = torch.isfinite(oracle)
        if not torch.equal(torch.isfinite(got), finite) or not bool((got[~finite] == oracle[~finite]).all()):
            self.problems.append(f"{name}: its infinite entries differ from the oracle's (rows that see no key)")
            return
        error = ((got - oracle).abs() / oracle.abs().clamp(min=1.0))[finite]
        worst = float(error.max()) if error.numel() else 0.0
        if not worst <= LSE_TOLERANCE:
            self.problems.append(f"{name}: relative error {worst:.3g}, above {LSE_TOLERANCE:g}")

    def equal(self, name: str, got, want) -> None:
        if not torch.equal(got.detach().cpu(), want.detach().cpu()):
            self.problems.append(f"{name}: differs from what was written")

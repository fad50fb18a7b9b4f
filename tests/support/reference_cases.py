"""Shared inputs for the reference tests (this module holds no tests): small
float64 problems covering every masking rule (causal both ways, key padding
with a zero length, dropout, GQA)."""

from __future__ import annotations

import torch

from fagen.reference import dropout_keep_mask


def make_inputs(B=2, Nq=9, Nk=11, H=2, Hk=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Nq, H, d, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Nk, Hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Nk, Hk, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, Nq, H, d, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def case_kwargs(case: str, B: int, H: int, Nq: int, Nk: int) -> dict:
    """Run-time kwargs for a named masking case."""
    if case == "plain":
        return {}
    if case == "scale":
        return {"softmax_scale": 0.37}
    if case == "causal":
        return {"causal": True}
    if case == "padding":
        lens = [Nk, 0] + [max(1, Nk // 3 + b) for b in range(2, B)]
        return {"seqlens_k": torch.tensor(lens[:B], dtype=torch.int32)}
    if case == "dropout":
        return {"dropout_p": 0.3, "keep_mask": dropout_keep_mask(1234, 5, B, H, Nq, Nk, 0.3)}
    if case == "everything":
        lens = [max(1, Nk - 3), 0] + [Nk] * (B - 2)
        return {"causal": True, "softmax_scale": 0.5,
                "seqlens_k": torch.tensor(lens[:B], dtype=torch.int32),
                "dropout_p": 0.2, "keep_mask": dropout_keep_mask(99, 0, B, H, Nq, Nk, 0.2)}
    raise ValueError(case)


CASES = ("plain", "scale", "causal", "padding", "dropout", "everything")

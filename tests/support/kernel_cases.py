"""Shared machinery of the kernel tests: run a variant through fagen.ops and
hold it to FlashAttention-2's tolerance rule against the float64 oracle.

The rule (DESIGN.md): the kernel's max error against the oracle is at most 2x
(output) or 3x (dq, dk, dv) the error of a same-dtype PyTorch implementation
against the same oracle. A small absolute floor keeps cases where PyTorch
happens to be exact (e.g. all-masked outputs) from demanding bit-exactness.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from fagen.dtypes import TORCH_DTYPE
from fagen.kernels import attention_kernels
from fagen.kernels.render import render
from fagen.emulate import assert_written, poison_
from fagen.reference import (attention_backward, attention_forward, attention_same_dtype,
                             dropout_keep_mask)
from fagen.spec import Spec

OUTPUT_FACTOR, GRAD_FACTOR = 2.0, 3.0
ABS_FLOOR = 1e-5
# The PTX ISA's maximum relative error of tanh.approx.f32, which the softcap's tanh runs on
# (fagen/numeric.cuh tanh_approx; its emulated twin errs by as much).
TANH_APPROX_BOUND = 2.0 ** -10.987


def lse_tolerance(softcap: float = 0.0) -> float:
    """L's tolerance against the float64 oracle: 1e-3 and, with a softcap c, c times
    tanh.approx.f32's bound (every score c tanh(s / c) moves by at most that much, and L, a
    logsumexp, by at most the largest move of a score)."""
    return 1e-3 + softcap * TANH_APPROX_BOUND


def softcap_output_slack(softcap: float, v: torch.Tensor) -> float:
    """What tanh.approx.f32 may move an output by, beyond the rounding PyTorch's own error
    measures: every score c tanh(s / c) moves by at most c times its bound (|tanh| <= 1), so
    each softmax weight by a factor within exp(+-2 c bound), and O = P V by at most
    (exp(2 c bound) - 1) max |v|. 0 without a softcap."""
    return math.expm1(2 * softcap * TANH_APPROX_BOUND) * float(v.abs().max()) if softcap else 0.0
SEED, OFFSET, DROPOUT_P = 0x1234_5678_9ABC, 3, 0.25
# CUDA's atomics (atomicAdd, ...) and fagen's own wrappers (fagen/global_reduce.cuh: atomic_add_pair).
ATOMIC_CALL = re.compile(r"\batomic(?:[A-Z]\w*|_\w+)\s*\(")


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int = 2
    kv_heads: int = 2

    def __str__(self) -> str:
        return f"B{self.batch}_q{self.seqlen_q}_k{self.seqlen_k}_h{self.heads}/{self.kv_heads}"


def poisoned_empty(*shape, dtype, device):
    """attention_kernels._empty for tests: every kernel-written buffer starts as NaN sentinels."""
    return poison_(torch.empty(*shape, dtype=dtype, device=device))


def make_inputs(spec: Spec, shape: Shape, seed: int = 0, *, lengths: list[int] | None = None, qk_scale: float = 1.0):
    """q, k, v, dout and (with key padding) seqlens_k. `lengths` gives each entry's keys;
    `qk_scale` multiplies q and k (by s, the scores by s^2: large logits)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPE[spec.dtype]
    d = spec.head_dim

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(dtype)

    q = randn(shape.batch, shape.seqlen_q, shape.heads, d, scale=qk_scale)
    k = randn(shape.batch, shape.seqlen_k, shape.kv_heads, d, scale=qk_scale)
    v = randn(shape.batch, shape.seqlen_k, shape.kv_heads, spec.head_dim_v)   # d_v columns
    dout = randn(shape.batch, shape.seqlen_q, shape.heads, spec.head_dim_v)
    seqlens_k = None
    if spec.key_padding:
        seqlens_k = torch.tensor(lengths or key_lengths(spec, shape), dtype=torch.int32)
    return q, k, v, dout, seqlens_k


def key_lengths(spec: Spec, shape: Shape) -> list[int]:
    """Keys of each batch entry. With key padding one entry keeps every key, one has none,
    the others lose some."""
    if not spec.key_padding:
        return [shape.seqlen_k] * shape.batch
    return [shape.seqlen_k] + [shape.seqlen_k * i // shape.batch for i in range(shape.batch - 1)]


def uneven_lengths(seqlen_k: int) -> list[int]:
    """Four entries: every key, 37 fewer, a single key, none."""
    return [seqlen_k, max(0, seqlen_k - 37), 1, 0]


def check_empty_row_statistics(spec: Spec, stats, ref_lse) -> None:
    """Rows that see no key carry the contract's exact values: L = +inf (version 2), or
    m = -inf and l = 0 (version 1); nothing else non-finite, NaN or -inf included."""
    empty = ~torch.isfinite(ref_lse)
    if spec.version == 2:
        (lse,) = stats
        assert torch.equal(lse[empty], torch.full_like(lse[empty], float("inf"))), "empty rows need L = +inf"
        assert torch.isfinite(lse[~empty]).all(), "rows that see a key need a finite L"
    else:
        row_max, row_sum = stats
        assert torch.equal(row_max[empty], torch.full_like(row_max[empty], float("-inf"))), "empty rows need m = -inf"
        assert torch.equal(row_sum[empty], torch.zeros_like(row_sum[empty])), "empty rows need l = 0"
        assert torch.isfinite(row_max[~empty]).all() and (row_sum[~empty] > 0).all(), (
            "rows that see a key need a finite m and l > 0")


def assert_no_atomic_calls(source) -> None:
    """A deterministic variant's source calls no atomic (the order of float atomics is the
    hardware's, so their sums differ from run to run)."""
    calls = ATOMIC_CALL.findall(source.code)
    assert not calls, f"{source.spec.name}: a deterministic variant calls {calls}"


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def run_and_check(spec: Spec, shape: Shape, *, backward: bool = True, device: str = "cpu",
                  softmax_scale: float | None = None, lengths: list[int] | None = None, qk_scale: float = 1.0,
                  source=None) -> dict:
    """Forward (and backward) of `spec` on `shape`, run on `device` (the CPU's emulator or a
    GPU), checked against the oracle on the CPU; returns the errors. `softmax_scale`,
    `lengths` (key padding) and `qk_scale` (large logits) vary the problem; `source` runs a
    rendered source of `spec` other than its own (the mutation tests)."""
    q, k, v, dout, seqlens_k = make_inputs(spec, shape, lengths=lengths, qk_scale=qk_scale)
    on = [t.to(device) if t is not None else None for t in (q, k, v, dout, seqlens_k)]
    source = render(spec) if source is None else source
    if spec.deterministic:
        assert_no_atomic_calls(source)
    p = DROPOUT_P if spec.dropout else 0.0
    out, stats = attention_kernels.forward(source, *on[:3], softmax_scale=softmax_scale, seqlens_k=on[4], dropout_p=p,
                                           seed=SEED, philox_offset=OFFSET)
    out, stats = out.cpu(), tuple(s.cpu() for s in stats)
    for name, t in (("out", out), *((f"stat{i}", s) for i, s in enumerate(stats))):
        assert_written(t, name)
    keep = dropout_keep_mask(SEED, OFFSET, shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k,
                             p) if spec.dropout else None
    kwargs = dict(causal=spec.causal, seqlens_k=seqlens_k, dropout_p=p, keep_mask=keep, softmax_scale=softmax_scale)
    ref_out, ref_lse = attention_forward(q, k, v, **kwargs)
    pt_out, pt_dq, pt_dk, pt_dv = attention_same_dtype(q, k, v, dout, **kwargs)
    errors = {"out": (max_error(out, ref_out), max_error(pt_out, ref_out))}
    check_empty_row_statistics(spec, stats, ref_lse)
    lse = stats[0] if spec.version == 2 else stats[0] + torch.log(stats[1])
    finite = torch.isfinite(ref_lse)
    lse_error = max_error(lse[finite], ref_lse[finite])
    assert lse_error < 1e-3, f"{spec.name} {shape}: L error {lse_error:.3g} (oracle's logsumexp)"
    if backward:
        drop = attention_kernels.dropout_args(p, SEED, OFFSET) if spec.dropout else None
        grads = attention_kernels.backward(source, *on[:3], out.to(device), tuple(s.to(device) for s in stats), on[3],
                                           softmax_scale=softmax_scale, seqlens_k=on[4], dropout_args=drop)
        grads = tuple(g.cpu() for g in grads)
        for name, t in zip(("dq", "dk", "dv"), grads):
            assert_written(t, name)
        refs = attention_backward(q, k, v, ref_out, dout, **kwargs)
        for name, got, ref, pt in zip(("dq", "dk", "dv"), grads, refs, (pt_dq, pt_dk, pt_dv)):
            errors[name] = (max_error(got, ref), max_error(pt, ref))
    for name, (kernel_err, torch_err) in errors.items():
        factor = OUTPUT_FACTOR if name == "out" else GRAD_FACTOR
        assert kernel_err <= factor * torch_err + ABS_FLOOR, (
            f"{spec.name} {shape}: {name} error {kernel_err:.3g} exceeds {factor}x PyTorch's "
            f"{torch_err:.3g} (same-dtype implementation vs float64)")
    return errors

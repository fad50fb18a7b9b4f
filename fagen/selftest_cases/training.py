"""The self-test's training calls: `fagen.flash_attn_func` and `flash_attn_varlen_func`, forward
(O and L) and, where the case asks, backward, each held to the rule (fagen.selftest_cases.rule).

Small shapes that still cross tile edges: 140 queries against 170 keys (neither a multiple of any
tile), GQA (two query heads over one K/V head), causal rows that see no key where Nq > Nk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .. import ops
from ..dtypes import TORCH_DTYPE
from ..ops.common import philox_state
from ..reference import attention_gradients, attention_same_dtype, dropout_keep_mask
from .rule import Checks

DROPOUT_P = 0.17


@dataclass(frozen=True)
class Training:
    """One training call's inputs. `shape` is (batch, Nq, Nk, heads, kv_heads)."""

    head_dim: int = 64
    head_dim_v: int | None = None
    dtype: str = "fp16"
    shape: tuple = (1, 140, 170, 2, 1)
    causal: bool = False
    key_padding: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    dropout: bool = False
    mods: bool = False
    deterministic: bool = False
    version: int = 2
    backward: bool = True
    seed: int = 0


def check_training(call: Training, device: torch.device) -> list[str]:
    """Run `call` through flash_attn_func on `device`; the problems the rule finds."""
    generator = torch.Generator().manual_seed(1234 + call.seed)
    batch, nq, nk, heads, kv_heads = call.shape
    dtype = TORCH_DTYPE[call.dtype]
    q, k = (torch.randn(batch, n, h, call.head_dim, generator=generator).to(device, dtype).requires_grad_()
            for n, h in ((nq, heads), (nk, kv_heads)))
    v = torch.randn(batch, nk, kv_heads, call.head_dim_v or call.head_dim, generator=generator)
    v = v.to(device, dtype).requires_grad_()
    variant, captures = _variant(call, batch, nq, nk, heads, device, generator)
    dropout_p, seed = (DROPOUT_P, 99 + call.seed) if call.dropout else (0.0, None)
    if seed is not None:   # the call draws its Philox pair from torch's CPU generator: replay the draw
        torch.manual_seed(seed)
        pair = philox_state(dropout_p, device).tolist()
        torch.manual_seed(seed)
    out, lse = ops.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=call.causal, deterministic=call.deterministic,
                                   return_lse=True, version=call.version, **variant["fagen"])
    keep = None if seed is None else dropout_keep_mask(pair[0], pair[1], batch, heads, nq, nk, dropout_p)
    dout = torch.randn(out.shape, generator=generator).to(device, dtype)
    checks = Checks()
    on_cpu = [t.detach().cpu() for t in (q, k, v, dout)]
    oracle = attention_gradients(*on_cpu, keep_mask=keep, causal=call.causal, dropout_p=dropout_p,
                                 captures=captures["reference"], **variant["reference"])
    same = attention_same_dtype(q.detach(), k.detach(), v.detach(), dout, causal=call.causal, dropout_p=dropout_p,
                                keep_mask=None if keep is None else keep.to(device), return_extra=True,
                                captures=captures["same_dtype"], **variant["same_dtype"])
    checks.output("O", out, oracle["out"], same[0])
    checks.lse("L", lse, oracle["lse"])
    if call.backward:
        leaves = [q, k, v] + variant["leaves"]
        grads = torch.autograd.grad(out, leaves, dout, retain_graph=call.deterministic)   # a repeat's
        for name, got, want, base in zip(("dQ", "dK", "dV"), grads, (oracle["dq"], oracle["dk"], oracle["dv"]),
                                         same[1:4]):
            checks.gradient(name, got, want, base)
        if call.sinks:
            checks.gradient("dsinks", grads[3], oracle["dsinks"], same[4]["dsinks"])
        if call.mods:
            checks.gradient("d(captured bias)", grads[-1], oracle["captures"][0], same[4]["captures"][0])
        if call.deterministic:   # the promise itself: the same bits again
            again = torch.autograd.grad(out, leaves, dout)
            names = ["dQ", "dK", "dV"] + ["dsinks"] * call.sinks + ["d(captured bias)"] * call.mods   # leaves
            checks.problems += [f"{name}: deterministic=True, but a second backward differs"
                                for name, first, second in zip(names, grads, again)
                                if not torch.equal(first, second)]
    return checks.problems


def _variant(call: Training, batch: int, nq: int, nk: int, heads: int, device, generator):
    """The variant's arguments three ways: for fagen on `device`, for the float64 oracle on the
    CPU, for the same-dtype yardstick on `device`; the tensors whose gradients are checked."""
    fagen, reference = {}, {}
    if call.window != (-1, -1):
        fagen["window_size"] = reference["window_size"] = call.window
    if call.softcap:
        fagen["softcap"] = reference["softcap"] = call.softcap
    if call.alibi:
        slopes = torch.rand(batch, heads, generator=generator) * 0.3
        fagen["alibi_slopes"], reference["alibi_slopes"] = slopes.to(device), slopes
    if call.key_padding:
        lengths = torch.tensor([nk, nk // 2 + 3][:batch] + [0] * max(0, batch - 2), dtype=torch.int32)
        fagen["seqlens_k"], reference["seqlens_k"] = lengths.to(device), lengths
    same = dict(reference)
    same.update({name: fagen[name] for name in ("alibi_slopes", "seqlens_k") if name in fagen})
    leaves, captures = [], {"reference": [], "same_dtype": []}
    if call.sinks:
        sinks = (torch.randn(heads, generator=generator) + 1.0).to(device).requires_grad_()
        fagen["sinks"], same["sinks"], reference["sinks"] = sinks, sinks.detach(), sinks.detach().cpu()
        leaves.append(sinks)
    if call.mods:   # a bias table indexed by relative position (with its gradient), and documents
        bias = (torch.randn(heads, nq + nk, generator=generator) * 0.5)
        documents = torch.sort(torch.randint(0, 3, (batch, max(nq, nk)), generator=generator,
                                             dtype=torch.int32), dim=1).values
        on_device, same_bias = bias.to(device).requires_grad_(), bias.to(device).requires_grad_()
        oracle_bias = bias.to(torch.float64).requires_grad_()
        fagen.update(score_mod=_relative_bias(on_device, nk), mask_mod=_same_document(documents.to(device), nq, nk))
        reference.update(score_mod=_relative_bias(oracle_bias, nk), mask_mod=_same_document(documents, nq, nk))
        same.update(score_mod=_relative_bias(same_bias, nk), mask_mod=_same_document(documents.to(device), nq, nk))
        leaves.append(on_device)
        captures["reference"], captures["same_dtype"] = [oracle_bias], [same_bias]
    return {"fagen": fagen, "reference": reference, "same_dtype": same, "leaves": leaves}, captures


def _relative_bias(table: torch.Tensor, nk: int):
    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + nk]
    return relative_bias


def _same_document(documents: torch.Tensor, nq: int, nk: int):
    """Query i and key j share a document; queries are aligned bottom-right, as causal is."""
    offset = max(nq, nk) - nq
    key_offset = max(nq, nk) - nk

    def same_document(b, h, q_idx, kv_idx):
        return documents[b, q_idx + offset] == documents[b, kv_idx + key_offset]
    return same_document


@dataclass(frozen=True)
class Packed:
    """Packed sequences through flash_attn_varlen_func: lengths of queries and keys per sequence
    (a zero-length one among them), forward and backward."""

    head_dim: int = 64
    dtype: str = "fp16"
    lengths_q: tuple = (70, 0, 133)
    lengths_k: tuple = (90, 17, 120)
    heads: tuple = (2, 1)
    causal: bool = True


def check_packed(call: Packed, device: torch.device) -> list[str]:
    """Each sequence against the oracle run on it alone; gradients too."""
    generator = torch.Generator().manual_seed(4321)
    dtype, (heads, kv_heads) = TORCH_DTYPE[call.dtype], call.heads
    total_q, total_k = sum(call.lengths_q), sum(call.lengths_k)
    q = torch.randn(total_q, heads, call.head_dim, generator=generator).to(device, dtype).requires_grad_()
    k, v = (torch.randn(total_k, kv_heads, call.head_dim, generator=generator).to(device, dtype).requires_grad_()
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
                  for lengths in (call.lengths_q, call.lengths_k))
    out, lse = ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(call.lengths_q), max(call.lengths_k),
                                          causal=call.causal, return_lse=True)
    dout = torch.randn(out.shape, generator=generator).to(device, dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    checks = Checks()
    for b, (lq, lk) in enumerate(zip(call.lengths_q, call.lengths_k)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b]) + lq), slice(int(cu_k[b]), int(cu_k[b]) + lk)
        if lq == 0:
            continue
        one = [t[None, s].detach() for t, s in ((q, rows), (k, keys), (v, keys), (dout, rows))]
        oracle = attention_gradients(*(t.cpu() for t in one), causal=call.causal)
        same = attention_same_dtype(*one, causal=call.causal)
        checks.output(f"sequence {b} O", out[None, rows], oracle["out"], same[0])
        checks.lse(f"sequence {b} L", lse[None, :, rows], oracle["lse"])
        for name, got, want, base in zip(("dQ", "dK", "dV"), (grads[0][None, rows], grads[1][None, keys],
                                                              grads[2][None, keys]),
                                         (oracle["dq"], oracle["dk"], oracle["dv"]), same[1:4]):
            checks.gradient(f"sequence {b} {name}", got, want, base)
    return checks.problems

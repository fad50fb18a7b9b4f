"""The self-test's decoding calls: `fagen.flash_attn_with_kvcache` (contiguous and paged caches,
appended keys, split-KV, GQA packing, absorbed MLA) and packed queries over a paged cache
(`flash_attn_varlen_func` with a block_table), each entry held to the rule (fagen.selftest_cases.rule)
against the oracle run on its own keys, and the cache checked row by row after the append.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .. import ops
from ..dtypes import TORCH_DTYPE
from ..ops.fp8_inputs import saturated
from ..reference import attention_forward, attention_same_dtype
from .rule import Checks

CACHE_FP8_SCALE = 16.0   # an 8-bit cache holds 16 x (descale 1/16, a power of two: exact)

MLA_HEAD_DIM, MLA_HEAD_DIM_V = 576, 512


@dataclass(frozen=True)
class Decoding:
    """One decoding step per split count in `splits`: B entries of `seqlens` keys each (before
    the append of `new` rows), `nq` queries; a paged cache when `page` is set."""

    head_dim: int = 64
    dtype: str = "fp16"
    heads: tuple = (2, 2)          # query heads, K/V heads (more query heads: GQA packing)
    seqlens: tuple = (37, 150, 0)
    nq: int = 2
    new: int = 2
    capacity: int = 192
    page: int | None = None
    causal: bool = True
    splits: tuple = (1, 3)
    mla: bool = False               # one cache of 576-wide rows, V its first 512 columns
    softcap: float = 0.0
    seed: int = 0
    cache_fp8: bool = False         # the cache in e4m3 with descales, appended rows quantised


def check_decoding(call: Decoding, device: torch.device) -> list[str]:
    checks = Checks()
    for splits in call.splits:
        _check_step(call, splits, device, checks)
    return checks.problems


def _check_step(call: Decoding, splits: int, device: torch.device, checks: Checks) -> None:
    generator = torch.Generator().manual_seed(777 + call.seed + splits)
    dtype, (heads, kv_heads) = TORCH_DTYPE[call.dtype], call.heads
    batch, width = len(call.seqlens), MLA_HEAD_DIM if call.mla else call.head_dim
    pages, table = batch * call.capacity, None
    if call.page:
        pages = batch * call.capacity // call.page
        table = torch.randperm(pages + 1, generator=generator)[:pages].view(batch, -1).int()
        shape = (pages + 1, call.page, kv_heads, width)
    else:
        shape = (batch, call.capacity, kv_heads, width)
    k_cache, v_cache = (torch.randn(shape, generator=generator) * 0.5 for _ in range(2))
    q = torch.randn(batch, call.nq, heads, width, generator=generator) * 0.5
    k_new, v_new = (torch.randn(batch, call.new, kv_heads, width, generator=generator) * 0.5 for _ in range(2))
    k_cache, v_cache, q, k_new, v_new = (t.to(device, dtype) for t in (k_cache, v_cache, q, k_new, v_new))
    descales, appended = {}, (k_new, v_new)
    if call.cache_fp8:   # an 8-bit cache: K = e4m3 * k_descale; new rows stored as e4m3(x / descale)
        descales = {name: torch.full((batch, kv_heads), 1 / CACHE_FP8_SCALE, device=device)
                    for name in ("k_descale", "v_descale")}
        k_cache, v_cache = (t.to(torch.float8_e4m3fn) for t in (k_cache * CACHE_FP8_SCALE, v_cache * CACHE_FP8_SCALE))
        appended = tuple(saturated(t.float() * CACHE_FP8_SCALE) for t in (k_new, v_new))
    before_k, before_v = k_cache.clone(), v_cache.clone()
    if call.mla:   # V is K's first 512 columns: one cache, appended through k alone
        v_cache, v_new = k_cache[..., :MLA_HEAD_DIM_V], k_new[..., :MLA_HEAD_DIM_V]
    seqlens = torch.tensor(call.seqlens, dtype=torch.int32)
    out, lse = ops.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens.to(device),
                                           block_table=None if table is None else table.to(device),
                                           causal=call.causal, softcap=call.softcap, num_splits=splits,
                                           return_softmax_lse=True, **descales)
    rows = _rows_of(table)
    for b in range(batch):
        start, stop = call.seqlens[b], call.seqlens[b] + call.new
        label = f"{splits} split(s), entry {b}"
        for name, cache, old, new in (("k_cache", k_cache, before_k, appended[0]),
                                      ("v_cache", v_cache, before_v, appended[1])):
            if call.mla and name == "v_cache":
                continue
            got, was = _bits(rows(cache, b)), _bits(rows(old, b))
            checks.equal(f"{label}: {name} outside the appended rows", torch.cat([got[:start], got[stop:]]),
                         torch.cat([was[:start], was[stop:]]))
            checks.equal(f"{label}: {name}'s appended rows", got[start:stop], _bits(new[b]))
        keys, values = rows(k_cache, b)[None, :stop], rows(v_cache, b)[None, :stop]
        if call.cache_fp8:   # the keys the cache holds, in q's dtype for the same-dtype yardstick
            keys, values = ((t.float() / CACHE_FP8_SCALE).to(dtype) for t in (keys, values))
        one_q = q[b:b + 1]
        variant = {"softcap": call.softcap} if call.softcap else {}
        oracle_out, oracle_lse = attention_forward(one_q.cpu(), keys.cpu(), values.cpu(), causal=call.causal, **variant)
        same = attention_same_dtype(one_q, keys, values, torch.zeros_like(out[b:b + 1]), causal=call.causal, **variant)
        checks.output(f"{label}: O", out[b:b + 1], oracle_out, same[0])
        checks.lse(f"{label}: L", lse[b:b + 1], oracle_lse)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor as its bytes (float8 has no equality of its own), others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rows_of(table: torch.Tensor | None):
    """An entry's cache rows, in key order: its row of a contiguous cache, or its pages in order."""
    if table is None:
        return lambda cache, b: cache[b]
    return lambda cache, b: torch.cat([cache[p] for p in table[b].tolist()])


@dataclass(frozen=True)
class PagedPacked:
    """Packed queries over a paged cache (forward only, as in flash-attn): each sequence's keys are
    its row of the block table, as many as cu_seqlens_k gives it."""

    head_dim: int = 64
    dtype: str = "fp16"
    lengths_q: tuple = (3, 0, 40)
    lengths_k: tuple = (50, 16, 97)
    heads: tuple = (2, 1)
    page: int = 16
    causal: bool = True


def check_paged_packed(call: PagedPacked, device: torch.device) -> list[str]:
    generator = torch.Generator().manual_seed(555)
    dtype, (heads, kv_heads) = TORCH_DTYPE[call.dtype], call.heads
    per_sequence = max(-(-n // call.page) for n in call.lengths_k)
    batch = len(call.lengths_q)
    table = torch.randperm(batch * per_sequence, generator=generator).view(batch, per_sequence).int()
    k_cache, v_cache = (torch.randn(batch * per_sequence, call.page, kv_heads, call.head_dim, generator=generator)
                        .to(device, dtype) for _ in range(2))
    q = torch.randn(sum(call.lengths_q), heads, call.head_dim, generator=generator).to(device, dtype)
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32) for n in (call.lengths_q, call.lengths_k))
    out, lse = ops.flash_attn_varlen_func(q, k_cache, v_cache, cu_q.to(device), cu_k.to(device), max(call.lengths_q),
                                          max(call.lengths_k), causal=call.causal, block_table=table.to(device),
                                          return_lse=True)
    rows, checks = _rows_of(table), Checks()
    for b, (lq, lk) in enumerate(zip(call.lengths_q, call.lengths_k)):
        if lq == 0:
            continue
        span = slice(int(cu_q[b]), int(cu_q[b]) + lq)
        keys, values, one_q = rows(k_cache, b)[None, :lk], rows(v_cache, b)[None, :lk], q[None, span]
        oracle_out, oracle_lse = attention_forward(one_q.cpu(), keys.cpu(), values.cpu(), causal=call.causal)
        same = attention_same_dtype(one_q, keys, values, torch.zeros_like(one_q), causal=call.causal)
        checks.output(f"sequence {b}: O", out[None, span], oracle_out, same[0])
        checks.lse(f"sequence {b}: L", lse[None, :, span], oracle_lse)
    return checks.problems

"""Packed sequences' arguments, checked: flash-attn 2.8's `flash_attn_varlen_func` layout.

q (total_q, H, d) and k, v (total_k, Hk, d) hold B sequences back to back; cu_seqlens_q and
cu_seqlens_k (int32, (B + 1,)) give where each starts, from 0, non-decreasing, ending at the
totals; max_seqlen_q / max_seqlen_k bound every length (they size the grid). With a block_table
(B, max_pages) int32, k and v are a paged cache (num_pages, page_size, Hk, d) instead, and
cu_seqlens_k counts each sequence's keys in its pages. Every error names the argument. Shapes,
dtypes and devices are always checked; the values of cu_seqlens and the block table only with
FAGEN_CHECK_VALUES=1 (a device sync per call; never under torch.compile or CUDA graph capture).
By default the kernels' guards check them on the device (macros.j2 varlen_views, page_sources):
a sequence or page out of range is refused, nothing read or written outside the tensors, and
the call raises lazily (fagen.kernels.attention_kernels.raise_flagged).
"""

from __future__ import annotations

import torch

from ..errors import InputError, InputTypeError
from .common import check_dense_tensor, check_half_rows, values_checked

PAGE_MULTIPLE = 16   # a paged cache's page_size: any multiple of the mma tile's 16 rows
ROW_CHUNK = 8        # elements in the kernels' 16-byte loads (fp16 / bf16)


def _check_packed(name: str, t, dtypes=None) -> None:
    check_dense_tensor(name, t)
    if t.dim() != 3:
        raise InputError(f"{name} must have 3 dims (total tokens, heads, head_dim) for packed sequences, "
                         f"got shape {tuple(t.shape)}")
    check_half_rows(name, t, dtypes)


def _check_cu(name: str, cu, total: int, max_name: str, max_seqlen, device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
        got = cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise InputTypeError(f"{name} must be an int32 tensor of shape (batch + 1,), got {got}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise InputError(f"{name} must be 1-D with batch + 1 >= 1 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise InputError(f"{name} must be on q's device {device}, got {cu.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise InputError(f"{max_name} must be an int >= 0, got {max_seqlen!r}")
    if values_checked(cu):
        values = cu.tolist()   # one device sync
        if values[0] != 0:
            raise InputError(f"{name} must start at 0, got {values[0]}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        if any(n < 0 for n in lengths):
            raise InputError(f"{name} must be non-decreasing, got {values}")
        if total is not None and values[-1] != total:
            raise InputError(f"{name}[-1] must equal the {total} tokens packed, got {values[-1]}")
        if lengths and max(lengths) > max_seqlen:
            raise InputError(f"{max_name} = {max_seqlen} is smaller than a sequence of {max(lengths)} tokens")
    return cu.contiguous()


def _paged_rows(k, v):
    """A paged K/V cache (num_pages, page_size, Hk, d): checked, and seen as (pages, Hk, d) rows
    for the checks every K/V gets."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InputError(f"{name} must have 4 dims (num_pages, page_size, kv_heads, head_dim) with a "
                             f"block_table, got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        check_cache_rows(name, t)
    check_page_size(k.shape[1], "k.shape[1]")
    return k[:, 0], v[:, 0]


def check_cache_rows(name: str, t: torch.Tensor) -> None:
    """A K/V cache is read in place, 16 bytes at a time: it cannot be copied into alignment. (A
    head_dim that is not a multiple of 8 is zero-padded into a copy first, as flash-attn does:
    the copy is aligned whatever the cache's strides.)"""
    chunk = 16 // t.element_size()   # ROW_CHUNK for 2-byte elements, 16 for an 8-bit cache's bytes
    if t.shape[-1] % chunk:
        return
    if t.data_ptr() % 16 or any(s % chunk for s in t.stride()[:3]):
        raise InputError(f"{name} must be 16-byte aligned with strides that are multiples of {chunk} elements "
                         f"(the kernels read 16-byte rows), got strides {t.stride()}")


def check_some_pages(k, block_table, name: str) -> None:
    """A block table needs a page to name: the kernels' guard reads page 0 in place of a page
    outside the cache (macros.j2 page_sources)."""
    if k.shape[0] == 0 and block_table.shape[1]:
        raise InputError(f"{name} has no pages (shape {tuple(k.shape)}) for block_table's {block_table.shape[1]} "
                         f"per sequence to name")


def pages_held(block_table, page_size: int) -> str:
    """What a block table's columns hold, as the messages say it: naming the argument, as
    flash-attn's do (its tests match "block_table")."""
    columns = block_table.shape[1]
    return f"block_table's {columns} page{'s' * (columns != 1)} of {page_size} rows hold{'s' * (columns == 1)}"


def check_page_size(page_size: int, where: str) -> None:
    if page_size == 0 or page_size % PAGE_MULTIPLE:
        raise InputError(f"a paged cache's page_size ({where}) must be a multiple of {PAGE_MULTIPLE}, "
                         f"got {page_size}")


def _check_table(block_table, q, k, batch: int, max_seqlen_k: int) -> torch.Tensor:
    """block_table (B, max_pages) int32: sequence b's key j is row j % page_size of page
    block_table[b][j / page_size]."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        got = block_table.dtype if isinstance(block_table, torch.Tensor) else type(block_table).__name__
        raise InputTypeError(f"block_table must be a 2-D int32 tensor (batch, max_pages), got {got}")
    if block_table.shape[0] != batch or block_table.device != q.device:
        raise InputError(f"block_table must be ({batch}, max_pages) on q's device {q.device}, got "
                         f"{tuple(block_table.shape)} on {block_table.device}")
    page_size = k.shape[1]
    if max_seqlen_k > block_table.shape[1] * page_size:
        raise InputError(f"max_seqlen_k = {max_seqlen_k} is more than {pages_held(block_table, page_size)}")
    check_some_pages(k, block_table, "k")
    if values_checked(block_table) and block_table.numel():
        low, high = int(block_table.min()), int(block_table.max())
        if low < 0 or high >= k.shape[0]:
            raise InputError(f"block_table names page {low if low < 0 else high}; k has pages 0..{k.shape[0] - 1}")
    return block_table.contiguous()


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=None, dtypes=None):
    """Validate a packed call; returns (cu_seqlens_q, cu_seqlens_k, block_table) ready for the
    kernels. With a block_table, k and v are a paged cache (num_pages, page_size, Hk, d) and
    cu_seqlens_k counts each sequence's keys in it. `dtypes`: the ones taken, where not fp16 and
    bf16 (the fp8 forward's)."""
    _check_packed("q", q, dtypes)
    paged = block_table is not None
    k_rows, v_rows = _paged_rows(k, v) if paged else (k, v)
    for name, t in (("k", k_rows), ("v", v_rows)):
        _check_packed(name, t, dtypes)
    if not q.dtype == k.dtype == v.dtype:
        raise InputTypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise InputError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape[:-1] != v.shape[:-1]:   # v's head dim (d_v) may differ: checked below
        raise InputError(f"k and v must have the same shape but for the head dim, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    if q.shape[2] != k_rows.shape[2]:
        raise InputError(f"q and k must have the same head_dim, got {q.shape[2]} and {k_rows.shape[2]}")
    if not 1 <= v.shape[-1] <= q.shape[2]:
        raise InputError(f"v's head dim (v.shape[-1] = {v.shape[-1]}) must be from 1 to q's ({q.shape[2]}): the "
                         f"kernels stage V in K's shared-memory rows")
    if k_rows.shape[1] == 0 or q.shape[1] % k_rows.shape[1]:
        raise InputError(f"q's number of heads ({q.shape[1]}) must be a multiple of k's ({k_rows.shape[1]})")
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q, q.device)
    cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], "max_seqlen_k", max_seqlen_k,
                     q.device)
    if cu_q.numel() != cu_k.numel():
        raise InputError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got {cu_q.numel() - 1} "
                         f"and {cu_k.numel() - 1}")
    table = _check_table(block_table, q, k, cu_q.numel() - 1, max_seqlen_k) if paged else None
    return cu_q, cu_k, table


def packed_lse(slots: torch.Tensor, cu_seqlens_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """(H, total_q), flash-attn's varlen lse, from the kernels' (B, H, max_seqlen_q) slots (no sync;
    differentiable: a gradient on it reaches each sequence's rows of its slot)."""
    batch = cu_seqlens_q.numel() - 1
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(batch, device=slots.device), lengths, output_size=total_q)
    row = torch.arange(total_q, device=slots.device) - cu_seqlens_q.long()[sequence]
    return slots[sequence, :, row].transpose(0, 1)

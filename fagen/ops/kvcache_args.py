"""`flash_attn_with_kvcache`'s arguments, checked before anything is written to the cache.

flash-attn 2.8's layout: q (B, Nq, H, d); k_cache, v_cache (B_cache, N_cache, Hk, d), or
paged (num_pages, page_size, Hk, d) with block_table (B, max_pages) int32; k, v (B, N_new,
Hk, d) to append at cache_seqlens. Every error names the argument and what was expected.
An 8-bit cache (float8_e4m3fn k_cache and v_cache under fp16 or bf16 q, as vLLM and FlashInfer
serve) takes k_descale and v_descale, fp32 (B, Hk): the cached K and V are the e4m3 values times
them (ones when omitted), and the new k and v, in q's dtype, are divided by them as they are
quantised into the cache. Shapes, dtypes and devices are always checked. The values of the index tensors (cache_seqlens,
cache_leftpad, cache_batch_idx, block_table) are checked here only with FAGEN_CHECK_VALUES=1
(one device sync per call, messages that name the entry and its value; never under
torch.compile or CUDA graph capture). By default the kernels' guards check them on the device:
a value out of range is refused there, nothing written outside the cache, and the call raises
lazily (fagen.kernels.attention_kernels.raise_flagged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, InputTypeError
from ..spec import CACHE_FP8_ROW_MULTIPLE, MAX_HEAD_DIM, MLA_HEAD_DIM
from .common import HEAD_DIM_MULTIPLE, check_dense_tensor, check_flag, check_half_rows, values_checked
from .varlen_args import check_cache_rows, check_page_size, check_some_pages, pages_held

CACHE_FP8_DTYPE = torch.float8_e4m3fn   # an 8-bit cache's (Spec.cache_dtype "e4m3")


@dataclass
class CacheCall:
    """The checked call: each batch entry's cache rows and key counts as int32 (B,) tensors."""

    cache_seqlens: torch.Tensor   # keys already in the cache, per entry (absolute row index of the append)
    cache_batch: torch.Tensor     # the cache entry each batch entry reads (contiguous cache)
    cache_start: torch.Tensor     # its first row (cache_leftpad)
    unit_descales: torch.Tensor | None   # an 8-bit cache's descales where none are given: ones (B, Hk)
    capacity: int                 # rows one entry can hold: N_cache, or max_pages * page_size
    page_size: int | None         # None: a contiguous cache
    new_tokens: int               # N_new, 0 without k / v
    v_from_k: bool = False        # v_cache is k_cache's first d_v columns (absorbed MLA: one cache)


def _check_data(name: str, t, ndim: int, layout: str, dtypes=None) -> None:
    check_dense_tensor(name, t)
    if t.dim() != ndim:
        raise InputError(f"{name} must have {ndim} dims {layout}, got shape {tuple(t.shape)}")
    check_half_rows(name, t, dtypes)


def _check_index(name: str, t, shape: tuple, device, dims: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputTypeError(f"{name} must be an int32 tensor of shape {dims}, got {got}")
    if tuple(t.shape) != shape:
        raise InputError(f"{name} must have shape {dims} = {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise InputError(f"{name} must be on q's device {device}, got {t.device}")
    return t.contiguous()


def _same_as_q(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.dtype != q.dtype or t.device != q.device:
        raise InputError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got {t.dtype} on {t.device}")


class RangeChecks:
    """Elementwise low <= t <= high checks of index tensors, read with one device sync for the
    whole call (`raise_first`); only with FAGEN_CHECK_VALUES=1 (common.values_checked)."""

    def __init__(self):
        self.pending: list[tuple[str, torch.Tensor, torch.Tensor, str]] = []

    def add(self, name: str, t: torch.Tensor, low, high, what: str) -> None:
        if values_checked(t) and t.numel():
            self.pending.append((name, t, (t < low) | (t > high), what))

    def raise_first(self) -> None:
        if not self.pending:
            return
        failed = torch.stack([bad.any() for _, _, bad, _ in self.pending]).tolist()   # the one sync
        for (name, t, bad, what), wrong in zip(self.pending, failed):
            if wrong:
                index = tuple(int(i) for i in bad.nonzero()[0])
                raise InputError(f"{name}{list(index)} = {int(t[index])} is out of range: {what}")


def _check_cache(q, k_cache, v_cache, block_table):
    _check_data("q", q, 4, "(batch, seqlen_q, heads, head_dim)")
    layout = "(num_pages, page_size, kv_heads, head_dim)" if block_table is not None else \
        "(batch_cache, seqlen_cache, kv_heads, head_dim)"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != CACHE_FP8_DTYPE:   # a cache in q's dtype
            _check_data(name, t, 4, layout)
            _same_as_q(name, t, q)
            continue
        _check_data(name, t, 4, layout, (CACHE_FP8_DTYPE,))
        if t.device != q.device:
            raise InputError(f"{name} must be on q's device {q.device}, got {t.device}")
    if k_cache.dtype != v_cache.dtype:
        raise InputError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dtype == CACHE_FP8_DTYPE and (k_cache.shape[3] % CACHE_FP8_ROW_MULTIPLE
                                             or v_cache.shape[3] % CACHE_FP8_ROW_MULTIPLE):
        raise InputError(f"an 8-bit cache's head dims must be multiples of {CACHE_FP8_ROW_MULTIPLE} (its rows are "
                         f"read in 16-byte chunks), got {k_cache.shape[3]} and {v_cache.shape[3]}")
    if k_cache.shape[:3] != v_cache.shape[:3]:   # v's head dim (d_v) may differ: checked below
        raise InputError(f"k_cache and v_cache must have the same shape but for the head dim, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    d, kv_heads = q.shape[3], k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise InputError(f"q and k_cache must have the same head_dim, got {d} and {k_cache.shape[3]}")
    if not (1 <= d <= MAX_HEAD_DIM or d == MLA_HEAD_DIM):
        raise InputError(f"head_dim (q.shape[-1]) must be from 1 to {MAX_HEAD_DIM} (or {MLA_HEAD_DIM}, absorbed "
                         f"MLA's), got {d}")
    if not 1 <= v_cache.shape[3] <= d:
        raise InputError(f"v_cache's head dim (v_cache.shape[-1] = {v_cache.shape[3]}) must be from 1 to q's "
                         f"({d}): the kernels stage V in K's shared-memory rows")
    if kv_heads == 0 or q.shape[2] % kv_heads:
        raise InputError(f"q's number of heads ({q.shape[2]}) must be a multiple of k_cache's ({kv_heads})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_cache_rows(name, t)


def _check_new(q, k_cache, v_cache, k, v):
    if (k is None) != (v is None):
        raise InputError("k and v must be given together (the new keys and values to append)")
    if k is None:
        return 0
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        _check_data(name, t, 4, "(batch, seqlen_new, kv_heads, head_dim)")
        _same_as_q(name, t, q)
        expected = (q.shape[0], k.shape[1], k_cache.shape[2], cache.shape[3])
        if tuple(t.shape) != expected:
            raise InputError(f"{name} must have shape (batch, seqlen_new, kv_heads, head_dim) = {expected}, "
                             f"got {tuple(t.shape)}")
    return k.shape[1]


def v_in_k(k, v) -> bool:
    """Whether v is k's first v.shape[-1] columns: one storage, one first element, k's strides
    (absorbed MLA's cache, `v_cache = k_cache[..., :512]`; a view, no copy)."""
    return (v.shape[-1] < k.shape[-1] and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
            and v.shape[:-1] == k.shape[:-1] and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr())


def _check_v_from_k(k_cache, v_cache, k, v, rotary_given: bool) -> bool:
    """A v_cache that is k_cache's first columns: its new values must be k's first columns too
    (the append writes each K row once), its head dims multiples of 8 (a padded copy would end
    the sharing), and rotary, which turns a row's first features (V's too), is refused."""
    if not v_in_k(k_cache, v_cache):
        return False
    if k is not None and not v_in_k(k, v):
        raise InputError("v_cache is a view of k_cache's first columns (one cache, as absorbed MLA keeps), so v must "
                         f"be k's: pass v = k[..., :{v_cache.shape[-1]}] (the append writes each K row once)")
    if k_cache.shape[-1] % HEAD_DIM_MULTIPLE or v_cache.shape[-1] % HEAD_DIM_MULTIPLE:
        raise InputError(f"v_cache as a view of k_cache needs head dims that are multiples of 8, got "
                         f"{k_cache.shape[-1]} and {v_cache.shape[-1]}")
    if rotary_given:
        raise InputError("rotary_cos / rotary_sin turn a row's first features, which are V's too when v_cache is a "
                         "view of k_cache: apply rotary to k's rotary part before the call")
    return True


def _check_writable(k_cache, v_cache, v_from_k: bool) -> None:
    """The append writes both caches in place: refused where torch refuses an in-place write
    (memory that two written elements share), and for a cache that requires grad, whose write
    autograd cannot record (stricter than torch, which allows it under no_grad: the check runs
    inside the forward-only Function, where grad mode is always off)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.requires_grad:
            raise InputError(f"{name} requires grad: the append writes it in place, which autograd cannot "
                             f"record; pass {name}.detach() (the same memory, so the append still lands in it)")
        if torch._debug_has_internal_overlap(t) == 1:   # 1: certain overlap (a stride 0), as torch refuses
            raise InputError(f"{name} has more than one element that refers to a single memory location "
                             f"(stride {t.stride()}, e.g. from expand): the append would write one row over "
                             f"another; pass a cache with memory of its own (.contiguous())")
    if not v_from_k and _same_memory(k_cache, v_cache):   # one cache by design (MLA) is written once
        raise InputError("k_cache and v_cache share memory: the appended values would overwrite the appended "
                         "keys; pass two caches (slices of one buffer that interleave, such as kv[:, :, 0] "
                         "and kv[:, :, 1], are fine)")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two same-shape tensors certainly share an element, torch's rule for two written
    tensors (at::get_overlap_status): the same first element, or dense byte ranges that meet."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.numel() == 0:
        return False
    if a.data_ptr() == b.data_ptr():
        return True
    if not (a.is_contiguous() and b.is_contiguous()):
        return False   # interleaved views of one buffer: torch cannot tell cheaply either
    size = a.numel() * a.element_size()
    return a.data_ptr() < b.data_ptr() + size and b.data_ptr() < a.data_ptr() + size


def check_rotary(q, rotary_cos, rotary_sin, k, capacity: int, interleaved) -> None:
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        raise InputError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise InputError("rotary_cos / rotary_sin rotate the appended keys: pass k and v as well")
    check_flag("rotary_interleaved", interleaved)
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise InputError(f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        _same_as_q(name, t, q)
    if rotary_cos.shape != rotary_sin.shape:
        raise InputError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(rotary_cos.shape)} and "
                         f"{tuple(rotary_sin.shape)}")
    rotary_dim = 2 * rotary_cos.shape[1]
    if rotary_dim == 0 or rotary_dim > q.shape[3]:
        raise InputError(f"the rotary dimension (2 * rotary_cos.shape[1] = {rotary_dim}) must be in 2.."
                         f"head_dim ({q.shape[3]})")
    if rotary_cos.shape[0] < capacity:
        raise InputError(f"rotary_cos / rotary_sin need a row per cache position: at least {capacity} rows, "
                         f"got {rotary_cos.shape[0]}")


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, rotary_given: bool = False) -> CacheCall:
    """Validate everything but rotary and the variant; returns the per-entry rows as tensors."""
    _check_cache(q, k_cache, v_cache, block_table)
    new_tokens = _check_new(q, k_cache, v_cache, k, v)
    v_from_k = _check_v_from_k(k_cache, v_cache, k, v, rotary_given)
    if new_tokens:
        _check_writable(k_cache, v_cache, v_from_k)
    batch, device = q.shape[0], q.device
    page_size, checks = None, RangeChecks()
    if block_table is not None:
        if cache_batch_idx is not None or cache_leftpad is not None:
            raise InputError("a paged cache (block_table) takes no cache_batch_idx or cache_leftpad: "
                             "the block table already names each entry's pages")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise InputError("block_table must be a 2-D int32 tensor (batch, max_pages)")
        block_table = _check_index("block_table", block_table, (batch, block_table.shape[1]), device,
                                   "(batch, max_pages)")
        page_size = k_cache.shape[1]
        check_page_size(page_size, "k_cache.shape[1]")
        check_some_pages(k_cache, block_table, "k_cache")
        capacity = block_table.shape[1] * page_size
        holds = f"{pages_held(block_table, page_size)} {capacity} rows per entry"
        checks.add("block_table", block_table, 0, k_cache.shape[0] - 1, f"pages are 0..{k_cache.shape[0] - 1}")
        cache_batch = torch.arange(batch, dtype=torch.int32, device=device)   # unused by paged kernels
    else:
        capacity = k_cache.shape[1]
        holds = f"k_cache holds {capacity} rows per entry"
        if cache_batch_idx is None:
            if k_cache.shape[0] != batch:
                raise InputError(f"k_cache holds {k_cache.shape[0]} entries for a batch of {batch}: pass "
                                 f"cache_batch_idx to say which entry each batch entry uses")
            cache_batch = torch.arange(batch, dtype=torch.int32, device=device)
        else:
            cache_batch = _check_index("cache_batch_idx", cache_batch_idx, (batch,), device, "(batch,)")
            checks.add("cache_batch_idx", cache_batch, 0, k_cache.shape[0] - 1,
                         f"k_cache has entries 0..{k_cache.shape[0] - 1}")
    seqlens = _cache_seqlens(cache_seqlens, batch, device, capacity, new_tokens, holds, checks)
    if cache_leftpad is None:
        start = torch.zeros(batch, dtype=torch.int32, device=device)
    else:
        start = _check_index("cache_leftpad", cache_leftpad, (batch,), device, "(batch,)")
        checks.add("cache_leftpad", start, 0, seqlens, "it must be in 0..cache_seqlens of its entry")
    checks.raise_first()
    unit = torch.ones(batch, k_cache.shape[2], device=device) if k_cache.dtype == CACHE_FP8_DTYPE else None
    return CacheCall(seqlens, cache_batch, start, unit, capacity, page_size, new_tokens, v_from_k)


def check_cache_descales(k_cache, k_descale, v_descale, batch: int, v_from_k: bool) -> None:
    """An 8-bit cache's descales: fp32 (B, Hk) on the cache's device, or None (ones). Refused for
    a cache in q's dtype, which has none, and v_descale for absorbed MLA's one cache, whose V is
    K's bytes (k_descale scales both)."""
    if k_cache.dtype != CACHE_FP8_DTYPE:
        for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
            if t is not None:
                raise InputError(f"{name} scales an 8-bit (float8_e4m3fn) cache; k_cache is {k_cache.dtype}")
        return
    if v_from_k and v_descale is not None:
        raise InputError("v_descale: v_cache is a view of k_cache (one cache, absorbed MLA's), so its values are "
                         "k_cache's bytes and k_descale scales both; pass k_descale alone")
    shape = (batch, k_cache.shape[2])
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"{name} must be a float32 tensor of shape (batch, kv_heads) = {shape}, got {got}")
        if t.device != k_cache.device:
            raise InputError(f"{name} must be on the cache's device {k_cache.device}, got {t.device}")


def _cache_seqlens(cache_seqlens, batch: int, device, capacity: int, new_tokens: int, holds: str,
                   checks: RangeChecks) -> torch.Tensor:
    """`holds` says what bounds the rows (with a block_table: its pages, the word flash-attn's
    test matches)."""
    if cache_seqlens is None:
        if new_tokens:
            raise InputError("cache_seqlens is needed to append k and v (it says where they go)")
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - new_tokens:
            raise InputError(f"cache_seqlens = {cache_seqlens} is out of range: the {holds} and {new_tokens} "
                             f"are appended")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    seqlens = _check_index("cache_seqlens", cache_seqlens, (batch,), device, "(batch,)")
    checks.add("cache_seqlens", seqlens, 0, capacity - new_tokens, f"the {holds} and {new_tokens} are appended")
    return seqlens

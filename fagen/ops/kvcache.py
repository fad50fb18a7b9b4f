"""`flash_attn_with_kvcache`: one decoding step against a KV cache, flash-attn 2.8's signature.

A step (1) rotates q and the new keys (rotary), (2) appends the new keys and values to the
cache in place at cache_seqlens, and (3) attends over each entry's keys with a kv_cache spec
(Spec.kv_cache): the kernel reads a contiguous cache through cache_batch_idx / cache_leftpad,
or a paged one through block_table, in place. Nq = 1 leaves most of a 64-row tile empty,
so the query heads that share a K/V head are packed into the tile's rows (GQA packing; the
kernel maps each row back to its own query and head), and the keys are split into num_splits
ranges whose fp32 partials a combine kernel merges by L (the identity of fagen.merge_attention),
so that a small batch still fills the GPU.
Forward only, as in flash-attn: inputs that require grad run, and only a backward raises
(fagen.errors.forward_only). Everything is checked before the cache is written; the append bumps
the caches' version counters, as torch's in-place ops do. A head_dim that is not a multiple of 8
runs on padded copies (PaddedHeadDim).
No host sync: the index values (cache_seqlens, cache_batch_idx, cache_leftpad, block_table) are
checked by the kernels' guards, which refuse a value out of range (an append that would leave the
cache is not written at all), and the step raises lazily from their flag (kernels.attention_kernels
.raise_flagged); FAGEN_CHECK_VALUES=1 checks them on the host first. Under torch.compile the step
is one custom op (fagen::flash_attn_with_kvcache) that declares its writes to the caches.
A serving loop calls this with one signature (shapes, strides, dtypes, devices, options) step
after step: the first call is checked and planned (`_prepare` → `StepPlan`), and the warm ones
reuse the plan and its bound launches, so a step's host time is its allocations and launches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..dtypes import DTYPE_NAME
from ..arch_families import ARCH_FAMILY_ENV, family_of
from ..errors import InputError, InputTypeError, run_forward_only, wanting_grad
from ..kernels import launch
from ..kernels import attention_kernels
from ..kernels import kv_kernels
from ..kernels.render import source_for
from ..kernels.splits import MAX_SPLITS, choose_splits, processor_count
from ..selftest.gate import GENERATION as SELFTEST_GENERATION, SELFTEST_ENV
from ..spec import Spec
from ..variants.builtins import check_softcap
from ..environment import raw_settings, setting_keys
from .common import (CHECK_VALUES_ENV, HEAD_DIM_MULTIPLE, aligned_rows, check_flag, device_shared_limit,
                     values_checked)
from .call import decoding_spec
from .kvcache_args import CacheCall, check_cache_descales, check_kvcache, check_rotary
from .variant_args import variant_call


def decode_spec(head_dim: int, dtype: torch.dtype, causal: bool, page_size: int | None, fields: dict, *,
                shared_limit: int | None = None, device=None) -> Spec:
    """The kv_cache spec of a step (call.decoding_spec: Spec.for_kv_cache, its tiles fitted to
    `shared_limit`, a GPU's shared memory per block), in the family that serves it on `device`
    (None: as built, the sm80 family's)."""
    return decoding_spec(head_dim, DTYPE_NAME[dtype], causal, page_size, fields, device,
                         shared_limit=shared_limit, served=device is not None)


def step_spec(head_dim: int, dtype: torch.dtype, *, seqlen_q: int, heads: int, kv_heads: int, causal: bool,
              page_size: int | None, fields: dict, shared_limit: int | None = None, device=None) -> Spec:
    """The spec flash_attn_with_kvcache builds for a step (the GPU check precompiles the same):
    one query sees every key whether causal or not, so causal is dropped there unless ALiBi
    measures distances from the diagonal (flash-attn drops it too); with fewer K/V heads than
    query heads, the query heads of each K/V head share its tiles (GQA packing)."""
    if seqlen_q == 1 and not fields.get("alibi"):
        causal = False
    return decode_spec(head_dim, dtype, causal, page_size, {**fields, "pack_gqa": heads > kv_heads},
                       shared_limit=shared_limit, device=device)


_loaded: set = set()   # (source, device) pairs compiled and loaded once in this process


def _load_before_writing(source, device: torch.device) -> None:
    """Compile and load a step's kernels before the cache is touched, so that a failure there
    leaves it intact (the first call of a spec on a device only: the compile does not depend on
    the emulator build a later call may switch to)."""
    key = (source.hash, device)
    if key not in _loaded:
        launch.load(source, device)
        _loaded.add(key)


def _pack(q, kv_heads: int):
    """GQA packing (Spec.pack_gqa): query i of head kv_head * group + g becomes row i * group + g
    of its K/V head; the kernel maps each row back to its own query and head for every mask,
    window and mod."""
    b, n, h, d = q.shape
    return q.view(b, n, kv_heads, h // kv_heads, d).transpose(2, 3).reshape(b, n * (h // kv_heads), kv_heads, d)


def _unpack(out, lse, shape):
    b, n, h, _ = shape
    kv_heads, d = out.shape[2], out.shape[3]   # O's head dim: v's
    group = h // kv_heads
    out = out.view(b, n, group, kv_heads, d).transpose(2, 3).reshape(b, n, h, d)
    lse = lse.view(b, kv_heads, n, group).transpose(2, 3).reshape(b, h, n)
    return out, lse


@dataclass
class PaddedHeadDim:
    """A head_dim that is not a multiple of 8 (the kernels' 16-byte rows), handled as flash-attn
    does: the step runs on zero-padded copies of q, the caches and the new keys (zero columns add
    nothing to q k^T; rotary turns only the first rotary_dim columns), then the appended rows are
    copied back into the caller's caches. That copy is the call's only write to them, after
    every kernel has run: a call that fails leaves them as they were."""

    head_dim: int                # the caller's (q's and k's)
    k_cache: torch.Tensor        # the caller's caches (v_cache's last dim: the output's)
    v_cache: torch.Tensor
    k_cache_copy: torch.Tensor   # their padded copies, which the kernels read and append to
    v_cache_copy: torch.Tensor


def _pad_head_dim(t):
    return None if t is None else torch.nn.functional.pad(t, (0, -t.shape[-1] % HEAD_DIM_MULTIPLE))


def _copy_appended(padded: PaddedHeadDim, cache, seqlens, k_cache, v_cache, block_table, flag) -> None:
    """Rows cache_seqlens[b] .. + N_new of each entry, from the padded caches into the caller's
    (index_put_: it bumps their version counters). Where a guard refused an index (`flag`, on a
    GPU still unraised), the indices are clamped into the cache and each row gets its own old
    value back: nothing changes, and no sync decides it."""
    refused = flag[0] != 0
    rows = (seqlens.long()[:, None] + torch.arange(cache.new_tokens, device=k_cache.device))
    rows = rows.clamp(0, cache.capacity - 1)
    if block_table is None:
        first, second = cache.cache_batch.long()[:, None].expand_as(rows), rows
    else:
        first, second = block_table.long().gather(1, rows // cache.page_size), rows % cache.page_size
    first = first.clamp(0, k_cache.shape[0] - 1)
    for caller, source in ((padded.k_cache, k_cache), (padded.v_cache, v_cache)):
        width = caller.shape[-1]
        caller[first, second] = torch.where(refused, caller[first, second], source[first, second, :, :width])


def _check_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise InputError(f"num_splits must be an int in 0..{MAX_SPLITS} (0: chosen from the SM count), "
                         f"got {num_splits!r}")
    return num_splits


@dataclass
class StepPlan:
    """What a decoding step derives from its arguments' shapes, strides, dtypes, devices, grad
    flags, alignment and options, which is all that `_prepare` checks: a warm step whose
    `_signature` was seen reuses it and its bound launches, so it only allocates its outputs
    and launches (one frame from here to the launches). A plan that holds tensors of its call
    (a padded head dim's copies of the caches) serves that call only."""

    source: object                       # kernels.render.Source of the step's kv_cache spec
    cache: CacheCall                     # capacity, page size, new tokens; the index tensors it made
    given: tuple                         # which of cache_seqlens, cache_batch_idx, cache_leftpad came as tensors
    rotary_interleaved: bool
    return_lse: bool
    scale: float                         # the softmax scale (1 / sqrt of the caller's head_dim by default)
    variant: dict | None                 # the variant's kernel arguments (VariantCall.values)
    q_positions_step: bool               # rotary rotates q at cache_seqlens + i (causal or windowed)
    pack_group: int | None               # GQA packing: query heads per K/V head
    num_splits: int
    padded: PaddedHeadDim | None
    reusable: bool
    update: list | None = None           # the bound launches (kernels.launch.BoundLaunch), bound by the first step
    attend: list | None = None
    packs_in_place: bool = False         # GQA packing of one query: q and out pass as they are (`_attend`)

    def run(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, k_descale=None, v_descale=None):
        """The step on this call's tensors: the append (with rotary), the attention, the raise
        from the guards' flag."""
        padded, cache = self.padded, self.cache
        if padded is not None:   # the plan of this very call (not reusable): copies of its tensors
            k_cache, v_cache = padded.k_cache_copy, padded.v_cache_copy
            q, k, v = (_pad_head_dim(t) for t in (q, k, v))
        seqlens_given, batch_given, start_given = self.given
        seqlens = cache_seqlens.contiguous() if seqlens_given else cache.cache_seqlens
        rows = (cache_batch_idx.contiguous() if batch_given else cache.cache_batch,
                cache_leftpad.contiguous() if start_given else cache.cache_start)
        block_table = None if block_table is None else block_table.contiguous()
        flag = attention_kernels.error_flag(q.device)   # the guards' refusals, raised once below
        descales = None
        if cache.unit_descales is not None:   # an 8-bit cache: absorbed MLA's V is K's bytes, k_descale scales both
            k_descale = cache.unit_descales if k_descale is None else k_descale.contiguous()
            descales = (k_descale, k_descale if cache.v_from_k else
                        cache.unit_descales if v_descale is None else v_descale.contiguous())
        if k is not None:
            q = self._append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, rows, block_table, flag,
                             descales)
        batch, seqlen_q, heads, _ = q.shape
        if batch == 0 or seqlen_q == 0 or heads == 0:
            out = q.new_zeros(batch, seqlen_q, heads, v_cache.shape[-1])
            lse = torch.full((batch, heads, seqlen_q), math.inf, device=q.device)
        else:
            out, lse = self._attend(q, k_cache, v_cache, seqlens, rows, block_table, alibi_slopes, flag, descales)
        attention_kernels.raise_flagged(flag, kv_kernels.DECODE_REFUSED)
        if padded is not None:
            if cache.new_tokens:
                _copy_appended(padded, cache, seqlens, k_cache, v_cache, block_table, flag)
            out = out[..., :padded.v_cache.shape[-1]]
        return (out, lse) if self.return_lse else out

    def _append(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, rows, block_table, flag, descales):
        """Rotary and the append: one kernel, in place. Returns the rotated q (or q)."""
        if rotary_cos is None:
            q_rot = q
            rotary_cos = rotary_sin = attention_kernels.unused(q.device, q.dtype)
        else:
            q_rot = attention_kernels.new_output(q)
            rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
        tensors = kv_kernels.cache_update_arguments(q, q_rot, k, v, k_cache, v_cache, seqlens, rotary_cos, rotary_sin,
                                                    flag, cache_rows=rows, block_table=block_table,
                                                    descales=descales)
        if self.update is None:
            self.update = kv_kernels.bind_cache_update(self.source, tensors, interleaved=self.rotary_interleaved,
                                                       q_positions_step=self.q_positions_step)
        attention_kernels.launch_all(self.update, tensors)
        # The kernel wrote the caches through raw pointers: bump their version counters as torch's
        # own in-place ops do, so that autograd refuses a backward that saved their old values.
        torch.autograd.graph.increment_version((k_cache, v_cache))
        return q_rot

    def _attend(self, q, k_cache, v_cache, seqlens, rows, block_table, alibi_slopes, flag, descales):
        """The attention over the cache (each entry's keys end at row seqlens[b] + new_tokens:
        the kernel adds the append), its (out, L) in the caller's layout. GQA packing with one
        query per head packs by views: the kernel reads q and writes the caller's output through
        strides."""
        batch, seqlen_q, heads, head_dim = q.shape
        kv_heads, group, head_dim_v = k_cache.shape[2], self.pack_group, v_cache.shape[-1]
        if group is None:
            q_kernel = aligned_rows(q)
            out = out_kernel = attention_kernels.new_buffer(batch, seqlen_q, heads, head_dim_v, dtype=q.dtype,
                                                            device=q.device)   # O has v's head dim
        elif seqlen_q == 1:   # packed row g of K/V head j is query head j * group + g
            out = attention_kernels.new_buffer(batch, 1, heads, head_dim_v, dtype=q.dtype, device=q.device)
            if self.packs_in_place:   # the bound launch has the views' strides; their pointers are q's and out's
                q_kernel, out_kernel = q, out
            else:
                packed, (s_b, _, s_h, _) = (batch, group, kv_heads, head_dim), q.stride()
                q_kernel = aligned_rows(q.as_strided(packed, (s_b, s_h, group * s_h, 1), q.storage_offset()))
                out_kernel = out.as_strided((batch, group, kv_heads, head_dim_v),
                                            (heads * head_dim_v, head_dim_v, group * head_dim_v, 1))
        else:   # rows i * group + g: copies
            q_kernel = _pack(q, kv_heads)
            out_kernel = attention_kernels.new_buffer(*q_kernel.shape[:-1], head_dim_v, dtype=q.dtype,
                                                      device=q.device)
        kernel_heads, kernel_rows = (kv_heads, group * seqlen_q) if group is not None else (heads, seqlen_q)
        # L in the caller's (B, H, Nq) where one query packs: the kernel writes it by row index,
        # and the (B, Hk, group) rows it indexes lie as (B, H, 1)'s do.
        lse_shape = (batch, heads, 1) if group is not None and seqlen_q == 1 else (batch, kernel_heads, kernel_rows)
        lse = attention_kernels.new_buffer(*lse_shape, dtype=torch.float32, device=q.device)
        variant_tensors = None
        if self.variant:   # the call's own ALiBi slopes (checked by _prepare for this signature)
            variant = self.variant
            if alibi_slopes is not None:
                variant = {**variant, "alibi_slopes": alibi_slopes.contiguous()}
            variant_tensors, scalars = attention_kernels.split_variant(self.source.spec, variant, self.scale)
        tensors = kv_kernels.kv_cache_arguments(
            q_kernel, k_cache, v_cache, out_kernel, lse, seqlens,
            *kv_kernels.partials(q_kernel, kernel_heads, kernel_rows, self.num_splits, head_dim_v), flag,
            cache_rows=None if block_table is not None else rows, block_table=block_table,
            variant_tensors=variant_tensors, descales=descales)
        if self.attend is None:
            self.attend = kv_kernels.bind_kv_cache(
                self.source, tensors, batch=batch, seqlen_q=kernel_rows, heads=kernel_heads,
                seqlen_k=self.cache.capacity, scale=self.scale, num_splits=self.num_splits, pack_group=group,
                new_tokens=self.cache.new_tokens, scalars=dict(scalars) if self.variant else {})
        attention_kernels.launch_all(self.attend, tensors)
        if group is not None and seqlen_q == 1 and not self.packs_in_place:
            # Now bound: a later step of this signature (the same strides and alignment) passes q
            # and out themselves where the views start at their first elements (q not copied). Not
            # on the sm90 family: its q is a tensor map, encoded at each launch from the tensor
            # passed, whose shape and strides must then be the view's.
            self.packs_in_place = (q_kernel.data_ptr() == q.data_ptr()
                                   and not family_of(self.source.spec).tensor_maps)
        if group is None or seqlen_q == 1:
            return out, lse
        return _unpack(out_kernel, lse, q.shape)


def _check_scale(softmax_scale):
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not softmax_scale > 0):
        raise InputError(f"softmax_scale must be a float > 0 or None, got {softmax_scale!r}")


def _prepare(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
             return_softmax_lse, k_descale=None, v_descale=None) -> StepPlan:
    """Check a step's arguments (everything but index values, which the kernels' guards check;
    FAGEN_CHECK_VALUES=1: here too), find its kernels and load them before the cache is touched."""
    cache = check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                          rotary_given=rotary_cos is not None or rotary_sin is not None)
    check_rotary(q, rotary_cos, rotary_sin, k, cache.capacity, rotary_interleaved)
    check_cache_descales(k_cache, k_descale, v_descale, q.shape[0], cache.v_from_k)
    rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    num_splits = _check_splits(num_splits)
    causal = check_flag("causal", causal)
    return_softmax_lse = check_flag("return_softmax_lse", return_softmax_lse)
    _check_scale(softmax_scale)
    padded = None
    # Padded copies of q and the caches; the scale keeps the true d.
    if q.shape[-1] % HEAD_DIM_MULTIPLE or v_cache.shape[-1] % HEAD_DIM_MULTIPLE:
        padded = PaddedHeadDim(q.shape[-1], k_cache, v_cache, _pad_head_dim(k_cache), _pad_head_dim(v_cache))
        q, k_cache, v_cache = _pad_head_dim(q), padded.k_cache_copy, padded.v_cache_copy
    head_dim_given = q.shape[-1] if padded is None else padded.head_dim   # the scale's d: the caller's
    scale = 1.0 / math.sqrt(head_dim_given) if softmax_scale is None else float(softmax_scale)
    batch, seqlen_q, heads, head_dim = q.shape
    call = variant_call(q, k_cache, causal=causal, window_size=window_size, softcap=softcap,
                        alibi_slopes=alibi_slopes, sizes=(batch, seqlen_q, heads, cache.capacity))
    kv_heads, fields = k_cache.shape[2], dict(call.spec_fields) if call else {}
    if v_cache.shape[-1] != head_dim:   # V's own head dim (Spec.head_dim_v)
        fields["head_dim_v"] = v_cache.shape[-1]
    if cache.v_from_k:   # V's rows are K's first columns: read and appended once (Spec.v_from_k)
        fields["v_from_k"] = True
    if cache.unit_descales is not None:   # an 8-bit cache, widened in the kernel (Spec.cache_dtype)
        fields["cache_dtype"] = DTYPE_NAME[k_cache.dtype]
    spec = step_spec(head_dim, q.dtype, seqlen_q=seqlen_q, heads=heads, kv_heads=kv_heads, causal=causal,
                     page_size=cache.page_size, fields=fields, shared_limit=device_shared_limit(q.device),
                     device=q.device)
    source = source_for(spec)
    _load_before_writing(source, q.device)
    if num_splits == 0:
        packed_rows = seqlen_q * (heads // kv_heads) if spec.pack_gqa else seqlen_q
        forward = source.kernels.forward
        row_blocks = batch * (kv_heads if spec.pack_gqa else heads) * forward.slices * \
            -(-packed_rows // forward.rows_per_block)
        key_tile = family_of(spec).key_tile(spec)
        num_splits = choose_splits(row_blocks, -(-cache.capacity // key_tile), processor_count(q.device))
    given = tuple(isinstance(t, torch.Tensor) for t in (cache_seqlens, cache_batch_idx, cache_leftpad))
    return StepPlan(source, cache, given, rotary_interleaved, return_softmax_lse, scale,
                    call.values if call else None, spec.causal or bool(call and call.spec_fields.get("window")),
                    heads // kv_heads if spec.pack_gqa else None, num_splits, padded,
                    reusable=padded is None)


# Plans of seen step signatures (`_signature`); bounded: many distinct shapes start it over.
_plans: dict[tuple, StepPlan] = {}
MAX_PLANS = 1024


def _signature(args) -> tuple | None:
    """Everything `_prepare` reads of a step's arguments, as one flat tuple: per tensor its shape,
    strides, dtype and device; for q and the caches also the grad flag and 16-byte alignment (the
    checks refuse to write a cache that requires grad or is misaligned, and q is copied when
    misaligned), and whether the caches could share memory; other arguments as they are where
    they are plain Python values; the launch backend. None (checked in full) for anything else
    (tensor or NumPy scalars, tensor subclasses, sparse tensors) and for `_unplanned` steps."""
    q, k_cache, v_cache = args[0], args[1], args[2]
    if type(q) is not torch.Tensor or type(k_cache) is not torch.Tensor or type(v_cache) is not torch.Tensor:
        return None
    settings = raw_settings(_STEP_SETTINGS)
    if _unplanned(q, settings[0]):
        return None
    try:
        parts = [q.shape, q.stride(), q.dtype, q.device, q.requires_grad, q.data_ptr() % 16,
                 k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.requires_grad,
                 k_cache.data_ptr() % 16,
                 v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, v_cache.requires_grad,
                 v_cache.data_ptr() % 16]
        for a in args[3:]:
            kind = type(a)
            if kind is torch.Tensor:
                parts += (a.shape, a.stride(), a.dtype, a.device)
            elif a is None or kind is int or kind is float or kind is bool:
                parts.append(a)
            elif kind is tuple and len(a) == 2 and type(a[0]) is int and type(a[1]) is int:   # a window
                parts.append(a)
            elif (kind is tuple or kind is list) and all(type(x) is int for x in a):
                parts.append(tuple(a))
            else:
                return None
    except RuntimeError:   # a layout without strides or storage (sparse): the checks name it
        return None
    gap = k_cache.data_ptr() - v_cache.data_ptr()   # what _check_writable's shared-memory test reads
    # The launch backend: q's device (in parts), and what `launch.backend_key` reads on the CPU.
    parts += (gap == 0, abs(gap) < k_cache.numel() * k_cache.element_size(), settings[1:],
              launch.counters_collected(), SELFTEST_GENERATION[0])
    k, v = args[3], args[4]
    if gap == 0 and type(k) is torch.Tensor and type(v) is torch.Tensor:   # one MLA cache: is v k's view too?
        parts.append(k.data_ptr() == v.data_ptr())
    return tuple(parts)


# Read raw in one step on every warm call (environment.raw_settings): FAGEN_CHECK_VALUES, then
# FAGEN_ARCH_FAMILY and FAGEN_SELFTEST (the step's kernel family, with the self-test's verdicts'
# generation) and the emulator build's settings (what `launch.backend_key` reads, with
# instrumentation.collecting).
_STEP_SETTINGS = setting_keys(CHECK_VALUES_ENV, ARCH_FAMILY_ENV, SELFTEST_ENV, *launch.BACKEND_SETTINGS)
_UNSET = (None, b"", b"0", "", "0")   # raw values of a FAGEN_CHECK_VALUES that checks nothing


def _unplanned(q, check_values_raw) -> bool:
    """Steps that check everything every time: FAGEN_CHECK_VALUES=1 (the index values are read;
    `check_values_raw` is its raw value, and common.values_checked decides when it is set), and
    CUDA graph capture (a plan's index tensors made during a capture hold nothing until a replay,
    and one made before it would be freed under the graph if its plan were dropped)."""
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return True
    return check_values_raw not in _UNSET and values_checked(q)


def _step(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
          cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
          window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
          return_softmax_lse=False, k_descale=None, v_descale=None):
    """flash_attn_with_kvcache's eager implementation (the custom op's too): the plan of the
    call's signature (checked once by `_prepare`), run on its tensors."""
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            return_softmax_lse, k_descale, v_descale)
    key = _signature(args)
    plan = None if key is None else _plans.get(key)
    if plan is None:
        plan = _prepare(*args)
        if key is not None and plan.reusable:
            if len(_plans) >= MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    return plan.run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, alibi_slopes, k_descale, v_descale)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            k_descale=None, v_descale=None):
    """Attention of q against a KV cache, after appending k and v to it in place (flash-attn 2.8).

    q (B, Nq, H, d); k_cache, v_cache (B_cache, N_cache, Hk, d), or with block_table (B,
    max_pages) int32 a paged cache (num_pages, page_size, Hk, d) with page_size any multiple of
    16; k, v (B, N_new, Hk, d) are rotated (k only) and written at rows cache_seqlens[b] ..
    + N_new; cache_seqlens (int or int32 (B,)) counts each entry's keys before the append;
    cache_batch_idx (B,) picks each entry's cache row, cache_leftpad (B,) its first key.
    rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2) rotate q and k at their absolute cache
    positions (q at cache_seqlens + i when causal or windowed, else all at cache_seqlens),
    interleaved or not. Causal is bottom-right aligned to each entry's keys; window_size,
    softcap and alibi_slopes as in flash_attn_func. num_splits = 0 picks the split-KV count from
    the SM count. Returns out (B, Nq, H, d), and with return_softmax_lse also L (B, H, Nq).
    Any d up to 512: one that is not a multiple of 8 is zero-padded as flash-attn does.
    An 8-bit cache: k_cache and v_cache in float8_e4m3fn (q, k, v and the output stay fp16 or
    bf16), with k_descale and v_descale, fp32 (B, Hk), FlashAttention-3's names: the cache holds
    K / k_descale and V / v_descale in e4m3, the appended k and v are quantised so (rounded to
    nearest, saturated at +-448), and the kernel widens each tile exactly. Head dims are then
    multiples of 16; absorbed MLA's one cache takes k_descale alone.
    """
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits)
    descales = (k_descale, v_descale)
    # Forward only, as in flash-attn (errors.forward_only, unrolled: a step is a hot path). The
    # index tensors are integers, which cannot require grad.
    if wanting_grad((q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, alibi_slopes, *descales)):
        return run_forward_only("flash_attn_with_kvcache",
                                functools.partial(_dispatch, args, return_softmax_lse, descales), args)
    return _dispatch(args, return_softmax_lse, descales)


def _dispatch(args: tuple, return_softmax_lse, descales: tuple):
    if torch.compiler.is_compiling():
        return _traced_step(*args, check_flag("return_softmax_lse", return_softmax_lse), *descales)
    return _step(*args, return_softmax_lse, *descales)


# -- torch.compile: the step as one custom op ---------------------------------------------------

def _traced_step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                 num_splits, return_softmax_lse: bool, k_descale=None, v_descale=None):
    """The op's arguments in its schema's types (flags as Python bools, the window as two ints,
    an int cache_seqlens apart from a tensor one); every other check runs in the op, eagerly."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise InputTypeError(f"under torch.compile, window_size must be a pair of Python ints, got {window_size!r}")
    check_softcap(softcap)   # the op's schema takes a float: refused here, by the built-in's own check
    seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    out, lse = _step_op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_tensor,
                        None if seqlens_tensor is not None else cache_seqlens, cache_batch_idx, cache_leftpad,
                        block_table, None if softmax_scale is None else float(softmax_scale),
                        check_flag("causal", causal), int(window_size[0]), int(window_size[1]), float(softcap),
                        check_flag("rotary_interleaved", rotary_interleaved), alibi_slopes, _check_splits(num_splits),
                        k_descale, v_descale)
    return (out, lse) if return_softmax_lse else out


@torch.library.custom_op("fagen::flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _step_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
             v: torch.Tensor | None, rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
             cache_seqlens: torch.Tensor | None, cache_seqlens_int: int | None, cache_batch_idx: torch.Tensor | None,
             cache_leftpad: torch.Tensor | None, block_table: torch.Tensor | None, softmax_scale: float | None,
             causal: bool, window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
             alibi_slopes: torch.Tensor | None, num_splits: int, k_descale: torch.Tensor | None = None,
             v_descale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step (the eager implementation), declared to write k_cache and v_cache: functionalization
    and the version counters see the append. Returns fresh contiguous (out, L)."""
    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    out, lse = _step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, cache_leftpad,
                     block_table, softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved,
                     alibi_slopes, num_splits, True, k_descale, v_descale)
    return out.contiguous(), lse.contiguous()


@_step_op.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int, cache_batch_idx,
      cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
      alibi_slopes, num_splits, k_descale=None, v_descale=None):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)

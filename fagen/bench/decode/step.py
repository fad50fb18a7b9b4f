"""The decode section's decoding step: its inputs (a contiguous cache and the same keys paged),
the contenders (fagen, SDPA pinned to one backend, FlexAttention), one timed cell, and fagen's
check against fp32 torch. See run.py for the section as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...arch_families import SM90
from ..measure import context_lost, torch_attention, torch_dtype
from ..peers import (SDPA_BACKENDS, FlexSystem, NotAvailable, failure_reason, in_family, is_out_of_memory,
                     sm90_unavailable)
from ..timing import Timing
from .config import DECODE_LABELS, DecodeConfig


def fagen_decode_functions() -> tuple:
    """fagen's decoding and varlen entry points (imported late: a broken install is reported)."""
    from fagen import flash_attn_varlen_func, flash_attn_with_kvcache

    return flash_attn_with_kvcache, flash_attn_varlen_func


# -- decode inputs --------------------------------------------------------------------

@dataclass
class DecodeInputs:
    """One decoding step's tensors: fagen's cache layout, the same keys paged, and (made on
    first use) PyTorch's (B, H, N, d) layout."""

    q: object               # (B, 1, Hq, d)
    k_cache: object         # (B, N, Hk, d)
    v_cache: object
    cache_seqlens: object   # int32 (B,): every cache full
    k_pages: object         # (B N / page_size, page_size, Hk, d)
    v_pages: object
    block_table: object     # int32 (B, N / page_size), a random permutation of the pages
    _torch_layout: tuple | None = field(default=None, repr=False)

    def torch_layout(self) -> tuple:
        """q (B, Hq, 1, d), k and v (B, Hk, N, d), contiguous."""
        if self._torch_layout is None:
            self._torch_layout = tuple(t.transpose(1, 2).contiguous() for t in (self.q, self.k_cache, self.v_cache))
        return self._torch_layout


def make_decode_inputs(config: DecodeConfig, batch: int, cache_len: int, device) -> DecodeInputs:
    import torch

    if cache_len % config.page_size:
        raise ValueError(f"cache_len {cache_len} is not a whole number of {config.page_size}-token pages")
    dtype = torch_dtype(config.dtype)
    pages = cache_len // config.page_size
    q = torch.randn(batch, 1, config.q_heads, config.head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, cache_len, config.kv_heads, config.head_dim, device=device, dtype=dtype)
            for _ in range(2))
    order = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(config.seed))
    block_table = order.view(batch, pages).to(device=device, dtype=torch.int32)
    page_shape = (batch * pages, config.page_size, config.kv_heads, config.head_dim)
    k_pages, v_pages = torch.empty(page_shape, device=device, dtype=dtype), torch.empty(page_shape, device=device,
                                                                                         dtype=dtype)
    rows = block_table.flatten().long()
    k_pages[rows], v_pages[rows] = k.reshape(page_shape), v.reshape(page_shape)
    seqlens = torch.full((batch,), cache_len, device=device, dtype=torch.int32)
    return DecodeInputs(q, k, v, seqlens, k_pages, v_pages, block_table)


# -- decode systems ---------------------------------------------------------------------

class DecodeSystem:
    """One contender for the decoding step. `prepare` returns the timed call (output in
    (B, 1, Hq, d)) and how many K/V heads it reads, with a line saying how it got GQA."""

    name = "decode"

    @property
    def label(self) -> str:
        return DECODE_LABELS.get(self.name, self.name)

    def unavailable_reason(self) -> str | None:
        return None

    def prepare(self, inputs: DecodeInputs, config: DecodeConfig) -> tuple[Callable, dict]:
        raise NotImplementedError

    def reference_caches(self, inputs: DecodeInputs) -> tuple:
        """The contiguous caches whose attention the system computes (the sanity check's)."""
        return inputs.k_cache, inputs.v_cache


class FagenDecode(DecodeSystem):
    """flash_attn_with_kvcache on the contiguous cache or the paged one; with `family` sm90 (arch_families.SM90), on
    the Hopper family (FAGEN_ARCH_FAMILY=sm90 around each step; compute capability 9.0 only); with `fp8`, on
    the caches quantised to e4m3 once, before the timing (`quantised_caches`: half the bytes read)."""

    def __init__(self, paged: bool, family: str = "", fp8: bool = False):
        self.paged, self.family, self.fp8 = paged, family, fp8
        self.name = "_".join(["fagen", *([family] if family else []), *(["fp8"] if fp8 else []),
                              *(["paged"] if paged else [])])

    def unavailable_reason(self) -> str | None:
        try:
            fagen_decode_functions()
        except Exception as exc:  # noqa: BLE001 - report any import failure
            return f"cannot import fagen's decode functions: {type(exc).__name__}: {exc}"
        return sm90_unavailable() if self.family == SM90.name else None

    def prepare(self, inputs, config):
        decode = fagen_decode_functions()[0]
        k_cache, v_cache = (inputs.k_pages, inputs.v_pages) if self.paged else (inputs.k_cache, inputs.v_cache)
        options = {"cache_seqlens": inputs.cache_seqlens, **({"block_table": inputs.block_table} if self.paged else {})}
        info = {"kv_heads_read": config.kv_heads, "gqa": "native"}
        if self.fp8:
            k_cache, v_cache, options["k_descale"], options["v_descale"] = quantised_caches(k_cache, v_cache,
                                                                                           inputs.q.shape[0])
            info["cache_element"] = 1

        def step():
            return in_family(self.family, decode, inputs.q, k_cache, v_cache, **options)
        return step, info

    def reference_caches(self, inputs):
        """The contiguous caches this system attends to: its e4m3 values times their descales."""
        if not self.fp8:
            return inputs.k_cache, inputs.v_cache
        k8, v8, kd, vd = quantised_caches(inputs.k_cache, inputs.v_cache, inputs.q.shape[0])
        return k8.to(kd.dtype) * kd[:, None, :, None], v8.to(vd.dtype) * vd[:, None, :, None]


def quantised_caches(k_cache, v_cache, batch: int) -> tuple:
    """(k8, v8, k_descale, v_descale): each cache in e4m3 with one descale per K/V head (amax / 448,
    the same for every batch entry, so that pages need no entry of their own), as (B, Hk) fp32."""
    import torch

    out = []
    for cache in (k_cache, v_cache):
        descale = (cache.abs().amax(dim=(0, 1, 3)).float() / 448.0).clamp_min(1e-12)   # (Hk,)
        out.append(((cache.float() / descale[:, None]).to(torch.float8_e4m3fn), descale.expand(batch, -1).contiguous()))
    (k8, kd), (v8, vd) = out
    return k8, v8, kd, vd


class SdpaDecode(DecodeSystem):
    """SDPA pinned to one backend: enable_gqa if the backend takes it (probed with one call),
    else on K/V expanded to every query head beforehand."""

    def __init__(self, name: str):
        self.name, self.backend_name = name, SDPA_BACKENDS[name]

    def unavailable_reason(self) -> str | None:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"torch.nn.attention.sdpa_kernel is missing: {exc}"
        if getattr(SDPBackend, self.backend_name, None) is None:
            return f"this torch has no SDPBackend.{self.backend_name}"
        return None

    def _call(self, q, k, v, gqa: bool):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, self.backend_name)):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).transpose(1, 2)

    def prepare(self, inputs, config):
        import warnings

        q, k, v = inputs.torch_layout()
        with warnings.catch_warnings():   # a refusing backend warns why, then raises
            warnings.simplefilter("ignore")
            try:
                self._call(q, k, v, True)
                return (lambda: self._call(q, k, v, True)), {"kv_heads_read": config.kv_heads, "gqa": "enable_gqa"}
            except Exception as exc:  # noqa: BLE001 - try the expanded form next
                refused = failure_reason(exc, limit=160)
            if context_lost(refused):
                raise NotAvailable(refused)
            k_all, v_all = (t.repeat_interleave(config.group, dim=1) for t in (k, v))
            try:
                self._call(q, k_all, v_all, False)
            except Exception as exc:  # noqa: BLE001
                raise NotAvailable(f"enable_gqa: {refused}; on expanded K/V: {failure_reason(exc, limit=160)}") \
                    from None
        return (lambda: self._call(q, k_all, v_all, False)), {
            "kv_heads_read": config.q_heads,
            "gqa": f"K/V expanded to {config.q_heads} heads beforehand (enable_gqa refused: {refused})"}


class FlexDecode(DecodeSystem):
    """torch.compile(flex_attention) with enable_gqa and no block mask."""

    name = "flex"

    def __init__(self, flex: FlexSystem | None = None):
        self.flex = flex or FlexSystem()

    def unavailable_reason(self) -> str | None:
        return self.flex.unavailable_reason()

    def prepare(self, inputs, config):
        q, k, v = inputs.torch_layout()
        flex = self.flex._function()
        return (lambda: flex(q, k, v, enable_gqa=True).transpose(1, 2)), {"kv_heads_read": config.kv_heads,
                                                                          "gqa": "enable_gqa"}


def measure_decode(system: DecodeSystem, inputs: DecodeInputs, config: DecodeConfig, timer: Callable[..., Timing],
                   timer_kwargs: dict, *, batch: int, cache_len: int) -> dict:
    """One system's cell: its timing and the bytes it moves (bandwidth: markdown.add_bandwidth)."""
    try:
        step, info = system.prepare(inputs, config)
        step()   # the first call compiles or loads the kernel: kept out of the timer's sizing call
        timing = timer(step, **timer_kwargs)
    except Exception as exc:  # noqa: BLE001 - fail soft: the reason goes in the report
        return {"skipped": failure_reason(exc), "oom": is_out_of_memory(exc)}
    cell = timing.to_dict()
    cell.update(bytes=config.decode_bytes(info["kv_heads_read"], batch=batch, cache_len=cache_len,
                                          cache_element=info.get("cache_element", 2)),
                kv_heads_read=info["kv_heads_read"], expanded=info["kv_heads_read"] != config.kv_heads,
                gqa=info["gqa"], host_bound=timing.host_ms >= 0.9 * timing.median_ms)
    return cell


def decode_sanity(system: DecodeSystem, config: DecodeConfig, device) -> dict:
    """fagen's step on the small shape against fp32 torch, next to bf16 torch (2x rule)."""
    import torch

    batch, cache_len = config.sanity_shape
    inputs = make_decode_inputs(config, batch, cache_len, device)
    try:
        out = system.prepare(inputs, config)[0]()
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": failure_reason(exc)}
    k, v = (t.repeat_interleave(config.group, dim=2) for t in system.reference_caches(inputs))
    ref = torch_attention(inputs.q, k, v, False, torch.float32)
    same = torch_attention(inputs.q, k.to(inputs.q.dtype), v.to(inputs.q.dtype), False, inputs.q.dtype)
    err, err_pt = [(x.float() - ref).abs().max().item() for x in (out, same)]
    return {"fwd_err": err, "fwd_torch_err": err_pt, "ok": bool(err <= 2 * err_pt + 1e-4),
            "shape": f"B={batch} cache {cache_len}"}

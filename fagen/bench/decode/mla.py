"""The decode section's absorbed-MLA rows (issue 27 item 3): DeepSeek-V3's decoding step, one
cache of 576-wide rows (512 latent + 64 rotary features) whose first 512 columns are V, one K/V
head under 128 query heads, bf16, Nq = 1, every cache full, at B = 64 and B = 1.

  fagen_mla   flash_attn_with_kvcache(q, kv, kv[..., :512], ...) on 64-row pages (FlashMLA's):
              fagen reads each cache row once (Spec.v_from_k)
  fagen_sm90_mla
              the same on the sm90 family (FAGEN_ARCH_FAMILY=sm90; compute capability 9.0): two
              blocks per row block, each O's 256-column slice of V read from K's tile
  sdpa        scaled_dot_product_attention(q, k, k[..., :512], enable_gqa=True), torch's choice
              of backend, on the (B, 1, N, 576) cache
  flex        torch.compile(flex_attention), enable_gqa, the same views

Every system is credited with the bytes the step needs (config.DecodeConfig.mla_bytes: each
cache row read once, q read, out written), so its share of the copy bandwidth says how close
it comes to reading the cache once at the device's speed. fagen is first checked on a small step
against fp32 torch (2x bf16 torch's error).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...arch_families import SM90
from ..measure import torch_attention, torch_dtype
from ..peers import FlexSystem, NotAvailable, failure_reason, in_family, is_out_of_memory, sm90_unavailable
from .config import MLA_DIM, MLA_DIM_V, DecodeConfig

PAGE = 64   # FlashMLA's page size
FAGEN_FAMILIES = {"fagen_mla": "", "fagen_sm90_mla": SM90.name}   # fagen's systems, and their kernel family


@dataclass
class MlaInputs:
    q: object            # (B, 1, H, 576)
    pages: object        # (B N / 64, 64, 1, 576): the cache, V its first 512 columns
    block_table: object  # int32 (B, N / 64), a random permutation of the pages
    seqlens: object      # int32 (B,): every cache full
    rows: object         # (B, 1, N, 576): the same keys in PyTorch's layout, for the peers


def make_mla_inputs(config: DecodeConfig, batch: int, cache_len: int, device) -> MlaInputs:
    import torch

    dtype = torch_dtype(config.dtype)
    pages = cache_len // PAGE
    rows = torch.randn(batch, 1, cache_len, MLA_DIM, device=device, dtype=dtype) * 0.5
    order = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(config.seed))
    block_table = order.view(batch, pages).to(device=device, dtype=torch.int32)
    paged = torch.empty(batch * pages, PAGE, 1, MLA_DIM, device=device, dtype=dtype)
    paged[block_table.flatten().long()] = rows.reshape(batch * pages, PAGE, 1, MLA_DIM)
    q = torch.randn(batch, 1, config.mla_heads, MLA_DIM, device=device, dtype=dtype) * 0.5
    seqlens = torch.full((batch,), cache_len, device=device, dtype=torch.int32)
    return MlaInputs(q, paged, block_table, seqlens, rows)


def mla_step(name: str, inputs: MlaInputs, flex: FlexSystem | None = None):
    """The timed call of system `name`, returning (B, 1, H, 512)."""
    scale = MLA_DIM ** -0.5
    if name in FAGEN_FAMILIES:
        from fagen import flash_attn_with_kvcache

        return lambda: in_family(FAGEN_FAMILIES[name], flash_attn_with_kvcache, inputs.q, inputs.pages,
                                 inputs.pages[..., :MLA_DIM_V], cache_seqlens=inputs.seqlens,
                                 block_table=inputs.block_table, softmax_scale=scale)
    q = inputs.q.transpose(1, 2)
    k, v = inputs.rows, inputs.rows[..., :MLA_DIM_V]
    if name == "sdpa":
        import torch.nn.functional as F

        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2)
    if name == "flex":
        function = (flex or FlexSystem())._function()
        return lambda: function(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2)
    raise NotAvailable(f"no MLA system {name!r}")


def unavailable(name: str) -> str | None:
    """Why system `name` cannot run on this device, or None."""
    return sm90_unavailable() if FAGEN_FAMILIES.get(name) == SM90.name else None


def measure_mla(name: str, inputs: MlaInputs, config: DecodeConfig, timer, timer_kwargs, *, batch: int) -> dict:
    if unavailable(name):
        return {"skipped": unavailable(name), "oom": False}
    try:
        step = mla_step(name, inputs)
        step()   # compiles or loads the kernels: kept out of the timer
        timing = timer(step, **timer_kwargs)
    except Exception as exc:  # noqa: BLE001 - fail soft: the reason goes in the report
        return {"skipped": failure_reason(exc), "oom": is_out_of_memory(exc)}
    cell = timing.to_dict()
    cell.update(bytes=config.mla_bytes(batch), kv_heads_read=1, expanded=False,
                gqa="native" if name in FAGEN_FAMILIES else "enable_gqa",
                host_bound=timing.host_ms >= 0.9 * timing.median_ms)
    return cell


def mla_sanity(config: DecodeConfig, device, name: str = "fagen_mla") -> dict:
    """fagen's MLA step (system `name`) on a small cache against fp32 torch, next to bf16 torch
    (2x rule)."""
    import torch

    inputs = make_mla_inputs(config, 2, 4 * PAGE, device)
    try:
        out = mla_step(name, inputs)()
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": failure_reason(exc)}
    k = inputs.rows.transpose(1, 2).expand(-1, -1, config.mla_heads, -1)
    v = k[..., :MLA_DIM_V]
    ref = torch_attention(inputs.q, k, v, False, torch.float32)
    same = torch_attention(inputs.q, k, v, False, inputs.q.dtype)
    err, err_pt = [(x.float() - ref).abs().max().item() for x in (out, same)]
    return {"fwd_err": err, "fwd_torch_err": err_pt, "ok": bool(err <= 2 * err_pt + 1e-4),
            "shape": f"B=2 cache {4 * PAGE}"}

"""The ops users call: pick a Spec from the inputs, render, compile, launch.

Shapes follow flash-attn: q (B, Nq, H, d), k and v (B, Nk, Hk, d), any
strides on the first three dims and a contiguous last dim; the output is
(B, Nq, H, d) and the statistics are fp32 (B, H, Nq).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from . import launch
from .codegen import Source, kernel_entries, render
from .spec import Spec, check_dropout_p

TORCH_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
LOG2E = 1.4426950408889634


def _spec_dtype(tensor: torch.Tensor, name: str) -> str:
    if tensor.dtype not in TORCH_DTYPES:
        raise TypeError(f"{name} must be float16 or bfloat16, got {tensor.dtype}")
    return TORCH_DTYPES[tensor.dtype]


def _check_inputs(q, k, v, seqlens_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got {t.stride(-1)}")
        _spec_dtype(t, name)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q's heads ({q.shape[2]}) must be a multiple of k's heads ({k.shape[2]})")
    if seqlens_k is not None:
        if not isinstance(seqlens_k, torch.Tensor) or seqlens_k.dtype != torch.int32:
            raise TypeError("seqlens_k must be an int32 tensor of shape (batch,)")
        if seqlens_k.shape != (q.shape[0],) or seqlens_k.device != q.device:
            raise ValueError(f"seqlens_k must have shape ({q.shape[0]},) on {q.device}, got "
                             f"{tuple(seqlens_k.shape)} on {seqlens_k.device}")


def _dropout_args(dropout_p: float, generator: torch.Generator | None) -> dict:
    """Seed and offset for Philox, drawn from torch's generator (manual_seed reproduces them)."""
    from .reference import dropout_threshold

    seed = int(torch.randint(0, 2**63 - 1, (), generator=generator).item())
    return {"seed": seed, "philox_offset": 0, "keep_threshold": dropout_threshold(dropout_p),
            "keep_scale": 1.0 / (1.0 - dropout_p)}


def forward(source: Source, q, k, v, *, softmax_scale=None, seqlens_k=None, dropout_p=0.0,
            generator=None):
    """Launch `source`'s forward kernel. Returns (out, stats) where stats is
    (lse,) for version 2 and (m, l) for version 1."""
    spec = source.spec
    _check_inputs(q, k, v, seqlens_k)
    dropout_p = check_dropout_p(dropout_p)
    if (dropout_p > 0) != spec.dropout:
        raise ValueError(f"{spec.name} was built {'with' if spec.dropout else 'without'} dropout; "
                         f"dropout_p must be {'> 0' if spec.dropout else '0'}, got {dropout_p}")
    if (seqlens_k is not None) != spec.key_padding:
        raise ValueError(f"{spec.name} {'needs' if spec.key_padding else 'takes no'} seqlens_k")
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    if head_dim != spec.head_dim or TORCH_DTYPES[q.dtype] != spec.dtype:
        raise ValueError(f"{spec.name} expects head_dim {spec.head_dim} and {spec.dtype}, got "
                         f"{head_dim} and {q.dtype}")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    out = torch.empty_like(q)
    stat_names = ("lse",) if spec.version == 2 else ("row_max_out", "row_sum_out")
    stats = [torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
             for _ in stat_names]
    if batch == 0 or seqlen_q == 0:
        return out, tuple(stats)
    values = {"q": q, "k": k, "v": v, "out": out, "seqlens_k": seqlens_k, "heads": heads,
              "kv_heads": kv_heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
              "softmax_scale_log2": scale * LOG2E, **dict(zip(stat_names, stats))}
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        values.update({f"{name}_stride_b": t.stride(0), f"{name}_stride_n": t.stride(1),
                       f"{name}_stride_h": t.stride(2)})
    if spec.dropout:
        values.update(_dropout_args(dropout_p, generator))
    entry = source.entry("_fwd")
    launch.load(source, q.device).launch(entry, entry.grid(batch, heads, seqlen_q), values)
    return out, tuple(stats)


@functools.lru_cache(maxsize=256)
def _generated_source(spec: Spec, path: str, sha256: str) -> Source:
    code = Path(path).read_text()
    source = Source(spec=spec, code=code, entries=kernel_entries(spec))
    if source.hash != sha256:
        raise RuntimeError(f"{path} does not match its module (sha256 {source.hash[:12]} != "
                           f"{sha256[:12]}); rebuild it with `fagen build`")
    return source


def run_generated(spec: Spec, source_path: Path, sha256: str, q, k, v, **kwargs):
    """Entry point of the op modules `fagen build` writes into generated/."""
    out, _ = forward(_generated_source(spec, str(source_path), sha256), q, k, v, **kwargs)
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, seqlens_k=None,
                    return_lse=False, version=2, generator=None):
    """Exact attention in flash-attn's layout (forward only until the backward kernels land)."""
    _check_inputs(q, k, v, seqlens_k)
    spec = Spec(head_dim=q.shape[-1], dtype=_spec_dtype(q, "q"), version=version,
                mask="causal" if causal else "none", key_padding=seqlens_k is not None,
                dropout=check_dropout_p(dropout_p) > 0)
    out, stats = forward(render(spec), q, k, v, softmax_scale=softmax_scale, seqlens_k=seqlens_k,
                         dropout_p=dropout_p, generator=generator)
    if not return_lse:
        return out
    if version == 2:
        return out, stats[0]
    row_max, row_sum = stats
    return out, row_max + torch.log(row_sum)

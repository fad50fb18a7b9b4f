"""The ops users call: `flash_attn_func` (flash-attn's layout) and `attention`
(PyTorch's layout), with autograd and torch.compile support.

Each call checks its inputs (every error names the argument and what was
expected), picks a Spec from them (and from the tuning cache), renders and
compiles it once per process, and launches it: CUDA tensors through CuPy,
CPU tensors through the SIMT emulator.

The forward and backward passes are `torch.library` custom ops
(`fagen::flash_attn_fwd`, `fagen::flash_attn_bwd`) with fake implementations,
so `torch.compile(fullgraph=True)` traces a call without graph breaks, and the
backward is registered with `register_autograd`: it saves O, the statistics and
the RNG state (seed, offset), never P or the dropout mask, which the backward
kernels regenerate bit for bit.

Empty problems are defined, not errors: batch = 0 or Nq = 0 gives empty
outputs; Nk = 0 (no keys at all) gives O = 0, L = +inf and zero gradients,
the same as any row that sees no key.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from . import attention_kernels
from .codegen import Source, kernel_entries, render
from .spec import MAX_HEAD_DIM, Spec, check_dropout_p

TORCH_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
ALIGN_ELEMENTS = 8  # cp.async moves 16 bytes: rows must start 16-byte aligned


# -- input checking --------------------------------------------------------------------------

def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    if t.dtype not in TORCH_DTYPES:
        raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}")


def check_inputs(q, k, v, seqlens_k=None) -> None:
    """Validate flash-attn-layout inputs; raises TypeError/ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    head_dim = q.shape[3]
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (q.shape[-1]) must be a multiple of 8 from 8 to {MAX_HEAD_DIM}, got {head_dim}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q's number of heads ({q.shape[2]}) must be a multiple of k's ({k.shape[2]})")
    if seqlens_k is not None:
        _check_seqlens_k(seqlens_k, q, k)


def _check_seqlens_k(seqlens_k, q, k) -> None:
    if not isinstance(seqlens_k, torch.Tensor) or seqlens_k.dtype != torch.int32:
        got = seqlens_k.dtype if isinstance(seqlens_k, torch.Tensor) else type(seqlens_k).__name__
        raise TypeError(f"seqlens_k must be an int32 tensor of shape (batch,), got {got}")
    if tuple(seqlens_k.shape) != (q.shape[0],):
        raise ValueError(f"seqlens_k must have shape ({q.shape[0]},), got {tuple(seqlens_k.shape)}")
    if seqlens_k.device != q.device:
        raise ValueError(f"seqlens_k must be on q's device {q.device}, got {seqlens_k.device}")
    if torch.compiler.is_compiling() or seqlens_k.numel() == 0:
        return  # values are data: checked eagerly only (the kernels clamp them anyway)
    low, high = (int(x) for x in torch.aminmax(seqlens_k))  # one device sync
    if low < 0 or high > k.shape[1]:
        raise ValueError(f"seqlens_k values must be in [0, {k.shape[1]}] (the keys k holds), "
                         f"got values from {low} to {high}")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself if its rows are contiguous and start 16-byte aligned (cp.async's need), else a
    contiguous copy (this also covers broadcast tensors such as the dO of `out.sum()`)."""
    ok = (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
          and all(s % ALIGN_ELEMENTS == 0 and s > 0 for s in t.stride()[:3]))
    return t if ok else t.contiguous()


# -- choosing and building the kernels ---------------------------------------------------------

@functools.lru_cache(maxsize=512)
def source_for(spec: Spec) -> Source:
    """Render a spec once per process (the compiled kernels are cached by launch/compiler)."""
    return render(spec)


@functools.lru_cache(maxsize=256)
def _generated_source(spec: Spec, path: str, sha256: str) -> Source:
    source = Source(spec=spec, code=Path(path).read_text(), kernels=kernel_entries(spec))
    if source.hash != sha256:
        raise RuntimeError(f"{path} does not match its module (sha256 {source.hash[:12]} != "
                           f"{sha256[:12]}); rebuild it with `fagen build`")
    return source


_call_sources: dict[tuple, tuple[int, Source]] = {}
MAX_CALL_SHAPES = 4096


def _source(q, k, seqlens_k, dropout_p, causal, version, deterministic, module_source) -> Source:
    """The kernels for a call: a dict lookup once a call of this shape has been seen."""
    if module_source:  # a generated op module: its own .cu file, its fixed spec
        return _module_source(module_source)
    from . import tuning

    generation = tuning.cache.INDEX.current_generation()  # a new tuning result invalidates the memo
    key = (q.shape, k.shape, q.dtype, q.device, seqlens_k is not None, dropout_p > 0, causal, version,
           deterministic)
    hit = _call_sources.get(key)
    if hit is not None and hit[0] == generation:
        return hit[1]
    spec = Spec(head_dim=q.shape[3], dtype=TORCH_DTYPES[q.dtype], version=version,
                mask="causal" if causal else "none", key_padding=seqlens_k is not None,
                dropout=dropout_p > 0, deterministic=deterministic)
    # Empty problems (batch, Nq or Nk of 0) still pick tiles: from the smallest shape bucket.
    spec = tuning.lookup(spec, seqlen_q=max(1, q.shape[1]), seqlen_k=max(1, k.shape[1]),
                         batch=max(1, q.shape[0]), heads=q.shape[2], device=q.device)
    source = source_for(spec)
    if len(_call_sources) >= MAX_CALL_SHAPES:  # many distinct shapes: start over, stay bounded
        _call_sources.clear()
    _call_sources[key] = (generation, source)
    return source


@functools.lru_cache(maxsize=256)
def _module_source(module_source: str) -> Source:
    spec_name, path, sha256 = module_source.split("|")
    return _generated_source(Spec.from_name(spec_name), path, sha256)


# -- custom ops --------------------------------------------------------------------------------

@torch.library.custom_op("fagen::flash_attn_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_k: torch.Tensor | None,
            rng: torch.Tensor | None, dropout_p: float, softmax_scale: float, causal: bool, version: int,
            deterministic: bool, module_source: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    source = _source(q, k, seqlens_k, dropout_p, causal, version, deterministic, module_source)
    seed, offset = (int(x) for x in rng.tolist()) if rng is not None else (0, 0)
    out, stats = attention_kernels.forward(source, _aligned(q), _aligned(k), _aligned(v),
                                           softmax_scale=softmax_scale, seqlens_k=seqlens_k,
                                           dropout_p=dropout_p, seed=seed, philox_offset=offset)
    row_sum = stats[1] if version == 1 else q.new_empty(0, dtype=torch.float32)
    return out, stats[0], row_sum


@_fwd_op.register_fake
def _(q, k, v, seqlens_k, rng, dropout_p, softmax_scale, causal, version, deterministic, module_source):
    batch, seqlen_q, heads, _ = q.shape
    stats = q.new_empty(batch, heads, seqlen_q, dtype=torch.float32)
    row_sum = q.new_empty(batch, heads, seqlen_q, dtype=torch.float32) if version == 1 else \
        q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), stats, row_sum


@torch.library.custom_op("fagen::flash_attn_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            stat: torch.Tensor, row_sum: torch.Tensor, seqlens_k: torch.Tensor | None, rng: torch.Tensor | None,
            dropout_p: float, softmax_scale: float, causal: bool, version: int, deterministic: bool,
            module_source: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    source = _source(q, k, seqlens_k, dropout_p, causal, version, deterministic, module_source)
    stats = (stat,) if version == 2 else (stat, row_sum)
    drop = None
    if rng is not None:
        seed, offset = (int(x) for x in rng.tolist())
        drop = attention_kernels.dropout_args(dropout_p, seed, offset)
    return attention_kernels.backward(source, _aligned(q), _aligned(k), _aligned(v), out, stats,
                                      _aligned(dout), softmax_scale=softmax_scale, seqlens_k=seqlens_k,
                                      dropout_args=drop)


@_bwd_op.register_fake
def _(dout, q, k, v, out, stat, row_sum, seqlens_k, rng, dropout_p, softmax_scale, causal, version,
      deterministic, module_source):
    fresh = dict(memory_format=torch.contiguous_format)
    return torch.empty_like(q, **fresh), torch.empty_like(k, **fresh), torch.empty_like(v, **fresh)


def _setup_context(ctx, inputs, output):
    q, k, v, seqlens_k, rng, dropout_p, softmax_scale, causal, version, deterministic, module_source = inputs
    out, stat, row_sum = output
    ctx.mark_non_differentiable(stat, row_sum)  # L (or m, l) has no gradient formula: say so
    ctx.save_for_backward(q, k, v, out, stat, row_sum, seqlens_k, rng)
    ctx.options = (dropout_p, softmax_scale, causal, version, deterministic, module_source)


def _backward(ctx, dout, _dstat, _drow_sum):
    q, k, v, out, stat, row_sum, seqlens_k, rng = ctx.saved_tensors
    dq, dk, dv = _bwd_op(dout, q, k, v, out, stat, row_sum, seqlens_k, rng, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd("fagen::flash_attn_fwd", _backward, setup_context=_setup_context)


# -- public API --------------------------------------------------------------------------------

def _philox_state(dropout_p: float, device: torch.device) -> torch.Tensor | None:
    """(seed, offset) for Philox, drawn from torch's default CPU generator whatever the device:
    torch.manual_seed (which seeds it) reproduces a run, and no device sync is needed.

    The pair reaches the kernels as launch arguments, so a CUDA graph would replay the
    captured pair, one dropout mask on every replay: capturing is refused instead."""
    if dropout_p == 0:
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "fagen: dropout_p > 0 inside CUDA graph capture is not supported: the graph would replay "
            "one dropout mask on every replay. Capture with dropout_p=0, or run this call eagerly.")
    state = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    return torch.stack([state[0], state[1] % 2**32])


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, seqlens_k=None,
                    return_lse=False, deterministic=False, version=2, *, _module_source=""):
    """Exact attention, flash-attn's conventions.

    q (B, Nq, H, d); k, v (B, Nk, Hk, d) with H % Hk == 0 (GQA/MQA); fp16 or
    bf16, last dim contiguous; d a multiple of 8 up to 256. Returns out
    (B, Nq, H, d), and with return_lse also L = logsumexp of each row's scaled
    scores (B, H, Nq), fp32, natural log, +inf for rows that see no key (L is
    not differentiable). causal aligns bottom-right when Nq != Nk; seqlens_k
    (int32, (B,)) masks each batch entry's keys past its length; dropout_p
    uses Philox seeded from torch's generator; deterministic=True makes the
    backward pass bit-reproducible (no atomics); version=1 runs
    FlashAttention-1.
    """
    check_inputs(q, k, v, seqlens_k)
    dropout_p = check_dropout_p(dropout_p)
    if version not in (1, 2):
        raise ValueError(f"version must be 1 or 2, got {version!r}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    elif not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if seqlens_k is not None:
        seqlens_k = seqlens_k.contiguous()  # the kernels index it as a plain array
    out, stat, row_sum = _fwd_op(q, k, v, seqlens_k, _philox_state(dropout_p, q.device), dropout_p,
                                 float(softmax_scale), bool(causal), int(version), bool(deterministic),
                                 _module_source)
    if not return_lse:
        return out
    return out, (stat if version == 2 else _lse_from_stats(stat, row_sum))


def _lse_from_stats(row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """FlashAttention-1's (m, l) as L = m + log l, with +inf for rows that saw no key (l = 0)."""
    lse = row_max + torch.log(row_sum)
    return torch.where(row_sum > 0, lse, torch.full_like(lse, math.inf))


def attention(q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False, seqlens_k=None,
              return_lse=False, deterministic=False, version=2):
    """Like `flash_attn_func`, in PyTorch's layout: q (B, H, Nq, d), k and v (B, Hk, Nk, d)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seqlen, head_dim), got shape "
                             f"{tuple(t.shape)}")
    result = flash_attn_func(*(t.transpose(1, 2) if isinstance(t, torch.Tensor) else t for t in (q, k, v)),
                             dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                             seqlens_k=seqlens_k, return_lse=return_lse, deterministic=deterministic,
                             version=version)
    if return_lse:
        return result[0].transpose(1, 2), result[1]
    return result.transpose(1, 2)


def run_generated(spec: Spec, source_path: Path, sha256: str, q, k, v, *, softmax_scale=None,
                  seqlens_k=None, dropout_p=0.0, return_lse=False):
    """Entry point of the op modules `fagen build` writes: a fixed spec and its own .cu file."""
    if TORCH_DTYPES.get(getattr(q, "dtype", None)) != spec.dtype or getattr(q, "shape", (0,))[-1] != spec.head_dim:
        raise ValueError(f"{spec.name} takes {spec.dtype} inputs with head_dim {spec.head_dim}, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} with shape {tuple(getattr(q, 'shape', ()))}")
    if (seqlens_k is not None) != spec.key_padding:
        raise ValueError(f"{spec.name} {'needs' if spec.key_padding else 'takes no'} seqlens_k")
    if (dropout_p > 0) != spec.dropout:
        raise ValueError(f"{spec.name} was built {'with' if spec.dropout else 'without'} dropout; "
                         f"dropout_p must be {'> 0' if spec.dropout else '0'}, got {dropout_p}")
    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=spec.causal,
                           seqlens_k=seqlens_k, return_lse=return_lse, deterministic=spec.deterministic,
                           version=spec.version, _module_source=f"{spec.name}|{source_path}|{sha256}")

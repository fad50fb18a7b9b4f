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
kernels regenerate bit for bit. Eager calls run the same implementations
through a plain `torch.autograd.Function` (or, without autograd, directly),
which costs a few microseconds less per call than the custom-op dispatcher:
for decoding and small batches that host time is the whole cost.

Empty problems are defined, not errors: batch = 0 or Nq = 0 gives empty
outputs; Nk = 0 (no keys at all) gives O = 0, L = +inf and zero gradients,
the same as any row that sees no key.
"""

from __future__ import annotations

import math

import torch

from . import attention_kernels, generated_sources, tuning, variant_attention
from .argument_checks import check_dense_tensor, check_flag
from .codegen import Source, source_for
from .errors import InputError, InputTypeError, run_forward_only
from .spec import MAX_HEAD_DIM, Spec, check_dropout_p
from .variant_args import VariantCall, variant_call
from .varlen_args import check_varlen, packed_lse, values_checkable

TORCH_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
ALIGN_ELEMENTS = 8   # cp.async moves 16 bytes: rows must start 16-byte aligned
HEAD_DIM_MULTIPLE = 8  # head dims in between are zero-padded up to this (flash-attn does too)
MAX_INT32 = 2**31 - 1  # sequence lengths, heads and batch reach the kernels as int


# -- input checking --------------------------------------------------------------------------

FLASH_LAYOUT = ("batch", "seqlen", "heads", "head_dim")
TORCH_LAYOUT = ("batch", "heads", "seqlen", "head_dim")   # PyTorch's (SDPA's) order


def _check_tensor(name: str, t, dims=FLASH_LAYOUT) -> None:
    check_dense_tensor(name, t)
    if t.dim() != 4:
        raise InputError(f"{name} must have 4 dims ({', '.join(dims)}), got shape {tuple(t.shape)}")
    if t.dtype not in TORCH_DTYPES:
        raise InputTypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise InputError(f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}")


def check_inputs(q, k, v, seqlens_k=None, names=("q", "k", "v"), dims=FLASH_LAYOUT) -> None:
    """Validate q, k, v; raises TypeError/ValueError naming the argument. `names` are the
    caller's own argument names and `dims` its layout (fagen.sdpa: query, key, value in
    TORCH_LAYOUT), so every message speaks of what the user passed, in its shape."""
    nq, nk, nv = names
    for name, t in zip(names, (q, k, v)):
        _check_tensor(name, t, dims)
    q_shape, k_shape = q.shape, k.shape
    if not q.dtype == k.dtype == v.dtype:
        raise InputTypeError(f"{nq}, {nk} and {nv} must share a dtype, got {nq} {q.dtype}, {nk} {k.dtype}, "
                             f"{nv} {v.dtype}")
    if not q.device == k.device == v.device:
        raise InputError(f"{nq}, {nk} and {nv} must be on one device, got {nq} {q.device}, {nk} {k.device}, "
                         f"{nv} {v.device}")
    if k_shape != v.shape:
        raise InputError(f"{nk} and {nv} must have the same shape, got {nk} {tuple(k_shape)} and {nv} {tuple(v.shape)}")
    heads_axis, seq_axis = dims.index("heads"), dims.index("seqlen")
    batch, heads, head_dim = q_shape[0], q_shape[heads_axis], q_shape[3]
    if batch != k_shape[0]:
        raise InputError(f"{nq} and {nk} must have the same batch size, got {batch} and {k_shape[0]}")
    if head_dim != k_shape[3]:
        raise InputError(f"{nq} and {nk} must have the same head_dim, got {head_dim} and {k_shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise InputError(f"head_dim ({nq}.shape[-1]) must be from 1 to {MAX_HEAD_DIM}, got {head_dim}")
    if k_shape[heads_axis] == 0 or heads % k_shape[heads_axis]:
        raise InputError(f"{nq}'s number of heads ({heads}) must be a multiple of {nk}'s ({k_shape[heads_axis]})")
    if max(batch, q_shape[seq_axis], heads, k_shape[seq_axis]) > MAX_INT32:
        for name, size in (("batch", batch), ("seqlen_q", q_shape[seq_axis]), ("heads", heads),
                           ("seqlen_k", k_shape[seq_axis])):
            if size > MAX_INT32:
                raise InputError(f"{name} = {size} is above {MAX_INT32}, the largest size the kernels' "
                                 f"int arguments hold")
    if seqlens_k is not None:
        _check_seqlens_k(seqlens_k, q, k)


def _check_seqlens_k(seqlens_k, q, k) -> None:
    if not isinstance(seqlens_k, torch.Tensor) or seqlens_k.dtype != torch.int32:
        got = seqlens_k.dtype if isinstance(seqlens_k, torch.Tensor) else type(seqlens_k).__name__
        raise InputTypeError(f"seqlens_k must be an int32 tensor of shape (batch,), got {got}")
    if tuple(seqlens_k.shape) != (q.shape[0],):
        raise InputError(f"seqlens_k must have shape ({q.shape[0]},), got {tuple(seqlens_k.shape)}")
    if seqlens_k.device != q.device:
        raise InputError(f"seqlens_k must be on q's device {q.device}, got {seqlens_k.device}")
    # Unchecked (traced or captured), a value above Nk counts as Nk and one below 0 as 0:
    # the kernels clamp each length to [0, Nk].
    if seqlens_k.numel() == 0 or not values_checkable(seqlens_k):
        return
    low, high = (int(x) for x in torch.aminmax(seqlens_k))  # one device sync
    if low < 0 or high > k.shape[1]:
        raise InputError(f"seqlens_k values must be in [0, {k.shape[1]}] (the keys k holds), "
                         f"got values from {low} to {high}")


def check_scale(name: str, scale, head_dim: int) -> float:
    """A softmax scale (None: 1/sqrt(head_dim)) as a float; `name` is the caller's argument."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise InputTypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        # The kernels take each row's max of the raw scores S and fold the scale into the
        # exponent: max(tau S) = tau max(S) holds for tau > 0 only.
        raise InputError(f"{name} must be a positive finite float, got {scale}")
    return float(scale)


def _check_options(dropout_p, softmax_scale, causal, return_lse, deterministic, version, head_dim):
    """The non-tensor arguments, checked; returns (dropout_p, softmax_scale, causal, return_lse,
    deterministic) as floats and Python bools: a NumPy bool must not reach the custom op."""
    causal, return_lse, deterministic = (check_flag(name, value) for name, value in (
        ("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic)))
    if isinstance(version, bool) or version not in (1, 2):
        raise InputError(f"version must be 1 or 2, got {version!r}")
    return check_dropout_p(dropout_p), check_scale("softmax_scale", softmax_scale, head_dim), causal, return_lse, \
        deterministic


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself if its rows are contiguous and start 16-byte aligned (cp.async's need), else an
    aligned contiguous copy (this also covers broadcast tensors such as the dO of `out.sum()`,
    and a contiguous view that starts off alignment, which .contiguous() would return as is).
    Any number of dims: (B, N, H, d) or packed (total, H, d)."""
    if t.dim() == 4:   # the hot path of every call: unrolled
        s_b, s_n, s_h, s_d = t.stride()
        ok = (s_d == 1 and t.data_ptr() % 16 == 0 and s_b > 0 and s_n > 0 and s_h > 0
              and not (s_b % ALIGN_ELEMENTS or s_n % ALIGN_ELEMENTS or s_h % ALIGN_ELEMENTS))
    else:
        *outer, s_d = t.stride()
        ok = s_d == 1 and t.data_ptr() % 16 == 0 and all(s > 0 and s % ALIGN_ELEMENTS == 0 for s in outer)
    return t if ok else t.clone(memory_format=torch.contiguous_format)


# -- choosing and building the kernels ---------------------------------------------------------

_call_sources: dict[tuple, tuple[int, Source]] = {}
MAX_CALL_SHAPES = 4096


def _source(q, k, seqlens_k, dropout_p, causal, version, deterministic, module_source) -> Source:
    """The kernels for a call: a dict lookup once a call of this shape has been seen."""
    if module_source:  # a generated op module: its own .cu file, its fixed spec
        return generated_sources.source_of(module_source)
    on_gpu = q.device.type == "cuda"
    # A new tuning result invalidates the memo; CPU calls never read the tuning cache.
    generation = tuning.cache.INDEX.current_generation() if on_gpu else 0
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


# -- the implementations (shared by the custom ops and the eager path) ------------------------------

def _rng_pair(rng: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if rng is None else tuple(int(x) for x in rng.tolist())


def _forward_kernels(q, k, v, seqlens_k, rng, dropout_p, softmax_scale, causal, version, deterministic,
                     module_source):
    """Run the forward kernels. Returns (out, stat, row_sum), and what the eager backward
    reuses: the Source and the aligned q, k, v the kernels read."""
    source = _source(q, k, seqlens_k, dropout_p, causal, version, deterministic, module_source)
    seed, offset = _rng_pair(rng)
    q, k, v = aligned_rows(q), aligned_rows(k), aligned_rows(v)
    out, stats = attention_kernels.forward(source, q, k, v, softmax_scale=softmax_scale, seqlens_k=seqlens_k,
                                           dropout_p=dropout_p, seed=seed, philox_offset=offset)
    return (out, stats[0], stats[1] if version == 1 else None), source, (q, k, v)


def _forward_impl(q, k, v, seqlens_k, rng, *args):
    """The custom op's implementation: its row_sum output is an empty tensor for version 2.
    Never traced, so it makes a compiled call's CUDA-graph check (see _philox_state)."""
    if rng is not None:
        _refuse_graph_capture(q.device)
    out, stat, row_sum = _forward_kernels(q, k, v, seqlens_k, rng, *args)[0]
    return out, stat, q.new_empty(0, dtype=torch.float32) if row_sum is None else row_sum


def _backward_kernels(source, dout, q, k, v, out, stat, row_sum, seqlens_k, rng, dropout_p, softmax_scale,
                      version, dlse=None):
    """Run the backward kernels on aligned q, k, v. Returns (dq, dk, dv). `dlse` is the
    gradient of the returned L, or None."""
    stats = (stat,) if version == 2 else (stat, row_sum)
    drop = None if rng is None else attention_kernels.dropout_args(dropout_p, *_rng_pair(rng))
    dout = torch.zeros_like(out) if dout is None else aligned_rows(dout)
    return attention_kernels.backward(source, q, k, v, out, stats, dout, softmax_scale=softmax_scale,
                                      seqlens_k=seqlens_k, dropout_args=drop, dlse=dlse)


def _dlse(dstat, drow_sum, row_sum, version):
    """The gradient of L = m + log l (FA-1) or of L (FA-2) from its outputs' gradients."""
    if version == 2 or dstat is not None:
        return dstat
    return None if drow_sum is None else drow_sum * row_sum


def _backward_impl(dout, q, k, v, out, stat, row_sum, seqlens_k, rng, dropout_p, softmax_scale, causal,
                   version, deterministic, module_source, dlse=None):
    source = _source(q, k, seqlens_k, dropout_p, causal, version, deterministic, module_source)
    return _backward_kernels(source, dout, aligned_rows(q), aligned_rows(k), aligned_rows(v), out, stat, row_sum,
                             seqlens_k, rng, dropout_p, softmax_scale, version, dlse)


# -- custom ops (what torch.compile and opcheck see) -----------------------------------------------

@torch.library.custom_op("fagen::flash_attn_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_k: torch.Tensor | None,
            rng: torch.Tensor | None, dropout_p: float, softmax_scale: float, causal: bool, version: int,
            deterministic: bool, module_source: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, seqlens_k, rng, dropout_p, softmax_scale, causal, version, deterministic,
                         module_source)


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
            module_source: str, dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(dout, q, k, v, out, stat, row_sum, seqlens_k, rng, dropout_p, softmax_scale,
                          causal, version, deterministic, module_source, dlse)


@_bwd_op.register_fake
def _(dout, q, k, v, out, stat, row_sum, seqlens_k, rng, dropout_p, softmax_scale, causal, version,
      deterministic, module_source, dlse=None):
    fresh = dict(memory_format=torch.contiguous_format)
    return torch.empty_like(q, **fresh), torch.empty_like(k, **fresh), torch.empty_like(v, **fresh)


def _setup_context(ctx, inputs, output):
    q, k, v, seqlens_k, rng, dropout_p, softmax_scale, causal, version, deterministic, module_source = inputs
    out, stat, row_sum = output
    ctx.save_for_backward(q, k, v, out, stat, row_sum, seqlens_k, rng)
    ctx.options = (dropout_p, softmax_scale, causal, version, deterministic, module_source)


def _backward(ctx, dout, dstat, drow_sum):
    q, k, v, out, stat, row_sum, seqlens_k, rng = ctx.saved_tensors
    # L takes part in autograd: dS = P (dP - (D - dL)).
    dlse = _dlse(dstat, drow_sum, row_sum, ctx.options[3])
    dq, dk, dv = _bwd_op(dout, q, k, v, out, stat, row_sum, seqlens_k, rng, *ctx.options, dlse)
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd("fagen::flash_attn_fwd", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' autograd formula for eager calls, without the dispatcher's cost.
    Only q, k, v are autograd inputs; the rest travels as one tuple (fewer inputs, a
    cheaper apply)."""

    @staticmethod
    def forward(ctx, q, k, v, rest):
        seqlens_k, rng, dropout_p, softmax_scale, causal, version, deterministic, module_source = rest
        (out, stat, row_sum), source, aligned = _forward_kernels(
            q, k, v, seqlens_k, rng, dropout_p, softmax_scale, causal, version, deterministic, module_source)
        # The aligned q, k, v (the inputs themselves unless they had to be copied) and the
        # Source: the backward needs neither a second copy nor a second lookup.
        ctx.save_for_backward(*aligned, out, stat, row_sum, seqlens_k, rng)
        ctx.source, ctx.options = source, (dropout_p, softmax_scale, version)
        ctx.set_materialize_grads(False)  # an unused L gets no gradient, not zeros
        if row_sum is None:  # version 2: L only
            return out, stat
        return out, stat, row_sum

    @staticmethod
    def backward(ctx, dout, dstat, drow_sum=None):
        q, k, v, out, stat, row_sum, seqlens_k, rng = ctx.saved_tensors
        dropout_p, softmax_scale, version = ctx.options
        dq, dk, dv = _backward_kernels(ctx.source, dout, q, k, v, out, stat, row_sum, seqlens_k, rng, dropout_p,
                                       softmax_scale, version, _dlse(dstat, drow_sum, row_sum, version))
        return dq, dk, dv, None


def _run(*args):
    """(out, stat, row_sum) through the custom op when traced, else the eager path (where
    version 2's row_sum is None)."""
    if torch.compiler.is_compiling():
        return _fwd_op(*args)
    q, k, v = args[:3]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        outputs = _EagerAttention.apply(q, k, v, args[3:])
        return outputs if len(outputs) == 3 else (*outputs, None)
    return _forward_kernels(*args)[0]


# -- public API --------------------------------------------------------------------------------

def _refuse_graph_capture(device: torch.device) -> None:
    """Dropout's (seed, offset) reach the kernels as launch arguments, so a CUDA graph would
    replay the captured pair, one dropout mask on every replay: capturing is refused instead."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "fagen: dropout_p > 0 inside CUDA graph capture is not supported: the graph would replay "
            "one dropout mask on every replay. Capture with dropout_p=0, or run this call eagerly.")


def _philox_state(dropout_p: float, device: torch.device) -> torch.Tensor | None:
    """(seed, offset) for Philox, drawn from torch's default CPU generator whatever the device:
    torch.manual_seed (which seeds it) reproduces a run, and no device sync is needed."""
    if dropout_p == 0:
        return None
    # Dynamo cannot trace the capture query (a torch function returning a bool): a compiled
    # call is checked at run time instead, by the custom op's implementation (_forward_impl).
    if not torch.compiler.is_compiling():
        _refuse_graph_capture(device)
    state = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    return torch.stack([state[0], state[1] % 2**32])


def _padded_head_dim(q, k, v):
    """q, k, v with d zero-padded up to a multiple of 8 (the kernels' 16-byte rows), and the
    true d. Zero columns add nothing to Q K^T, and the output's extra columns are dropped."""
    head_dim = q.shape[-1]
    pad = -head_dim % HEAD_DIM_MULTIPLE
    if pad == 0:
        return q, k, v, head_dim
    padded = (torch.nn.functional.pad(t, (0, pad)) for t in (q, k, v))
    return *padded, head_dim


def _attention(q, k, v, dropout_p, softmax_scale, causal, seqlens_k, return_lse, deterministic, version,
               module_source, variant=None):
    check_inputs(q, k, v, seqlens_k)
    dropout_p, softmax_scale, causal, return_lse, deterministic = _check_options(
        dropout_p, softmax_scale, causal, return_lse, deterministic, version, q.shape[-1])  # the true d's scale
    call = variant_call(q, k, causal=causal, **variant) if variant else None
    q, k, v, head_dim = _padded_head_dim(q, k, v)
    if seqlens_k is not None:
        seqlens_k = seqlens_k.contiguous()  # the kernels index it as a plain array
    if call is not None:
        out, lse = _variant_run(call, q, k, v, seqlens_k, dropout_p, softmax_scale, causal, version, deterministic)
    else:
        out, stat, row_sum = _run(q, k, v, seqlens_k, _philox_state(dropout_p, q.device), dropout_p,
                                  softmax_scale, causal, version, deterministic, module_source)
        lse = None if not return_lse else (stat if version == 2 else _lse_from_stats(stat, row_sum))
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    return (out, lse) if return_lse else out


@torch.compiler.disable
def _variant_run(call: VariantCall, q, k, v, seqlens_k, dropout_p, softmax_scale, causal, version, deterministic):
    """(out, L) of a call with a variant: its own Spec (the mods' presence, never their values)."""
    try:
        spec = Spec(head_dim=q.shape[3], dtype=TORCH_DTYPES[q.dtype], version=version,
                    mask="causal" if causal else "none", key_padding=seqlens_k is not None, dropout=dropout_p > 0,
                    deterministic=deterministic, **call.spec_fields)
    except ValueError as exc:   # e.g. deterministic=True with a captured tensor's gradient
        raise InputError(f"fagen: {exc}") from None
    spec = tuning.lookup(spec, seqlen_q=max(1, q.shape[1]), seqlen_k=max(1, k.shape[1]), batch=max(1, q.shape[0]),
                         heads=q.shape[2], device=q.device)
    return variant_attention.run(source_for(spec), call, q, k, v, seqlens_k, _philox_state(dropout_p, q.device),
                                 dropout_p, softmax_scale)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, seqlens_k=None,
                    return_lse=False, sinks=None, score_mod=None, mask_mod=None, version=2):
    """Exact attention, flash-attn 2.8's signature and conventions (fagen's extras keyword-only).

    q (B, Nq, H, d); k, v (B, Nk, Hk, d) with H % Hk == 0 (GQA/MQA); fp16 or
    bf16, last dim contiguous; d up to 256 (a d that is not a multiple of 8
    is zero-padded on the way in and sliced on the way out, as flash-attn
    does; the default scale still uses the true d). Returns out (B, Nq, H, d);
    with return_lse, (out, L) with L = logsumexp of each row's scores (B, H, Nq), fp32,
    natural log, +inf for rows that see no key, and differentiable (its gradient enters the
    backward as dS = P (dP - (D - dL))); return_attn_probs=True returns (out, L, None), as
    there is no probability matrix to return. causal (a bool) aligns bottom-right when
    Nq != Nk; window_size=(left, right) lets query i see keys i + Nk - Nq - left ..
    i + Nk - Nq + right (-1: unbounded; causal sets right = 0); softcap > 0 applies
    c tanh(s / c) to the scaled scores; alibi_slopes (H,) or (B, H) fp32 adds
    -slope |i + Nk - Nq - j|; sinks (H,) fp32 logits join every row's softmax denominator
    (and get gradients); score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx,
    kv_idx) are FlexAttention-style functions traced into the kernel (fagen.variants);
    seqlens_k (int32, (B,)) masks each batch entry's keys past its length (Nk in the
    alignments is then the entry's own length); dropout_p uses Philox seeded from torch's
    generator, also with every variant; deterministic=True makes the backward pass
    bit-reproducible (no atomics); version=1 runs FlashAttention-1.
    """
    return_attn_probs = check_flag("return_attn_probs", return_attn_probs)
    # The common call: no variant to check (a window given as an array or a tensor is checked as one).
    plain = isinstance(window_size, tuple) and window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None \
        and sinks is None and score_mod is None and mask_mod is None
    variant = None if plain else dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                      sinks=sinks, score_mod=score_mod, mask_mod=mask_mod)
    result = _attention(q, k, v, dropout_p, softmax_scale, causal, seqlens_k,
                        check_flag("return_lse", return_lse) or return_attn_probs,
                        deterministic, version, "", variant)
    return (*result, None) if return_attn_probs else result


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, return_lse=False,
                           sinks=None, score_mod=None, mask_mod=None, version=2):
    """Exact attention over packed sequences, flash-attn 2.8's signature and conventions.

    q (total_q, H, d), k and v (total_k, Hk, d) hold B sequences back to back; cu_seqlens_q
    and cu_seqlens_k (int32, (B + 1,)) give where each starts; max_seqlen_q / max_seqlen_k bound
    their lengths. One launch covers every sequence (tiles past a sequence's end exit at once);
    zero-length sequences are legal. causal is bottom-right aligned per sequence, and every
    variant (window, softcap, ALiBi, sinks, score_mod with q_idx / kv_idx counted within the
    sequence, mask_mod) applies per sequence; dropout keys on each sequence's own (b, h, row,
    col). Returns out (total_q, H, d); with return_lse also L (H, total_q), differentiable;
    return_attn_probs=True returns (out, L, None).
    """
    return_attn_probs = check_flag("return_attn_probs", return_attn_probs)
    cu_q, cu_k, table = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    dropout_p, softmax_scale, causal, return_lse, deterministic = _check_options(
        dropout_p, softmax_scale, causal, return_lse, deterministic, version, q.shape[-1])
    batch, heads = cu_q.numel() - 1, q.shape[1]
    call = variant_call(q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks, score_mod=score_mod, mask_mod=mask_mod,
                        sizes=(batch, max_seqlen_q, heads, max_seqlen_k))
    varlen = (cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    if table is not None:
        out, slots = _varlen_paged_run(call, q, k, v, varlen, table, dropout_p, softmax_scale, causal, version)
        return _varlen_result(out, slots, cu_q, q.shape[0], q.shape[-1], return_lse, return_attn_probs)
    q, k, v, head_dim = _padded_head_dim(q, k, v)
    q, k, v = aligned_rows(q), aligned_rows(k), aligned_rows(v)
    out, slots = _varlen_run(call, q, k, v, varlen, dropout_p, softmax_scale, causal, version, deterministic)
    return _varlen_result(out, slots, cu_q, q.shape[0], head_dim, return_lse, return_attn_probs)


def _varlen_result(out, slots, cu_q, total_q: int, head_dim: int, return_lse: bool, return_attn_probs: bool):
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    if not (return_lse or return_attn_probs):
        return out
    lse = packed_lse(slots, cu_q, total_q)
    return (out, lse, None) if return_attn_probs else (out, lse)


@torch.compiler.disable
def _varlen_paged_run(call, q, k, v, varlen, table, dropout_p, softmax_scale, causal, version):
    """Packed queries over a paged K/V cache: forward only, as in flash-attn (its backward does not
    take a block table). Inputs that require grad still run, as in flash-attn: only a backward
    raises. A head_dim that is not a multiple of 8 reads a zero-padded copy of the cache, as
    flash-attn does (softmax_scale comes from the true d: _check_options)."""
    if dropout_p > 0 or version != 2:
        raise InputError(f"flash_attn_varlen_func with a block_table runs FlashAttention-2 without dropout; got "
                         f"dropout_p={dropout_p}, version={version}")
    try:
        spec = Spec.for_kv_cache(q.shape[2] + -q.shape[2] % HEAD_DIM_MULTIPLE, TORCH_DTYPES[q.dtype], causal=causal,
                                 page_size=k.shape[1], varlen=True, **(call.spec_fields if call else {}))
    except ValueError as exc:   # sinks (the decoding kernels take no sinks)
        raise InputError(f"fagen: with a block_table, {exc}") from None

    def run():
        q_kernel, k_cache, v_cache, _ = _padded_head_dim(q, k, v)
        return attention_kernels.forward_kv_cache(source_for(spec), aligned_rows(q_kernel), k_cache, v_cache, None,
                                                  seqlen_k=varlen[3], block_table=table, softmax_scale=softmax_scale,
                                                  variant=call.values if call else None, varlen=varlen)
    return run_forward_only("flash_attn_varlen_func with a block_table", run, (q, k, v))


@torch.compiler.disable
def _varlen_run(call, q, k, v, varlen, dropout_p, softmax_scale, causal, version, deterministic):
    try:
        spec = Spec(head_dim=q.shape[2], dtype=TORCH_DTYPES[q.dtype], version=version,
                    mask="causal" if causal else "none", dropout=dropout_p > 0, deterministic=deterministic,
                    varlen=True, **(call.spec_fields if call else {}))
    except ValueError as exc:
        raise InputError(f"fagen: {exc}") from None
    spec = tuning.lookup(spec, seqlen_q=max(1, varlen[2]), seqlen_k=max(1, varlen[3]),
                         batch=max(1, varlen[0].numel() - 1), heads=q.shape[1], device=q.device)
    return variant_attention.run(source_for(spec), call, q, k, v, None, _philox_state(dropout_p, q.device),
                                 dropout_p, softmax_scale, varlen=varlen)


def _lse_from_stats(row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """FlashAttention-1's (m, l) as L = m + log l, with +inf for rows that saw no key (l = 0)."""
    lse = row_max + torch.log(row_sum)
    return torch.where(row_sum > 0, lse, torch.full_like(lse, math.inf))


def attention(q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, seqlens_k=None, return_lse=False, sinks=None, score_mod=None, mask_mod=None,
              deterministic=False, version=2):
    """Like `flash_attn_func`, in PyTorch's layout: q (B, H, Nq, d), k and v (B, Hk, Nk, d)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise InputError(f"{name} must have 4 dims (batch, heads, seqlen, head_dim), got shape "
                             f"{tuple(t.shape)}")
    result = flash_attn_func(*(t.transpose(1, 2) if isinstance(t, torch.Tensor) else t for t in (q, k, v)),
                             dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                             seqlens_k=seqlens_k, return_lse=return_lse, sinks=sinks, score_mod=score_mod,
                             mask_mod=mask_mod, version=version)
    if return_lse:
        return result[0].transpose(1, 2), result[1]
    return result.transpose(1, 2)


def run_generated(spec: Spec, source_path, sha256: str, q, k, v, *, softmax_scale=None,
                  seqlens_k=None, dropout_p=0.0, return_lse=False):
    """Entry point of the op modules `fagen build` writes: a fixed spec and its own .cu file."""
    if spec.has_mods:
        raise InputError(f"{spec.name} is a variant: its op module cannot pass the variant's arguments yet; "
                         f"call fagen.flash_attn_func with window_size/softcap/alibi_slopes/sinks instead")
    if TORCH_DTYPES.get(getattr(q, "dtype", None)) != spec.dtype or getattr(q, "shape", (0,))[-1] != spec.head_dim:
        raise InputError(f"{spec.name} takes {spec.dtype} inputs with head_dim {spec.head_dim}, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} with shape {tuple(getattr(q, 'shape', ()))}")
    if (seqlens_k is not None) != spec.key_padding:
        raise InputError(f"{spec.name} {'needs' if spec.key_padding else 'takes no'} seqlens_k")
    if (check_dropout_p(dropout_p) > 0) != spec.dropout:
        raise InputError(f"{spec.name} was built {'with' if spec.dropout else 'without'} dropout; "
                         f"dropout_p must be {'> 0' if spec.dropout else '0'}, got {dropout_p}")
    return _attention(q, k, v, dropout_p, softmax_scale, spec.causal, seqlens_k, return_lse, spec.deterministic,
                      spec.version, generated_sources.module_source(spec, source_path, sha256))

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

import torch

from .. import tuning
from ..errors import InputError
from ..kernels import run as attention_kernels
from ..kernels import sources as generated_sources
from ..kernels.render import Source, source_for
from ..spec import Spec, check_dropout_p
from . import autograd
from .common import (TORCH_DTYPES, aligned_rows, check_flag, check_inputs, check_options, padded_head_dim,
                     philox_state, refuse_graph_capture)
from .variant_args import VariantCall, variant_call

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
    Never traced, so it makes a compiled call's CUDA-graph check (see philox_state)."""
    if rng is not None:
        refuse_graph_capture(q.device)
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

# -- public API --------------------------------------------------------------------------------

def _attention(q, k, v, dropout_p, softmax_scale, causal, seqlens_k, return_lse, deterministic, version,
               module_source, variant=None):
    check_inputs(q, k, v, seqlens_k)
    dropout_p, softmax_scale, causal, return_lse, deterministic = check_options(
        dropout_p, softmax_scale, causal, return_lse, deterministic, version, q.shape[-1])  # the true d's scale
    call = variant_call(q, k, causal=causal, **variant) if variant else None
    q, k, v, head_dim = padded_head_dim(q, k, v)
    if seqlens_k is not None:
        seqlens_k = seqlens_k.contiguous()  # the kernels index it as a plain array
    if call is not None:
        out, lse = _variant_run(call, q, k, v, seqlens_k, dropout_p, softmax_scale, causal, version, deterministic)
    else:
        out, stat, row_sum = _run(q, k, v, seqlens_k, philox_state(dropout_p, q.device), dropout_p,
                                  softmax_scale, causal, version, deterministic, module_source)
        lse = None if not return_lse else (stat if version == 2 else attention_kernels.lse_from_stats(stat, row_sum))
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
    return autograd.run(source_for(spec), call, q, k, v, seqlens_k, philox_state(dropout_p, q.device),
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

"""The one autograd path of every attention call: dense, variant and packed sequences.

Eager calls run `Attention` (a torch.autograd.Function: a few microseconds cheaper per call than
the dispatcher); traced calls (torch.compile) run the custom ops `fagen::attention_fwd` and
`fagen::attention_bwd`, with fake implementations and the same backward registered through
`register_autograd`. Both run `forward_kernels` / `backward_kernels` on a call's options and
values (`call.py`).

The forward saves O and the statistics, never P or the dropout mask, which the backward kernels
regenerate bit for bit from the saved Philox pair. It returns O and L = logsumexp of each row's
scores, which takes part in autograd: dL enters the backward as D - dL (dS = P (dP - (D - dL))).
The variant's tensors are autograd inputs too: sinks get -sum P_sink (D - dL), a captured tensor
the score_mod reads (when it requires grad) what the backward kernel accumulates for it.
"""

from __future__ import annotations

import torch

from ..kernels import attention_kernels
from .call import CallOptions, CallValues, params_tensor, source_for_call, unpack
from .common import aligned_rows, refuse_graph_capture

FIXED_TENSORS = 4   # seqlens_k, rng, cu_seqlens_q, cu_seqlens_k lead the tensors list


def _varlen_sizes(options: CallOptions, tensors: list, ints: list):
    return (tensors[2].shape[0] - 1, ints[0], ints[1]) if options.varlen else None


class Prepared:
    """What a call's forward and backward share: its options and values, its kernel arguments
    (`unpack`), its kernels (`source_for_call`) and, for a call without tensors of its own, the
    memo of its launch plans (`attention_kernels.Memo`). Found once per eager call, or kept with a reusable
    call's signature (dense.DenseCall)."""

    __slots__ = ("options", "tensors", "floats", "ints", "params", "args", "source", "memo", "kernel_args")

    def __init__(self, options: CallOptions, q, k, values: CallValues, memo=None):
        self.options, self.tensors, self.floats, self.ints, self.params = (
            options, values.tensors, values.floats, values.ints, values.params)
        self.args = unpack(options, values.tensors, values.floats, values.ints, values.params)
        self.source = source_for_call(options, q, k, _varlen_sizes(options, values.tensors, values.ints))
        self.memo = memo
        # What both passes give `attention_kernels.forward` / `.backward` (dropout's Philox pair aside), as
        # keywords built once: a warm call passes them in one step.
        args = self.args
        self.kernel_args = dict(softmax_scale=args["softmax_scale"], seqlens_k=args["seqlens_k"],
                                variant_values=args["variant_values"], varlen=args["varlen"], memo=memo)


def forward_kernels(prepared: Prepared, q, k, v):
    """Run a call's forward on q, k, v (rows aligned: common.aligned_rows). Returns (out, lse,
    fa1_stats) with fa1_stats (2, B, H, Nq) = (m, l) for FlashAttention-1 (its backward's
    statistics), None for version 2."""
    rng = prepared.args["rng"]
    if prepared.memo is not None:   # a reusable call (dense.DenseCall): q, k and v are all it passes
        out, *stats = prepared.memo.forward(prepared.source, q, k, v, prepared.args["softmax_scale"])
    elif rng is None:
        out, stats = attention_kernels.forward(prepared.source, q, k, v, **prepared.kernel_args)
    else:
        refuse_graph_capture(q.device)   # never traced: a compiled call is checked on every run
        seed, offset = rng.tolist()   # a CPU tensor: no sync
        out, stats = attention_kernels.forward(prepared.source, q, k, v, dropout_p=prepared.args["dropout_p"],
                                               seed=seed, philox_offset=offset, **prepared.kernel_args)
    if prepared.options.version == 2:
        return out, stats[0], None
    return out, attention_kernels.lse_from_stats(*stats), torch.stack(stats)


def backward_kernels(prepared: Prepared, dout, dlse, q, k, v, out, lse, fa1_stats):
    """Run a call's backward (q, k, v with aligned rows, as forward_kernels took them). Returns
    (dq, dk, dv, grads) with grads one per tensor of the call (None where it gets none)."""
    args, tensors = prepared.args, prepared.tensors
    stats = (lse,) if prepared.options.version == 2 else tuple(fa1_stats)
    dout = torch.zeros_like(out) if dout is None else aligned_rows(dout)
    if prepared.memo is not None and dlse is None:   # a reusable call (dense.DenseCall), L unused
        dq, dk, dv = prepared.memo.backward(prepared.source, q, k, v, out, stats, dout, args["softmax_scale"])
        return dq, dk, dv, [None] * len(tensors)
    drop = None if args["rng"] is None else attention_kernels.dropout_args(args["dropout_p"], *args["rng"].tolist())
    extras = {} if args["variant_values"] else None   # only a variant has gradients beyond dq, dk, dv
    dq, dk, dv = attention_kernels.backward(prepared.source, q, k, v, out, stats, dout, dropout_args=drop, dlse=dlse,
                                            extras=extras, **prepared.kernel_args)
    if not extras:   # no variant gradients: the common call
        return dq, dk, dv, [None] * len(tensors)
    names = prepared.options.variant_names[0]
    grads = [None] * FIXED_TENSORS + [_gradient(name, extras, t) for name, t in zip(names, tensors[FIXED_TENSORS:])]
    return dq, dk, dv, grads


def _gradient(name: str, extras: dict, tensor: torch.Tensor) -> torch.Tensor | None:
    found = extras.get("dsinks" if name == "sinks" else f"{name}_grad")
    return None if found is None else found.to(tensor.dtype)


class Attention(torch.autograd.Function):
    """Eager calls: inputs q, k, v, the call's `Prepared` (its fixed tensors ride in it, as they
    take no gradient), then the variant's tensors (autograd inputs: sinks and captured tensors
    get gradients); outputs O and L."""

    @staticmethod
    def forward(ctx, q, k, v, prepared, *variant_tensors):
        out, lse, fa1_stats = forward_kernels(prepared, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, fa1_stats, *variant_tensors)
        ctx.prepared = prepared
        ctx.set_materialize_grads(False)   # an unused L gets no gradient, not zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        saved = ctx.saved_tensors   # q, k, v, out, lse, fa1_stats, then the variant's tensors
        dq, dk, dv, grads = backward_kernels(ctx.prepared, dout, dlse, *saved[:6])
        return (dq, dk, dv, None, *grads[FIXED_TENSORS:])


def _eager_apply():
    """`Attention.apply` less its Python wrapper, or None where torch lacks the hooks it needs.

    torch.autograd.Function.apply is a Python wrapper over torch's C++ apply. For `Attention` (no
    setup_context: no default arguments to bind) it only hands the call to functorch while a
    transform (vmap, grad) is active, and otherwise unwraps tensors that a finished transform
    left behind (`unwrap_if_dead`) before the C++ apply. `run` does those two steps itself: a
    warm forward + backward spends ~3 us less on the host (benchmarks/call_overhead.py)."""
    transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
    unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    if transforms_active is None or unwrap_if_dead is None:
        return None
    cpp_apply = super(torch.autograd.Function, Attention).apply   # torch._C._FunctionBase's, bound to Attention

    def apply(q, k, v, prepared, *variant_tensors):
        if transforms_active():   # functorch's path, and its error: Attention has no setup_context
            return Attention.apply(q, k, v, prepared, *variant_tensors)
        return cpp_apply(unwrap_if_dead(q), unwrap_if_dead(k), unwrap_if_dead(v), prepared,
                         *map(unwrap_if_dead, variant_tensors))
    return apply


_apply = _eager_apply() or Attention.apply


# -- the custom ops (what torch.compile traces) ---------------------------------------------------

@torch.library.custom_op("fagen::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor], floats: list[float],
                  ints: list[int], params: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = aligned_rows(q), aligned_rows(k), aligned_rows(v)
    out, lse, fa1_stats = forward_kernels(Prepared(CallOptions.from_key(key), q, k,
                                                   CallValues(tensors, floats, ints, params)), q, k, v)
    return out, lse, (lse.new_empty(0) if fa1_stats is None else fa1_stats)


@attention_fwd.register_fake
def _(q, k, v, tensors, floats, ints, params, key):
    options = CallOptions.from_key(key)
    if options.varlen:   # q (total, H, d); statistics in (B, H, max_seqlen_q) slots
        rows = (tensors[2].shape[0] - 1, q.shape[1], ints[0])
    else:
        rows = (q.shape[0], q.shape[2], q.shape[1])
    f32 = dict(dtype=torch.float32)
    fa1 = q.new_empty(2, *rows, **f32) if options.version == 1 else q.new_empty(0, **f32)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])   # d_v columns (contiguous, as the kernels write it)
    return out, q.new_empty(*rows, **f32), fa1


@torch.library.custom_op("fagen::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, fa1_stats: torch.Tensor, tensors: list[torch.Tensor],
                  floats: list[float], ints: list[int], params: torch.Tensor,
                  key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    q, k, v = aligned_rows(q), aligned_rows(k), aligned_rows(v)
    prepared = Prepared(CallOptions.from_key(key), q, k, CallValues(tensors, floats, ints, params))
    dq, dk, dv, grads = backward_kernels(prepared, dout, dlse if dlse.numel() else None, q, k, v, out, lse,
                                         fa1_stats if fa1_stats.numel() else None)
    return dq, dk, dv, [t.new_empty(0) if g is None else g for g, t in zip(grads, tensors)]


@attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, fa1_stats, tensors, floats, ints, params, key):
    options = CallOptions.from_key(key)
    grad_names = set(_grad_names(options))
    names = (None,) * FIXED_TENSORS + options.variant_names[0]
    fresh = dict(memory_format=torch.contiguous_format)
    grads = [torch.empty_like(t) if name in grad_names else t.new_empty(0) for name, t in zip(names, tensors)]
    return torch.empty_like(q, **fresh), torch.empty_like(k, **fresh), torch.empty_like(v, **fresh), grads


def _grad_names(options: CallOptions) -> list:
    """The variant's tensors that receive a gradient: sinks, and captures whose gradient the
    backward kernel accumulates."""
    spec = options.spec()
    names = ["sinks"] if spec.sinks else []
    if spec.score_mod is not None:
        names += [f"score_cap{i}" for i, grad in enumerate(spec.score_mod.grads) if grad]
    return names


def _setup_context(ctx, inputs, output):
    q, k, v, tensors, floats, ints, params, key = inputs
    out, lse, fa1_stats = output
    ctx.save_for_backward(q, k, v, out, lse, fa1_stats, params, *tensors)
    ctx.fixed = (floats, ints, key)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, dfa1):
    q, k, v, out, lse, fa1_stats, params, *tensors = ctx.saved_tensors
    floats, ints, key = ctx.fixed
    dlse = lse.new_empty(0) if dlse is None else dlse
    dq, dk, dv, grads = attention_bwd(dout, dlse, q, k, v, out, lse, fa1_stats, tensors, floats, ints, params, key)
    return dq, dk, dv, [g if g.numel() else None for g in grads], None, None, None, None


torch.library.register_autograd("fagen::attention_fwd", _backward, setup_context=_setup_context)


def run(options: CallOptions, q, k, v, values: CallValues, prepared: Prepared | None = None, aligned: bool = False):
    """(out, L) of a call, with autograd where anything requires grad: the custom ops when traced,
    `Attention` eagerly, the kernels alone without autograd. `prepared`: the call's own, kept
    with a reusable call's signature (else found here). `aligned`: the caller has checked that q,
    k and v's rows are (common.aligned_rows). Whether torch.compile traces is asked here, never
    inferred from the arguments: dynamo may trace this frame on its own, called from an eager one."""
    if torch.compiler.is_compiling():
        out, lse, _ = attention_fwd(q, k, v, values.tensors, values.floats, values.ints,
                                    params_tensor(values.params), options.key())
        return out, lse
    if not aligned:   # once: the backward takes the same
        q, k, v = aligned_rows(q), aligned_rows(k), aligned_rows(v)
    prepared = prepared or Prepared(options, q, k, values)
    variant_tensors = values.tensors[FIXED_TENSORS:]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or any(t.requires_grad for t in variant_tensors)):
        return _apply(q, k, v, prepared, *variant_tensors)
    return forward_kernels(prepared, q, k, v)[:2]

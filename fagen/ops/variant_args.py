"""A call's variant arguments, checked: flash-attn 2.8's window_size, softcap and
alibi_slopes, sinks, and FlexAttention-style score_mod / mask_mod.

`variant_call(...)` returns None for plain attention, else a `VariantCall`: the Spec fields
of the variant (which kernels to build: only the presence of each feature, never a value),
the kernels' run-time arguments by parameter name (values never cause a recompile), and
the tensors that receive gradients (sinks, floating tensors a score_mod captures that
require grad). Every error names the argument and what was expected.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..variants.builtins import BUILTINS, CallShape
from ..variants.compose import custom_mod, mod_expression
from ..variants.free_values import describe, has_opaque
from ..variants.language import ModError, trace_mod, traced_structure
from ..variants.tiles import SUMMARY_ROWS, summaries


@dataclass
class VariantCall:
    spec_fields: dict                                  # flags, and mods as their JSON (CustomMod.to_dict)
    values: dict = field(default_factory=dict)         # the kernels' arguments by parameter name
    kinds: dict = field(default_factory=dict)          # each value's kind: "tensor", "float", "int", "param"
    grad_tensors: list = field(default_factory=list)   # autograd inputs beyond q, k, v
    grad_names: list = field(default_factory=list)     # where backward's extras hold their gradients

    def put(self, name: str, value, kind: str) -> None:
        self.values[name], self.kinds[name] = value, kind


# A built-in's value kind (VariantCall.kinds) by its kernel parameter's launcher kind.
_KINDS = {"int32": "int", "float32": "float", "tensor": "tensor"}


def _captures(prefix: str, tensors, q, call: VariantCall) -> None:
    for i, tensor in enumerate(tensors):
        name = f"{prefix}_cap{i}"
        if tensor.device != q.device:
            raise InputError(f"{prefix}_mod captures a tensor on {tensor.device}; captured tensors must be on "
                             f"q's device {q.device}")
        graded = prefix == "score" and tensor.requires_grad and tensor.is_floating_point()
        # A tensor that gets a gradient stays the caller's (an autograd input of the call);
        # its strides follow from it (kernels.params.variant_arguments).
        call.put(name, tensor.contiguous() if graded else tensor.detach().contiguous(), "tensor")
        if graded:
            call.grad_tensors.append(tensor)
            call.grad_names.append(f"{name}_grad")


def variant_call(q, k, *, causal: bool, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                 score_mod=None, mask_mod=None, sizes=None) -> VariantCall | None:
    """`sizes` = (batch, seqlen_q, heads, seqlen_k) where q and k are not (B, N, H, d) (packed sequences:
    the maxima)."""
    shape = CallShape(q, causal, *(sizes or (*q.shape[:3], k.shape[1])))
    given = {"window": window_size, "softcap": softcap, "alibi": alibi_slopes, "sinks": sinks}
    values = {row.flag: row.check(given[row.flag], shape) for row in BUILTINS}   # every argument checked
    if not any(values.values()) and score_mod is None and mask_mod is None:
        return None
    call = VariantCall({row.flag: values[row.flag] is not None for row in BUILTINS})
    for row in BUILTINS:
        for name, value in (values[row.flag] or {}).items():
            call.put(name, value, _KINDS[row.params[[p[0] for p in row.params].index(name)][2]])
        if row.grad and values[row.flag] is not None and given[row.flag].requires_grad:
            call.grad_tensors.append(given[row.flag])
            call.grad_names.append(row.grad)
    if score_mod is not None:
        _mod("score", score_mod, q, call)
    if mask_mod is not None:
        _summaries(call, _mod("mask", mask_mod, q, call))
    return call


def _mod(prefix: str, fn, q, call: VariantCall) -> tuple:
    """A score_mod or mask_mod: its canonical form (traced once per signature), its captured
    tensors and the numbers it reads from its closure or globals, as kernel arguments. Returns
    the (capture, dim) of each summary its mask needs (`_summaries`)."""
    signature, free = describe(fn)
    found = mod_key(prefix, signature)
    if found is not None:
        mod_json, capture_slots, param_slots, summary_dims = found
        tensors, params = [free[s] for s in capture_slots], [free[s] for s in param_slots]
    else:   # the mod uses a free value structurally: traced as it is, its numbers baked
        if torch.compiler.is_compiling():
            raise ModError(f"{prefix}_mod uses a number or tensor of its closure as Python control flow, a "
                           f"Python index or a tensor it transforms, or keeps an object fagen cannot describe: "
                           f"under torch.compile its free variables must be used as values (arithmetic, "
                           f"indexing captured tensors)")
        traced, free = trace_mod(prefix, fn)
        mod_json, tensors, params = _mod_json(traced), traced.tensors, [free[s] for s, _ in traced.params]
        summary_dims = _summary_dims(custom_mod(traced))
    call.spec_fields[f"{prefix}_mod"] = mod_json
    _captures(prefix, tensors, q, call)
    for i, value in enumerate(params):
        call.put(f"{prefix}_par{i}", value, "param")
    return summary_dims


@functools.lru_cache(maxsize=1024)
def _mod_key(kind: str, signature: tuple):
    traced = traced_structure(kind, signature)
    if traced is None:
        return None
    return (_mod_json(traced), traced.capture_slots, tuple(slot for slot, _ in traced.params),
            _summary_dims(custom_mod(traced)) if kind == "mask" else ())


@torch._dynamo.assume_constant_result
def mod_key(kind: str, signature: tuple):
    """(the mod's JSON, its captures' and lifted numbers' slots among its free values) for a mod's
    signature, or None where the signature cannot stand for the mod (an opaque object among its
    free variables, or a free value used structurally). A constant to torch.compile: traced
    once per signature, so a new closure of the same code recompiles nothing."""
    if has_opaque(signature):
        return None
    try:
        return _mod_key(kind, signature)
    except TypeError:   # an unhashable part (a list default argument): traced as it is
        return None


def _mod_json(traced) -> str:
    return json.dumps(custom_mod(traced).to_dict())


def _summary_dims(mod) -> tuple:
    """(capture, dim) of each summary a mask's tile classes read (tiles.Summary)."""
    return tuple((s.capture, s.dim) for s in summaries(mod_expression(mod, "mask")))


def _summaries(call: VariantCall, summary_dims: tuple) -> None:
    """Per-group (16 rows) min and max of each captured tensor whose equality across q_idx and
    kv_idx the tile classes use (document ids): O(N / 16) work on the tensor's device."""
    for capture, dim in summary_dims:
        ids = call.values[capture]   # int32 ids unless the capture holds int64 (variants.cuda.summary_ctype)
        ids = (ids.long() if ids.dtype == torch.int64 else ids.int()).movedim(dim, -1)
        pad = -ids.shape[-1] % SUMMARY_ROWS
        if pad:   # the last group repeats its last id: no id that is not there
            ids = torch.cat([ids, ids[..., -1:].expand(*ids.shape[:-1], pad)], dim=-1)
        groups = ids.reshape(*ids.shape[:-1], -1, SUMMARY_ROWS)
        low, high = (x.movedim(-1, dim).contiguous() for x in (groups.amin(-1), groups.amax(-1)))
        call.put(f"{capture}_gmin", low, "tensor")   # group counts and strides: call.derived_values
        call.put(f"{capture}_gmax", high, "tensor")

"""A call's options and values: the one place a Spec is built from call arguments, and the flat
form in which every attention call (dense, variant, packed sequences) reaches the kernels.
Dense and packed calls build theirs from `CallOptions.spec()`, decoding steps and packed queries
over a paged cache from `decoding_spec`, the ring's pairs from `CallOptions.spec()` too
(`source_at_spec_tiles`); all take their kernel family from the self-test's gate
(fagen.selftest.gate.serving_spec).

`CallOptions` (frozen) holds what selects kernels and nothing else; `spec()` builds the Spec,
and `source_for_call` adds the tiles the tuning cache (or the fallback table) gives the call's
shapes. `CallValues` holds the rest, in the forms a torch custom op takes:

  tensors   seqlens_k, the Philox pair, cu_seqlens_q / _k (each an empty tensor when absent),
            then the variant's tensors (ALiBi slopes, sinks, captured tensors, summaries)
  floats    softmax_scale, dropout_p, then the variant's floats (softcap)
  ints      max_seqlen_q / _k of packed sequences (0 otherwise), then the variant's ints (window)
  params    the mods' lifted numbers (closure and global constants), one float64 CPU tensor: a
            changed constant is a new value, never a recompile (Dynamo specializes a custom op's
            float and int arguments, not tensors)

The variant's values are named by `CallOptions.variant_names`, in the order above; strides and
the other values derived from its tensors are computed from them (`derived_values`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from ..dtypes import DTYPE_NAME
from .. import tuning
from ..arch_families import ARCH_FAMILY_ENV
from ..environment import raw_settings, setting, setting_keys
from ..errors import InputError
from ..kernels import launch, sources as generated_sources
from ..kernels.compile import spec_target
from ..kernels.render import Source, source_for
from ..kernels.spill_free import spill_free
from ..selftest.gate import GENERATION as SELFTEST_GENERATION, SELFTEST_ENV, check_fixed_spec, serving_spec
from ..spec import CustomMod, Spec
from .common import padded_width

NOTHING = torch.empty(0)
NO_NAMES = ((), (), (), ())   # CallOptions.variant_names of a call without a variant   # the tensors list's stand-in for an absent tensor (on the CPU: never read)


@dataclass(frozen=True)
class CallOptions:
    head_dim: int                  # the kernels' (padded to a multiple of 8)
    dtype: str
    version: int = 2
    causal: bool = False
    key_padding: bool = False
    dropout: bool = False
    deterministic: bool = False
    varlen: bool = False
    variant: tuple = ()            # sorted (Spec field, value): flags, and mods as their JSON
    variant_names: tuple = NO_NAMES   # names of the variant's tensors, floats, ints, params
    module_source: str = ""        # a generated op module's .cu (its own, fixed spec)
    head_dim_v: int = 0            # v's, padded as head_dim is; 0: head_dim's

    def spec(self) -> Spec:
        return _spec_of(self)

    def key(self) -> str:
        """The options as one string: the compiled path's custom ops take this."""
        return call_key(_key_parts(self))

    @staticmethod
    def from_key(key: str) -> "CallOptions":
        return _options_of(key)


def _key_parts(options: CallOptions) -> tuple:
    return (options.head_dim, options.dtype, options.version, options.causal, options.key_padding,
            options.dropout, options.deterministic, options.varlen, options.variant, options.variant_names,
            options.module_source, options.head_dim_v)


@torch._dynamo.assume_constant_result
def call_key(parts: tuple) -> str:
    """JSON of an options tuple (`_key_parts`): a constant to torch.compile, so the key is
    built at trace time, never in the graph."""
    return json.dumps(parts)


@functools.lru_cache(maxsize=1024)
def _options_of(key: str) -> CallOptions:
    (head_dim, dtype, version, causal, key_padding, dropout, deterministic, varlen, variant, names,
     module_source, head_dim_v) = json.loads(key)
    return CallOptions(head_dim, dtype, version, causal, key_padding, dropout, deterministic, varlen,
                       tuple(tuple(item) for item in variant), tuple(tuple(group) for group in names), module_source,
                       head_dim_v)


@functools.lru_cache(maxsize=1024)
def _spec_of(options: CallOptions) -> Spec:
    """The only place a Spec is built from a call (tiles unset: source_for_call picks them)."""
    fields = {name: (CustomMod.from_dict(json.loads(value)) if isinstance(value, str) else value)
              for name, value in options.variant}
    try:
        return Spec(head_dim=options.head_dim, dtype=options.dtype, version=options.version,
                    mask="causal" if options.causal else "none", key_padding=options.key_padding,
                    dropout=options.dropout, deterministic=options.deterministic, varlen=options.varlen,
                    head_dim_v=options.head_dim_v or None, **fields)
    except ValueError as exc:   # e.g. a combination the family refuses
        raise InputError(f"fagen: {exc}") from None


def decoding_spec(head_dim: int, dtype: str, causal: bool, page_size: int | None, fields: dict, device, *,
                  shared_limit: int | None = None, varlen: bool = False, served: bool = True,
                  refusal: str | None = None) -> Spec:
    """The kv_cache Spec of a decoding step (ops.kvcache) or of packed queries over a paged cache
    (ops.varlen): Spec.for_kv_cache, its tiles fitted to `shared_limit` (a GPU's shared memory per
    block), in the family that serves it on `device` (selftest.gate.serving_spec, as every call's);
    `served` False: before that choice (what the GPU check precompiles). Built once per distinct
    call: a Spec validates itself, which costs more than the rest of a warm call. With `refusal`, a
    Spec that refuses its fields raises InputError, the refusal's words after it."""
    try:
        spec = _decoding_spec(head_dim, dtype, causal, page_size, tuple(sorted(fields.items())), shared_limit,
                              varlen)
    except ValueError as exc:
        if refusal is None:
            raise
        raise InputError(f"fagen: {refusal}{exc}") from None
    return serving_spec(spec, device, decoding=True) if served else spec


@functools.lru_cache(maxsize=256)
def _decoding_spec(head_dim: int, dtype: str, causal: bool, page_size: int | None, fields: tuple,
                   shared_limit: int | None, varlen: bool) -> Spec:
    return Spec.for_kv_cache(head_dim, dtype, causal=causal, page_size=page_size, shared_limit=shared_limit,
                             varlen=varlen, **dict(fields))


_call_sources: dict[tuple, tuple[int, Source]] = {}
MAX_CALL_SHAPES = 4096


def kernels_generation(device: torch.device) -> tuple[int, str]:
    """What a memo of a call's kernels must match: the tuning cache's generation (a new tuning
    result invalidates it; CPU calls never read the tuning cache), the kernel family asked
    for (FAGEN_ARCH_FAMILY), and the self-test's switch and verdicts (fagen.selftest.gate)."""
    return _generation(device.type == "cuda")


def _generation(cuda: bool) -> tuple:
    return (tuning.cache.INDEX.current_generation() if cuda else 0, setting(ARCH_FAMILY_ENV), setting(SELFTEST_ENV),
            SELFTEST_GENERATION[0])


_CPU_STATE = setting_keys(ARCH_FAMILY_ENV, SELFTEST_ENV, *launch.BACKEND_SETTINGS)


def kernels_state(cuda: bool) -> tuple:
    """What a kept call's kernels and launch plans (dense.DenseCall's) depend on beyond the call,
    on a CUDA device or (cuda False) the CPU: `kernels_generation`, and on the CPU what
    `launch.backend_key` reads (the emulator build's settings, raw, and whether counters are
    collected). Read in one step on every warm call; a change starts the call's plans over."""
    if cuda:
        return _generation(True)
    return raw_settings(_CPU_STATE), launch.counters_collected(), SELFTEST_GENERATION[0]


def compiled_arch(device: torch.device) -> str | None:
    """The arch a call's kernels compile for where it matters to the spec (a mod's spill-free tiles,
    `spill_free`): the GPU's; None on the CPU, whose emulator compiles for the host. (A seam: the
    GPU check's recorder, fagen.kernel_record, answers for the GPU it records for.)"""
    return launch.arch_of(device) if device.type == "cuda" else None


def source_for_call(options: CallOptions, q, k, varlen_sizes=None) -> Source:
    """The kernels for a call: its Spec with the tiles the tuning cache (or the fallback table)
    gives its shapes, in the kernel family that serves it on this device (fagen.selftest.gate:
    FAGEN_ARCH_FAMILY's, a tuning's, or sm90 on Hopper where its self-test passed); a dict lookup
    once a call of this shape has been seen."""
    if options.module_source:   # a generated op module: its own .cu file, its fixed spec
        source = generated_sources.source_of(options.module_source)
        check_fixed_spec(source.spec, q.device)   # no other family can serve it: a failed template raises
        return source
    on_gpu = q.device.type == "cuda"
    generation = kernels_generation(q.device)
    key = (options, q.shape, k.shape, q.device, varlen_sizes)
    hit = _call_sources.get(key)
    if hit is not None and hit[0] == generation:
        return hit[1]
    if varlen_sizes is None:   # empty problems (batch, Nq or Nk of 0) pick tiles of the smallest bucket
        sizes = dict(seqlen_q=max(1, q.shape[1]), seqlen_k=max(1, k.shape[1]), batch=max(1, q.shape[0]),
                     heads=q.shape[2])
    else:
        batch, max_q, max_k = varlen_sizes
        sizes = dict(seqlen_q=max(1, max_q), seqlen_k=max(1, max_k), batch=max(1, batch), heads=q.shape[1])
    spec = serving_spec(tuning.lookup(options.spec(), **sizes, device=q.device), q.device,
                        tuned=on_gpu and tuning.is_tuned(options.spec(), **sizes, device=q.device))
    arch = compiled_arch(q.device)
    if arch is not None and (spec.score_mod is not None or spec.mask_mod is not None):   # spilling mods: smaller tiles
        spec = spill_free(spec, spec_target(spec, arch))
    source = source_for(spec)
    if len(_call_sources) >= MAX_CALL_SHAPES:   # many distinct shapes: start over, stay bounded
        _call_sources.clear()
    _call_sources[key] = (generation, source)
    return source


def source_at_spec_tiles(options: CallOptions, device) -> Source:
    """The kernels of `options` at their Spec's own tiles (no tuning lookup), in the family that
    serves them on `device`: the ring's pairs (fagen.distributed.ring_ops)."""
    return source_for(serving_spec(options.spec(), device))


@dataclass
class CallValues:
    tensors: list       # seqlens_k, rng, cu_seqlens_q, cu_seqlens_k, then the variant's
    floats: list        # softmax_scale, dropout_p, then the variant's
    ints: list          # max_seqlen_q, max_seqlen_k, then the variant's
    params: list        # the mods' lifted numbers (Python numbers eagerly; graph values when traced)


def values_of(options: CallOptions, *, seqlens_k, rng, varlen, softmax_scale: float, dropout_p: float,
              variant_values: dict | None) -> CallValues:
    """A call's values in the order `options` names them (`variant_values`: the variant's, by name)."""
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
    tensor_names, float_names, int_names, param_names = options.variant_names
    variant = variant_values or {}
    return CallValues(
        [NOTHING if t is None else t for t in (seqlens_k, rng, cu_q, cu_k)] + [variant[n] for n in tensor_names],
        [softmax_scale, dropout_p] + [variant[n] for n in float_names],
        [max_q, max_k] + [variant[n] for n in int_names],
        [variant[n] for n in param_names])


def params_tensor(params: list) -> torch.Tensor:
    """The lifted numbers as one float64 CPU tensor, built by tensor arithmetic, so that
    torch.compile keeps them graph values (`torch.tensor(list)` would specialize each)."""
    if not params:
        return NOTHING
    zero = torch.zeros((), dtype=torch.float64)
    return torch.stack([zero + p for p in params])


def unpack(options: CallOptions, tensors: list, floats: list, ints: list, params) -> dict:
    """The kernels' view of a call's values: seqlens_k, rng, varlen, softmax_scale, dropout_p
    and the variant's arguments by kernel parameter name, `variant_values` (`attention_kernels.forward`'s keywords)."""
    seqlens_k, rng, cu_q, cu_k, *variant_tensors = tensors
    softmax_scale, dropout_p, *variant_floats = floats
    max_q, max_k, *variant_ints = ints
    if options.variant_names == NO_NAMES:   # no variant: the common call, kept short
        return dict(seqlens_k=seqlens_k if options.key_padding else None, rng=rng if options.dropout else None,
                    varlen=(cu_q, cu_k, max_q, max_k) if options.varlen else None,
                    softmax_scale=softmax_scale, dropout_p=dropout_p, variant_values=None)
    tensor_names, float_names, int_names, param_names = options.variant_names
    if isinstance(params, torch.Tensor):
        params = params.tolist()   # a CPU tensor: no device sync
    variant = {**dict(zip(tensor_names, variant_tensors)), **dict(zip(float_names, variant_floats)),
               **dict(zip(int_names, variant_ints)), **dict(zip(param_names, params))}
    spec = options.spec()
    for name in param_names:   # an int parameter crosses as float64: exact below 2**53
        prefix, index = name.split("_par")
        kind = (spec.score_mod if prefix == "score" else spec.mask_mod).params[int(index)]
        variant[name] = int(variant[name]) if kind == "int" else float(variant[name])
    return dict(seqlens_k=seqlens_k if options.key_padding else None, rng=rng if options.dropout else None,
                varlen=(cu_q, cu_k, max_q, max_k) if options.varlen else None,
                softmax_scale=softmax_scale, dropout_p=dropout_p, variant_values=variant or None)


def options_for(q, *, version: int, causal: bool, key_padding: bool, dropout: bool, deterministic: bool,
                varlen: bool = False, variant_fields: dict | None = None, variant_kinds: dict | None = None,
                module_source: str = "", v=None) -> CallOptions:
    """The options of a call: its variant's Spec fields (mods as JSON) and value names by kind.
    The kernels' head dims are q's and v's rounded up to a multiple of 8 (common.padded_head_dim)."""
    head_dim = padded_width(int(q.shape[-1]))
    head_dim_v = 0 if v is None else padded_width(int(v.shape[-1]))
    return _options(head_dim, DTYPE_NAME[q.dtype], int(version), _flag(causal),
                    _flag(key_padding),
                    _flag(dropout), _flag(deterministic), _flag(varlen),
                    tuple(sorted(variant_fields.items())) if variant_fields else (),
                    _names_by_kind(variant_kinds) if variant_kinds else NO_NAMES, module_source,
                    0 if head_dim_v == head_dim else head_dim_v)


@functools.lru_cache(maxsize=1024)
def _options(*fields) -> CallOptions:
    """One CallOptions per distinct call: a warm call builds none (a frozen dataclass costs a
    few microseconds), and equal options are one object (dict lookups compare by identity)."""
    return CallOptions(*fields)


def _flag(value) -> bool:
    """A flag as a Python bool. Under torch.compile a flag computed from a graph value
    (dropout_p > 0) is symbolic, and bool() of it stays so; a branch specializes it (a guard):
    what selects kernels is never a graph value."""
    return True if value else False


def _names_by_kind(kinds: dict) -> tuple:
    return tuple(tuple(sorted(n for n, k in kinds.items() if k == kind)) for kind in ("tensor", "float", "int", "param"))

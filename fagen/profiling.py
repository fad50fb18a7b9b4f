"""`fagen profile`: how a spec's kernels use memory, counted on the CPU.

The spec's kernels run in the emulator's instrumented build on random inputs of the
given shape; every load and store is counted (fagen/emulate/instrumentation.py):
HBM bytes per tensor, 32-byte sectors per warp-level request, shared-memory
bank conflicts, mma.sync, barriers, Philox calls. Beside each pass (forward,
backward) stands the FlashAttention IO model's HBM traffic for the same shape
and tiles, from the tiled executable specifications in `fagen.reference`
(fa1/fa2 with `hbm.IOCount`): what the paper's algorithm reads and writes.
These are counts of a model machine, not timings of a GPU.

Variants run with their run-time values (flash-attn's window_size, softcap,
alibi_slopes, sinks). Softcap, ALiBi and sinks change values, never which
blocks a kernel visits, so the model's bytes stand as they are; their per-head
arrays are read by every thread (cached on a GPU) and, like the key lengths,
are left out of the comparison and listed apart. A sliding window changes
which blocks are visited: the tiled specifications skip the same blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .kernels import attention_kernels
from .kernels.render import source_for
from .dtypes import TORCH_DTYPE
from .emulate import LaunchReport, collect_counters
from .reference import fa1_backward, fa1_forward, fa2_backward, fa2_forward
from .spec import Spec
from .ops.variant_args import variant_call

# Bytes per element of each array the IO model counts: the inputs and outputs in the
# variant's 16-bit dtype, the statistics and the dQ accumulator in fp32.
FP32_ARRAYS = {"L", "m", "l", "D", "dQ"}
# Tensors the IO model has no array for: per-batch lengths and the variants' per-head values,
# read by every thread (they stay in cache on a GPU). The passes' comparison leaves them out.
NOT_IN_MODEL = {"seqlens_k", "alibi_slopes", "sinks"}
# The values `default_variant_values` gives (none changes a count): Gemma 2's attention softcap.
DEFAULT_SOFTCAP = 50.0
# Each built-in variant: its Spec field and the run-time argument that carries its value.
VARIANT_ARGUMENTS = (("window", "window_size"), ("softcap", "softcap"), ("alibi", "alibi_slopes"),
                     ("sinks", "sinks"))
DROPOUT_P = 0.1
SEED, OFFSET = 0x5EED, 0


@dataclass
class PassProfile:
    """One pass (forward or backward): its kernels' counters and the IO model's bytes."""

    name: str
    launches: list[LaunchReport]
    model_read_bytes: int
    model_write_bytes: int

    def _bytes(self, kinds: tuple[str, ...]) -> int:
        return sum(t[kind] for r in self.launches for name, t in r.tensors.items() if name not in NOT_IN_MODEL
                   for kind in kinds)

    @property
    def read_bytes(self) -> int:
        """HBM bytes read by the pass's kernels, over the arrays the IO model has."""
        return self._bytes(("read_bytes", "atomic_bytes"))

    @property
    def write_bytes(self) -> int:
        return self._bytes(("written_bytes", "atomic_bytes"))

    @property
    def left_out_bytes(self) -> dict[str, int]:
        """HBM bytes (read + written) per tensor the comparison leaves out."""
        totals: dict[str, int] = {}
        for r in self.launches:
            for name, t in r.tensors.items():
                if name in NOT_IN_MODEL:
                    totals[name] = totals.get(name, 0) + t["read_bytes"] + t["written_bytes"] + t["atomic_bytes"]
        return totals


@dataclass
class Profile:
    spec: Spec
    shape: dict
    passes: list[PassProfile] = field(default_factory=list)

    def to_json(self) -> dict:
        kernels = {}
        for p in self.passes:
            for r in p.launches:
                kernels[r.kernel] = {
                    "pass": p.name, "grid": list(r.grid), "hbm_read_bytes": r.hbm_read_bytes,
                    "hbm_write_bytes": r.hbm_write_bytes, "bank_conflicts": r.bank_conflicts,
                    "sectors_per_request": round(r.sectors_per_request, 3), "mma": r.counters["mma"],
                    "barriers": r.counters["barriers"], "philox_calls": r.counters["philox_calls"],
                    "cp_async_bytes": r.counters["cp_async_bytes"], "tensors": r.tensors, "counters": r.counters,
                }
        model = {p.name: {"model_read_bytes": p.model_read_bytes, "model_write_bytes": p.model_write_bytes,
                          "read_bytes": p.read_bytes, "write_bytes": p.write_bytes,
                          "left_out_bytes": p.left_out_bytes} for p in self.passes}
        return {"spec": self.spec.name, "shape": self.shape, "kernels": kernels, "passes": model,
                "note": "counted on the CPU emulator's model of the memory system, not timed on a GPU"}


def _model_bytes(model, dtype_bytes: int = 2) -> tuple[int, int]:
    """(read, written) bytes of a tiled specification's result (its IOCount comes last)."""
    io = model[-1]

    def size(counts):
        return sum(n * (4 if name in FP32_ARRAYS else dtype_bytes) for name, n in counts.items())

    return size(io.reads), size(io.writes)


def _tiles_spec(spec: Spec, block_m: int, block_n: int) -> Spec:
    """`spec` with other tiles for the IO model (the backward's), with any legal warp count."""
    warps = max(w for w in (1, 2, 4, 8) if block_m % (16 * w) == 0)
    return spec.replace(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=1)


def random_inputs(spec: Spec, batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPE[spec.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    q, k, v = randn(batch, seqlen_q, heads, spec.head_dim), randn(batch, seqlen_k, kv_heads, spec.head_dim), \
        randn(batch, seqlen_k, kv_heads, spec.head_dim)
    dout = randn(batch, seqlen_q, heads, spec.head_dim)
    seqlens_k = torch.full((batch,), seqlen_k, dtype=torch.int32) if spec.key_padding else None
    return q, k, v, dout, seqlens_k


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes 2^(-8 h / H) for h = 1..H (Press et al.; exact for a power-of-two H)."""
    return torch.tensor([2.0 ** (-8.0 * h / heads) for h in range(1, heads + 1)], dtype=torch.float32)


def default_variant_values(spec: Spec, heads: int) -> dict:
    """Run-time values for `spec`'s softcap, ALiBi and sinks, as `profile` keywords. None of them
    changes a count; window sizes do, so they have no default and the caller gives them."""
    values: dict = {}
    if spec.softcap:
        values["softcap"] = DEFAULT_SOFTCAP
    if spec.alibi:
        values["alibi_slopes"] = alibi_slopes(heads)
    if spec.sinks:
        values["sinks"] = torch.zeros(heads, dtype=torch.float32)
    return values


def _kernel_variant(spec: Spec, q, k, values: dict) -> dict | None:
    """The kernels' variant arguments for flash-attn-style `values`, which must give exactly the
    built-in variants `spec` was built with."""
    if spec.score_mod is not None or spec.mask_mod is not None:
        raise ValueError(f"{spec.name} has a custom score_mod or mask_mod; profile runs the built-in variants "
                         f"(window, softcap, ALiBi, sinks) only")
    call = variant_call(q, k, causal=spec.causal, **values)
    present = call.spec_fields if call is not None else {}
    for feature, argument in VARIANT_ARGUMENTS:
        if present.get(feature, False) and not getattr(spec, feature):
            raise ValueError(f"{argument} is given, but {spec.name} has no {feature}: profile a spec built "
                             f"with {feature}=True, or drop {argument}")
        if getattr(spec, feature) and not present.get(feature, False):
            what = ("(left, right) with a bounded side (-1 is unbounded; causal bounds the right)"
                    if feature == "window" else "> 0" if feature == "softcap" else "")
            raise ValueError(f"{spec.name} has {feature}: give its run-time value {argument} {what}".rstrip())
    return call.values if call is not None else None


def _check_shape(**sizes) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if sizes["heads"] % sizes["kv_heads"]:
        raise ValueError(f"heads ({sizes['heads']}) must be a multiple of kv_heads ({sizes['kv_heads']})")


def profile(spec: Spec, *, seqlen_q: int, seqlen_k: int | None = None, batch: int = 1, heads: int = 1,
            kv_heads: int | None = None, backward: bool = False, window_size=(-1, -1), softcap: float = 0.0,
            alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> Profile:
    """Run `spec` on the emulator with its counters on, and the IO model beside it. A variant's
    run-time values are flash_attn_func's arguments of the same names (`default_variant_values`
    gives all but the window's)."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    kv_heads = heads if kv_heads is None else kv_heads
    _check_shape(seqlen_q=seqlen_q, seqlen_k=seqlen_k, batch=batch, heads=heads, kv_heads=kv_heads)
    q, k, v, dout, seqlens_k = random_inputs(spec, batch, heads, kv_heads, seqlen_q, seqlen_k)
    variant = _kernel_variant(spec, q, k, {"window_size": window_size, "softcap": softcap,
                                           "alibi_slopes": alibi_slopes, "sinks": sinks})
    source = source_for(spec)
    p = DROPOUT_P if spec.dropout else 0.0
    keep = None
    if spec.dropout:
        from .reference import dropout_keep_mask

        keep = dropout_keep_mask(SEED, OFFSET, batch, heads, seqlen_q, seqlen_k, p)
    model_kwargs = dict(seqlens_k=seqlens_k, dropout_p=p, keep_mask=keep, window_size=window_size)
    result = Profile(spec, {"batch": batch, "heads": heads, "kv_heads": kv_heads, "seqlen_q": seqlen_q,
                            "seqlen_k": seqlen_k})
    with collect_counters() as forward_reports:
        out, stats = attention_kernels.forward(source, q, k, v, seqlens_k=seqlens_k, dropout_p=p, seed=SEED,
                                               philox_offset=OFFSET, variant_values=variant)
    forward_model = (fa2_forward if spec.version == 2 else fa1_forward)(q, k, v, spec, **model_kwargs)
    result.passes.append(PassProfile("forward", list(forward_reports), *_model_bytes(forward_model)))
    if backward:
        drop = attention_kernels.dropout_args(p, SEED, OFFSET) if spec.dropout else None
        with collect_counters() as backward_reports:
            attention_kernels.backward(source, q, k, v, out, stats, dout, seqlens_k=seqlens_k, dropout_args=drop,
                                       variant_values=variant)
        model = _backward_model(spec, q, k, v, dout, forward_model, model_kwargs)
        result.passes.append(PassProfile("backward", list(backward_reports), *_model_bytes(model)))
    return result


def _backward_model(spec: Spec, q, k, v, dout, forward_model, model_kwargs):
    """The tiled backward on the backward kernel's tiles, from the tiled forward's O and statistics."""
    tiles = spec.backward_tiles
    model_spec = _tiles_spec(spec, tiles.block_m, tiles.block_n)
    ref_out, ref_stats = forward_model[0], forward_model[1:-1]
    if spec.version == 2:
        return fa2_backward(q, k, v, ref_out, dout, ref_stats[0], model_spec, **model_kwargs)
    return fa1_backward(q, k, v, ref_out, dout, *ref_stats, model_spec, **model_kwargs)


# -- the table ------------------------------------------------------------------------------------

def _mib(n: int) -> str:
    return f"{n / 2**20:9.3f}"


def _ratio(measured: int, model: int) -> str:
    return f"{measured / model:6.3f}" if model else "     -"


def _notes(result: Profile) -> list[str]:
    """What the pass comparison leaves out, and why a pass has no model."""
    lines = [("model: the tiled FlashAttention algorithm's HBM traffic (fagen.reference, FA-1/FA-2 "
              "paper IO analysis) for the same tiles")]
    for p in result.passes:
        left_out = p.left_out_bytes
        if left_out:
            listed = ", ".join(f"{name} {n / 2**20:.3f} MiB" for name, n in sorted(left_out.items()))
            lines.append(f"{p.name}: left out of the comparison (per-batch or per-head values the model has "
                         f"no array for, cached on a GPU): {listed}")
    return lines


def format_table(result: Profile) -> str:
    shape = result.shape
    lines = [f"{result.spec.name}: batch {shape['batch']}, heads {shape['heads']}/{shape['kv_heads']}, "
             f"seqlen {shape['seqlen_q']} x {shape['seqlen_k']} (counted on the CPU emulator, not timed)", "",
             f"{'kernel':<38} {'read MiB':>9} {'write MiB':>9} {'sect/req':>8} {'bank cf':>8} "
             f"{'mma':>9} {'barriers':>8} {'philox':>8}"]
    for p in result.passes:
        for r in p.launches:
            c = r.counters
            lines.append(f"{r.kernel:<38} {_mib(r.hbm_read_bytes)} {_mib(r.hbm_write_bytes)} "
                         f"{r.sectors_per_request:8.2f} {r.bank_conflicts:8d} {c['mma']:9d} {c['barriers']:8d} "
                         f"{c['philox_calls']:8d}")
    lines += ["", f"{'pass':<10} {'read MiB':>9} {'model MiB':>9} {'ratio':>6}   {'write MiB':>9} "
                  f"{'model MiB':>9} {'ratio':>6}"]
    for p in result.passes:
        lines.append(f"{p.name:<10} {_mib(p.read_bytes)} {_mib(p.model_read_bytes)} "
                     f"{_ratio(p.read_bytes, p.model_read_bytes)}   {_mib(p.write_bytes)} "
                     f"{_mib(p.model_write_bytes)} {_ratio(p.write_bytes, p.model_write_bytes)}")
    return "\n".join(lines + _notes(result))


def write_json(result: Profile, path: Path) -> None:
    from .cache_files import write_atomic

    write_atomic(Path(path), (json.dumps(result.to_json(), indent=2) + "\n").encode())


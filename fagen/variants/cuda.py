"""A variant's mathematics as CUDA: a few device functions the kernel templates call.

`variant_code(spec)` renders, through a sympy CUDA printer, one block of device functions
in `namespace fagen_variant` (score_mod and its derivative, the captured tensors'
gradients, the mask, the tile class and the tile ranges), the kernel parameters they
need, and the statement that gathers those parameters into a `fagen_variant::Context`.
Each function carries the expression it computes in a comment.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import lru_cache

import sympy as sp
from sympy.codegen.ast import float32, real
from sympy.printing.c import C99CodePrinter

from ..spec import Spec
from .builtins import ALIBI, kernel_params
from .compose import (ALIBI_DISTANCE, ALIBI_SLOPES, KEYS, SEQLEN_Q, SOFTCAP, WINDOW_LEFT, WINDOW_RIGHT,
                      VariantMath, variant_math)
from .language import B, H, KV_IDX, Q_IDX, SCORE
from .tiles import (KV_HI, KV_LO, Q_HI, Q_LO, SUMMARY_ROWS, classify, key_range, query_range, summaries,
                    undecided_atoms)

CAPTURE_CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int",
                  "int64": "long long", "int16": "short", "int8": "signed char", "uint8": "unsigned char",
                  "bool": "bool"}
NAMES = {SCORE: "score", B: "b", H: "h", Q_IDX: "q_idx", KV_IDX: "kv_idx", SEQLEN_Q: "ctx.seqlen_q",
         KEYS: "ctx.keys", **{value: f"ctx.{value.name}" for value in (SOFTCAP, WINDOW_LEFT, WINDOW_RIGHT)},
         Q_LO: "q_lo", Q_HI: "q_hi", KV_LO: "kv_lo", KV_HI: "kv_hi"}


PARAM_NAME = re.compile(r"(score|mask)_par\d+")   # a mod's lifted number (fagen.variants.free_values)


class CudaPrinter(C99CodePrinter):
    """sympy -> CUDA C++ in fp32: float literals and functions (tanhf), integer index math,
    captured tensors read through the Context."""

    def __init__(self, captures=()):
        super().__init__({"type_aliases": {real: float32}})
        self.captures = {c.name: c for c in captures}

    def _print_Symbol(self, expr):
        if expr in NAMES:
            return NAMES[expr]
        return f"ctx.{expr.name}" if PARAM_NAME.fullmatch(expr.name) else expr.name

    def _print_Function(self, expr):
        name = expr.func.__name__
        if expr.func == ALIBI_SLOPES:
            b, h = (self._print(a) for a in expr.args)
            (slopes, _, _), (stride, _, _) = ALIBI.params
            return f"ctx.{slopes}[(long long)({b}) * ctx.{stride} + ({h})]"
        if name in self.captures:
            index = " + ".join(f"(long long)({self._print(a)}) * ctx.{name}_stride[{i}]"
                               for i, a in enumerate(expr.args)) or "0"
            load = f"ctx.{name}[{index}]"
            return f"fagen::to_float({load})" if self.captures[name].dtype in ("float16", "bfloat16") else \
                (load if self.captures[name].dtype == "float32" else f"(long long)({load})")
        return super()._print_Function(expr)

    def _print_tanh(self, expr):
        """The softcap's tanh (its argument holds the softcap, which no user mod can name) on the
        special-function unit (fagen::tanh_approx, FlashAttention-2's choice); any other tanh
        (a score_mod's own) as tanhf, within a few ulp of tanh."""
        arg = expr.args[0]
        # x / c stays an IEEE division (a MUFU.RCP and a slow-path branch per score): the
        # forward and the dQ pass of the softcap alone take capped_score's multiply by tau / c
        # instead, but in the backward's score_mod_grad both a reciprocal and the fast division
        # (__fdividef) spilled d = 128 kernels with softcap, a window and dropout.
        if SOFTCAP in arg.free_symbols:
            return f"fagen::tanh_approx({self._print(arg)})"
        return f"tanhf({self._print(arg)})"

    def _print_Piecewise(self, expr):
        *cases, (last, cond) = expr.args
        text = self._print(last) if cond == sp.true else \
            f"(({self._print(cond)}) ? ({self._print(last)}) : (0.0f / 0.0f))"
        for value, condition in reversed(cases):
            text = f"(({self._print(condition)}) ? ({self._print(value)}) : ({text}))"
        return text

    def _print_Mod(self, expr):
        """Python's (floor) modulo, parenthesized whole: sympy prints `a % b` bare where both are
        nonnegative, which C then binds to a neighbouring `*` (`0.5F*kv_idx % 7`); and C's fmod
        keeps the numerator's sign where Mod takes the divisor's."""
        num, den = expr.args
        if num.is_integer and den.is_integer:
            return f"({super()._print_Mod(expr)})"
        a, b = self._print(num), self._print(den)
        return f"(({a}) - ({b}) * floorf(({a}) / ({b})))"

    def _print_Abs(self, expr):
        """An integer |x| in 64 bits (a mod's index arithmetic may leave 32), except ALiBi's
        distance: the kernels call the mods with 0 <= q_idx < seqlen_q and 0 <= kv_idx < keys,
        so keys - kv_idx is in [1, keys], q_idx - seqlen_q in [-seqlen_q, -1], and their sum and
        its absolute value fit an int. 64-bit math per score there cost ALiBi a third of its
        main loop (fa2_d64_alibi_fp16 forward, sm_90: 10.1 -> 7.1 instructions per HMMA)."""
        if expr == ALIBI_DISTANCE:
            return "abs((ctx.keys - kv_idx) + (q_idx - ctx.seqlen_q))"
        arg = expr.args[0]
        return f"{'llabs' if arg.is_integer else 'fabsf'}({self._print(arg)})"

    def _minmax(self, expr, op):
        integer = all(a.is_integer for a in expr.args)
        func = ("max" if op == "max" else "min") if integer else ("fmaxf" if op == "max" else "fminf")
        args = [self._print(a) for a in expr.args]
        text = args[0]
        for a in args[1:]:
            text = f"{func}({text}, {a})"
        return text

    def _print_Max(self, expr):
        return self._minmax(expr, "max")

    def _print_Min(self, expr):
        return self._minmax(expr, "min")

    def _print_sign(self, expr):
        x = self._print(expr.args[0])
        return f"(float)(({x} > 0) - ({x} < 0))"

    def _print_Heaviside(self, expr):
        return f"(({self._print(expr.args[0])}) > 0 ? 1.0f : 0.0f)"

    def _print_Pow(self, expr):
        """Small integer powers as products, parenthesized whole: the C printer puts a Mul's
        denominator after a bare `/` (`a/(t1) * (t1)` would divide by t1 once and multiply by it
        again: how sigmoid's derivative came out before this was mended)."""
        base, exponent = expr.args
        if exponent.is_integer and 1 <= abs(int(exponent)) <= 4:
            product = " * ".join([f"({self._print(base)})"] * abs(int(exponent)))
            if abs(int(exponent)) > 1:
                product = f"({product})"
            return product if exponent > 0 else f"(1.0f / {product})"
        return super()._print_Pow(expr)

    def _print_BooleanTrue(self, expr):
        return "true"

    def _print_BooleanFalse(self, expr):
        return "false"


def _ctype(expr) -> str:
    if isinstance(expr, (sp.core.relational.Relational, sp.logic.boolalg.BooleanFunction,
                         sp.logic.boolalg.BooleanAtom)):
        return "bool"
    return "long long" if expr.is_integer else "float"


def common_subexpressions(outputs: list) -> tuple[list, list]:
    """sympy's cse of `outputs`, with temporaries that know their kind: (replacements, reduced)."""
    replacements, reduced = sp.cse(outputs, symbols=sp.numbered_symbols("t"), optimizations="basic")
    # cse's temporaries know nothing of what they stand for: give each its value's kind, so
    # that later expressions print integer math (abs, max) where the value is an integer.
    typed, renames = [], {}
    for symbol, expr in replacements:
        expr = expr.xreplace(renames)
        kind = {"integer": True} if expr.is_integer else ({"real": True} if expr.is_real else {})
        renames[symbol] = sp.Symbol(symbol.name, **kind)
        typed.append((renames[symbol], expr))
    return typed, [e.xreplace(renames) for e in reduced]


def emitted_score_grad(math: VariantMath) -> tuple[sp.Basic, dict]:
    """The derivative as score_mod_grad computes it: an expression of cse temporaries, and
    what each temporary stands for (`fagen verify` proves it equals sympy's derivative)."""
    replacements, (_, grad) = common_subexpressions([math.score, math.score_grad])
    return grad, dict(replacements)


def capture_load_grads(math: VariantMath) -> list[tuple[sp.Basic, sp.Basic]]:
    """(load, ds'/d load) for each load of a captured tensor that receives a gradient."""
    pairs = []
    for load in math.grad_loads:
        dummy = sp.Dummy("load", real=True)
        pairs.append((load, sp.diff(math.score.xreplace({load: dummy}), dummy).xreplace({dummy: load})))
    return pairs


def _body(printer: CudaPrinter, outputs: list, names: list[str]) -> list[str]:
    """Common subexpressions as named temporaries, then one line per output."""
    replacements, reduced = common_subexpressions(outputs)
    lines = [f"const {_ctype(e)} {printer._print(s)} = {printer.doprint(e)};" for s, e in replacements]
    lines += [f"{name} = {printer.doprint(e)};" for name, e in zip(names, reduced)]
    return lines


def _comment(text: str) -> str:
    return " ".join(text.split())


@dataclass(frozen=True)
class DeviceFunctions:
    """A variant's device functions and what the templates need to know of them (render hands
    them to the templates as `variant`; formerly VariantCode)."""

    block: str                  # the device functions (namespace fagen_variant)
    params: tuple               # (name, ctype, kind) kernel parameters, every kernel with a Context
    grad_params: tuple          # the backward kernel's gradient buffers for captured tensors
    masks: bool                 # mask beyond padding + causal: templates use the tile functions
    summaries: bool             # the mask reads summaries (document ids): a loop reads its fixed
                                # side's Bounds once (tile_class_rows / tile_class_keys)
    mask_loads: bool            # the mask reads captured tensors: a partial tile evaluates it at
                                # clamped indices with `&` (attention.j2 `visible`)
    scores: bool                # s' is not the scaled score itself (softcap, ALiBi, a score_mod):
                                # the templates apply score_mod, in natural-log units; without it
                                # (masks and sinks alone) they keep the plain kernel's exp2 scaling
    capped: bool                # the chain is the softcap alone: the templates work in units of the
                                # cap, t = tanh(tau S / c) (capped_score), as FlashAttention-2 does
    alibi_alone: bool           # the chain is ALiBi alone: the templates add its bias to the raw
                                # scores (alibi_raw_scale), which keep the plain kernel's scaling
    score_grad: bool            # ds'/dx is not 1: the backward multiplies dS by it
    capture_grads: bool         # the backward adds captured tensors' gradients
    sinks: bool

    def units(self, packed: bool = False) -> str:
        """The units a kernel keeps the scores and its running max in (the templates' `units`):
        "raw" q.k where no chain changes them or ALiBi alone adds its bias to them (not when GQA
        packing mixes heads in a tile's rows), "capped" for the softcap alone, else "natural"."""
        if self.capped:
            return "capped"
        return "raw" if not self.scores or (self.alibi_alone and not packed) else "natural"

    def context(self, with_grads: bool, seqlen_q: str = "seqlen_q") -> str:
        """The statement that gathers the Context (after `keys` and the block coordinates);
        `seqlen_q` names the queries per head (GQA packing's rows hold several heads')."""
        fields = [seqlen_q, "keys"] + [name for name, _, _ in self.params if name != "sinks"]
        if self.capture_grads:
            fields += [name if with_grads else "nullptr" for name, _, _ in self.grad_params]
        return f"const fagen_variant::Context ctx = {{{', '.join(fields)}}};"


def _capture_params(math: VariantMath, exact: bool):
    """The captured tensors' parameters and their gradients' buffers: fp32, or with `exact`
    (a deterministic spec) an order-free sum's digits per element (fagen/exact_sum.cuh)."""
    grad_ctype = "long long* __restrict__" if exact else "float* __restrict__"
    params, grads = [], []
    for c in math.captures:
        params.append((c.name, f"const {CAPTURE_CTYPES[c.dtype]}* __restrict__", "tensor"))
        params += [(f"{c.name}_stride{i}", "long long", "int64") for i in range(c.ndim)]
        if c.grad:
            grads.append((f"{c.name}_grad", grad_ctype, "tensor"))
    return params, grads


def summary_ctype(math: VariantMath, capture: str) -> str:
    """The C type of a summary's ids: int for a capture of 32 bits or fewer (one-instruction min
    and max), long long for int64 ids. fagen.ops.variant_args builds the summaries to match."""
    dtype = next(c.dtype for c in math.captures if c.name == capture)
    return "long long" if dtype == "int64" else "int"


def _params(spec: Spec, math: VariantMath):
    params = kernel_params(spec)   # the built-ins' (builtins.BUILTINS), then the mods'
    # The mods' lifted numbers (closure / global constants): arguments, never part of the kernel.
    params += [(name, "float" if kind == "float" else "int", "float32" if kind == "float" else "int32")
               for name, kind in math.params]
    captures, grads = _capture_params(math, spec.deterministic)
    for s in summaries(math.mask):   # per-group min / max of document ids (tiles.Summary)
        ndim = next(c.ndim for c in math.captures if c.name == s.capture)
        ids = summary_ctype(math, s.capture)
        captures += [(f"{s.capture}_gmin", f"const {ids}* __restrict__", "tensor"),
                     (f"{s.capture}_gmax", f"const {ids}* __restrict__", "tensor")]
        captures += [(f"{s.capture}_sumstride{i}", "long long", "int64") for i in range(ndim)]
        captures.append((f"{s.capture}_groups", "int", "int32"))
    return tuple(params + captures), tuple(grads)


def _context_struct(params, grads) -> list[str]:
    lines = ["struct Context {", "  int seqlen_q, keys;  // this batch entry's key count"]
    for name, ctype, _ in params:
        if name == "sinks":
            continue
        if "_stride" in name and name[-1].isdigit() and not name.startswith("alibi"):
            base, index = name.rsplit("_stride", 1)
            if index == "0":
                count = sum(1 for n, _, _ in params if n.startswith(base + "_stride"))
                lines.append(f"  long long {base}_stride[{count}];")
            continue
        lines.append(f"  {ctype.replace(' __restrict__', '')} {name};")
    lines += [f"  {ctype.replace(' __restrict__', '')} {name};" for name, ctype, _ in grads]
    return lines + ["};"]


SIGNATURE = "int b, int h, int q_idx, int kv_idx, const Context& ctx"


CAPPED_SCORE = SOFTCAP * sp.tanh(SCORE / SOFTCAP)
ALIBI_SCORE = SCORE - ALIBI_SLOPES(B, H) * ALIBI_DISTANCE


def capped(math: VariantMath) -> bool:
    """Whether the score chain is the softcap alone, s' = c tanh(x / c) (Gemma 2's)."""
    return math.score == CAPPED_SCORE


def _score_functions(printer, math: VariantMath, exact: bool) -> list[str]:
    score, grad = math.score, math.score_grad
    lines = [f"// s' = {_comment(str(score))}" + (f"   (score_mod: {_comment(math.score_source)})"
                                                  if math.score_source else ""),
             f"__device__ __forceinline__ float score_mod(float score, {SIGNATURE}) {{", "  float s;"]
    lines += ["  " + line for line in _body(printer, [score], ["s"])] + ["  return s;", "}", ""]
    lines += [f"// s' and ds'/dscore = {_comment(str(grad))}",
              f"__device__ __forceinline__ float score_mod_grad(float score, {SIGNATURE}, float& grad) {{",
              "  float s;"]
    lines += ["  " + line for line in _body(printer, [score, grad], ["s", "grad"])] + ["  return s;", "}", ""]
    if math.score == ALIBI_SCORE:
        lines += ["// ALiBi alone: s' = tau (S + b), b = -(slope / tau) |i + Nk - Nq - j|: the kernels add b to the",
                  "// raw score S as fmaf(scale, |i + Nk - Nq - j|, S) (the distance exact in fp32 below 2^24) and",
                  "// keep the plain kernel's scaling inside the exponent. The scale, -slope / tau, once a block:",
                  "__device__ __forceinline__ float alibi_raw_scale(int b, int h, float softmax_scale,",
                  "                                                 const Context& ctx) {",
                  "  return -ctx.alibi_slopes[(long long)(b) * ctx.alibi_stride_b + h] / softmax_scale;", "}",
                  "// A raw score with its bias: raw + scale |i + Nk - Nq - j|.",
                  "__device__ __forceinline__ float alibi_biased(float raw, int q_idx, int kv_idx, float scale,",
                  "                                              const Context& ctx) {",
                  "  return fmaf(scale, fabsf((float)(q_idx + ctx.keys - ctx.seqlen_q) - (float)kv_idx), raw);",
                  "}", ""]
    if capped(math):
        lines += ["// The softcap alone, in units of the cap: t = tanh(tau S / c) from the raw score S, so that",
                  "// s' = c t. The online softmax keeps its max in these units and c log2(e) joins the exponent;",
                  "// ds'/dx = 1 - t^2. tau / c and c log2(e) are parameters (params.variant_arguments).",
                  "__device__ __forceinline__ float capped_score(float raw, const Context& ctx) {",
                  "  return fagen::tanh_approx(raw * ctx.softcap_scale);", "}", ""]
    return lines + _capture_grad_function(printer, math, exact)


def _capture_grad_function(printer, math: VariantMath, exact: bool) -> list[str]:
    """add_capture_grads: each captured tensor's gradient term, added where its load reads; by
    float atomics, or with `exact` (a deterministic spec) into an order-free sum's digits."""
    loads = capture_load_grads(math)
    if not loads:
        return []
    lines = ["// The captured tensors' gradients: ds times ds'/d(load), added where each load reads."]
    if exact:
        lines.append("// Deterministic: into an order-free sum's digits (fagen/exact_sum.cuh), not by float atomics.")
    lines.append(f"__device__ __forceinline__ void add_capture_grads(float score, float ds, {SIGNATURE}) {{")
    for load, derivative in loads:
        name = load.func.__name__
        index = " + ".join(f"(long long)({printer._print(a)}) * ctx.{name}_stride[{i}]"
                           for i, a in enumerate(load.args)) or "0"
        lines.append(f"  // d s' / d {_comment(str(load))} = {_comment(str(derivative))}")
        term = f"ds * ({printer.doprint(derivative)})"
        lines.append(f"  fagen::exact_sum_add(ctx.{name}_grad + ({index}) * fagen::kExactSumWords, {term});"
                     if exact else f"  atomicAdd(ctx.{name}_grad + ({index}), {term});")
    return lines + ["}", ""]


def _summary_functions(printer, math: VariantMath) -> list[str]:
    """The summaries' reader and, over a box's rows and over its keys, their bounds (`Bounds`,
    one min and max per Summary): computed apart, so that a loop whose rows (or keys) stay fixed
    reads theirs once (`tile_class_rows`, `tile_class_keys`)."""
    found = summaries(math.mask)
    lines = ["// An empty range's bounds: the largest and smallest id of a summary's type.",
             "template <class Id> __device__ __forceinline__ Id id_max();",
             "template <class Id> __device__ __forceinline__ Id id_min();",
             "template <> __device__ __forceinline__ int id_max<int>() { return 2147483647; }",
             "template <> __device__ __forceinline__ int id_min<int>() { return -2147483647 - 1; }",
             "template <> __device__ __forceinline__ long long id_max<long long>() {",
             "  return 9223372036854775807LL;", "}",
             "template <> __device__ __forceinline__ long long id_min<long long>() {",
             "  return -9223372036854775807LL - 1;", "}",
             "",
             f"// The min and max of a summarized tensor over rows [lo, hi]: groups of {SUMMARY_ROWS} rows,",
             "// clamped to the groups that exist.",
             "template <typename Id>",
             "__device__ __forceinline__ void summary_range(const Id* gmin, const Id* gmax, long long base,",
             "                                              long long stride, int groups, int lo, int hi, Id& low,",
             "                                              Id& high) {",
             f"  const int first = max(lo, 0) / {SUMMARY_ROWS}, last = min(hi / {SUMMARY_ROWS}, groups - 1);",
             "  low = id_max<Id>(), high = id_min<Id>();",
             "  for (int g = first; g <= last; ++g) {",
             "    low = min(low, gmin[base + g * stride]), high = max(high, gmax[base + g * stride]);",
             "  }", "}", "",
             f"// The same over rows [lo, hi] inside one tile of kSpan rows (a multiple of {SUMMARY_ROWS}, starting",
             f"// at one): kSpan / {SUMMARY_ROWS} reads, unrolled and unconditional (a group past the range reads",
             "// its last group again, which changes no min or max), then an empty range made empty.",
             "template <int kSpan, typename Id>",
             "__device__ __forceinline__ void tile_summary(const Id* gmin, const Id* gmax, long long base,",
             "                                             long long stride, int groups, int lo, int hi, Id& low,",
             "                                             Id& high) {",
             f"  static_assert(kSpan % {SUMMARY_ROWS} == 0, \"a tile spans whole summary groups\");",
             f"  const int first = max(lo, 0) / {SUMMARY_ROWS}, last = min(hi / {SUMMARY_ROWS}, groups - 1);",
             "  low = id_max<Id>(), high = id_min<Id>();",
             "  FAGEN_UNROLL",
             f"  for (int i = 0; i < kSpan / {SUMMARY_ROWS}; ++i) {{",
             "    const long long at = base + max(min(first + i, last), 0) * stride;",
             "    low = min(low, gmin[at]), high = max(high, gmax[at]);",
             "  }",
             "  if (last < first) low = id_max<Id>(), high = id_min<Id>();",
             "}", "",
             "// Each summarized tensor's ids over a range of rows or keys (document-style equality).",
             "struct Bounds { " + " ".join(f"{summary_ctype(math, s.capture)} {s.capture}_min, {s.capture}_max;"
                                           for s in found) + " };", ""]
    reads, tile_reads = [], []
    for s in found:
        name = s.capture
        dims = [i for i in range(len(s.others) + 1) if i != s.dim]
        base = " + ".join(f"(long long)({printer._print(a)}) * ctx.{name}_sumstride{i}"
                          for i, a in zip(dims, s.others)) or "0"
        arguments = f"ctx.{name}_gmin, ctx.{name}_gmax, {base}, ctx.{name}_sumstride{s.dim}, ctx.{name}_groups"
        reads.append(f"  summary_range({arguments}, lo, hi, found.{name}_min, found.{name}_max);")
        tile_reads.append(f"  tile_summary<kSpan>({arguments}, lo, hi, found.{name}_min, found.{name}_max);")
    lines += ["// The Bounds of indices [lo, hi]: rows or keys (the summarized dim is indexed by both).",
              "__device__ __forceinline__ Bounds bounds_of(int b, int h, int lo, int hi, const Context& ctx) {",
              "  Bounds found;", *reads, "  return found;", "}", "",
              "// The Bounds of [lo, hi] inside one tile of kSpan rows or keys (tile_summary).",
              "template <int kSpan>",
              "__device__ __forceinline__ Bounds tile_bounds(int b, int h, int lo, int hi, const Context& ctx) {",
              "  Bounds found;", *tile_reads, "  return found;", "}", ""]
    return lines


def _tile_class_functions(printer, math: VariantMath, full, empty) -> list[str]:
    """tile_class over a box; with summaries also tile_class_rows / tile_class_keys, which take
    the Bounds of rows (keys) that a loop keeps fixed, read once before it."""
    box = "int b, int h, int q_lo, int q_hi, int kv_lo, int kv_hi"
    decide = [f"  if ({printer.doprint(empty)}) return kEmptyTile;",
              f"  if ({printer.doprint(full)}) return kFullTile;",
              "  return kPartialTile;", "}", ""]
    head = ["// The rows [q_lo, q_hi] x keys [kv_lo, kv_hi] of a tile: all visible, all masked, or partial",
            "// (fagen/variants/tiles.py derives both conditions from the mask's atoms).",
            "enum TileClass { kEmptyTile = 0, kFullTile = 1, kPartialTile = 2 };"]
    found = summaries(math.mask)
    if not found:
        return head + [f"__device__ __forceinline__ int tile_class({box}, const Context& ctx) {{", *decide]
    names = [s.capture for s in found]
    unpack = [f"  const auto {n}_qmin = rows.{n}_min, {n}_qmax = rows.{n}_max, {n}_kvmin = keys.{n}_min, "
              f"{n}_kvmax = keys.{n}_max;" for n in names]
    return head + [
        "// From the Bounds of rows that cover every visible row of the box and of keys that cover",
        "// every visible key (a wider range only makes a tile partial more often: sound).",
        f"__device__ __forceinline__ int tile_class_of({box}, const Bounds& rows, const Bounds& keys,",
        "                                             const Context& ctx) {", *unpack, *decide,
        "// Only rows and keys that the linear atoms let meet matter to the summaries: each side",
        "// shrinks to them (sound: every visible pair lies inside both ranges).",
        f"__device__ __forceinline__ int tile_class({box}, const Context& ctx) {{",
        "  const IndexRange meet = query_range(b, h, kv_lo, kv_hi, ctx), seen = key_range(b, h, q_lo, q_hi, ctx);",
        "  const Bounds rows = bounds_of(b, h, max(q_lo, meet.first), min(q_hi, meet.last), ctx);",
        "  const Bounds keys = bounds_of(b, h, max(kv_lo, seen.first), min(kv_hi, seen.last), ctx);",
        "  return tile_class_of(b, h, q_lo, q_hi, kv_lo, kv_hi, rows, keys, ctx);", "}", "",
        "// The forward's K/V loop: `rows`, the Bounds of the block's rows [q_lo, q_hi], read once",
        "// before it. They are read again, shrunk, only where the linear atoms shrink the rows (a",
        "// tile on the diagonal); each tile's kKeys keys are read per tile. Decides as tile_class.",
        "template <int kRows, int kKeys>",
        f"__device__ __forceinline__ int tile_class_rows({box}, const Bounds& rows, const Context& ctx) {{",
        "  const IndexRange meet = query_range(b, h, kv_lo, kv_hi, ctx), seen = key_range(b, h, q_lo, q_hi, ctx);",
        "  const int q_first = max(q_lo, meet.first), q_last = min(q_hi, meet.last);",
        "  const Bounds shrunk =",
        "      q_first == q_lo && q_last == q_hi ? rows : tile_bounds<kRows>(b, h, q_first, q_last, ctx);",
        "  const Bounds keys = tile_bounds<kKeys>(b, h, max(kv_lo, seen.first), min(kv_hi, seen.last), ctx);",
        "  return tile_class_of(b, h, q_lo, q_hi, kv_lo, kv_hi, shrunk, keys, ctx);", "}", "",
        "// The backward's Q loop: the same with the block's keys fixed (`keys`, read once before it).",
        "template <int kRows, int kKeys>",
        f"__device__ __forceinline__ int tile_class_keys({box}, const Bounds& keys, const Context& ctx) {{",
        "  const IndexRange meet = query_range(b, h, kv_lo, kv_hi, ctx), seen = key_range(b, h, q_lo, q_hi, ctx);",
        "  const int kv_first = max(kv_lo, seen.first), kv_last = min(kv_hi, seen.last);",
        "  const Bounds shrunk =",
        "      kv_first == kv_lo && kv_last == kv_hi ? keys : tile_bounds<kKeys>(b, h, kv_first, kv_last, ctx);",
        "  const Bounds rows = tile_bounds<kRows>(b, h, max(q_lo, meet.first), min(q_hi, meet.last), ctx);",
        "  return tile_class_of(b, h, q_lo, q_hi, kv_lo, kv_hi, rows, shrunk, ctx);", "}", "",
    ]


def _mask_functions(printer, math: VariantMath) -> list[str]:
    full, empty = classify(math.mask)
    keys, queries = key_range(math.mask), query_range(math.mask)
    reader = _summary_functions(printer, math) if summaries(math.mask) else []
    return [
        f"// Visible: {_comment(str(math.mask))}" + (f"   (mask_mod: {_comment(math.mask_source)})"
                                                     if math.mask_source else ""),
        f"__device__ __forceinline__ bool visible({SIGNATURE}) {{",
        f"  return {printer.doprint(math.mask)};", "}", "",
        "struct IndexRange { int first, last; };  // inclusive; empty when last < first",
        "// The keys any row of [q_lo, q_hi] may see (the forward's K/V loop bounds).",
        "__device__ __forceinline__ IndexRange key_range(int b, int h, int q_lo, int q_hi, const Context& ctx) {",
        f"  return {{(int)({printer.doprint(keys.first)}), (int)({printer.doprint(keys.last)})}};", "}", "",
        "// The queries any key of [kv_lo, kv_hi] may meet (the backward's Q loop bounds).",
        "__device__ __forceinline__ IndexRange query_range(int b, int h, int kv_lo, int kv_hi, const Context& ctx) {",
        f"  return {{(int)({printer.doprint(queries.first)}), (int)({printer.doprint(queries.last)})}};", "}", "",
        *reader, *_tile_class_functions(printer, math, full, empty),
    ]


def _group_functions(math: VariantMath) -> list[str]:
    """GQA packing (Spec.pack_gqa): a tile's rows hold queries [q_lo, q_hi] of the `group` query
    heads from h0 on. A mask that reads the head is asked for each of them; one that does not,
    once."""
    box = "int b, int h0, int group, int q_lo, int q_hi"
    if H not in math.mask.free_symbols:
        return ["// GQA packing: the mask does not read the head, so any head of the group answers for all.",
                f"__device__ __forceinline__ IndexRange group_key_range({box}, const Context& ctx) {{",
                "  return key_range(b, h0, q_lo, q_hi, ctx);", "}", "",
                f"__device__ __forceinline__ int group_tile_class({box}, int kv_lo, int kv_hi, const Context& ctx) {{",
                "  return tile_class(b, h0, q_lo, q_hi, kv_lo, kv_hi, ctx);", "}", ""]
    return [
        "// GQA packing: the keys any (query, head) of the tile may see: the union over the group's heads.",
        f"__device__ __forceinline__ IndexRange group_key_range({box}, const Context& ctx) {{",
        "  IndexRange seen = key_range(b, h0, q_lo, q_hi, ctx);",
        "  for (int g = 1; g < group; ++g) {",
        "    const IndexRange other = key_range(b, h0 + g, q_lo, q_hi, ctx);",
        "    if (other.last < other.first) continue;  // this head sees nothing here",
        "    if (seen.last < seen.first) seen = other;",
        "    else seen.first = min(seen.first, other.first), seen.last = max(seen.last, other.last);",
        "  }",
        "  return seen;", "}", "",
        "// GQA packing: a tile is empty (or full) only if it is so for every head of the group.",
        f"__device__ __forceinline__ int group_tile_class({box}, int kv_lo, int kv_hi, const Context& ctx) {{",
        "  const int first = tile_class(b, h0, q_lo, q_hi, kv_lo, kv_hi, ctx);",
        "  for (int g = 1; g < group; ++g)",
        "    if (tile_class(b, h0 + g, q_lo, q_hi, kv_lo, kv_hi, ctx) != first) return kPartialTile;",
        "  return first;", "}", "",
    ]


@lru_cache(maxsize=256)
def variant_code(spec: Spec) -> DeviceFunctions | None:
    """The device functions of `spec`'s variant; None for plain attention (no mods)."""
    if not spec.has_mods:
        return None
    math = variant_math(spec)
    undecided = undecided_atoms(math.mask)
    if undecided:   # correct, slower: say so once per variant
        logging.getLogger("fagen").warning(
            "%s: the mask atoms %s are not decided per tile (neither linear in q_idx and kv_idx nor an id "
            "equality across them): every tile they touch is computed as partial", spec.name,
            ", ".join(map(str, undecided)))
    params, grads = _params(spec, math)
    printer = CudaPrinter(math.captures)
    lines = ["// " + "-" * 75, f"// Variant {spec.name}", "// (fagen/variants): the templates call these "
             "functions. `score` is the scaled score", "// tau q.k; the indices are absolute.", "// " + "-" * 75,
             "namespace fagen_variant {", ""]
    lines += _context_struct(params, grads) + [""]
    lines += _score_functions(printer, math, spec.deterministic)
    if math.masks:
        lines += _mask_functions(printer, math)
        if spec.pack_gqa:
            lines += _group_functions(math)
    lines += ["}  // namespace fagen_variant"]
    return DeviceFunctions(block="\n".join(lines), params=params, grad_params=grads, masks=math.masks,
                           summaries=bool(summaries(math.mask)), scores=math.score != SCORE, capped=capped(math),
                           alibi_alone=math.score == ALIBI_SCORE,
                           mask_loads=any(c.name.startswith("mask_") for c in math.captures),
                           score_grad=math.has_score_grad, capture_grads=bool(grads), sinks=spec.sinks)

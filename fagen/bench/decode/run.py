"""The decode section: a decoding step against a KV cache, and varlen causal training.

Decode (config.DecodeConfig; B = 64 entries, 8k cached tokens each, Hq = 32 over Hk = 8, d = 128,
bf16, one query per entry, non-causal, every cache full):

  fagen           flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...)
  fagen_paged     the same keys in pages of 256 (a seeded random block table), block_table=...
  fagen_fp8, fagen_fp8_paged
                  the same two over the caches quantised to e4m3 (float8_e4m3fn, one descale per
                  K/V head, made before the timing): half the cache bytes read
  fagen_sm90, fagen_sm90_paged
                  the same two on the Hopper family (FAGEN_ARCH_FAMILY=sm90; compute capability
                  9.0 only)
  sdpa_math, sdpa_efficient, sdpa_flash
                  scaled_dot_product_attention pinned to one backend, on (B, H, N, d) caches
                  (the layout a PyTorch model keeps), enable_gqa=True where the backend takes
                  it, else on K/V expanded to Hq heads beforehand (not timed: the peer then
                  reads 4x the bytes, and is counted so)
  flex            torch.compile(flex_attention), enable_gqa=True, no block mask (Nq = 1 makes
                  it pick its decoding kernel); last, and only with time left for its compile

A step is memory-bound: each is reported as bytes moved per second (K and V read, q read,
out written: config.DecodeConfig.decode_bytes) and as a fraction of the device copy's
bandwidth (the peak section's, or measured here when that did not run), which counts read
plus written bytes in the same way. fagen's two calls are first checked on a small step
against the same attention in fp32 torch, next to bf16 torch (the sweep's 2x rule).

Varlen training (16k tokens in ~10 documents of mixed lengths, H = 16, d = 128, causal,
forward and forward + backward):

  fagen_varlen    flash_attn_varlen_func on the packed (total, H, d) tensors
  fagen_padded    flash_attn_func(..., causal=True) on the batch right-padded to the longest
                  (no seqlens_k: fagen aligns causal to an entry's own key count, which would
                  shift a short document's diagonal; causal alone keeps its rows off the padding)
  sdpa_padded     SDPA's flash backend (else its efficient one), is_causal, on the padded batch

TFLOP/s count only the documents' own causal FLOPs, so the padding's wasted work shows as
a lower rate; ratios are fagen varlen / each.

Absorbed MLA (mla.py): DeepSeek-V3's decoding step over one 576-wide cache whose first 512
columns are V, 128 query heads on one K/V head, 8k rows per entry, at B = 64 and B = 1: fagen on
64-row pages (the sm80 family's kernel, and the sm90 family's on compute capability 9.0), SDPA
and FlexAttention (last, with the other Flex run) on views of one cache; each credited with
reading every cache row once.

The CUDA-graph row (graph.py): a serving step (append one token with rotary, split-KV, combine)
captured in a CUDA graph, replayed with new cache_seqlens, equal to the same step run eagerly,
and its replay timed against the eager step. It runs after varlen and before Flex's compile.
Failing soft throughout: a system that cannot run gets a skipped cell with its reason.

Modules: config (sizes, bytes, FLOPs, the forecast), step (the decoding step's inputs and
contenders), varlen (the documents and theirs), graph (the captured step), markdown (the
derived numbers and the text).
"""

from __future__ import annotations

import time
from typing import Callable

from ...arch_families import SM90
from ..measure import GUARD_REASON, context_lost, free_memory, measure_system
from ..peers import failure_reason
from ..timing import Deadline, Timing, measure_copy_bandwidth, time_cuda
from .config import DecodeConfig
from .graph import cuda_graph_capture, measure_graph
from .markdown import add_bandwidth, add_varlen_ratios, graph_text, section_note
from .mla import FAGEN_FAMILIES, make_mla_inputs, measure_mla, mla_sanity, unavailable
from .step import FagenDecode, FlexDecode, SdpaDecode, decode_sanity, make_decode_inputs, measure_decode
from .varlen import FagenPadded, FagenVarlen, SdpaPadded, make_documents, varlen_sanity

# The copy measured here when the peak section did not run: 512 MiB, well above the L2.
COPY_BYTES = 1 << 29
FLEX_GUARD_REASON = GUARD_REASON + " (too little left for a Flex compile)"
GRAPH_NEED_S = 2.0   # left in the section for the graph's inputs, capture, check and two timings


# -- the section ------------------------------------------------------------------------------

def default_factories() -> dict[str, Callable[[], object]]:
    """Per system name, a function making the system (varlen ones get their Documents later)."""
    factories: dict[str, Callable[[], object]] = {
        "fagen": lambda: FagenDecode(paged=False), "fagen_paged": lambda: FagenDecode(paged=True),
        "fagen_fp8": lambda: FagenDecode(paged=False, fp8=True),
        "fagen_fp8_paged": lambda: FagenDecode(paged=True, fp8=True),
        "fagen_sm90": lambda: FagenDecode(paged=False, family=SM90.name),
        "fagen_sm90_paged": lambda: FagenDecode(paged=True, family=SM90.name),
        "flex": FlexDecode, "fagen_varlen": FagenVarlen, "fagen_padded": FagenPadded, "sdpa_padded": SdpaPadded}
    for name in ("sdpa_math", "sdpa_efficient", "sdpa_flash"):
        factories[name] = lambda name=name: SdpaDecode(name)
    return factories


class _Section:
    """The section's results and the bookkeeping its parts share."""

    def __init__(self, config: DecodeConfig, deadline: Deadline, log, checkpoint):
        self.config, self.deadline, self.log, self._checkpoint = config, deadline, log, checkpoint
        batch, longest = config.padded_shape()
        self.data: dict = {
            "status": "ok", "note": "", "systems": {}, "points": [], "sanity": {}, "not_run": 0, "copy": {},
            "config": {"decode": config.decode_label, "varlen": config.varlen_label,
                       "lengths": config.document_lengths(), "padded": [batch, longest],
                       "passes": list(config.varlen_passes)},
            "bytes_note": ("bytes moved per step: K and V read (B N Hk d x 2 B each, Hk = the heads the "
                           "system is given) + q read + out written; the copy bandwidth counts read + "
                           "written bytes alike")}
        self.decode_point = {"part": "decode", "pass": "fwd", "label": config.decode_label, "batch": config.batch,
                             "cache_len": config.cache_len, "results": {}}
        self.varlen_points = {p: {"part": "varlen", "pass": p, "label": config.varlen_label,
                                  "flops": config.varlen_flops(p), "results": {}} for p in config.varlen_passes}
        if config.decode_systems:
            self.data["points"].append(self.decode_point)
        if config.varlen_systems:
            self.data["points"].extend(self.varlen_points.values())
        self.mla_points = {b: {"part": "decode", "pass": "fwd", "label": config.mla_label(b), "batch": b,
                               "cache_len": config.mla_cache_len, "results": {}}
                           for b in (config.mla_batches if config.mla_systems else ())}
        self.data["points"].extend(self.mla_points.values())

    def checkpoint(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint(self.data)

    def lost(self, where: str, reason: str) -> dict:
        self.data["status"] = "error"
        self.data["note"] = f"the CUDA context was lost at {where}: {reason}; the section stopped there"
        self.log("  " + self.data["note"])
        self.checkpoint()
        return self.data

    def skip(self, name: str, reason: str, points: list) -> None:
        if reason.startswith(GUARD_REASON):
            self.data["not_run"] += len(points)
        for point in points:
            point["results"][name] = {"skipped": reason}

    def available(self, name: str, system) -> bool:
        reason = system.unavailable_reason()
        self.data["systems"][name] = {"label": system.label, "available": reason is None, "reason": reason}
        if reason is not None:
            self.log(f"  {system.label}: not available ({reason})")
        return reason is None


def _copy_bandwidth(copy_tb_per_s: float | None, measure_copy: Callable[[], dict]) -> dict:
    if copy_tb_per_s is not None:
        return {"tb_per_s": copy_tb_per_s, "source": "the peak section's device copy (read + write bytes)"}
    try:
        copy = measure_copy()
        return {"tb_per_s": copy["tb_per_s"], "source": f"measured here: {copy['what']} (read + write bytes)"}
    except Exception as exc:  # noqa: BLE001 - the times stand without it
        return {"tb_per_s": None, "source": f"not measured: {failure_reason(exc)}"}


def _decode_part(run: _Section, factories, device, timer, timer_kwargs, names) -> dict | None:
    """The decoding step in `names`: fagen's sanity first, then each timed; a lost context's
    section, else None."""
    config, point = run.config, run.decode_point
    systems = {name: factories[name]() for name in names}
    runnable = [name for name, system in systems.items() if run.available(name, system)]
    for name in names:
        if name not in runnable:
            run.skip(name, f"not available: {run.data['systems'][name]['reason']}", [point])
    for name in [n for n in runnable if n.startswith("fagen")]:
        if not run.deadline.expired(2.0):
            sanity = run.data["sanity"][name] = decode_sanity(systems[name], config, device)
            if context_lost(sanity.get("error", "")):
                return run.lost(f"{systems[name].label}'s sanity check", sanity["error"])
    inputs = None
    for name in runnable:
        if name == "flex" and run.deadline.expired(config.flex_start_s):
            run.skip(name, FLEX_GUARD_REASON, [point])
            continue
        if run.deadline.expired(1.0):
            run.skip(name, GUARD_REASON, [point])
            continue
        inputs = inputs or make_decode_inputs(config, config.batch, config.cache_len, device)
        cell = point["results"][name] = measure_decode(systems[name], inputs, config, timer, timer_kwargs,
                                                       batch=config.batch, cache_len=config.cache_len)
        free_memory(device)   # an expanded peer's copies
        run.log(f"  decode {systems[name].label}: " + (f"{cell['ms']:.3f} ms, {cell['bytes'] / cell['ms'] / 1e9:.2f} "
                                                       "TB/s" if "ms" in cell else cell["skipped"]))
        if context_lost(cell.get("skipped", "")):
            return run.lost(systems[name].label, cell["skipped"])
        run.checkpoint()
    return None


def _mla_part(run: _Section, device, timer, timer_kwargs, names) -> dict | None:
    """Absorbed MLA's step (mla.py) for `names` at each batch: fagen's sanity first; a lost
    context's section, else None."""
    config = run.config
    for name in [n for n in names if n in FAGEN_FAMILIES and not unavailable(n)]:   # its rows say why not
        if run.deadline.expired(2.0):
            break
        sanity = run.data["sanity"][name] = mla_sanity(config, device, name)
        if context_lost(sanity.get("error", "")):
            return run.lost(f"{name}'s sanity check", sanity["error"])
    for batch, point in run.mla_points.items():
        inputs = None
        for name in names:
            if run.deadline.expired(config.flex_start_s if name == "flex" else 1.0):
                run.skip(name, FLEX_GUARD_REASON if name == "flex" else GUARD_REASON, [point])
                continue
            inputs = inputs or make_mla_inputs(config, batch, config.mla_cache_len, device)
            cell = point["results"][name] = measure_mla(name, inputs, config, timer, timer_kwargs, batch=batch)
            run.log(f"  MLA B={batch} {name}: " + (f"{cell['ms']:.3f} ms" if "ms" in cell else cell["skipped"]))
            if context_lost(cell.get("skipped", "")):
                return run.lost(f"MLA {name}", cell["skipped"])
            run.checkpoint()
        inputs = None
        free_memory(device)
    return None


def _varlen_part(run: _Section, factories, device, timer, timer_kwargs) -> dict | None:
    """Varlen training: each fagen call's sanity on a few short documents, then every system
    forward and forward + backward on the plan's documents."""
    config, points = run.config, list(run.varlen_points.values())
    ndocs, tokens, heads = config.varlen_sanity_shape
    small = make_documents(DecodeConfig(varlen_tokens=tokens, documents=ndocs, seed=config.seed).document_lengths(),
                           heads, config.head_dim, config.dtype, device)
    docs = None
    flops = {p: point["flops"] for p, point in run.varlen_points.items()}
    for name in config.varlen_systems:
        system = factories[name]()
        if not run.available(name, system):
            run.skip(name, f"not available: {run.data['systems'][name]['reason']}", points)
            continue
        if run.deadline.expired(1.0):
            run.skip(name, GUARD_REASON, points)
            continue
        if system.is_fagen:
            system.docs = small
            sanity = run.data["sanity"][name] = varlen_sanity(system, small)
            if context_lost(sanity.get("error", "") or sanity.get("bwd_error", "")):
                return run.lost(f"{system.label}'s sanity check", sanity.get("error") or sanity["bwd_error"])
        system.docs = docs = docs or make_documents(config.document_lengths(), config.varlen_heads, config.head_dim,
                                                    config.dtype, device)
        try:
            extra = system.prepare()
            cells = measure_system(system, *system.inputs(), True, config.varlen_passes, flops, timer, timer_kwargs)
        except Exception as exc:  # noqa: BLE001 - fail soft
            extra, cells = {}, {p: {"skipped": failure_reason(exc)} for p in config.varlen_passes}
        for p, cell in cells.items():
            run.varlen_points[p]["results"][name] = {**cell, **extra}
        run.log(f"  varlen {system.label}: " + ", ".join(
            f"{p} {c['tflops']:.0f} TFLOP/s" if "tflops" in c else f"{p} {c['skipped']}" for p, c in cells.items()))
        lost = next((c["skipped"] for c in cells.values() if context_lost(c.get("skipped", ""))), None)
        if lost is not None:
            return run.lost(system.label, lost)
        run.checkpoint()
    return None


def _graph_part(run: _Section, device, timer, timer_kwargs, capture) -> dict | None:
    """The step captured in a CUDA graph (graph.py): its equality with the eager step, then both
    timed; a lost context's section, else None."""
    config = run.config
    if not config.graph_shape:
        return None
    if run.deadline.expired(GRAPH_NEED_S):
        run.data["not_run"] += 2
        run.data["graph"] = {"label": config.graph_label, "skipped": GUARD_REASON}
        return None
    row = run.data["graph"] = measure_graph(config, device, timer, timer_kwargs, capture=capture)
    run.log(f"  decode step in a CUDA graph: {graph_text(row)}")
    if context_lost(row.get("skipped", "")):
        return run.lost("the decode step in a CUDA graph", row["skipped"])
    run.checkpoint()
    return None


def run_decode_section(plan, deadline: Deadline, *, device="cuda", timer: Callable[..., Timing] = time_cuda,
                       log: Callable[[str], None] = print, checkpoint: Callable[[dict], None] | None = None,
                       copy_tb_per_s: float | None = None, measure_copy: Callable[[], dict] | None = None,
                       factories: dict | None = None, capture: Callable = cuda_graph_capture) -> dict:
    """Every part within `deadline`: the decoding step, varlen training, the step in a CUDA graph
    (`capture` makes the graph: torch.cuda.graph, or a test's stand-in), and FlexAttention's
    decoding step last (its compile cannot crowd out the rest)."""
    config = plan.decode
    run = _Section(config, deadline, log, checkpoint)
    if not config.enabled:
        run.data["note"] = "no decode section in this plan"
        return run.data
    factories = factories or default_factories()
    timer_kwargs = {"warmup": plan.warmup, "min_repeats": plan.min_repeats, "max_repeats": plan.max_repeats,
                    "target_ms": plan.target_ms}
    if config.decode_systems or config.mla_systems:
        run.data["copy"] = _copy_bandwidth(copy_tb_per_s, measure_copy or (lambda: measure_copy_bandwidth(COPY_BYTES)))
    first = [n for n in config.decode_systems if n != "flex"]
    parts = [lambda: _decode_part(run, factories, device, timer, timer_kwargs, first),
             lambda: _varlen_part(run, factories, device, timer, timer_kwargs),
             lambda: _graph_part(run, device, timer, timer_kwargs, capture),
             lambda: _mla_part(run, device, timer, timer_kwargs, [n for n in config.mla_systems if n != "flex"]),
             lambda: _decode_part(run, factories, device, timer, timer_kwargs,
                                  [n for n in config.decode_systems if n == "flex"]),
             lambda: _mla_part(run, device, timer, timer_kwargs, [n for n in config.mla_systems if n == "flex"])]
    started = time.monotonic()
    for part in parts:
        stopped = part()
        if stopped is not None:
            return stopped
        free_memory(device)
    add_bandwidth(run.data)
    add_varlen_ratios(run.data)
    run.data["seconds"] = round(time.monotonic() - started, 1)
    if run.data["not_run"]:
        run.data["status"] = "partial"
    if (run.data.get("graph") or {}).get("equal", {}).get("ok") is False:
        run.data["status"] = "failed"   # the replay computed something else than the step it captured
    run.data["note"] = section_note(run.data)
    log("  " + run.data["note"])
    run.checkpoint()
    return run.data

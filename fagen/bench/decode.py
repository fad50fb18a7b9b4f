"""The decode section: a decoding step against a KV cache, and varlen causal training.

Decode (plan.DecodeConfig; B = 64 entries, 8k cached tokens each, Hq = 32 over Hk = 8, d = 128,
bf16, one query per entry, non-causal, every cache full):

  fagen           flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...)
  fagen_paged     the same keys in pages of 256 (a seeded random block table), block_table=...
  sdpa_math, sdpa_efficient, sdpa_flash
                  scaled_dot_product_attention pinned to one backend, on (B, H, N, d) caches
                  (the layout a PyTorch model keeps), enable_gqa=True where the backend takes
                  it, else on K/V expanded to Hq heads beforehand (not timed: the peer then
                  reads 4x the bytes, and is counted so)
  flex            torch.compile(flex_attention), enable_gqa=True, no block mask (Nq = 1 makes
                  it pick its decoding kernel); last, and only with time left for its compile

A step is memory-bound: each is reported as bytes moved per second (K and V read, q read,
out written: plan.DecodeConfig.decode_bytes) and as a fraction of the device copy's
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
a lower rate; ratios are fagen varlen / each. Failing soft throughout: a system that cannot
run gets a skipped cell with its reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .peers import (SDPA_BACKENDS, FlexSystem, NotAvailable, SdpaSystem, System, failure_reason,
                    is_out_of_memory)
from .plan import DECODE_LABELS, DecodeConfig, Plan
from .sweep import GUARD_REASON, _free_memory, add_gradient_errors, context_lost, measure_system, torch_attention, \
    torch_dtype
from .timing import Deadline, Timing, measure_copy_bandwidth, time_cuda

# The copy measured here when the peak section did not run: 512 MiB, well above the L2.
COPY_BYTES = 1 << 29
FLEX_GUARD_REASON = GUARD_REASON + " (too little left for a Flex compile)"


def fagen_decode_functions() -> tuple:
    """fagen's decoding and varlen entry points (imported late: a broken install is reported)."""
    from fagen import flash_attn_varlen_func, flash_attn_with_kvcache

    return flash_attn_with_kvcache, flash_attn_varlen_func


# -- decode inputs --------------------------------------------------------------------

@dataclass
class DecodeInputs:
    """One decoding step's tensors: fagen's cache layout, the same keys paged, and (made on
    first use) PyTorch's (B, H, N, d) layout."""

    q: object               # (B, 1, Hq, d)
    k_cache: object         # (B, N, Hk, d)
    v_cache: object
    cache_seqlens: object   # int32 (B,): every cache full
    k_pages: object         # (B N / page_size, page_size, Hk, d)
    v_pages: object
    block_table: object     # int32 (B, N / page_size), a random permutation of the pages
    _torch_layout: tuple | None = field(default=None, repr=False)

    def torch_layout(self) -> tuple:
        """q (B, Hq, 1, d), k and v (B, Hk, N, d), contiguous."""
        if self._torch_layout is None:
            self._torch_layout = tuple(t.transpose(1, 2).contiguous() for t in (self.q, self.k_cache, self.v_cache))
        return self._torch_layout


def make_decode_inputs(config: DecodeConfig, batch: int, cache_len: int, device) -> DecodeInputs:
    import torch

    if cache_len % config.page_size:
        raise ValueError(f"cache_len {cache_len} is not a whole number of {config.page_size}-token pages")
    dtype = torch_dtype(config.dtype)
    pages = cache_len // config.page_size
    q = torch.randn(batch, 1, config.q_heads, config.head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, cache_len, config.kv_heads, config.head_dim, device=device, dtype=dtype)
            for _ in range(2))
    order = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(config.seed))
    block_table = order.view(batch, pages).to(device=device, dtype=torch.int32)
    page_shape = (batch * pages, config.page_size, config.kv_heads, config.head_dim)
    k_pages, v_pages = torch.empty(page_shape, device=device, dtype=dtype), torch.empty(page_shape, device=device,
                                                                                         dtype=dtype)
    rows = block_table.flatten().long()
    k_pages[rows], v_pages[rows] = k.reshape(page_shape), v.reshape(page_shape)
    seqlens = torch.full((batch,), cache_len, device=device, dtype=torch.int32)
    return DecodeInputs(q, k, v, seqlens, k_pages, v_pages, block_table)


# -- decode systems ---------------------------------------------------------------------

class DecodeSystem:
    """One contender for the decoding step. `prepare` returns the timed call (output in
    (B, 1, Hq, d)) and how many K/V heads it reads, with a line saying how it got GQA."""

    name = "decode"

    @property
    def label(self) -> str:
        return DECODE_LABELS.get(self.name, self.name)

    def unavailable_reason(self) -> str | None:
        return None

    def prepare(self, inputs: DecodeInputs, config: DecodeConfig) -> tuple[Callable, dict]:
        raise NotImplementedError


class FagenDecode(DecodeSystem):
    def __init__(self, paged: bool):
        self.paged = paged
        self.name = "fagen_paged" if paged else "fagen"

    def unavailable_reason(self) -> str | None:
        try:
            fagen_decode_functions()
        except Exception as exc:  # noqa: BLE001 - report any import failure
            return f"cannot import fagen's decode functions: {type(exc).__name__}: {exc}"
        return None

    def prepare(self, inputs, config):
        decode = fagen_decode_functions()[0]
        if self.paged:
            def step():
                return decode(inputs.q, inputs.k_pages, inputs.v_pages, cache_seqlens=inputs.cache_seqlens,
                              block_table=inputs.block_table)
        else:
            def step():
                return decode(inputs.q, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.cache_seqlens)
        return step, {"kv_heads_read": config.kv_heads, "gqa": "native"}


class SdpaDecode(DecodeSystem):
    """SDPA pinned to one backend: enable_gqa if the backend takes it (probed with one call),
    else on K/V expanded to every query head beforehand."""

    def __init__(self, name: str):
        self.name, self.backend_name = name, SDPA_BACKENDS[name]

    def unavailable_reason(self) -> str | None:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"torch.nn.attention.sdpa_kernel is missing: {exc}"
        if getattr(SDPBackend, self.backend_name, None) is None:
            return f"this torch has no SDPBackend.{self.backend_name}"
        return None

    def _call(self, q, k, v, gqa: bool):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, self.backend_name)):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).transpose(1, 2)

    def prepare(self, inputs, config):
        import warnings

        q, k, v = inputs.torch_layout()
        with warnings.catch_warnings():   # a refusing backend warns why, then raises
            warnings.simplefilter("ignore")
            try:
                self._call(q, k, v, True)
                return (lambda: self._call(q, k, v, True)), {"kv_heads_read": config.kv_heads, "gqa": "enable_gqa"}
            except Exception as exc:  # noqa: BLE001 - try the expanded form next
                refused = failure_reason(exc, limit=160)
            if context_lost(refused):
                raise NotAvailable(refused)
            k_all, v_all = (t.repeat_interleave(config.group, dim=1) for t in (k, v))
            try:
                self._call(q, k_all, v_all, False)
            except Exception as exc:  # noqa: BLE001
                raise NotAvailable(f"enable_gqa: {refused}; on expanded K/V: {failure_reason(exc, limit=160)}") \
                    from None
        return (lambda: self._call(q, k_all, v_all, False)), {
            "kv_heads_read": config.q_heads,
            "gqa": f"K/V expanded to {config.q_heads} heads beforehand (enable_gqa refused: {refused})"}


class FlexDecode(DecodeSystem):
    """torch.compile(flex_attention) with enable_gqa and no block mask."""

    name = "flex"

    def __init__(self, flex: FlexSystem | None = None):
        self.flex = flex or FlexSystem()

    def unavailable_reason(self) -> str | None:
        return self.flex.unavailable_reason()

    def prepare(self, inputs, config):
        q, k, v = inputs.torch_layout()
        flex = self.flex._function()
        return (lambda: flex(q, k, v, enable_gqa=True).transpose(1, 2)), {"kv_heads_read": config.kv_heads,
                                                                          "gqa": "enable_gqa"}


def measure_decode(system: DecodeSystem, inputs: DecodeInputs, config: DecodeConfig, timer: Callable[..., Timing],
                   timer_kwargs: dict, *, batch: int, cache_len: int) -> dict:
    """One system's cell: its timing and the bytes it moves (bandwidth: decode_report)."""
    try:
        step, info = system.prepare(inputs, config)
        step()   # the first call compiles or loads the kernel: kept out of the timer's sizing call
        timing = timer(step, **timer_kwargs)
    except Exception as exc:  # noqa: BLE001 - fail soft: the reason goes in the report
        return {"skipped": failure_reason(exc), "oom": is_out_of_memory(exc)}
    cell = timing.to_dict()
    cell.update(bytes=config.decode_bytes(info["kv_heads_read"], batch=batch, cache_len=cache_len),
                kv_heads_read=info["kv_heads_read"], expanded=info["kv_heads_read"] != config.kv_heads,
                gqa=info["gqa"], host_bound=timing.host_ms >= 0.9 * timing.median_ms)
    return cell


def decode_sanity(system: DecodeSystem, config: DecodeConfig, device) -> dict:
    """fagen's step on the small shape against fp32 torch, next to bf16 torch (2x rule)."""
    import torch

    batch, cache_len = config.sanity_shape
    inputs = make_decode_inputs(config, batch, cache_len, device)
    try:
        out = system.prepare(inputs, config)[0]()
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": failure_reason(exc)}
    k, v = (t.repeat_interleave(config.group, dim=2) for t in (inputs.k_cache, inputs.v_cache))
    ref = torch_attention(inputs.q, k, v, False, torch.float32)
    same = torch_attention(inputs.q, k, v, False, inputs.q.dtype)
    err, err_pt = [(x.float() - ref).abs().max().item() for x in (out, same)]
    return {"fwd_err": err, "fwd_torch_err": err_pt, "ok": bool(err <= 2 * err_pt + 1e-4),
            "shape": f"B={batch} cache {cache_len}"}


# -- varlen training --------------------------------------------------------------------------

@dataclass
class Documents:
    """Documents packed back to back, and the same padded to the longest."""

    lengths: list
    cu_seqlens: object      # int32 (B + 1,)
    seqlens: object         # int32 (B,)
    packed: tuple           # q, k, v (total, H, d), requiring grad
    padded: tuple           # q, k, v (B, N_max, H, d), the same rows, zeros past each end

    @property
    def max_len(self) -> int:
        return max(self.lengths)


def make_documents(lengths: list[int], heads: int, head_dim: int, dtype: str, device) -> Documents:
    import torch

    total, batch, longest = sum(lengths), len(lengths), max(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    packed = [torch.randn(total, heads, head_dim, device=device, dtype=torch_dtype(dtype)) for _ in range(3)]
    padded = [torch.zeros(batch, longest, heads, head_dim, device=device, dtype=torch_dtype(dtype)) for _ in range(3)]
    for b, n in enumerate(lengths):
        for flat, batched in zip(packed, padded):
            batched[b, :n] = flat[starts[b]:starts[b] + n]
    return Documents(list(lengths), torch.tensor(starts, device=device, dtype=torch.int32),
                     torch.tensor(lengths, device=device, dtype=torch.int32),
                     tuple(t.requires_grad_() for t in packed), tuple(t.requires_grad_() for t in padded))


class VarlenSystem(System):
    """A varlen-training contender; `packed` says which of the Documents' tensors it takes."""

    packed = False

    def __init__(self, docs: Documents | None = None):
        self.docs = docs

    @property
    def label(self) -> str:
        return DECODE_LABELS.get(self.name, self.name)

    def inputs(self) -> tuple:
        return self.docs.packed if self.packed else self.docs.padded

    def prepare(self) -> dict:
        """Choose what to run (before timing); extra fields for the system's cells."""
        return {}


class FagenVarlen(VarlenSystem):
    name, is_fagen, packed = "fagen_varlen", True, True

    def forward(self, q, k, v, causal: bool):
        docs = self.docs
        return fagen_decode_functions()[1](q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_len, docs.max_len,
                                           causal=causal)


class FagenPadded(VarlenSystem):
    """flash_attn_func, causal, on the right-padded batch. Without seqlens_k: fagen aligns
    causal to each entry's own key count (bottom-right), so seqlens_k would shift a short
    document's diagonal by its padding; causal alone keeps every document's rows off its
    padding (the padding rows' work is the waste a padded batch pays)."""

    name, is_fagen = "fagen_padded", True

    def forward(self, q, k, v, causal: bool):
        from fagen import flash_attn_func

        return flash_attn_func(q, k, v, causal=causal)


class SdpaPadded(VarlenSystem):
    """SDPA's flash backend on the padded batch, else its efficient one (probed forward)."""

    name = "sdpa_padded"
    BACKENDS = ("sdpa_flash", "sdpa_efficient")

    def __init__(self, docs: Documents | None = None):
        super().__init__(docs)
        self.sdpa = None

    def forward(self, q, k, v, causal: bool):
        return (self.sdpa or SdpaSystem(self.BACKENDS[0])).forward(q, k, v, causal)

    def prepare(self) -> dict:
        import warnings

        refused = []
        for backend in self.BACKENDS:
            self.sdpa = SdpaSystem(backend)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.forward(*self.inputs(), True)
                return {"backend": DECODE_LABELS.get(backend, backend)}
            except Exception as exc:  # noqa: BLE001 - the next backend, or a skipped cell
                refused.append(f"{backend}: {failure_reason(exc, limit=120)}")
        raise NotAvailable("; ".join(refused))


def varlen_sanity(system: VarlenSystem, docs: Documents, causal: bool = True) -> dict:
    """A varlen system's output on each document's rows against each document alone in fp32
    torch, next to bf16 torch (2x forward; 3x gradients where the inputs are packed)."""
    import torch

    q, k, v = docs.packed
    starts = docs.cu_seqlens.tolist()

    def per_document(dtype):
        return torch.cat([torch_attention(*(t[s:e].unsqueeze(0) for t in (q, k, v)), causal, dtype).squeeze(0)
                          for s, e in zip(starts[:-1], starts[1:])])

    try:
        out = system.forward(*system.inputs(), causal)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": failure_reason(exc)}
    if not system.packed:   # the padded rows: each document's first L of its entry
        out = torch.cat([out[b, :n] for b, n in enumerate(docs.lengths)])
    ref, same = per_document(torch.float32), per_document(q.dtype)
    err, err_pt = [(x.float() - ref).abs().max().item() for x in (out, same)]
    result = {"fwd_err": err, "fwd_torch_err": err_pt, "ok": bool(err <= 2 * err_pt + 1e-4)}
    if system.packed:
        add_gradient_errors(result, out, ref, same, (q, k, v))
    return result


# -- the section ------------------------------------------------------------------------------

def default_factories() -> dict[str, Callable[[], object]]:
    """Per system name, a function making the system (varlen ones get their Documents later)."""
    factories: dict[str, Callable[[], object]] = {
        "fagen": lambda: FagenDecode(paged=False), "fagen_paged": lambda: FagenDecode(paged=True),
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
        _free_memory(device)   # an expanded peer's copies
        run.log(f"  decode {systems[name].label}: " + (f"{cell['ms']:.3f} ms, {cell['bytes'] / cell['ms'] / 1e9:.2f} "
                                                       "TB/s" if "ms" in cell else cell["skipped"]))
        if context_lost(cell.get("skipped", "")):
            return run.lost(systems[name].label, cell["skipped"])
        run.checkpoint()
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


def run_decode_section(plan: Plan, deadline: Deadline, *, device="cuda", timer: Callable[..., Timing] = time_cuda,
                       log: Callable[[str], None] = print, checkpoint: Callable[[dict], None] | None = None,
                       copy_tb_per_s: float | None = None, measure_copy: Callable[[], dict] | None = None,
                       factories: dict | None = None) -> dict:
    """Both parts within `deadline`: the decoding step (FlexAttention's compile last, after
    varlen, so that it cannot crowd out the rest), and varlen training."""
    from .decode_report import add_bandwidth, add_varlen_ratios, section_note

    config = plan.decode
    run = _Section(config, deadline, log, checkpoint)
    if not config.enabled:
        run.data["note"] = "no decode section in this plan"
        return run.data
    factories = factories or default_factories()
    timer_kwargs = {"warmup": plan.warmup, "min_repeats": plan.min_repeats, "max_repeats": plan.max_repeats,
                    "target_ms": plan.target_ms}
    if config.decode_systems:
        run.data["copy"] = _copy_bandwidth(copy_tb_per_s, measure_copy or (lambda: measure_copy_bandwidth(COPY_BYTES)))
    first = [n for n in config.decode_systems if n != "flex"]
    parts = [lambda: _decode_part(run, factories, device, timer, timer_kwargs, first),
             lambda: _varlen_part(run, factories, device, timer, timer_kwargs),
             lambda: _decode_part(run, factories, device, timer, timer_kwargs,
                                  [n for n in config.decode_systems if n == "flex"])]
    started = time.monotonic()
    for part in parts:
        stopped = part()
        if stopped is not None:
            return stopped
        _free_memory(device)
    add_bandwidth(run.data)
    add_varlen_ratios(run.data)
    run.data["seconds"] = round(time.monotonic() - started, 1)
    if run.data["not_run"]:
        run.data["status"] = "partial"
    run.data["note"] = section_note(run.data)
    log("  " + run.data["note"])
    run.checkpoint()
    return run.data

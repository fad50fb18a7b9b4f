"""The variants section: fagen's attention variants against FlexAttention with the same mod.

One point, the sweep's longest (bf16, d = 128, N = 16k, B = 1, H = 16, causal), and per
variant (config.VariantsConfig.cases):

  window    flash_attn_func(..., window_size=(W, 0))      Flex: mask_mod causal & q - k <= W
  softcap   flash_attn_func(..., softcap=C)               Flex: score_mod C tanh(score / C)
  alibi     flash_attn_func(..., alibi_slopes=slopes)     Flex: score_mod score - slope[h] |q - k|
  document  flash_attn_func(..., mask_mod=doc[b, q] == doc[b, k])
                                                          Flex: mask_mod causal & the same

with slopes = 2^(-8 i / H), i = 1..H (fp32, (H,)) and doc the int32 ids of a few documents
of random lengths (seeded: config.VariantsConfig.document_lengths). Each is timed forward and
forward + backward in

  fagen_v2        fagen with the variant
  fagen_sm90      the same on the sm90 family (its own backward; compute capability 9.0)
  flex            torch.compile(flex_attention) with the same mod (a block mask from
                  create_block_mask for the masks, the causal one for the score mods)
  sdpa_flash      SDPA's flash backend, plain causal: SDPA expresses none of these mods
                  except through a dense N x N mask, so it is the no-mod peer
  fagen_v2_nomod  fagen without the mod (plain causal)

The two no-mod peers are measured once and their cells are copied into every variant's
rows (marked "shared"), so each row holds fagen and its three peers side by side, in the
speed sweep's point structure, and `speed.markdown.add_ratios` gives fagen / each peer.

FLOPs are the sweep's causal count (4 N^2 d H B / 2 forward, x3.5 for both passes) for
every variant: a mask that hides more keys therefore shows as a higher rate, and each row
says what share of the causal keys its variant leaves visible.

Every fagen variant kernel is first checked on a small problem (plan.sanity_shape) against
the same variant written densely in fp32 torch, next to the same in bf16 torch (the sweep's
rule: 2x forward, 3x gradients). Failing soft: a cell that cannot run records its reason,
and FlexAttention stops when its compile allowance is spent or too little time is left.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from ...arch_families import SM90
from ..measure import FLEX_FIRST_COMPILE_S, GUARD_REASON, add_gradient_errors, context_lost, make_inputs, measure_system
from ..peers import FagenSystem, FlexSystem, NotAvailable, SdpaSystem, System, failure_reason
from ..sizes import short_seqlen
from ..speed.config import skipped_cells, timed_passes
from ..speed.markdown import add_ratios
from ..timing import Deadline, Timing, time_cuda
from .config import FAGEN_VARIANT_SYSTEMS, NO_MOD_SYSTEMS, VARIANT_LABELS, VARIANT_SHORT, VariantsConfig

SHARED_NOTE = "plain causal, measured once for every variant"
# The order FlexAttention's cases run in (each costs a compile; the allowance may stop them).
FLEX_ORDER = ("document", "window", "softcap", "alibi")


def alibi_slopes(heads: int) -> list[float]:
    """The standard ALiBi slopes 2^(-8 i / H), i = 1..H."""
    return [2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)]


@dataclass
class VariantCase:
    """One variant at one size: how fagen is called, FlexAttention's mods, and the same
    variant densely in torch (the sanity checks' reference)."""

    name: str
    label: str
    seqlen: int
    window: int | None = None       # keys q - window .. q (causal)
    softcap: float = 0.0
    slopes: object = None           # fp32 (H,)
    doc: object = None              # int32 (B, N) document ids
    _block_masks: dict = field(default_factory=dict, repr=False)

    # -- fagen -----------------------------------------------------------------------
    @property
    def fagen_kwargs(self) -> dict:
        """flash_attn_func's keywords for this variant (causal is passed on its own)."""
        kwargs: dict = {}
        if self.window is not None:
            kwargs["window_size"] = (self.window, 0)
        if self.softcap:
            kwargs["softcap"] = self.softcap
        if self.slopes is not None:
            kwargs["alibi_slopes"] = self.slopes
        if self.doc is not None:
            doc = self.doc
            kwargs["mask_mod"] = lambda b, h, q_idx, kv_idx: doc[b, q_idx] == doc[b, kv_idx]
        return kwargs

    # -- FlexAttention -------------------------------------------------------------------
    @property
    def flex_score_mod(self):
        if self.softcap:
            cap = self.softcap

            def softcap_mod(score, b, h, q_idx, kv_idx):
                import torch

                return cap * torch.tanh(score / cap)

            return softcap_mod
        if self.slopes is not None:
            slopes = self.slopes

            def alibi_mod(score, b, h, q_idx, kv_idx):
                return score - slopes[h] * (q_idx - kv_idx).abs()

            return alibi_mod
        return None

    @property
    def flex_mask_mod(self):
        """The whole visibility condition, causal included (Nq == Nk: top-left = bottom-right)."""
        if self.window is not None:
            window = self.window

            def window_mask(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

            return window_mask
        if self.doc is not None:
            doc = self.doc

            def document_mask(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

            return document_mask

        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return causal_mask

    def block_mask(self, batch: int, seqlen: int, device):
        """FlexAttention's block mask for this variant, built once per shape."""
        key = (batch, seqlen, str(device))
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            per_batch = batch if self.doc is not None else None   # only document ids depend on b
            self._block_masks[key] = create_block_mask(self.flex_mask_mod, per_batch, None, seqlen, seqlen,
                                                       device=device)
        return self._block_masks[key]

    # -- dense torch ------------------------------------------------------------------------
    def dense(self, q, k, v, compute_dtype):
        """The variant in plain torch ops in `compute_dtype`, (B, N, H, d) in and out."""
        import torch

        qh, kh, vh = (x.transpose(1, 2).to(compute_dtype) for x in (q, k, v))
        n = q.shape[1]
        scores = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        i = torch.arange(n, device=q.device).unsqueeze(1)
        j = torch.arange(n, device=q.device).unsqueeze(0)
        if self.softcap:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if self.slopes is not None:
            scores = scores - self.slopes.to(compute_dtype).view(1, -1, 1, 1) * (i - j).abs().to(compute_dtype)
        visible = j <= i
        if self.window is not None:
            visible = visible & (i - j <= self.window)
        if self.doc is not None:
            visible = visible & (self.doc[:, None, :, None] == self.doc[:, None, None, :])
        scores = scores.masked_fill(~visible, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)


def document_ids(config: VariantsConfig, batch: int, seqlen: int, device):
    """int32 (B, N): the ids of the config's documents, the same in every batch entry."""
    import torch

    lengths = torch.tensor(config.document_lengths(seqlen))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return ids.to(torch.int32).unsqueeze(0).expand(batch, seqlen).contiguous().to(device)


def make_case(name: str, config: VariantsConfig, *, batch: int, seqlen: int, heads: int,
              device) -> VariantCase:
    import torch

    case = VariantCase(name, config.case_label(name), seqlen)
    if name == "window":
        case.window = config.window_for(seqlen)
    elif name == "softcap":
        case.softcap = float(config.softcap)
    elif name == "alibi":
        case.slopes = torch.tensor(alibi_slopes(heads), dtype=torch.float32, device=device)
    elif name == "document":
        case.doc = document_ids(config, batch, seqlen, device)
    else:
        raise ValueError(f"unknown variant {name!r}")
    return case


# -- the systems ---------------------------------------------------------------------------

class FagenVariant(FagenSystem):
    """fagen v2 with the case's variant; with `family` sm90 (arch_families.SM90), its forward on the Hopper family
    (FagenSystem's: FAGEN_ARCH_FAMILY around each call, compute capability 9.0 only)."""

    def __init__(self, case: VariantCase, family: str = ""):
        super().__init__(2, family)
        self.case = case

    def forward(self, q, k, v, causal: bool):
        return self.call(q, k, v, causal=causal, version=2, **self.case.fagen_kwargs)


class FlexVariant(FlexSystem):
    """torch.compile(flex_attention) with the case's mods; every case shares one compiled
    function (`shared`), so Dynamo compiles one graph per mod."""

    def __init__(self, case: VariantCase, shared: FlexSystem | None = None):
        super().__init__()
        self.case, self.shared = case, shared or self

    def forward(self, q, k, v, causal: bool):
        if not causal or q.shape[1] != k.shape[1]:
            raise NotAvailable("the variants' Flex masks are causal with Nq == Nk")
        block_mask = self.case.block_mask(q.shape[0], q.shape[1], q.device)
        out = self.shared._function()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      score_mod=self.case.flex_score_mod, block_mask=block_mask)
        return out.transpose(1, 2)


class Renamed(System):
    """Another system under another name (fagen v2 without the mod, beside fagen v2 with it)."""

    is_fagen = False

    def __init__(self, system: System, name: str):
        self.system, self.name = system, name

    @property
    def label(self) -> str:
        return VARIANT_LABELS.get(self.name, self.name)

    def unavailable_reason(self) -> str | None:
        return self.system.unavailable_reason()

    def forward(self, q, k, v, causal: bool):
        return self.system.forward(q, k, v, causal)


def default_factories() -> dict[str, Callable]:
    """Per system: a function of the case (None for the no-mod peers) giving the System."""
    shared_flex = FlexSystem()
    return {"fagen_v2": lambda case: FagenVariant(case), "fagen_sm90": lambda case: FagenVariant(case, SM90.name),
            "flex": lambda case: FlexVariant(case, shared_flex),
            "sdpa_flash": lambda case: SdpaSystem("sdpa_flash"),
            "fagen_v2_nomod": lambda case: Renamed(FagenSystem(2), "fagen_v2_nomod")}


# -- sanity: is the fast variant also right? ----------------------------------------------

def variant_sanity(system: System, case: VariantCase, q, k, v) -> dict:
    """Max errors of a fagen variant against the variant densely in fp32 torch, next to
    those of bf16 torch (2x forward, 3x gradients, as in the sweep)."""
    import torch

    try:
        out = system.forward(q, k, v, True)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": failure_reason(exc)}
    ref = case.dense(q, k, v, torch.float32)
    same = case.dense(q, k, v, q.dtype)
    err, err_pt = [(x.float() - ref).abs().max().item() for x in (out, same)]
    result = {"fwd_err": err, "fwd_torch_err": err_pt, "ok": bool(err <= 2 * err_pt + 1e-4)}
    add_gradient_errors(result, out, ref, same, (q, k, v))
    return result


# -- the section ------------------------------------------------------------------------------

def run_variant_sweep(plan, deadline: Deadline, *, device="cuda",
                      timer: Callable[..., Timing] = time_cuda, log: Callable[[str], None] = print,
                      checkpoint: Callable[[dict], None] | None = None,
                      clock: Callable[[], float] = time.monotonic,
                      factories: dict[str, Callable] | None = None) -> dict:
    """Time every variant of `plan.variants` in every system, within `deadline`."""
    config = plan.variants
    section: dict = {"status": "ok", "note": "", "config": {"label": config.label, "passes": list(config.passes),
                                                          "cases": list(config.cases)},
                     "systems": {}, "points": [], "sanity": {}, "not_run": 0, "flex_seconds": 0.0,
                     "sdpa": "SDPA expresses none of these mods except through a dense N x N mask: its "
                             "flash backend runs plain causal attention as the no-mod peer"}
    if not config.cases:
        section["note"] = "no variants in this plan"
        return section
    factories = factories or default_factories()
    names = [s for s in config.systems if s in factories]
    batch, seqlen, heads = config.batch, config.seqlen, config.heads
    flops = {p: config.flops(p) for p in config.passes}
    causal_pairs = config.visible_pairs("softcap")   # a variant that hides no key
    cases = {name: make_case(name, config, batch=batch, seqlen=seqlen, heads=heads, device=device)
             for name in config.cases}
    runnable = []
    for name in names:
        probe = factories[name](None if name in NO_MOD_SYSTEMS else cases[config.cases[0]])
        reason = probe.unavailable_reason()
        section["systems"][name] = {"label": probe.label, "available": reason is None, "reason": reason,
                                    "with_mod": name not in NO_MOD_SYSTEMS}
        if reason is None:
            runnable.append(name)
        else:
            log(f"  {probe.label}: not available ({reason})")
    points: dict = {}
    for case in config.cases:
        for p in config.passes:
            point = {"pass": p, "variant": case, "label": cases[case].label, "dtype": config.dtype,
                     "head_dim": config.head_dim, "causal": config.causal, "seqlen": seqlen, "batch": batch,
                     "heads": heads, "flops": flops[p], "visible_pairs": config.visible_pairs(case),
                     "visible_share": config.visible_pairs(case) / causal_pairs, "results": {}}
            points[case, p] = point
            section["points"].append(point)
    for name in names:
        if name not in runnable:
            for point in points.values():
                point["results"][name] = {"skipped": f"not available: {section['systems'][name]['reason']}"}
    timer_kwargs = {"warmup": plan.warmup, "min_repeats": plan.min_repeats, "max_repeats": plan.max_repeats,
                    "target_ms": plan.target_ms}
    inputs = None

    def record(name: str, case: str | None, cells: dict) -> str | None:
        """Put a system's cells in its rows (every row for a no-mod peer); a lost context's reason."""
        targets = config.cases if case is None else (case,)
        for c in targets:
            for p, cell in cells.items():
                points[c, p]["results"][name] = dict(cell, shared=SHARED_NOTE) if case is None else cell
        return next((c["skipped"] for c in cells.values() if "skipped" in c and context_lost(c["skipped"])), None)

    def skip(name: str, case: str | None, reason: str) -> None:
        if reason.startswith(GUARD_REASON):
            section["not_run"] += len(timed_passes(name, config.passes))
        record(name, case, skipped_cells(name, config.passes, reason))

    def lost(where: str, reason: str) -> dict:
        section["status"] = "error"
        section["note"] = f"the CUDA context was lost at {where}: {reason}; the section stopped there"
        log("  " + section["note"])
        if checkpoint is not None:
            checkpoint(section)
        return section

    def measure(name: str, case: str | None) -> tuple[dict, float]:
        nonlocal inputs
        if inputs is None:
            inputs = make_inputs(batch, seqlen, heads, config.head_dim, config.dtype, device)
        system = factories[name](None if case is None else cases[case])
        started = clock()
        cells = measure_system(system, *inputs, config.causal, config.passes, flops, timer, timer_kwargs)
        return cells, clock() - started

    # 1. The no-mod peers, once.
    for name in [n for n in runnable if n in NO_MOD_SYSTEMS]:
        if deadline.expired(1.0):
            skip(name, None, GUARD_REASON)
            continue
        cells, _ = measure(name, None)
        reason = record(name, None, cells)
        if reason is not None:
            return lost(VARIANT_SHORT.get(name, name), reason)
    # 2. fagen with each variant (v2, then its forward on the sm90 family): a sanity check on a
    #    small problem, then the timed point.
    for name in [n for n in FAGEN_VARIANT_SYSTEMS if n in runnable]:
        label = VARIANT_LABELS.get(name, name)
        for case in config.cases:
            if deadline.expired(1.0):
                skip(name, case, GUARD_REASON)
                continue
            sb, sn, sh = plan.sanity_shape
            small = make_case(case, config, batch=sb, seqlen=sn, heads=sh, device=device)
            sanity = variant_sanity(factories[name](small), small,
                                    *make_inputs(sb, sn, sh, config.head_dim, config.dtype, device))
            section["sanity"].setdefault(name, {})[case] = sanity
            fault = sanity.get("error") or sanity.get("bwd_error") or ""
            if context_lost(fault):
                return lost(f"{label}'s {case} sanity check", fault)
            cells, _ = measure(name, case)
            reason = record(name, case, cells)
            if reason is not None:
                return lost(f"{label}, {case}", reason)
            if checkpoint is not None:
                checkpoint(section)
    # 3. FlexAttention with each variant's mod, while its allowance lasts: the masks first
    #    (where block sparsity sets Flex and fagen apart), should the allowance run out.
    for case in sorted(config.cases, key=lambda c: FLEX_ORDER.index(c) if c in FLEX_ORDER else len(FLEX_ORDER)):
        if "flex" not in runnable:
            break
        if deadline.expired(FLEX_FIRST_COMPILE_S):
            skip("flex", case, GUARD_REASON + " (too little left for a Flex compile)")
            continue
        if section["flex_seconds"] > config.flex_allowance_s:
            skip("flex", case, f"skipped: FlexAttention's time allowance ({config.flex_allowance_s:.0f} s) "
                               "is used up")
            continue
        cells, seconds = measure("flex", case)
        section["flex_seconds"] = round(section["flex_seconds"] + seconds, 1)
        reason = record("flex", case, cells)
        if reason is not None:
            return lost(f"FlexAttention, {case}", reason)
        if checkpoint is not None:
            checkpoint(section)
    for case in config.cases:
        log(_progress_line(case, points, names, config.passes))
    add_ratios(section)
    if section["not_run"]:
        section["status"] = "partial"
        section["note"] = f"time guard: {section['not_run']} of {config.timed_runs()} measurements were not run; "
    section["note"] += ratio_note(section)
    bad = [f"{VARIANT_LABELS.get(name, name)} {case}" for name, checked in section["sanity"].items()
           for case, r in checked.items() if not r.get("ok")]
    if bad:
        section["note"] += f"; SANITY FAILED for {', '.join(bad)}"
    if checkpoint is not None:
        checkpoint(section)
    return section


def ratio_note(section: dict) -> str:
    """fagen v2 / Flex per variant and pass, in one line (the section's note), then fagen sm90 /
    Flex where it ran."""
    notes = []
    for name in FAGEN_VARIANT_SYSTEMS:
        parts = []
        for point in section.get("points", []):
            ratio = (point.get("ratios") or {}).get(f"{name}/flex")
            if ratio is not None:
                parts.append(f"{point['variant']} {'fwd' if point['pass'] == 'fwd' else 'f+b'} {ratio:.2f}")
        if parts:
            notes.append(f"{VARIANT_LABELS.get(name, name)} / Flex: " + ", ".join(parts))
    return "; ".join(notes) if notes else "no fagen v2 / Flex ratio"


def _progress_line(case: str, points: dict, names: list[str], passes: tuple) -> str:
    parts = []
    for name in names:
        values = []
        for p in passes:
            cell = points[case, p]["results"].get(name, {})
            values.append(f"{cell['tflops']:.0f}" if "tflops" in cell else "-")
        parts.append(f"{VARIANT_SHORT.get(name, name)} {'/'.join(values)}")
    point = points[case, passes[0]]
    return (f"  variant {case} N={short_seqlen(point['seqlen'])} B={point['batch']} H={point['heads']}: "
            + ", ".join(parts))

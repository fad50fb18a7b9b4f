"""The speed sweep: every (panel, sequence length) point, every system, every pass.

One point's inputs (fresh torch.randn, never zeros: zeros run faster than
real data on tensor cores and hide unwritten outputs) are shared by all
systems, so the numbers in one row of the table are side by side in one run.

Per system and point the passes run in this order, each timed on its own:
  fwd      out = attention(q, k, v) (inputs require grad, as in training, so
           every system saves what its backward needs, as FlashAttention-2's
           benchmark does)
  bwd      torch.autograd.grad(out, (q, k, v), dout) on a kept graph
  fwd_bwd  both in one timed call

Failing soft: any exception becomes {"skipped": reason} for that cell. A
non-memory failure is sticky for the rest of the panel (the same error would
recur at every length and cost time); an out-of-memory failure skips only the
longer lengths of the panel.
"""

from __future__ import annotations

import time
from typing import Callable

from ..measure import (FLEX_FIRST_COMPILE_S, GUARD_REASON, add_gradient_errors, context_lost, free_bytes, free_memory,
                       make_inputs, measure_system, torch_attention)
from ..peers import System, failure_reason, math_fits
from ..sizes import short_seqlen
from ..timing import Deadline, Timing, time_cuda
from .config import SYSTEM_SHORT, SpeedConfig, skipped_cells, timed_passes

# A system whose next point is predicted to need more than this (all passes,
# warm-ups and repeats) is skipped for the rest of the panel: FlashAttention-1
# at 16k tokens on a few heads can take seconds per call, and one cell must not
# eat the budget of the whole sweep.
SLOW_CELL_S = 20.0


# -- sanity: is a fast kernel also right? ---------------------------------------

def sanity_check(system: System, config: SpeedConfig, device, *, batch=2, seqlen=256, heads=4) -> dict:
    """Max errors of a fagen system against fp32 torch on a small problem,
    next to those of same-dtype torch (FlashAttention-2's rule: 2x forward,
    3x gradients). The `gpu` tests are the authority; this flags a fast but
    wrong kernel in the timing table."""
    import torch

    q, k, v = make_inputs(batch, seqlen, heads, config.head_dim, config.dtype, device)
    result: dict = {}
    try:
        out = system.forward(q, k, v, config.causal)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": failure_reason(exc)}
    ref = torch_attention(q, k, v, config.causal, torch.float32)
    same = torch_attention(q, k, v, config.causal, q.dtype)
    err, err_pt = [(x.float() - ref).abs().max().item() for x in (out, same)]
    result.update(fwd_err=err, fwd_torch_err=err_pt, ok=bool(err <= 2 * err_pt + 1e-4))
    add_gradient_errors(result, out, ref, same, (q, k, v))
    return result


# -- the sweep -----------------------------------------------------------------

def run_speed_sweep(plan, systems: list[System], deadline: Deadline, *, device="cuda",
                    timer: Callable[..., Timing] = time_cuda, log: Callable[[str], None] = print,
                    checkpoint: Callable[[dict], None] | None = None,
                    clock: Callable[[], float] = time.monotonic) -> dict:
    """Time every system at every point of the plan, within `deadline`."""
    section: dict = {"status": "ok", "note": "", "systems": {}, "points": [], "sanity": {},
                     "not_run": 0}
    runnable = []
    for system in systems:
        reason = system.unavailable_reason()
        section["systems"][system.name] = {"label": system.label, "available": reason is None,
                                           "reason": reason}
        if reason is None:
            runnable.append(system)
        else:
            log(f"  {system.label}: not available ({reason})")
    timer_kwargs = {"warmup": plan.warmup, "min_repeats": plan.min_repeats,
                    "max_repeats": plan.max_repeats, "target_ms": plan.target_ms}
    flex_spent = 0.0
    flex_compiled_configs: set = set()
    for config in plan.configs():
        heads = plan.heads(config.head_dim)
        sticky: dict[str, str] = {}       # system -> reason, for the rest of this panel
        oom_from: dict[str, int] = {}     # system -> seqlen that ran out of memory
        slowest: dict[str, tuple[float, float]] = {}  # system -> (slowest pass ms, its fwd flops)
        calls_per_cell = (plan.warmup + 1 + plan.min_repeats) * len(plan.passes)
        if not deadline.expired(5.0):
            for system in runnable:
                if system.is_fagen:
                    batch, seqlen, heads_ = plan.sanity_shape
                    sanity = sanity_check(system, config, device, batch=batch, seqlen=seqlen, heads=heads_)
                    section["sanity"].setdefault(system.name, {})[config.label] = sanity
                    fault = sanity.get("error") or sanity.get("bwd_error") or ""
                    if context_lost(fault):
                        section["status"] = "error"
                        section["note"] = (f"the CUDA context was lost in {system.label}'s sanity check "
                                           f"({config.label}): {fault}; the sweep stopped there")
                        log("  " + section["note"])
                        return section
        for seqlen in plan.seqlens:
            batch = plan.batch(seqlen)
            flops = {p: plan.flops(p, config, seqlen) for p in plan.passes}
            points = {p: {"pass": p, "dtype": config.dtype, "head_dim": config.head_dim,
                          "causal": config.causal, "seqlen": seqlen, "batch": batch, "heads": heads,
                          "flops": flops[p], "results": {}} for p in plan.passes}
            section["points"].extend(points.values())
            for system in systems:
                if system.name not in [s.name for s in runnable]:
                    why = section["systems"][system.name]["reason"]
                    for p in plan.passes:
                        points[p]["results"][system.name] = {"skipped": f"not available: {why}"}
            inputs = None
            for system in runnable:
                skip = None
                if deadline.expired(1.0):
                    skip = GUARD_REASON
                elif system.name in sticky:
                    skip = sticky[system.name]
                elif system.name in oom_from:
                    skip = f"skipped: OOM at N={short_seqlen(oom_from[system.name])}"
                elif system.name in slowest and (
                        slowest[system.name][0] * flops[plan.passes[0]] / slowest[system.name][1]
                        * calls_per_cell / 1e3 > SLOW_CELL_S):
                    predicted = slowest[system.name][0] * flops[plan.passes[0]] / slowest[system.name][1]
                    skip = f"skipped: too slow (predicted {predicted / 1e3:.1f} s per call)"
                elif system.name == "flex" and flex_spent > plan.flex_allowance_s:
                    skip = f"skipped: FlexAttention's time allowance ({plan.flex_allowance_s:.0f} s) is used up"
                elif (system.name == "flex" and config not in flex_compiled_configs
                      and deadline.expired(FLEX_FIRST_COMPILE_S)):
                    skip = GUARD_REASON + " (too little left for a Flex compile)"
                else:
                    fits, why = math_fits(system, free_bytes=free_bytes(device), batch=batch,
                                          heads=heads, seqlen=seqlen, head_dim=config.head_dim,
                                          training=True)
                    if not fits:
                        skip = why
                if skip is not None:
                    if skip.startswith(GUARD_REASON):
                        section["not_run"] += len(timed_passes(system.name, plan.passes))
                    for p, cell in skipped_cells(system.name, plan.passes, skip).items():
                        points[p]["results"][system.name] = cell
                    continue
                if inputs is None:
                    inputs = make_inputs(batch, seqlen, heads, config.head_dim, config.dtype, device)
                started = clock()
                cells = measure_system(system, *inputs, config.causal, plan.passes, flops, timer,
                                       timer_kwargs)
                if system.name == "flex":
                    flex_spent += clock() - started
                    flex_compiled_configs.add(config)
                for p, cell in cells.items():
                    points[p]["results"][system.name] = cell
                timed = [c["ms"] for c in cells.values() if "ms" in c]
                if timed:
                    slowest[system.name] = (max(timed), flops[plan.passes[0]])
                failures = [c for c in cells.values() if "skipped" in c]
                lost = next((c["skipped"] for c in failures if context_lost(c["skipped"])), None)
                if lost is not None:
                    section["status"] = "error"
                    section["note"] = (f"the CUDA context was lost at {system.label}, {config.label}, "
                                       f"N={short_seqlen(seqlen)}: {lost}; the sweep stopped there")
                    log("  " + section["note"])
                    if checkpoint is not None:
                        checkpoint(section)
                    return section
                if any(c.get("oom") for c in failures):
                    oom_from[system.name] = seqlen
                    free_memory(device)
                elif any(c.get("stage") == "forward" for c in failures):
                    sticky[system.name] = f"skipped: {failures[0]['skipped']} (as at N={short_seqlen(seqlen)})"
            inputs = None
            free_memory(device)
            log(_progress_line(config, seqlen, batch, points, runnable, plan.passes))
        if checkpoint is not None:
            checkpoint(section)
    if section["not_run"]:
        section["status"] = "partial"
        section["note"] = (f"time guard: {section['not_run']} of {plan.timed_runs()} measurements "
                           "were not run")
    return section


def _progress_line(config, seqlen, batch, points, systems, passes) -> str:
    parts = []
    for system in systems:
        values = []
        for p in passes:
            cell = points[p]["results"].get(system.name, {})
            values.append(f"{cell['tflops']:.0f}" if "tflops" in cell else "-")
        parts.append(f"{SYSTEM_SHORT.get(system.name, system.name)} {'/'.join(values)}")
    return f"  {config.label} N={short_seqlen(seqlen)} B={batch}: " + ", ".join(parts)

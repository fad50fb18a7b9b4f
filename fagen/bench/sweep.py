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

import gc
import math
import time
from typing import Callable

from .flops import tflops
from .peers import NotAvailable, System, failure_reason, is_out_of_memory, math_fits
from .plan import SYSTEM_SHORT, Plan, SpeedConfig, short_seqlen
from .timing import Deadline, Timing, time_cuda

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
GUARD_REASON = "skipped: time guard (the section's deadline was reached)"
# A system whose next point is predicted to need more than this (all passes,
# warm-ups and repeats) is skipped for the rest of the panel: FlashAttention-1
# at 16k tokens on a few heads can take seconds per call, and one cell must not
# eat the budget of the whole sweep.
SLOW_CELL_S = 20.0
# A kernel fault leaves the process's CUDA context unusable: every later
# launch fails with the same error, so the sweep stops instead of recording it
# a thousand times. (The correctness section runs first, in a subprocess, so
# a faulting kernel is normally caught there.)
CONTEXT_LOST_MARKERS = ("illegal memory access", "illegal address", "illegal instruction",
                        "unspecified launch failure", "misaligned address", "device-side assert",
                        "cuda_error_launch", "context is destroyed")


def context_lost(reason: str) -> bool:
    text = reason.lower()
    return any(marker in text for marker in CONTEXT_LOST_MARKERS)
FLEX_FIRST_COMPILE_S = 25.0  # do not start a Flex compile with less than this left


def torch_dtype(name: str):
    import torch

    return getattr(torch, TORCH_DTYPES[name])


def make_inputs(batch: int, seqlen: int, heads: int, head_dim: int, dtype: str, device):
    """q, k, v (B, N, H, d) of standard normal values, requiring grad."""
    import torch

    shape = (batch, seqlen, heads, head_dim)
    return tuple(torch.randn(shape, device=device, dtype=torch_dtype(dtype)).requires_grad_()
                 for _ in range(3))


def _free_memory(device) -> None:
    gc.collect()
    try:
        import torch

        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass


def _free_bytes(device) -> int:
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    return 1 << 62  # CPU tests: never refuse on memory


# -- one measurement ---------------------------------------------------------

def _timed_cell(fn: Callable[[], object], flops: float, timer: Callable[..., Timing],
                timer_kwargs: dict) -> dict:
    timing = timer(fn, **timer_kwargs)
    cell = timing.to_dict()
    cell["tflops"] = tflops(flops, timing.median_ms)
    # The host issuing calls slower than the GPU finishes them means the
    # number is a host-overhead figure, not the kernel's speed.
    cell["host_bound"] = timing.host_ms >= 0.9 * timing.median_ms
    return cell


def measure_system(system: System, q, k, v, causal: bool, passes: tuple, flops: dict,
                   timer: Callable[..., Timing], timer_kwargs: dict) -> dict:
    """{pass: cell} for one system at one point; exceptions become skipped cells."""
    import torch

    cells: dict = {}
    grads = (q, k, v)
    try:
        out = system.forward(q, k, v, causal)  # also the first warm-up (compiles)
    except Exception as exc:  # noqa: BLE001 - fail soft: the reason goes in the report
        reason = failure_reason(exc)
        return {p: {"skipped": reason, "oom": is_out_of_memory(exc), "stage": "forward"} for p in passes}
    dout = torch.randn_like(out)
    no_graph = None
    if not getattr(out, "requires_grad", False) or out.grad_fn is None:
        no_graph = f"{system.label} has no backward here (its output has no grad_fn)"
    # Drop the probe's graph: for the math backend it holds N x N matrices,
    # and the forward timing below builds (and frees) its own each call.
    out = None
    for pass_ in passes:
        try:
            if pass_ == "fwd":
                fn = lambda: system.forward(q, k, v, causal)  # noqa: E731
            elif no_graph is not None:
                raise NotAvailable(no_graph)
            elif pass_ == "bwd":
                out = system.forward(q, k, v, causal)  # one graph, replayed backward
                fn = lambda: torch.autograd.grad(out, grads, dout, retain_graph=True)  # noqa: E731
            else:
                fn = lambda: torch.autograd.grad(system.forward(q, k, v, causal), grads, dout)  # noqa: E731
            cells[pass_] = _timed_cell(fn, flops[pass_], timer, timer_kwargs)
        except Exception as exc:  # noqa: BLE001
            cells[pass_] = {"skipped": failure_reason(exc), "oom": is_out_of_memory(exc)}
        out = None
    return cells


# -- sanity: is a fast kernel also right? ---------------------------------------

def torch_attention(q, k, v, causal: bool, compute_dtype):
    """softmax(Q K^T / sqrt(d)) V in `compute_dtype` with plain torch ops, (B, N, H, d)."""
    import torch

    qh, kh, vh = (x.transpose(1, 2).to(compute_dtype) for x in (q, k, v))
    scores = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        i = torch.arange(nq, device=q.device).unsqueeze(1)
        j = torch.arange(nk, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(j > i + nk - nq, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)


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

def run_speed_sweep(plan: Plan, systems: list[System], deadline: Deadline, *, device="cuda",
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
                    fits, why = math_fits(system, free_bytes=_free_bytes(device), batch=batch,
                                          heads=heads, seqlen=seqlen, head_dim=config.head_dim,
                                          training=True)
                    if not fits:
                        skip = why
                if skip is not None:
                    if skip == GUARD_REASON or skip.startswith(GUARD_REASON):
                        section["not_run"] += len(plan.passes)
                    for p in plan.passes:
                        points[p]["results"][system.name] = {"skipped": skip}
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
                    _free_memory(device)
                elif any(c.get("stage") == "forward" for c in failures):
                    sticky[system.name] = f"skipped: {failures[0]['skipped']} (as at N={short_seqlen(seqlen)})"
            inputs = None
            _free_memory(device)
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


def add_gradient_errors(result: dict, out, ref, same, inputs) -> None:
    """dq, dk, dv errors of `out` against fp32 `ref`, beside the same-dtype `same`'s (the 3x rule),
    into `result`; a missing backward or a failing one is recorded, not raised."""
    import torch

    if not (getattr(out, "requires_grad", False) and out.grad_fn is not None):
        result["bwd_error"] = "no backward (output has no grad_fn)"
        return
    dout = torch.randn_like(out)
    try:
        ours = torch.autograd.grad(out, inputs, dout)
        refs = torch.autograd.grad(ref, inputs, dout.float())
        pts = torch.autograd.grad(same, inputs, dout)
        for name, a, r, p in zip(("dq", "dk", "dv"), ours, refs, pts):
            e, e_pt = (a.float() - r).abs().max().item(), (p.float() - r).abs().max().item()
            result[f"{name}_err"], result[f"{name}_torch_err"] = e, e_pt
            result["ok"] = bool(result["ok"] and e <= 3 * e_pt + 1e-4)
    except Exception as exc:  # noqa: BLE001
        result["bwd_error"] = failure_reason(exc)

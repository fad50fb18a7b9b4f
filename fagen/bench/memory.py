"""Peak GPU memory against sequence length: linear for FlashAttention, quadratic for math.

One (B=1) problem grows to 64k tokens. Per system and length we record the
peak bytes torch's allocator reached during a forward pass and during a
forward + backward pass, above what the inputs (q, k, v, dout) already held.
fagen allocates its outputs and statistics through torch, so the allocator's
peak is its peak too.

The math backend materialises N x N fp32 matrices and runs out of memory at
some length: that is recorded as "OOM", and longer lengths are not tried.
"""

from __future__ import annotations

from typing import Callable

from .peers import System, failure_reason, is_out_of_memory
from .plan import Plan, short_seqlen
from .sweep import GUARD_REASON, _free_memory, make_inputs
from .timing import Deadline


def peak_memory(system: System, q, k, v, dout, causal: bool) -> dict:
    """Peak allocator bytes above the inputs, forward and forward + backward."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = system.forward(q, k, v, causal)
    torch.cuda.synchronize()
    result = {"fwd_peak_bytes": torch.cuda.max_memory_allocated() - base}
    if getattr(out, "requires_grad", False) and out.grad_fn is not None:
        torch.autograd.grad(out, (q, k, v), dout)  # the peak is recorded; the grads can go
        torch.cuda.synchronize()
        result["fwd_bwd_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    else:
        result["note"] = "forward only (no backward)"
    return result


def run_memory_sweep(plan: Plan, systems: dict[str, System], deadline: Deadline, *, device="cuda",
                     log: Callable[[str], None] = print) -> dict:
    import torch

    cfg = plan.memory
    section: dict = {"status": "ok", "note": "", "config": {
        "dtype": cfg.dtype, "head_dim": cfg.head_dim, "heads": cfg.heads, "batch": cfg.batch,
        "causal": cfg.causal}, "points": [],
        "total_bytes": torch.cuda.get_device_properties(device).total_memory}
    oom_from: dict[str, int] = {}
    guard_hit = False
    for seqlen in cfg.seqlens:
        point = {"seqlen": seqlen, "results": {}}
        section["points"].append(point)
        inputs = None
        for name in cfg.systems:
            system = systems.get(name)
            if system is None or system.unavailable_reason() is not None:
                why = "unknown system" if system is None else system.unavailable_reason()
                point["results"][name] = {"status": "skipped", "note": f"not available: {why}"}
                continue
            if name in oom_from:
                point["results"][name] = {"status": "OOM",
                                          "note": f"not tried: OOM at N={short_seqlen(oom_from[name])}"}
                continue
            if deadline.expired(2.0):
                guard_hit = True
                point["results"][name] = {"status": "skipped", "note": GUARD_REASON}
                continue
            try:
                if inputs is None:
                    q, k, v = make_inputs(cfg.batch, seqlen, cfg.heads, cfg.head_dim, cfg.dtype, device)
                    inputs = (q, k, v, torch.randn_like(q))
                point["results"][name] = {"status": "ok", **peak_memory(system, *inputs, cfg.causal)}
            except Exception as exc:  # noqa: BLE001 - OOM is a result here, not a crash
                if is_out_of_memory(exc):
                    oom_from[name] = seqlen
                    point["results"][name] = {"status": "OOM", "note": "torch.OutOfMemoryError"}
                else:
                    point["results"][name] = {"status": "error", "note": failure_reason(exc)}
            _free_memory(device)
        inputs = None
        _free_memory(device)
        log(f"  memory N={short_seqlen(seqlen)}: " + ", ".join(
            f"{name} {_gib_text(r)}" for name, r in point["results"].items()))
    if guard_hit:
        section["status"] = "partial"
        section["note"] = "time guard: the longest lengths were not measured"
    return section


def _gib_text(result: dict) -> str:
    if result.get("status") != "ok":
        return result.get("status", "?")
    peak = result.get("fwd_bwd_peak_bytes", result.get("fwd_peak_bytes", 0))
    return f"{peak / 2**30:.2f} GiB"

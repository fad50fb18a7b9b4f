"""Peak GPU memory against sequence length: linear for FlashAttention, quadratic for math.

One (B=1) problem grows to 64k tokens. Per system and length we record the
peak bytes torch's allocator reached during a forward pass and during a
forward + backward pass, above what the inputs (q, k, v, dout) already held.
fagen allocates its outputs and statistics through torch, so the allocator's
peak is its peak too.

The math backend materialises N x N fp32 matrices and runs out of memory at
some length: that is recorded as "OOM", and longer lengths are not tried.

One module: the config (MemoryConfig, which plan.Plan holds) and the text (its line in the
plan, the summary, results.md and memory.png, from the results dict alone) are torch-free;
the run imports torch inside its functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .figures import pyplot
from .measure import GUARD_REASON, free_memory, make_inputs
from .peers import System, failure_reason, is_out_of_memory
from .sizes import short_seqlen
from .speed.config import SYSTEM_LABELS, SYSTEM_SHORT
from .timing import Deadline


@dataclass(frozen=True)
class MemoryConfig:
    """The one shape the memory sweep grows: B = 1, forward + backward."""

    dtype: str = "bf16"
    head_dim: int = 128
    heads: int = 16
    batch: int = 1
    causal: bool = False
    seqlens: tuple = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    systems: tuple = ("fagen_v2", "sdpa_math", "sdpa_flash")

    def estimate_seconds(self, cap_s: float) -> float:
        """About 3 s per (length, system), within the section's cap (the plan's memory_cap_s)."""
        return min(cap_s, 3.0 * len(self.seqlens) * len(self.systems))


def plan_lines(mem) -> list[str]:
    return [f"  memory: peak GPU memory, forward + backward, {mem.dtype} d={mem.head_dim} "
            f"H={mem.heads} B={mem.batch}, seqlens {', '.join(short_seqlen(n) for n in mem.seqlens)}; "
            f"systems {', '.join(SYSTEM_LABELS[s] for s in mem.systems)} (OOM recorded)"]


# -- the run ----------------------------------------------------------------------------------

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


def run_memory_sweep(plan, systems: dict[str, System], deadline: Deadline, *, device="cuda",
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
            free_memory(device)
        inputs = None
        free_memory(device)
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


# -- the summary, results.md and the plot -----------------------------------------------------

def summary_lines(results: dict) -> list[str]:
    """The summary's line: peak GiB per length and system."""
    memory = results.get("memory") or {}
    if not memory.get("points"):
        return []
    parts = []
    for point in memory["points"]:
        cells = []
        for name, r in point["results"].items():
            cells.append(f"{SYSTEM_SHORT.get(name, name)} {_memory_text(r)}")
        parts.append(f"{short_seqlen(point['seqlen'])}: " + " ".join(cells))
    return ["peak memory GiB (fwd+bwd): " + "; ".join(parts)]


def _memory_text(r: dict) -> str:
    if r.get("status") == "ok":
        peak = r.get("fwd_bwd_peak_bytes", r.get("fwd_peak_bytes"))
        suffix = "" if "fwd_bwd_peak_bytes" in r else "(f)"
        return f"{peak / 2**30:.2f}{suffix}"
    return r.get("status", "?")


def markdown_lines(results: dict) -> list[str]:
    memory = results.get("memory") or {}
    if not memory.get("points"):
        return []
    names = list(dict.fromkeys(n for p in memory["points"] for n in p["results"]))
    cfg = memory.get("config", {})
    out = ["", "## Peak GPU memory (GiB above the inputs)", "",
           f"{cfg.get('dtype')} d={cfg.get('head_dim')} H={cfg.get('heads')} B={cfg.get('batch')}; "
           "forward + backward, or forward only where marked (f).", "",
           "| N | " + " | ".join(SYSTEM_LABELS.get(n, n) for n in names) + " |",
           "|---:|" + "---:|" * len(names)]
    for point in memory["points"]:
        out.append(f"| {short_seqlen(point['seqlen'])} | "
                   + " | ".join(_memory_text(point["results"].get(n, {})) for n in names) + " |")
    return out


def plot(results: dict, out_dir: Path) -> list[Path]:
    memory = results.get("memory") or {}
    if not memory.get("points"):
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    names = list(dict.fromkeys(n for p in memory["points"] for n in p["results"]))
    for name in names:
        xs, ys, ooms = [], [], []
        for point in memory["points"]:
            r = point["results"].get(name, {})
            peak = r.get("fwd_bwd_peak_bytes", r.get("fwd_peak_bytes")) if r.get("status") == "ok" else None
            if peak is not None:
                xs.append(point["seqlen"])
                ys.append(max(peak, 1) / 2**30)
            elif r.get("status") == "OOM":
                ooms.append(point["seqlen"])
        line = ax.plot(xs, ys, "-o", label=SYSTEM_LABELS.get(name, name))[0] if xs else None
        if ooms:
            top = max(ys) if ys else 1.0
            ax.plot(ooms[:1], [top * 2], "x", markersize=10,
                    color=line.get_color() if line else None, label=f"{SYSTEM_LABELS.get(name, name)} OOM")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    seqlens = [p["seqlen"] for p in memory["points"]]
    ax.set_xticks(seqlens, [short_seqlen(n) for n in seqlens])
    cfg = memory.get("config", {})
    ax.set_title(f"peak memory above inputs, fwd+bwd, {cfg.get('dtype')} d={cfg.get('head_dim')} "
                 f"H={cfg.get('heads')} B={cfg.get('batch')}", fontsize=9)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("GiB")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "memory.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]

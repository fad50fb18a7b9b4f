"""The speed section's text: its lines in the plan, the ratios to the best peer, its block of the
short table, its tables in results.md and its PNG plots.

From the Plan's fields (`plan_lines`) or the results dict alone (no torch), so the CPU tests can
feed it synthetic results. The variants section's rows share the sweep's point structure, and
use `add_ratios` and `system_cells` from here (and `not_run_lines` from ..markdown).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..figures import pyplot
from ..markdown import heading, not_run_lines, sanity_table
from ..sizes import short_seqlen
from .config import COLUMN_SHORT, FAGEN_SYSTEMS, PASS_LABELS, SYSTEM_LABELS, SYSTEM_SHORT, SYSTEMS

PASS_SHORT = {"fwd": "fwd", "bwd": "bwd", "fwd_bwd": "f+b"}


# -- the plan ------------------------------------------------------------------------------

def plan_lines(plan, gpu_test_kernels: int) -> list[str]:
    """The sweep in the plan's text (and the gpu tests' kernels compiled beside its own)."""
    lines = ["  speed: passes " + ", ".join(PASS_LABELS[p] for p in plan.passes)
             + f" (all the time the other sections leave, at least {plan.min_speed_s:.0f} s)"]
    lines.append(f"    dtypes {', '.join(plan.dtypes)}; head dims {', '.join(map(str, plan.head_dims))}"
                 f"; causal {' and '.join('yes' if c else 'no' for c in plan.causal)}")
    lines.append(f"    seqlens {', '.join(short_seqlen(n) for n in plan.seqlens)} at "
                 f"{plan.tokens_per_batch} tokens per batch, hidden {plan.hidden_dim} "
                 f"(heads = {plan.hidden_dim}/d)")
    shapes = ", ".join(f"N={short_seqlen(n)}: B={plan.batch(n)}" for n in plan.seqlens)
    lines.append(f"    batch per seqlen: {shapes}")
    lines.append("    systems: " + ", ".join(SYSTEM_LABELS[s] for s in plan.systems))
    lines.append(f"    panels: {len(plan.configs())} ("
                 + "; ".join(c.label for c in plan.configs()) + ")")
    lines.append(f"    timed runs: {plan.timed_runs()} = {len(plan.configs())} panels x "
                 f"{len(plan.seqlens)} seqlens x {len(plan.passes)} passes x {len(plan.systems)} systems"
                 f"; fagen kernels to compile: {plan.sweep_kernels()} (+{gpu_test_kernels} "
                 "for the gpu tests), in parallel")
    lines.append(f"    timing: CUDA events, {plan.warmup} warm-up, median of {plan.min_repeats}-"
                 f"{plan.max_repeats} repeats (~{plan.target_ms:.0f} ms of GPU time each), fresh "
                 "torch.randn inputs per point; FlexAttention allowance "
                 f"{plan.flex_allowance_s:.0f} s")
    lines.append("    TFLOP/s = 4 N^2 d H B (forward), x2.5 (backward), x3.5 (both), /2 if causal; "
                 "matmul peak: 8192^3 bf16 torch.matmul")
    return lines


# -- derived numbers -----------------------------------------------------------------

def rate(cell: dict | None) -> float | None:
    if cell and isinstance(cell.get("tflops"), (int, float)) and math.isfinite(cell["tflops"]):
        return float(cell["tflops"])
    return None


def add_ratios(speed: dict) -> dict:
    """Per point: the best peer, and fagen / peer ratios (fagen_v2/best too)."""
    for point in speed.get("points", []):
        results = point.get("results", {})
        peers = {name: rate(cell) for name, cell in results.items() if name not in FAGEN_SYSTEMS}
        peers = {name: value for name, value in peers.items() if value is not None}
        best = max(peers, key=peers.get) if peers else None
        point["best_peer"] = best
        ratios = {}
        for fagen in FAGEN_SYSTEMS:
            ours = rate(results.get(fagen))
            if ours is None:
                continue
            for peer, value in peers.items():
                ratios[f"{fagen}/{peer}"] = ours / value
            if best is not None:
                ratios[f"{fagen}/best"] = ours / peers[best]
        point["ratios"] = ratios
    return speed


def systems_in(speed: dict) -> list[str]:
    """Systems with at least one cell, in the standard order (unknown ones last)."""
    seen = {name for point in speed.get("points", []) for name in point.get("results", {})}
    return [s for s in SYSTEMS if s in seen] + sorted(seen - set(SYSTEMS))


def _panels(speed: dict) -> list[tuple]:
    panels = []
    for point in speed.get("points", []):
        key = (point["dtype"], point["head_dim"], point["causal"])
        if key not in panels:
            panels.append(key)
    return panels


def _panel_label(panel: tuple) -> str:
    dtype, d, causal = panel
    return f"{dtype} d={d} {'causal' if causal else 'non-causal'}"


def _available(speed: dict, system: str) -> bool:
    """Whether `system` could run on this machine (the sm90 family: compute capability 9.0)."""
    return (speed.get("systems") or {}).get(system, {}).get("available", True)


def system_cells(point: dict, systems) -> list[str]:
    """One speed row's cells, per system: the rate, "h" where the host bounded it."""
    cells = []
    for s in systems:
        cell = point["results"].get(s)
        text = cell_text(cell, 1)
        if cell and cell.get("host_bound") and rate(cell) is not None:
            text += " h"
        cells.append(text)
    return cells


def cell_text(cell: dict | None, digits: int) -> str:
    value = rate(cell)
    if value is not None:
        return f"{value:.{digits}f}"
    skipped = str((cell or {}).get("skipped", ""))
    if cell and (cell.get("oom") or skipped == "OOM" or skipped.startswith("skipped: OOM")):
        return "oom"
    return "-"


# -- the short table (printed last) ------------------------------------------------------

def short_lines(results: dict) -> list[str]:
    """Compact TFLOP/s table: one block per configuration, one row per (pass, N)."""
    speed = results.get("speed") or {}
    if not speed.get("points"):
        return ["speed: no measurements" + (f" ({speed.get('note')})" if speed.get("note") else "")]
    add_ratios(speed)
    # Columns for systems that ran (or ran out of memory) somewhere; a peer
    # that never ran is a line in results.md, not a column of dashes.
    systems = [s for s in systems_in(speed) if _available(speed, s)
               and (s in FAGEN_SYSTEMS or any(cell_text(p["results"].get(s), 0) != "-" for p in speed["points"]))]
    # Columns 4 wide (TFLOP/s have 3 digits), headed by COLUMN_SHORT.
    header = "pass    N |" + "".join(f"{COLUMN_SHORT.get(s, s)[:3]:>4}" for s in systems) + " | v2/best"
    lines = ["TFLOP/s (4N^2dHB fwd, x2.5 bwd, /2 causal); v2/v1 fagen, s90 fagen's Hopper forward (sm90); "
             "fla/cdn/eff/mth SDPA backends (flash, cuDNN, efficient, math); flx FlexAttention; '-' skipped, "
             "'oom' out of memory (reasons, and sm90 / best peer, in results.md)", header]
    for panel in _panels(speed):
        lines.append(f"-- {_panel_label(panel)}")
        for point in speed["points"]:
            if (point["dtype"], point["head_dim"], point["causal"]) != panel:
                continue
            values = "".join(f"{cell_text(point['results'].get(s), 0):>4}" for s in systems)
            ratio = point.get("ratios", {}).get("fagen_v2/best")
            best = SYSTEM_SHORT.get(point.get("best_peer") or "", "")
            ratio_text = f"{ratio:4.2f} {best}" if ratio is not None else "-"
            pass_ = PASS_SHORT.get(point["pass"], point["pass"])
            lines.append(f"{pass_:<3} {short_seqlen(point['seqlen']):>5} |{values} | {ratio_text}")
    return lines


# -- results.md --------------------------------------------------------------------------

def markdown_lines(results: dict) -> list[str]:
    speed = results.get("speed") or {}
    if not speed.get("points"):
        return []
    add_ratios(speed)
    systems = systems_in(speed)
    hopper = _available(speed, "fagen_sm90")
    out = heading("Speed (TFLOP/s)",
                  "FLOPs as in the FlashAttention-2 paper: 4·N²·d·H·B forward, 2.5× that backward, "
                  "3.5× for forward + backward, halved when causal. 16k tokens per batch (B = 16384/N), "
                  "H·d = 2048. Median of CUDA-event timings; a `h` after a number means the host "
                  "issued calls slower than the GPU ran them (host-bound).", speed.get("note"))
    for pass_ in dict.fromkeys(p["pass"] for p in speed["points"]):
        out += ["", f"### {PASS_LABELS.get(pass_, pass_)}", "",
                "| dtype | d | causal | N | B | " + " | ".join(SYSTEM_LABELS.get(s, s) for s in systems)
                + " | v2 / best peer | v1 / best peer |" + (" sm90 / best peer |" if hopper else ""),
                "|---|---:|---|---:|---:|" + "---:|" * len(systems) + "---:|---:|" + ("---:|" if hopper else "")]
        for point in speed["points"]:
            if point["pass"] != pass_:
                continue
            cells = system_cells(point, systems)
            ratios = point.get("ratios", {})
            best = SYSTEM_LABELS.get(point.get("best_peer") or "", "")
            r2, r1, r90 = (ratios.get(f"{name}/best") for name in ("fagen_v2", "fagen_v1", "fagen_sm90"))
            out.append(f"| {point['dtype']} | {point['head_dim']} | {'yes' if point['causal'] else 'no'} | "
                       f"{short_seqlen(point['seqlen'])} | {point['batch']} | " + " | ".join(cells)
                       + f" | {f'{r2:.2f} ({best})' if r2 is not None else '-'}"
                       + f" | {f'{r1:.2f}' if r1 is not None else '-'} |"
                       + (f" {f'{r90:.2f} ({best})' if r90 is not None else '-'} |" if hopper else ""))
    return out + not_run_lines(speed, "Cells that did not run", SYSTEM_LABELS) + _markdown_sanity(speed)


def _markdown_sanity(speed: dict) -> list[str]:
    sanity = speed.get("sanity") or {}
    if not sanity:
        return []
    return sanity_table("Sanity of the timed fagen kernels (small problem vs fp32 torch)", ("system", "config"),
                        [((SYSTEM_LABELS.get(name, name), label), r) for name, per in sanity.items()
                         for label, r in per.items()], reference="torch")


# -- plots ------------------------------------------------------------------------------

def plot(results: dict, out_dir: Path) -> list[Path]:
    """One PNG per pass: a panel per configuration, TFLOP/s against N per system."""
    speed = results.get("speed") or {}
    if not speed.get("points"):
        return []
    plt = pyplot()
    panels = _panels(speed)
    systems = systems_in(speed)
    matmul = ((results.get("peak") or {}).get("matmul") or {}).get("tflops")
    written = []
    for pass_ in dict.fromkeys(p["pass"] for p in speed["points"]):
        cols = min(4, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, panels):
            _plot_panel(ax, [p for p in speed["points"]
                             if p["pass"] == pass_ and (p["dtype"], p["head_dim"], p["causal"]) == panel],
                        systems, _panel_label(panel))
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        handles, labels = [], []
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=min(7, len(labels)), fontsize=9)
        title = f"{PASS_LABELS.get(pass_, pass_)} on {(results.get('meta') or {}).get('device', '?')}"
        if matmul:
            title += f" (matmul peak {matmul:.0f} TFLOP/s)"
        fig.suptitle(title)
        fig.tight_layout(rect=(0, 0.07, 1, 0.96))
        path = out_dir / f"speed_{pass_}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def _plot_panel(ax, points: list, systems: list, title: str) -> None:
    for system in systems:
        xs = [p["seqlen"] for p in points if rate(p["results"].get(system)) is not None]
        ys = [rate(p["results"][system]) for p in points if rate(p["results"].get(system)) is not None]
        if xs:
            style = "-o" if system in FAGEN_SYSTEMS else "--."
            ax.plot(xs, ys, style, label=SYSTEM_LABELS.get(system, system), linewidth=1.5)
    ax.set_xscale("log", base=2)
    seqlens = sorted({p["seqlen"] for p in points})
    if seqlens:
        ax.set_xticks(seqlens, [short_seqlen(n) for n in seqlens])
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)

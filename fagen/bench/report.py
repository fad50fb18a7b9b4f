"""Results out: results.json, results.md, PNG plots, and the short printed table.

Everything here works from the results dict alone (no torch, no GPU), so the
CPU tests can feed it synthetic results. Files written (the device tool
returns at most 8 files per run, so plots are combined: one figure per pass
with one panel per configuration, and one memory figure):

  results.json      everything, including skipped cells with their reasons
  results.md        the tables, for the issue note
  speed_fwd.png, speed_bwd.png, speed_fwd_bwd.png, memory.png
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from . import decode_report, models_report, ring_report
from .markdown import md as _md
from .markdown import sanity_table
from .plan import (FAGEN_SYSTEMS, PASS_LABELS, SYSTEM_LABELS, SYSTEM_SHORT, SYSTEMS,
                   VARIANT_SYSTEMS, short_seqlen)

JSON_NAME, MD_NAME = "results.json", "results.md"
PASS_SHORT = {"fwd": "fwd", "bwd": "bwd", "fwd_bwd": "f+b"}


# -- derived numbers -----------------------------------------------------------------

def _rate(cell: dict | None) -> float | None:
    if cell and isinstance(cell.get("tflops"), (int, float)) and math.isfinite(cell["tflops"]):
        return float(cell["tflops"])
    return None


def add_ratios(speed: dict) -> dict:
    """Per point: the best peer, and fagen / peer ratios (fagen_v2/best too)."""
    for point in speed.get("points", []):
        results = point.get("results", {})
        peers = {name: _rate(cell) for name, cell in results.items() if name not in FAGEN_SYSTEMS}
        peers = {name: rate for name, rate in peers.items() if rate is not None}
        best = max(peers, key=peers.get) if peers else None
        point["best_peer"] = best
        ratios = {}
        for fagen in FAGEN_SYSTEMS:
            ours = _rate(results.get(fagen))
            if ours is None:
                continue
            for peer, rate in peers.items():
                ratios[f"{fagen}/{peer}"] = ours / rate
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


def _system_cells(point: dict, systems) -> list[str]:
    """One speed row's cells, per system: the rate, "h" where the host bounded it."""
    cells = []
    for s in systems:
        cell = point["results"].get(s)
        text = _cell_text(cell, 1)
        if cell and cell.get("host_bound") and _rate(cell) is not None:
            text += " h"
        cells.append(text)
    return cells


def _cell_text(cell: dict | None, digits: int) -> str:
    rate = _rate(cell)
    if rate is not None:
        return f"{rate:.{digits}f}"
    if cell and (cell.get("oom") or cell.get("skipped") == "OOM" or str(cell.get("skipped", "")).startswith("skipped: OOM")):
        return "oom"
    return "-"


def skip_reasons(speed: dict) -> dict[str, dict[str, int]]:
    """{system: {reason: number of cells}} for every cell that did not run."""
    reasons: dict[str, dict[str, int]] = {}
    for point in speed.get("points", []):
        for name, cell in point.get("results", {}).items():
            if "skipped" in cell:
                per = reasons.setdefault(name, {})
                per[cell["skipped"]] = per.get(cell["skipped"], 0) + 1
    return reasons


# -- the short table (printed last) ------------------------------------------------------

def short_table(results: dict) -> str:
    """Compact TFLOP/s table: one block per configuration, one row per (pass, N); then
    the variants' rows, then the decode section's (decode_report), the models section's
    tokens/s (models_report) and the ring section's (ring_report)."""
    return "\n".join([_short_speed_table(results)] + _short_variants_table(results)
                     + decode_report.short_lines(results) + models_report.short_lines(results)
                     + ring_report.short_lines(results))


def _short_variants_table(results: dict) -> list[str]:
    variants = results.get("variants") or {}
    if not variants.get("points"):
        return []
    add_ratios(variants)
    systems = [s for s in VARIANT_SYSTEMS if any(s in p["results"] for p in variants["points"])]
    label = (variants.get("config") or {}).get("label", "")
    lines = [f"-- variants, {label}: v2, flex with the mod; flsh, v2nm (fagen v2) plain causal; "
             "FLOPs as causal",
             "pass variant  seen |" + "".join(f"{SYSTEM_SHORT.get(s, s)[:5]:>5}" for s in systems)
             + " | v2/flex v2/flsh v2/v2nm"]
    for point in variants["points"]:
        values = "".join(f"{_cell_text(point['results'].get(s), 0):>5}" for s in systems)
        ratios = point.get("ratios", {})
        ratio_text = " ".join(f"{ratios[key]:{width}.2f}" if key in ratios else f"{'-':>{width}}"
                              for key, width in (("fagen_v2/flex", 7), ("fagen_v2/sdpa_flash", 7),
                                                 ("fagen_v2/fagen_v2_nomod", 7)))
        pass_ = PASS_SHORT.get(point["pass"], point["pass"])
        lines.append(f"{pass_:<4} {point['variant'][:8]:<8} {point.get('visible_share', 1.0):4.0%} |{values} | "
                     f"{ratio_text}")
    return lines


def _short_speed_table(results: dict) -> str:
    speed = results.get("speed") or {}
    lines = []
    matmul = (results.get("peak") or {}).get("matmul")
    copy = (results.get("peak") or {}).get("copy")
    device = (results.get("meta") or {}).get("device", "?")
    peak = f"matmul peak {matmul['tflops']:.0f} TFLOP/s ({matmul['what']})" if matmul else "matmul peak: not measured"
    if copy:
        peak += f"; copy {copy['tb_per_s']:.2f} TB/s"
    lines.append(f"== fagen GPU check on {device}: {peak}")
    if not speed.get("points"):
        lines.append("speed: no measurements" + (f" ({speed.get('note')})" if speed.get("note") else ""))
        return "\n".join(lines)
    add_ratios(speed)
    # Columns for systems that ran (or ran out of memory) somewhere; a peer
    # that never ran is a line in results.md, not a column of dashes.
    systems = [s for s in systems_in(speed)
               if s in FAGEN_SYSTEMS or any(_cell_text(p["results"].get(s), 0) != "-" for p in speed["points"])]
    header = "pass    N |" + "".join(f"{SYSTEM_SHORT.get(s, s)[:5]:>5}" for s in systems) + " | v2/best"
    lines.append("TFLOP/s (4N^2dHB fwd, x2.5 bwd, /2 causal); v2/v1 fagen; flsh/cdnn/eff/math SDPA "
                 "backends; flex FlexAttention; '-' skipped, 'oom' out of memory (reasons in results.md)")
    lines.append(header)
    for panel in _panels(speed):
        lines.append(f"-- {_panel_label(panel)}")
        for point in speed["points"]:
            if (point["dtype"], point["head_dim"], point["causal"]) != panel:
                continue
            values = "".join(f"{_cell_text(point['results'].get(s), 0):>5}" for s in systems)
            ratio = point.get("ratios", {}).get("fagen_v2/best")
            best = SYSTEM_SHORT.get(point.get("best_peer") or "", "")
            ratio_text = f"{ratio:4.2f} {best}" if ratio is not None else "-"
            pass_ = PASS_SHORT.get(point["pass"], point["pass"])
            lines.append(f"{pass_:<3} {short_seqlen(point['seqlen']):>5} |{values} | {ratio_text}")
    return "\n".join(lines)


def summary_lines(results: dict) -> list[str]:
    """One line per section: what to read first, after the driver and compiler used."""
    meta = results.get("meta") or {}
    lines = [f"versions: {meta['versions_line']}"] if meta.get("versions_line") else []
    if meta.get("nvrtc"):
        lines.append(f"toolchain: driver {meta.get('driver', '?')}, CUDA runtime {meta.get('cuda', '?')}, "
                     f"NVRTC {meta['nvrtc']}, target {meta.get('nvrtc_target_note', meta.get('nvrtc_target', '?'))}")
    for name, info in (results.get("sections") or {}).items():
        note = f" - {info['note']}" if info.get("note") else ""
        lines.append(f"{name:<12} {info.get('status', '?'):<10} {info.get('seconds', 0):6.1f} s{note}")
    correctness = results.get("correctness") or {}
    if correctness.get("summary"):
        lines.append(f"gpu tests: {correctness['summary']}")
    for failure in (correctness.get("failures") or [])[:8]:
        lines.append(f"  FAILED {failure['test']}: {failure['message'][:160]}")
    sanitizers = results.get("sanitizers") or {}
    for tool, run in (sanitizers.get("runs") or {}).items():
        lines.append(f"compute-sanitizer {tool}: {run.get('status')} {run.get('summary', '')}".rstrip())
    memory = results.get("memory") or {}
    if memory.get("points"):
        parts = []
        for point in memory["points"]:
            cells = []
            for name, r in point["results"].items():
                cells.append(f"{SYSTEM_SHORT.get(name, name)} {_memory_text(r)}")
            parts.append(f"{short_seqlen(point['seqlen'])}: " + " ".join(cells))
        lines.append("peak memory GiB (fwd+bwd): " + "; ".join(parts))
    return lines


def _memory_text(r: dict) -> str:
    if r.get("status") == "ok":
        peak = r.get("fwd_bwd_peak_bytes", r.get("fwd_peak_bytes"))
        suffix = "" if "fwd_bwd_peak_bytes" in r else "(f)"
        return f"{peak / 2**30:.2f}{suffix}"
    return r.get("status", "?")


# -- Markdown -------------------------------------------------------------------------

def markdown(results: dict) -> str:
    meta = results.get("meta") or {}
    out = [f"# fagen GPU check: {meta.get('device', '?')}", ""]
    out.append(" · ".join(f"{k} {v}" for k, v in meta.items() if k != "device" and v is not None))
    out += ["", "## Sections", "", "| section | status | seconds | note |", "|---|---|---:|---|"]
    for name, info in (results.get("sections") or {}).items():
        out.append(f"| {name} | {info.get('status', '?')} | {info.get('seconds', 0):.1f} | "
                   f"{_md(info.get('note', ''))} |")
    peak = results.get("peak") or {}
    if peak:
        out += ["", "## Ceilings measured in this run", ""]
        if peak.get("matmul"):
            out.append(f"- {peak['matmul']['what']}: **{peak['matmul']['tflops']:.1f} TFLOP/s**")
        if peak.get("copy"):
            out.append(f"- {peak['copy']['what']}: **{peak['copy']['tb_per_s']:.2f} TB/s** (read + write)")
    out += _markdown_correctness(results)
    out += _markdown_speed(results)
    out += _markdown_variants(results)
    out += decode_report.markdown_lines(results)
    out += models_report.markdown_lines(results)
    out += ring_report.markdown_lines(results)
    out += _markdown_memory(results)
    out += _markdown_sanitizers(results)
    return "\n".join(out) + "\n"


def _markdown_correctness(results: dict) -> list[str]:
    c = results.get("correctness")
    if not c:
        return []
    out = ["", "## Correctness (`pytest -m gpu`)", "", f"`{c.get('command', '')}`", "",
           f"**{c.get('status')}**: {c.get('summary')}"]
    for failure in c.get("failures", []):
        out.append(f"- FAILED `{failure['test']}`: {_md(failure['message'])}")
    if c.get("skips"):
        out += ["", "Skipped, by reason:"]
        out += [f"- {count} × {_md(reason)}" for reason, count in c["skips"].items()]
    return out


def _markdown_speed(results: dict) -> list[str]:
    speed = results.get("speed") or {}
    if not speed.get("points"):
        return []
    add_ratios(speed)
    systems = systems_in(speed)
    out = ["", "## Speed (TFLOP/s)", "",
           "FLOPs as in the FlashAttention-2 paper: 4·N²·d·H·B forward, 2.5× that backward, "
           "3.5× for forward + backward, halved when causal. 16k tokens per batch (B = 16384/N), "
           "H·d = 2048. Median of CUDA-event timings; a `h` after a number means the host "
           "issued calls slower than the GPU ran them (host-bound)."]
    if speed.get("note"):
        out += ["", f"Note: {_md(speed['note'])}"]
    for pass_ in dict.fromkeys(p["pass"] for p in speed["points"]):
        out += ["", f"### {PASS_LABELS.get(pass_, pass_)}", "",
                "| dtype | d | causal | N | B | " + " | ".join(SYSTEM_LABELS.get(s, s) for s in systems)
                + " | v2 / best peer | v1 / best peer |",
                "|---|---:|---|---:|---:|" + "---:|" * len(systems) + "---:|---:|"]
        for point in speed["points"]:
            if point["pass"] != pass_:
                continue
            cells = _system_cells(point, systems)
            ratios = point.get("ratios", {})
            best = SYSTEM_LABELS.get(point.get("best_peer") or "", "")
            r2, r1 = ratios.get("fagen_v2/best"), ratios.get("fagen_v1/best")
            out.append(f"| {point['dtype']} | {point['head_dim']} | {'yes' if point['causal'] else 'no'} | "
                       f"{short_seqlen(point['seqlen'])} | {point['batch']} | " + " | ".join(cells)
                       + f" | {f'{r2:.2f} ({best})' if r2 is not None else '-'}"
                       + f" | {f'{r1:.2f}' if r1 is not None else '-'} |")
    reasons = skip_reasons(speed)
    if reasons:
        out += ["", "### Cells that did not run", ""]
        for name, per in reasons.items():
            for reason, count in per.items():
                out.append(f"- {SYSTEM_LABELS.get(name, name)}: {_md(reason)} ({count} cells)")
    for name, info in (speed.get("systems") or {}).items():
        if not info.get("available"):
            out.append(f"- {info.get('label', name)} not available: {_md(info.get('reason'))}")
    sanity = speed.get("sanity") or {}
    if sanity:
        out += ["", "### Sanity of the timed fagen kernels (small problem vs fp32 torch)", "",
                "| system | config | ok | fwd err | torch fwd err | dq/dk/dv err (torch) | note |",
                "|---|---|---|---:|---:|---|---|"]
        for name, per in sanity.items():
            for label, r in per.items():
                grads = " / ".join(f"{r[g + '_err']:.2e} ({r[g + '_torch_err']:.2e})"
                                   for g in ("dq", "dk", "dv") if g + "_err" in r) or "-"
                out.append(f"| {SYSTEM_LABELS.get(name, name)} | {label} | {r.get('ok')} | "
                           f"{r.get('fwd_err', float('nan')):.2e} | {r.get('fwd_torch_err', float('nan')):.2e} | "
                           f"{grads} | {_md(r.get('error') or r.get('bwd_error') or '')} |")
    return out


def _markdown_variants(results: dict) -> list[str]:
    variants = results.get("variants") or {}
    if not variants.get("points"):
        return []
    add_ratios(variants)
    systems = [s for s in VARIANT_SYSTEMS if any(s in p["results"] for p in variants["points"])]
    config = variants.get("config") or {}
    out = ["", "## Variants (TFLOP/s)", "",
           f"{config.get('label', '')}. fagen v2 and FlexAttention (torch.compile, block mask) run the same "
           "mod; SDPA flash and fagen v2 (no mod) run plain causal attention, measured once for every row "
           f"({_md(variants.get('sdpa', ''))}). FLOPs are the causal count (4·N²·d·H·B / 2 forward, 3.5× for "
           "forward + backward) for every variant, so a mask that hides keys shows as a higher rate; "
           "'keys seen' is the share of the causal keys the variant leaves visible. Ratios are fagen v2 / peer."]
    if variants.get("note"):
        out += ["", f"Note: {_md(variants['note'])}"]
    ratio_keys = [(f"fagen_v2/{s}", SYSTEM_LABELS.get(s, s)) for s in systems if s != "fagen_v2"]
    for pass_ in dict.fromkeys(p["pass"] for p in variants["points"]):
        out += ["", f"### {PASS_LABELS.get(pass_, pass_)}", "",
                "| variant | keys seen | " + " | ".join(SYSTEM_LABELS.get(s, s) for s in systems) + " | "
                + " | ".join(f"v2 / {label}" for _, label in ratio_keys) + " |",
                "|---|---:|" + "---:|" * (len(systems) + len(ratio_keys))]
        for point in variants["points"]:
            if point["pass"] != pass_:
                continue
            cells = _system_cells(point, systems)
            ratios = point.get("ratios", {})
            out.append(f"| {_md(point.get('label', point['variant']))} | {point.get('visible_share', 1.0):.0%} | "
                       + " | ".join(cells) + " | "
                       + " | ".join(f"{ratios[key]:.2f}" if key in ratios else "-" for key, _ in ratio_keys) + " |")
    reasons = skip_reasons(variants)
    if reasons:
        out += ["", "### Variant cells that did not run", ""]
        for name, per in reasons.items():
            for reason, count in per.items():
                out.append(f"- {SYSTEM_LABELS.get(name, name)}: {_md(reason)} ({count} cells)")
    for name, info in (variants.get("systems") or {}).items():
        if not info.get("available"):
            out.append(f"- {info.get('label', name)} not available: {_md(info.get('reason'))}")
    sanity = (variants.get("sanity") or {}).get("fagen_v2") or {}
    if sanity:
        out += sanity_table("Sanity of the fagen variant kernels (small problem vs the variant in fp32 torch)",
                            "variant", sanity)
    return out


def _markdown_memory(results: dict) -> list[str]:
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


def _markdown_sanitizers(results: dict) -> list[str]:
    s = results.get("sanitizers")
    if not s:
        return []
    out = ["", "## compute-sanitizer", ""]
    if not s.get("runs"):
        return out + [f"{s.get('status')}: {_md(s.get('note', ''))}"]
    for tool, run in s["runs"].items():
        out.append(f"- {tool}: **{run.get('status')}** {run.get('summary', '')} "
                   f"({run.get('seconds', 0):.0f} s)")
    return out


# -- plots ------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on the GPU machine or in CI
    import matplotlib.pyplot as plt

    return plt


def plot_speed(results: dict, out_dir: Path) -> list[Path]:
    """One PNG per pass: a panel per configuration, TFLOP/s against N per system."""
    speed = results.get("speed") or {}
    if not speed.get("points"):
        return []
    plt = _pyplot()
    panels = _panels(speed)
    systems = systems_in(speed)
    matmul = ((results.get("peak") or {}).get("matmul") or {}).get("tflops")
    written = []
    for pass_ in dict.fromkeys(p["pass"] for p in speed["points"]):
        cols = min(4, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, panels):
            points = [p for p in speed["points"]
                      if p["pass"] == pass_ and (p["dtype"], p["head_dim"], p["causal"]) == panel]
            for system in systems:
                xs = [p["seqlen"] for p in points if _rate(p["results"].get(system)) is not None]
                ys = [_rate(p["results"][system]) for p in points if _rate(p["results"].get(system)) is not None]
                if xs:
                    style = "-o" if system in FAGEN_SYSTEMS else "--."
                    ax.plot(xs, ys, style, label=SYSTEM_LABELS.get(system, system), linewidth=1.5)
            ax.set_xscale("log", base=2)
            seqlens = sorted({p["seqlen"] for p in points})
            if seqlens:
                ax.set_xticks(seqlens, [short_seqlen(n) for n in seqlens])
            ax.set_title(_panel_label(panel), fontsize=10)
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
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


def plot_memory(results: dict, out_dir: Path) -> list[Path]:
    memory = results.get("memory") or {}
    if not memory.get("points"):
        return []
    plt = _pyplot()
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


# -- writing ------------------------------------------------------------------------------

def write_json(results: dict, out_dir: Path) -> Path:
    """results.json, written whole to a temporary name and renamed (a run
    killed mid-write leaves the previous complete file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / JSON_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_finite(results), indent=1, default=_json_default, allow_nan=False))
    tmp.replace(path)
    return path


def _json_default(value):
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def _finite(obj):
    """NaN/inf are not JSON; write them as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_report(results: dict, out_dir: Path) -> dict:
    """Write every output file; a plotting failure is noted, not raised."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for key in ("speed", "variants"):
        if results.get(key):
            add_ratios(results[key])
    if results.get("decode"):
        decode_report.add_varlen_ratios(decode_report.add_bandwidth(results["decode"]))
    if results.get("models"):
        models_report.add_rates(results["models"])
    if results.get("ring"):
        ring_report.add_ratios(results["ring"])
    files = {"json": None, "markdown": None, "plots": []}
    notes = results.setdefault("report_notes", [])
    try:
        files["plots"] += [str(p) for p in plot_speed(results, out_dir)]
        files["plots"] += [str(p) for p in plot_memory(results, out_dir)]
    except Exception as exc:  # noqa: BLE001 - plots are a convenience; numbers are in the JSON
        notes.append(f"plots not written: {type(exc).__name__}: {exc}")
    md_path = out_dir / MD_NAME
    md_path.write_text(markdown(results))
    files["markdown"] = str(md_path)
    results["files"] = {"json": str(out_dir / JSON_NAME), "markdown": str(md_path), "plots": files["plots"]}
    files["json"] = str(write_json(results, out_dir))
    return files

"""Results out: results.json, results.md, PNG plots, and the short printed table.

Everything here works from the results dict alone (no torch, no GPU), so the
CPU tests can feed it synthetic results. Each section's own module writes its
part (its rows of the short table, its results.md tables, its plots, the
numbers derived from its cells); this module puts them together in the
sections' order and writes the files. Files written (the device tool returns
at most 8 files per run, so plots are combined: one figure per pass with one
panel per configuration, and one memory figure):

  results.json      everything, including skipped cells with their reasons
  results.md        the tables, for the issue note
  speed_fwd.png, speed_bwd.png, speed_fwd_bwd.png, memory.png
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from . import correctness, memory, peak, selftest_step
from .decode import markdown as decode_md
from .markdown import md as _md
from .models import markdown as models_md
from .ring import markdown as ring
from .speed import markdown as speed_md
from .variants import markdown as variants_md

JSON_NAME, MD_NAME = "results.json", "results.md"


# -- the short table (printed last) ------------------------------------------------------

def short_table(results: dict) -> str:
    """Compact tables: the GPU and its ceilings, then the speed sweep's TFLOP/s (one block per
    configuration, one row per (pass, N)), the variants' rows, the decode section's, the models
    section's tokens/s and the ring section's; last, the self-test's verdicts and what the gpu
    tests measured (tanh.approx's error), so that they come back whatever the device tool cuts
    from the top."""
    return "\n".join([peak.header_line(results)] + speed_md.short_lines(results) + variants_md.short_lines(results)
                     + decode_md.short_lines(results) + models_md.short_lines(results)
                     + ring.short_lines(results) + selftest_step.short_lines(results)
                     + correctness.short_lines(results))


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
    return (lines + selftest_step.summary_lines(results) + correctness.summary_lines(results)
            + memory.summary_lines(results))


# -- Markdown -------------------------------------------------------------------------

def markdown(results: dict) -> str:
    meta = results.get("meta") or {}
    out = [f"# fagen GPU check: {meta.get('device', '?')}", ""]
    out.append(" · ".join(f"{k} {v}" for k, v in meta.items() if k != "device" and v is not None))
    out += ["", "## Sections", "", "| section | status | seconds | note |", "|---|---|---:|---|"]
    for name, info in (results.get("sections") or {}).items():
        out.append(f"| {name} | {info.get('status', '?')} | {info.get('seconds', 0):.1f} | "
                   f"{_md(info.get('note', ''))} |")
    for section_lines in (peak.markdown_lines, selftest_step.markdown_lines, correctness.markdown_lines,
                          speed_md.markdown_lines,
                          variants_md.markdown_lines, decode_md.markdown_lines, models_md.markdown_lines,
                          ring.markdown_lines, memory.markdown_lines, correctness.sanitizer_markdown_lines):
        out += section_lines(results)
    return "\n".join(out) + "\n"


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
    for key in ("speed", "variants"):   # the variants' rows have the sweep's point structure
        if results.get(key):
            speed_md.add_ratios(results[key])
    if results.get("decode"):
        decode_md.add_varlen_ratios(decode_md.add_bandwidth(results["decode"]))
    if results.get("models"):
        models_md.add_rates(results["models"])
    if results.get("ring"):
        ring.add_ratios(results["ring"])
    files = {"json": None, "markdown": None, "plots": []}
    notes = results.setdefault("report_notes", [])
    try:
        files["plots"] += [str(p) for p in speed_md.plot(results, out_dir)]
        files["plots"] += [str(p) for p in memory.plot(results, out_dir)]
    except Exception as exc:  # noqa: BLE001 - plots are a convenience; numbers are in the JSON
        notes.append(f"plots not written: {type(exc).__name__}: {exc}")
    md_path = out_dir / MD_NAME
    md_path.write_text(markdown(results))
    files["markdown"] = str(md_path)
    results["files"] = {"json": str(out_dir / JSON_NAME), "markdown": str(md_path), "plots": files["plots"]}
    files["json"] = str(write_json(results, out_dir))
    return files

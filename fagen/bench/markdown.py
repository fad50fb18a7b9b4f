"""Text pieces the sections' text modules share (report, and each section's markdown): Markdown
cells and tables, and the short table's skip and sanity notes."""

from __future__ import annotations

import math


def finite(value) -> float | None:
    """A measured number, or None for a missing, non-numeric or non-finite one."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def skip_text(cell: dict, limit: int) -> str:
    """A skipped cell's reason for the short table, at most `limit` characters."""
    reason = str(cell.get("skipped", "did not run"))
    for prefix in ("skipped: ", "NotAvailable: "):
        reason = reason[len(prefix):] if reason.startswith(prefix) else reason
    text = f"skipped: {reason}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def sanity_text(section: dict, labels: dict | None = None) -> str:
    """The section's sanity check in a few words: ok, not run, or which checks failed."""
    sanity = section.get("sanity") or {}
    if not sanity:
        return "sanity not run"
    bad = [(labels or {}).get(name, name) for name, r in sanity.items() if not r.get("ok")]
    return "SANITY FAILED: " + ", ".join(bad) if bad else "sanity ok"


def md(text) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def sanity_table(title: str, first_column: str, rows: dict, note_keys: tuple = ("error", "bwd_error")) -> list[str]:
    """A sanity check's table: per row, ok, the kernel's and bf16 torch's forward error against
    fp32 torch, the gradients' when checked, and a note (the first of `note_keys` present)."""
    out = ["", f"### {title}", "",
           f"| {first_column} | ok | fwd err | bf16 torch fwd err | dq/dk/dv err (bf16 torch) | note |",
           "|---|---|---:|---:|---|---|"]
    for label, r in rows.items():
        grads = " / ".join(f"{r[g + '_err']:.2e} ({r[g + '_torch_err']:.2e})"
                           for g in ("dq", "dk", "dv") if g + "_err" in r) or "-"
        note = next((r[key] for key in note_keys if r.get(key)), "")
        out.append(f"| {label} | {r.get('ok')} | {r.get('fwd_err', float('nan')):.2e} | "
                   f"{r.get('fwd_torch_err', float('nan')):.2e} | {grads} | {md(note)} |")
    return out

"""Text pieces the sections' text modules share (report, and each section's markdown): Markdown
cells, a section's heading, its sanity and not-run tables, the systems in table order, and the
short table's skip and sanity notes."""

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


def heading(title: str, intro: str, note=None) -> list[str]:
    """A section's opening in results.md: its heading, its paragraph, and its note when it has one."""
    return ["", f"## {title}", "", intro] + (["", f"Note: {md(note)}"] if note else [])


def in_order(names, order) -> list[str]:
    """`names` in the plan's system order (unknown ones last), whatever order they ran in."""
    names = list(dict.fromkeys(names))
    return [n for n in order if n in names] + [n for n in names if n not in order]


def cells_in_order(results: dict, order, labels: dict, width: int | None = None):
    """(name, label, cell) per system with a cell in `results`, in the plan's order (unknown ones
    last); each label cut to `width` characters (a short table's column) when given."""
    for name in in_order(results, order):
        yield name, labels.get(name, name)[:width], results[name]


def skip_reasons(section: dict) -> dict[str, dict[str, int]]:
    """{system: {reason: number of cells}} for every cell of the section's points that did not run."""
    reasons: dict[str, dict[str, int]] = {}
    for point in section.get("points", []):
        for name, cell in point.get("results", {}).items():
            if "skipped" in cell:
                per = reasons.setdefault(name, {})
                per[cell["skipped"]] = per.get(cell["skipped"], 0) + 1
    return reasons


def unavailable_lines(section: dict) -> list[str]:
    """A line per system of the section that could not run on this machine, with its reason."""
    return [f"- {info.get('label', name)} not available: {md(info.get('reason'))}"
            for name, info in (section.get("systems") or {}).items() if not info.get("available")]


def not_run_lines(section: dict, title: str, labels: dict) -> list[str]:
    """The cells that did not run, per system and reason (under `title`), then the systems that
    could not run at all."""
    out = []
    reasons = skip_reasons(section)
    if reasons:
        out += ["", f"### {title}", ""]
        for name, per in reasons.items():
            for reason, count in per.items():
                out.append(f"- {labels.get(name, name)}: {md(reason)} ({count} cells)")
    return out + unavailable_lines(section)


def sanity_table(title: str, first_column, rows, note_keys: tuple = ("error", "bwd_error"),
                 reference: str = "bf16 torch") -> list[str]:
    """A sanity check's table: per row, ok, the kernel's and `reference`'s forward error against
    fp32 torch, the gradients' when checked, and a note (the first of `note_keys` present).
    `first_column` names the label column, or a tuple of names the label columns (then each row's
    label is a tuple too); `rows` is a dict {label: result}, or its items."""
    columns = first_column if isinstance(first_column, tuple) else (first_column,)
    out = ["", f"### {title}", "",
           "| " + " | ".join(columns) + f" | ok | fwd err | {reference} fwd err | dq/dk/dv err ({reference}) | note |",
           "|---" * len(columns) + "|---|---:|---:|---|---|"]
    for label, r in (rows.items() if isinstance(rows, dict) else rows):
        labels = " | ".join(f"{cell}" for cell in (label if isinstance(label, tuple) else (label,)))
        grads = " / ".join(f"{r[g + '_err']:.2e} ({r[g + '_torch_err']:.2e})"
                           for g in ("dq", "dk", "dv") if g + "_err" in r) or "-"
        note = next((r[key] for key in note_keys if r.get(key)), "")
        out.append(f"| {labels} | {r.get('ok')} | {r.get('fwd_err', float('nan')):.2e} | "
                   f"{r.get('fwd_torch_err', float('nan')):.2e} | {grads} | {md(note)} |")
    return out

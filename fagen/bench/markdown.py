"""Markdown pieces results.md shares between its sections (report, decode_report)."""

from __future__ import annotations


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

"""The ring section's text: its lines in the plan, its derived ratios, the short table and results.md.

From a config.RingConfig (`plan_lines`, which plan_text.describe calls) or the section's dict alone
(no torch); report.py calls `add_ratios`, `short_lines` and `markdown_lines`.
"""

from __future__ import annotations

from ..markdown import finite, heading, skip_text
from ..markdown import md as _md
from .config import PAIRS_AT_WORLD_ONE, RingConfig


def add_ratios(section: dict) -> dict:
    """Per layout: ring / plain and the pair kernels' sum / plain, of the median times."""
    plain = finite((section.get("plain") or {}).get("ms"))
    for cell in (section.get("layouts") or {}).values():
        for key in ("ring", "pairs"):
            ms = finite((cell.get(key) or {}).get("ms"))
            if ms is not None and plain:
                cell[f"{key}/plain"] = ms / plain
    return section


def _with_ratios(results: dict) -> dict | None:
    """The section with its ratios (add_ratios), or None when it did not run."""
    section = results.get("ring")
    return add_ratios(section) if section else None


def section_note(section: dict) -> str:
    add_ratios(section)
    parts = []
    for layout, cell in (section.get("layouts") or {}).items():
        equal = cell.get("equal") or {}
        verdict = "equal" if equal.get("ok") else ("NOT EQUAL" if "ok" in equal else "equality not run")
        ratio = cell.get("ring/plain")
        parts.append(f"{layout} {verdict}" + (f", ring / plain {ratio:.2f}" if ratio is not None else ""))
    return "; ".join(parts)


# -- the plan ------------------------------------------------------------------------------

def plan_lines(c: RingConfig) -> list[str]:
    if not c.enabled:
        return ["  ring: none in this plan"]
    links = ", ".join(f"{name} {gb:.0f} GB/s" for name, gb in c.links)
    pairs = ", ".join(f"{layout} {PAIRS_AT_WORLD_ONE.get(layout, '?')}" for layout in c.layouts)
    return [f"  ring: cap {c.cap_s:.0f} s; fagen.distributed.ring_attention in a world-1 process group (NCCL, "
            f"else gloo) on this GPU, {c.label}, layouts {', '.join(c.layouts)}",
            "    equality: unshard(ring) vs fagen.flash_attn_func, max abs error <= 2 x 2^-7 x max|out| "
            "(2 bf16 roundings)",
            f"    timing: ring forward, plain forward, and the step's pair kernels summed ({pairs}); "
            "ratios / plain (1: no launch or merge overhead)",
            f"    overlap MODEL, not measured: zigzag at W = {', '.join(map(str, c.model_worlds))}; compute per step "
            "= its pairs x a measured c x c pair (c = N / 2W); transfer = K/V block 2 B (N/W) Hk d x 2 bytes over "
            f"{links} (assumed: vendor specs, per direction)",
            f"    timed runs: {c.timed_runs()}"]


# -- the short table ------------------------------------------------------------------------

def _ms(cell: dict | None, key: str = "ms", digits: int = 3) -> str:
    value = finite((cell or {}).get(key))
    return f"{value:.{digits}f}" if value is not None else "-"


def _times(cell: dict, key: str) -> str:
    """"3.360 ms 1.05x" (its median, and over the plain op's), or "-"."""
    ms = _ms(cell.get(key))
    return "-" if ms == "-" else f"{ms} ms {_ms(cell, key + '/plain', 2)}x"


def _layout_line(layout: str, cell: dict) -> str:
    """One layout in a line: the equality, then ring and the pair kernels' sum, as ms and x plain."""
    equal = cell.get("equal") or {}
    verdict = "ok" if equal.get("ok") else ("FAILED" if "ok" in equal else "-")
    pairs = cell.get("pairs") or {}
    line = (f"{layout[:10]:<10} {verdict:<6} err {_sci(equal.get('max_err'), 1)} tol {_sci(equal.get('tol'), 1)}; "
            f"ring {_times(cell, 'ring')}; {pairs.get('count', '-')} pairs {_times(cell, 'pairs')}")
    skipped = [c for c in (equal, cell.get("ring") or {}, pairs) if "skipped" in c]
    return line + (f"; {skip_text(skipped[0], 50)}" if skipped else "")


def _model_lines(model: dict) -> list[str]:
    rows = model.get("rows") or []
    if not rows:
        return []
    links = model.get("links") or {}
    parts = []
    for row in rows:
        if finite(row.get("compute_ms")) is None:
            parts.append(f"W={row['world']} {skip_text(row, 27)}")
            continue
        parts.append(f"W={row['world']} {row['compute_ms']:.3f} | " + ", ".join(
            f"{row['links'][n]['transfer_ms']:.3f} ({row['links'][n]['overlap']:.2f})" for n in links))
    names = ", ".join(f"{name} {gb:.0f}" for name, gb in links.items())
    return [f"MODEL, not measured (zigzag step): compute ms | transfer ms (overlap) over {names} GB/s (assumed)",
            "  " + "; ".join(parts)]


def short_lines(results: dict) -> list[str]:
    section = _with_ratios(results)
    if section is None:
        return []
    config = section.get("config") or {}
    lines = [f"-- ring, world 1 ({section.get('backend') or 'no process group'}): {config.get('label', '')}; "
             f"plain {_ms(section.get('plain'))} ms"]
    if not section.get("layouts"):
        return lines + [f"  not run: {section.get('note') or 'no layouts'}"]
    lines += [_layout_line(layout, cell) for layout, cell in section["layouts"].items()]
    return lines + _model_lines(section.get("model") or {})


# -- results.md --------------------------------------------------------------------------------

def markdown_lines(results: dict) -> list[str]:
    section = _with_ratios(results)
    if section is None:
        return []
    config = section.get("config") or {}
    intro = (f"`fagen.distributed.ring_attention` in a single-rank process group "
             f"({section.get('backend') or 'none created'}), {_md(config.get('label', ''))}: the one ring step runs "
             "every chunk pair on this GPU, with no communication, so it must equal `fagen.flash_attn_func` (max abs "
             "error within 2 bf16 roundings of max|out|) and its kernels must add up to the plain kernel's time. "
             f"Plain forward: {_ms(section.get('plain'))} ms. Ratios / plain above 1 are the pair launches and the "
             "merge of partial results (`merge_attention`).")
    out = heading("Ring attention (context parallelism)", intro, section.get("note"))
    out += ["", "| layout | equal | max abs err | tolerance | ring ms | pair kernels | pairs ms | ring / plain | "
            "pairs / plain | note |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for layout, cell in (section.get("layouts") or {}).items():
        equal = cell.get("equal") or {}
        verdict = str(equal["ok"]) if "ok" in equal else "-"
        skipped = [c for c in (equal, cell.get("ring") or {}, cell.get("pairs") or {}) if "skipped" in c]
        note = skip_text(skipped[0], 400) if skipped else ""
        out.append(f"| {layout} | {verdict} | {_sci(equal.get('max_err'))} | {_sci(equal.get('tol'))} | "
                   f"{_ms(cell.get('ring'))} | {(cell.get('pairs') or {}).get('count', '-')} | "
                   f"{_ms(cell.get('pairs'))} | {_ms(cell, 'ring/plain', 2)} | {_ms(cell, 'pairs/plain', 2)} | "
                   f"{_md(note)} |")
    return out + _markdown_model(section.get("model") or {})


def _sci(value, digits: int = 2) -> str:
    return f"{value:.{digits}e}" if finite(value) is not None else "-"


def _markdown_model(model: dict) -> list[str]:
    rows = model.get("rows") or []
    if not rows:
        return []
    links = list(model.get("links") or {})
    figures = ", ".join(f"{name} {gb:.0f} GB/s" for name, gb in model["links"].items())
    out = ["", "### Overlap at W ranks (model, not measured)", "",
           "A zigzag ring of W ranks over the same sequence: per step each rank runs its chunk pairs (counted in "
           "full c × c blocks, c = N / 2W, a causal diagonal pair as half; from `step_blocks`) while the next K/V "
           "block, 2 × B × (N/W) × Hk × d × 2 bytes, is in flight. Compute per step = pairs × the measured time of "
           f"one full c × c pair call here; transfer = bytes / link bandwidth, assumed per direction: {figures} "
           "(vendor specs, not measured). Overlap = min(1, compute / transfer): 1 means the transfer hides "
           "under the kernels.", "",
           "| W | c | pairs per step | pair ms | compute ms | K/V MB | "
           + " | ".join(f"{n} ms | {n} overlap" for n in links) + " |",
           "|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * len(links)]
    skipped = []
    for row in rows:
        if finite(row.get("compute_ms")) is None:
            skipped.append(f"W={row['world']}: {_md(skip_text(row, 300))}")
            continue
        out.append(f"| {row['world']} | {row['chunk']} | {row['pair_equivalents']:.1f} | {row['pair_ms']:.3f} | "
                   f"{row['compute_ms']:.3f} | {row['kv_bytes'] / 1e6:.1f} | "
                   + " | ".join(f"{row['links'][n]['transfer_ms']:.3f} | {row['links'][n]['overlap']:.2f}"
                                for n in links) + " |")
    return out + (["", "Not modelled: " + "; ".join(skipped) + "."] if skipped else [])

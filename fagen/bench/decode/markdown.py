"""The decode section's text: its lines in the plan, its derived numbers, and its rows in the short
table and results.md.

From a config.DecodeConfig (`plan_lines`) or the section's dict alone (no torch); report.py
calls `short_lines` and `markdown_lines`. Decode cells carry their bytes and median time; the
bandwidth and its fraction of the copy bandwidth are derived here (`add_bandwidth`), as are the
varlen ratios fagen varlen / each system (`add_varlen_ratios`, of TFLOP/s: > 1 means fagen
varlen is faster).
"""

from __future__ import annotations

from ..markdown import cells_in_order, finite, in_order, sanity_table, sanity_text, skip_text, unavailable_lines
from ..markdown import md as _md
from ..sizes import short_seqlen
from ..speed.config import PASS_LABELS
from ..speed.markdown import PASS_SHORT
from .config import DECODE_LABELS, DECODE_SYSTEMS, VARLEN_SYSTEMS

LABEL_WIDTH = 14   # "SDPA efficient"


def bandwidth_tb_per_s(nbytes: float, ms: float) -> float:
    """Bytes moved per second, in TB/s (10^12 bytes)."""
    if ms <= 0:
        raise ValueError(f"time must be positive, got {ms} ms")
    return nbytes / (ms * 1e-3) / 1e12


def _points(section: dict, part: str) -> list[dict]:
    return [p for p in section.get("points", []) if p.get("part") == part]


def add_bandwidth(section: dict) -> dict:
    """Per timed decode cell: TB/s = bytes / median time, and that as a fraction of the copy
    bandwidth (both count every byte read or written)."""
    copy = finite((section.get("copy") or {}).get("tb_per_s"))
    for point in _points(section, "decode"):
        for cell in point.get("results", {}).values():
            ms, nbytes = finite(cell.get("ms")), finite(cell.get("bytes"))
            if ms is None or nbytes is None or ms <= 0:
                continue
            cell["tb_per_s"] = bandwidth_tb_per_s(nbytes, ms)
            cell["copy_fraction"] = cell["tb_per_s"] / copy if copy else None
    return section


def add_varlen_ratios(section: dict) -> dict:
    """Per varlen point: fagen varlen's TFLOP/s over each other system's (same FLOPs, so
    also the inverse ratio of their times)."""
    for point in _points(section, "varlen"):
        results = point.get("results", {})
        ours = finite((results.get("fagen_varlen") or {}).get("tflops"))
        point["ratios"] = {}
        for name, cell in results.items():
            rate = finite(cell.get("tflops"))
            if ours is not None and rate and name != "fagen_varlen":
                point["ratios"][f"fagen_varlen/{name}"] = ours / rate
    return section


def _derived(results: dict) -> dict | None:
    """The section with its bandwidths and varlen ratios, or None when it has neither points nor a
    graph row."""
    section = results.get("decode") or {}
    if not section.get("points") and not section.get("graph"):
        return None
    return add_varlen_ratios(add_bandwidth(section))


def section_note(section: dict) -> str:
    """One line for the sections table: each decode system's share of copy bandwidth, the
    varlen ratios, the sanity, and the time guard's count."""
    add_bandwidth(section)
    add_varlen_ratios(section)
    parts = []
    for point in _points(section, "decode"):
        shares = [f"{DECODE_LABELS.get(n, n)} {c['copy_fraction']:.0%}" for n, c in point["results"].items()
                  if finite(c.get("copy_fraction")) is not None]
        if shares:
            parts.append("decode, of copy bandwidth: " + ", ".join(shares))
    per_peer: dict[str, list[str]] = {}
    for point in _points(section, "varlen"):
        for key, ratio in point["ratios"].items():
            peer = DECODE_LABELS.get(key.split("/")[1], key)
            per_peer.setdefault(peer, []).append(f"{PASS_SHORT.get(point['pass'], point['pass'])} {ratio:.2f}")
    if per_peer:
        parts.append("fagen varlen / " + ", / ".join(f"{peer} {' '.join(r)}" for peer, r in per_peer.items()))
    if section.get("graph"):
        parts.append("CUDA graph: " + graph_text(section["graph"]))
    parts.append(sanity_text(section, DECODE_LABELS))
    if section.get("not_run"):
        parts.append(f"time guard: {section['not_run']} measurements not run")
    return "; ".join(parts)


def graph_text(row: dict) -> str:
    """The CUDA-graph row in a few words (the short table has room for little more): the replay
    equal to the eager step or not, and the two times; or why it did not run."""
    if "equal" not in row:
        return skip_text(row, 120)
    equal = row["equal"]
    verdict = "equal" if equal.get("ok") else f"NOT EQUAL (max err {equal.get('max_err')})"
    replay, eager = (finite((row.get(key) or {}).get("ms")) for key in ("replay", "eager"))
    if replay is None or eager is None:
        return f"{verdict}; {skip_text(row, 100)}" if "skipped" in row else verdict
    return f"{verdict}, {replay:.3f} ms vs eager {eager:.3f} ms ({replay / eager:.2f}x)"


# -- the plan ------------------------------------------------------------------------------

def plan_lines(c, fagen_kernels: int) -> list[str]:
    """The section (a config.DecodeConfig, and the fagen kernels it adds) in the plan's text."""
    if not c.enabled:
        return ["  decode: none in this plan"]
    lines = [f"  decode: cap {c.cap_s:.0f} s; fagen checked first against fp32 torch (2x bf16 torch's "
             "error)"]
    if c.decode_systems:
        lines.append(f"    decode step: {c.decode_label}, full caches; sanity at B={c.sanity_shape[0]} "
                     f"cache {short_seqlen(c.sanity_shape[1])}")
        lines.append("    systems: " + ", ".join(DECODE_LABELS[s] + _DECODE_CALLS.get(s, "").format(c=c)
                                                 for s in c.decode_systems))
        peers = []
        if any(s.startswith("sdpa") for s in c.decode_systems):
            peers.append(f"SDPA: (B, H, N, d) caches, enable_gqa where the backend takes it, else K/V expanded "
                         f"to {c.q_heads} heads beforehand ({c.group}x the bytes, counted)")
        if "flex" in c.decode_systems:
            peers.append(f"FlexAttention: torch.compile, enable_gqa, no block mask, run last, only with "
                         f">= {c.flex_start_s:.0f} s left")
        if peers:
            lines.append("    " + "; ".join(peers))
        lines.append(f"    bytes per step: K + V read (B N Hk d, 2 B each) + q + out = "
                     f"{c.decode_bytes() / 1e9:.2f} GB (K/V expanded to Hq heads: "
                     f"{c.decode_bytes(c.q_heads) / 1e9:.2f} GB); TB/s = bytes / median time, as a "
                     "fraction of the copy bandwidth (which counts read + write bytes alike)")
    if c.varlen_systems:
        batch, longest = c.padded_shape()
        lines.append(f"    varlen training: {c.varlen_label}; passes "
                     f"{', '.join(PASS_LABELS[p] for p in c.varlen_passes)}")
        lines.append(f"    document lengths (seed {c.seed}): {', '.join(map(str, c.document_lengths()))}")
        lines.append("    systems: " + ", ".join(DECODE_LABELS[s] + _VARLEN_CALLS[s].format(b=batch, n=longest)
                                                 for s in c.varlen_systems))
        lines.append(f"    TFLOP/s count the documents' causal FLOPs only "
                     f"({c.varlen_flops('fwd') / 1e9:.0f} GFLOP forward, x3.5 for both); "
                     "ratios fagen varlen / each")
    if c.graph_shape:
        lines.append(f"    CUDA graph: {c.graph_label}, causal; caches filled to seeded lengths; captured after a "
                     "warm-up, replayed with new cache_seqlens; output and caches against the same step run "
                     "eagerly (bit for bit); replay time against the eager step's")
    if c.mla_systems:
        lines.append(f"    absorbed MLA at B = {', '.join(map(str, c.mla_batches))}: {c.mla_label(c.mla_batches[0])}; "
                     f"systems {', '.join(DECODE_LABELS[s] for s in c.mla_systems)}; each credited with reading "
                     f"every cache row once ({c.mla_bytes(c.mla_batches[0]) / 1e9:.2f} GB at B = "
                     f"{c.mla_batches[0]}); FlexAttention's compile last, with the other's")
    lines.append(f"    timed runs: {c.timed_runs()}; fagen kernels to compile: {fagen_kernels}")
    return lines


# How the decode section's fagen systems and padded peers are called (formatted with the
# config `c`, or the padded batch's size b x n).
_DECODE_CALLS = {
    "fagen": " (flash_attn_with_kvcache, contiguous cache)",
    "fagen_paged": " (the same keys in pages of {c.page_size}, seeded random block table)",
    "fagen_fp8": " (the contiguous cache in e4m3, one descale per K/V head: half the cache's bytes)",
    "fagen_fp8_paged": " (the pages in e4m3)",
    "fagen_sm90": " (the contiguous cache on the sm90 family; compute capability 9.0)",
    "fagen_sm90_paged": " (the pages on the sm90 family; compute capability 9.0)",
}
_VARLEN_CALLS = {
    "fagen_varlen": " (flash_attn_varlen_func, packed)",
    "fagen_padded": " (flash_attn_func, causal, on B={b} x N={n} right-padded; no seqlens_k, which would "
                    "align each entry's diagonal to its own length)",
    "sdpa_padded": " (flash backend, else efficient; is_causal, B={b} x N={n})",
}


# -- the short table ------------------------------------------------------------------------

def short_lines(results: dict) -> list[str]:
    """The section's block of the short table: one row per decode system, one per varlen system."""
    section = _derived(results)
    if section is None:
        return []
    graph = section.get("graph")
    return _short_decode(section) + _short_varlen(section) + ([f"-- decode graph: {graph_text(graph)}"]
                                                               if graph else [])


def _short_decode(section: dict) -> list[str]:
    lines = []
    copy = finite((section.get("copy") or {}).get("tb_per_s"))
    for point in _points(section, "decode"):
        copy_text = f"copy {copy:.2f} TB/s" if copy else "copy not measured"
        lines += [f"-- decode {point['label']}; {copy_text}; {sanity_text(section, DECODE_LABELS)}",
                  f"{'system':<{LABEL_WIDTH}}     ms GB/step   TB/s of copy"]
        for name, label, cell in cells_in_order(point["results"], DECODE_SYSTEMS, DECODE_LABELS, LABEL_WIDTH):
            if finite(cell.get("tb_per_s")) is None:
                lines.append(f"{label:<{LABEL_WIDTH}} {skip_text(cell, 64)}")
                continue
            fraction = cell.get("copy_fraction")
            lines.append(f"{label:<{LABEL_WIDTH}} {cell['ms']:6.3f} {cell['bytes'] / 1e9:7.2f} {cell['tb_per_s']:6.2f} "
                         f"{f'{fraction:.0%}' if fraction is not None else '-':>7}"
                         + (" K/V expanded" if cell.get("expanded") else ""))
    return lines


def _short_varlen(section: dict) -> list[str]:
    points = {p["pass"]: p for p in _points(section, "varlen")}
    if not points:
        return []
    passes = list(points)
    first = points[passes[0]]
    names = in_order((n for p in points.values() for n in p["results"]), VARLEN_SYSTEMS)
    lines = [f"-- varlen {first['label']}; TFLOP/s of the documents' causal FLOPs",
             f"{'system':<{LABEL_WIDTH}}" + "".join(f" {PASS_SHORT.get(p, p) + ' ms':>7} TFLOP/s" for p in passes)
             + " | varlen/this " + " ".join(f"{PASS_SHORT.get(p, p):>4}" for p in passes)]
    for name in names:
        label = DECODE_LABELS.get(name, name)[:LABEL_WIDTH]
        cells = [points[p]["results"].get(name, {}) for p in passes]
        if all(finite(c.get("tflops")) is None for c in cells):
            lines.append(f"{label:<{LABEL_WIDTH}} {skip_text(cells[0], 64)}")
            continue
        timed = "".join(f" {c['ms']:7.3f} {c['tflops']:7.1f}" if finite(c.get("tflops")) is not None
                        else f" {'-':>7} {'-':>7}" for c in cells)
        ratios = [points[p]["ratios"].get(f"fagen_varlen/{name}") for p in passes]
        ratio_text = " ".join(f"{r:4.2f}" if r is not None else f"{'-':>4}" for r in ratios)
        backend = next((c["backend"] for c in cells if c.get("backend")), None)
        lines.append(f"{label:<{LABEL_WIDTH}}{timed} | {'':11} {ratio_text}" + (f" ({backend})" if backend else ""))
    return lines


# -- results.md --------------------------------------------------------------------------------

def markdown_lines(results: dict) -> list[str]:
    section = _derived(results)
    if section is None:
        return []
    out = ["", "## Decode and varlen training", ""]
    if section.get("note"):
        out += [f"Note: {_md(section['note'])}", ""]
    return (out + _markdown_decode(section) + _markdown_varlen(section) + _markdown_graph(section.get("graph"))
            + _markdown_sanity(section))


def _markdown_graph(row: dict | None) -> list[str]:
    if not row:
        return []
    out = [f"### Decode step in a CUDA graph: {_md(row.get('label', ''))}", "",
           "One serving step (append one token with rotary, split-KV, combine) captured with torch.cuda.graph "
           "after a warm-up, then replayed after cache_seqlens changed in place, as a server advances its "
           "lengths: its output and both caches against the same step run eagerly on copies of the caches "
           "(bit for bit: the same kernels and split count). Times are CUDA-event medians per call; the eager "
           "step's include the gaps while the host issues its launches one by one."]
    if "equal" not in row:
        return out + ["", f"Not run: {_md(skip_text(row, 400))}", ""]
    equal = row["equal"]
    out += ["", f"Replay equals eager: **{bool(equal.get('ok'))}** (largest difference of the output: "
                f"{equal.get('max_err')})", "", "| step | ms | host ms per call | note |", "|---|---:|---:|---|"]
    for key, label in (("replay", "graph replay"), ("eager", "eager step")):
        cell = row.get(key) or {}
        ms, host = finite(cell.get("ms")), finite(cell.get("host_ms"))
        out.append(f"| {label} | {f'{ms:.3f}' if ms is not None else '-'} | "
                   f"{f'{host:.3f}' if host is not None else '-'} | {_md(skip_text(row, 400)) if ms is None else ''} |")
    ratio = finite(row.get("replay/eager"))
    return out + (["", f"Replay / eager: **{ratio:.2f}**"] if ratio is not None else []) + [""]


def _markdown_decode(section: dict) -> list[str]:
    copy = section.get("copy") or {}
    out = []
    for point in _points(section, "decode"):
        tb = finite(copy.get("tb_per_s"))
        out += [f"### Decode step: {point['label']}", "",
                f"Memory-bound, so the figure that matters is the share of the copy bandwidth. Bytes counted: "
                f"{_md(section.get('bytes_note', ''))}. Copy bandwidth: "
                + (f"**{tb:.2f} TB/s**, {_md(copy.get('source', ''))}." if tb else f"{_md(copy.get('source', '-'))}.")
                + " A step is nearly all reads, and a read stream may run a little faster than a copy, so a "
                "share near or just above 100% is the ceiling, not an error."
                + " SDPA with enable_gqa is credited with the bytes the step needs, though a backend may move "
                "more (the math backend repeats K/V to every query head inside the call); a peer given K/V "
                "expanded beforehand is counted with the expanded bytes.", "",
                "| system | ms | GB moved | TB/s | of copy | K/V heads read | note |",
                "|---|---:|---:|---:|---:|---:|---|"]
        for name, label, cell in cells_in_order(point["results"], DECODE_SYSTEMS, DECODE_LABELS):
            if finite(cell.get("tb_per_s")) is None:
                out.append(f"| {label} | - | - | - | - | - | {_md(skip_text(cell, 400))} |")
                continue
            fraction = cell.get("copy_fraction")
            note = "" if cell.get("gqa") in ("native", "enable_gqa") else cell.get("gqa", "")
            out.append(f"| {label} | {cell['ms']:.3f} | {cell['bytes'] / 1e9:.2f} | {cell['tb_per_s']:.2f} | "
                       f"{f'{fraction:.0%}' if fraction is not None else '-'} | {cell.get('kv_heads_read', '-')}"
                       f" ({cell.get('gqa', '')}) | {_md(note)}{' host-bound' if cell.get('host_bound') else ''} |")
        out.append("")
    return out


def _markdown_varlen(section: dict) -> list[str]:
    points = _points(section, "varlen")
    if not points:
        return []
    config = section.get("config") or {}
    batch, longest = (config.get("padded") or ["?", "?"])[:2]
    out = [f"### Varlen training: {points[0]['label']}", "",
           f"Document lengths: {', '.join(map(str, config.get('lengths', [])))}; the padded systems run "
           f"B = {batch} x N = {longest}. TFLOP/s count only the documents' causal FLOPs "
           "(sum of 4·L²·d·H / 2 forward, 3.5× for forward + backward), so padding shows as a lower rate. "
           "Ratios are fagen varlen / each (of TFLOP/s).", "",
           "| pass | system | ms | TFLOP/s | fagen varlen / this | note |", "|---|---|---:|---:|---:|---|"]
    for point in points:
        for name, label, cell in cells_in_order(point["results"], VARLEN_SYSTEMS, DECODE_LABELS):
            if finite(cell.get("tflops")) is None:
                out.append(f"| {PASS_SHORT.get(point['pass'], point['pass'])} | {label} | - | - | - | "
                           f"{_md(skip_text(cell, 400))} |")
                continue
            ratio = point.get("ratios", {}).get(f"fagen_varlen/{name}")
            note = f"backend: {cell['backend']}" if cell.get("backend") else ""
            out.append(f"| {PASS_SHORT.get(point['pass'], point['pass'])} | {label} | {cell['ms']:.3f} | "
                       f"{cell['tflops']:.1f} | {f'{ratio:.2f}' if ratio is not None else '-'} | {_md(note)} |")
    return out + [""]


def _markdown_sanity(section: dict) -> list[str]:
    sanity = section.get("sanity") or {}
    out = unavailable_lines(section)
    if sanity:
        out += sanity_table("Sanity of fagen's decode and varlen calls (small problem vs fp32 torch)", "system",
                            {DECODE_LABELS.get(name, name): r for name, r in sanity.items()},
                            note_keys=("error", "bwd_error", "shape"))
    return out

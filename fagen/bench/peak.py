"""The peak section: the ceilings the other sections are read against, measured in this run.

The matmul peak (8192^3 bf16 torch.matmul, TFLOP/s) and the device copy's bandwidth (read + write
bytes, TB/s; the decode section's steps are shares of it). Its reserve is the Plan's own field
(peak_reserve_s). The text works from the results dict alone (no torch).
"""

from __future__ import annotations


def run_peak() -> dict:
    from .timing import measure_copy_bandwidth, measure_matmul_peak

    peak = {"matmul": measure_matmul_peak(), "copy": measure_copy_bandwidth()}
    return {**peak, "note": f"{peak['matmul']['tflops']:.0f} TFLOP/s, {peak['copy']['tb_per_s']:.2f} TB/s"}


def header_line(results: dict) -> str:
    """The short table's first line: the GPU and its measured ceilings."""
    matmul = (results.get("peak") or {}).get("matmul")
    copy = (results.get("peak") or {}).get("copy")
    device = (results.get("meta") or {}).get("device", "?")
    peak = f"matmul peak {matmul['tflops']:.0f} TFLOP/s ({matmul['what']})" if matmul else "matmul peak: not measured"
    if copy:
        peak += f"; copy {copy['tb_per_s']:.2f} TB/s"
    return f"== fagen GPU check on {device}: {peak}"


def markdown_lines(results: dict) -> list[str]:
    peak = results.get("peak") or {}
    if not peak:
        return []
    out = ["", "## Ceilings measured in this run", ""]
    if peak.get("matmul"):
        out.append(f"- {peak['matmul']['what']}: **{peak['matmul']['tflops']:.1f} TFLOP/s**")
    if peak.get("copy"):
        out.append(f"- {peak['copy']['what']}: **{peak['copy']['tb_per_s']:.2f} TB/s** (read + write)")
    return out

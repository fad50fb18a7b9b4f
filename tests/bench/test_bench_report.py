"""The report and the run around it: results.json, results.md, the plots, the short table within
what the device tool returns, the summary, and a run with no GPU or stopped by SIGTERM."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fagen.bench import report
from fagen.bench.gpu_check import run_gpu_check
from fagen.bench.plan import full_plan, quick_plan

from bench_stand_ins import REPO
from bench_synthetic import (SYNTHETIC_RING_TABLE, synthetic_decode, synthetic_models, synthetic_results,
                             synthetic_ring, synthetic_variants)


def test_report_writes_json_markdown_and_plots(tmp_path):
    results = synthetic_results()
    files = report.write_report(results, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    point = data["speed"]["points"][0]
    assert point["best_peer"] == "sdpa_cudnn"
    assert point["ratios"]["fagen_v2/best"] == pytest.approx(0.4)
    assert point["ratios"]["fagen_v2/sdpa_flash"] == pytest.approx(0.5)
    assert point["ratios"]["fagen_v1/best"] == pytest.approx(0.2)
    md = (tmp_path / "results.md").read_text()
    assert "| bf16 | 128 | no | 1k | 16 | 100.0 | 50.0 | 200.0 | 250.0 | oom | - | 0.40 (SDPA cuDNN) | 0.20 |" in md
    assert "FlexAttention: not available: triton does not import (12 cells)" in md
    assert "**790.0 TFLOP/s**" in md and "40 passed" in md
    pytest.importorskip("matplotlib")
    names = sorted(Path(p).name for p in files["plots"])
    assert names == ["memory.png", "speed_bwd.png", "speed_fwd.png", "speed_fwd_bwd.png"]
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back


def test_short_table_fits_the_returned_output():
    table = report.short_table(synthetic_results())
    assert "matmul peak 790 TFLOP/s" in table
    assert "pass    N |  v2  v1 fla cdn mth | v2/best" in table  # flex never ran: no column
    assert "fwd    1k | 100  50 200 250 oom | 0.40 cdnn" in table
    assert "f+b    2k |" in table
    # The full plan's table must fit in the 12,000 characters the device tool returns.
    plan = full_plan()
    points = [{"pass": p, "dtype": c.dtype, "head_dim": c.head_dim, "causal": c.causal, "seqlen": n,
               "batch": plan.batch(n), "heads": plan.heads(c.head_dim), "flops": 1.0,
               "results": {s: {"tflops": 555.5} for s in plan.systems}}
              for c in plan.configs() for n in plan.seqlens for p in plan.passes]
    big = report.short_table({"speed": {"points": points}, "meta": {"device": "NVIDIA H200"}})
    assert len(big) < 9_500
    # With the variants' rows too, 2,200 characters are left for the summary printed before it.
    variants = synthetic_variants()
    for point in variants["points"]:
        point["results"] = {s: {"tflops": 555.5} for s in point["results"]}
    both = report.short_table({"speed": {"points": points}, "variants": variants, "meta": {"device": "NVIDIA H200"}})
    assert both.startswith(big) and both.count("\n") == big.count("\n") + 2 + len(variants["points"])
    assert len(both) < 9_800


def test_the_short_table_with_every_section_still_fits_the_returned_output():
    plan = full_plan()
    points = [{"pass": p, "dtype": c.dtype, "head_dim": c.head_dim, "causal": c.causal, "seqlen": n,
               "batch": plan.batch(n), "heads": plan.heads(c.head_dim), "flops": 1.0,
               "results": {s: {"tflops": 555.5} for s in plan.systems}}
              for c in plan.configs() for n in plan.seqlens for p in plan.passes]
    results = {"speed": {"points": points}, "variants": synthetic_variants(), "decode": synthetic_decode(),
               "models": synthetic_models(), "ring": synthetic_ring(), "meta": {"device": "NVIDIA H200"}}
    table = report.short_table(results)
    assert table.endswith(SYNTHETIC_RING_TABLE)
    # The whole table still comes back in the device tool's last 12,000 characters (the summary
    # printed before it is cut first; results.md holds it whole).
    assert len(table) < 11_750


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_without_a_gpu_writes_what_it_knows(tmp_path):
    lines = []
    code = run_gpu_check(quick_plan(), tmp_path, log=lines.append)
    assert code == 2
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["sections"]["setup"]["status"] == "error"
    assert "no CUDA GPU" in data["sections"]["setup"]["note"]
    assert (tmp_path / "results.md").exists()


def test_sigterm_stops_the_run_and_still_writes_the_report(tmp_path):
    """The wrapper's hard timeout sends SIGTERM: the run stops where it is,
    writes results.json/results.md from what it has, and exits 124."""
    script = (
        "import sys, time\n"
        "from fagen.bench import gpu_check\n"
        "from fagen.bench.plan import quick_plan\n"
        "gpu_check.found_versions = lambda: time.sleep(60) or {}\n"
        f"sys.exit(gpu_check.run_gpu_check(quick_plan(), {str(tmp_path)!r}))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # wait until the run is inside its first section
        if line.startswith("== setup"):
            break
    proc.terminate()
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 124, output
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["stopped"].startswith("stopped from outside")
    assert (tmp_path / "results.md").exists()
    assert "== fagen GPU check" in output  # the short table is still printed last


def test_the_summary_names_the_driver_and_nvrtc():
    from fagen.bench import gpu_check, report

    meta = {"device": "NVIDIA H200", "capability": "sm_90", "cuda": "13.0",
            **gpu_check._toolchain_meta("sm_90")}
    assert meta["nvrtc_target"] == "sm_90" and meta["driver"]
    first = report.summary_lines({"meta": meta, "sections": {}})[0]
    assert first.startswith("toolchain: driver ") and f"NVRTC {meta['nvrtc']}" in first and "sm_90" in first
    assert "NVRTC" in gpu_check.toolchain_line(meta)

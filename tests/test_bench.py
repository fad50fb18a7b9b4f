"""The GPU check's CPU-side contract: the plan, the FLOP count, the report,
failing soft, and the time guard. (The GPU run itself is `python -m fagen.bench
gpu-check`; its measurements need a GPU and are not asserted here.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fagen.bench import report
from fagen.bench.correctness import parse_pytest_summary, parse_sanitizer
from fagen.bench.flops import attention_flops, tflops
from fagen.bench.gpu_check import run_gpu_check
from fagen.bench.peers import System, failure_reason
from fagen.bench.plan import Plan, full_plan, quick_plan
from fagen.bench.sweep import GUARD_REASON, run_speed_sweep, torch_attention
from fagen.bench.timing import Budget, Deadline, Timing, repeats_for

REPO = Path(__file__).resolve().parents[1]


# -- the plan and --dry-run -------------------------------------------------------------

def test_full_plan_is_the_papers_setup():
    plan = full_plan()
    assert plan.seqlens == (512, 1024, 2048, 4096, 8192, 16384)
    assert [plan.batch(n) * n for n in plan.seqlens] == [16384] * 6
    assert (plan.heads(64), plan.heads(128)) == (32, 16)
    assert plan.timed_runs() == 8 * 6 * 3 * 7
    assert max(plan.memory.seqlens) == 65536
    assert plan.estimate_seconds()["total"] < 480  # the 8 minutes
    assert quick_plan().timed_runs() < plan.timed_runs() / 5


def test_dry_run_prints_the_plan_and_exits_zero(tmp_path):
    env = dict(os.environ, FAGEN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "fagen.bench", "gpu-check", "--dry-run"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert f"timed runs: {full_plan().timed_runs()}" in out
    for needle in ("sections, in order: setup, precompile, peak, correctness, sanitizers, speed, "
                   "memory, report", "fagen v2, fagen v1, SDPA flash, SDPA cuDNN, SDPA efficient, "
                   "SDPA math, FlexAttention", "[     ok] compile one fagen variant: fa2_d128_causal_bf16 for sm_90",
                   "[     ok] fagen flash_attn_func", "dry run: ok"):
        assert needle in out


def test_main_runs_by_path_from_elsewhere(tmp_path):
    """No install step: the entry point finds fagen in the tree it lives in."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(REPO / "fagen" / "bench" / "__main__.py"), "gpu-check", "--help"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "--dry-run" in run.stdout and "--quick" in run.stdout


# -- FLOPs ------------------------------------------------------------------------------

def test_flop_formula():
    shape = dict(batch=2, heads=3, seqlen=1024, head_dim=64)
    forward = 4 * 1024 * 1024 * 64 * 3 * 2
    assert attention_flops("fwd", causal=False, **shape) == forward
    assert attention_flops("bwd", causal=False, **shape) == 2.5 * forward
    assert attention_flops("fwd_bwd", causal=False, **shape) == 3.5 * forward
    for pass_ in ("fwd", "bwd", "fwd_bwd"):
        assert attention_flops(pass_, causal=True, **shape) == attention_flops(pass_, causal=False, **shape) / 2
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        attention_flops("backward", causal=False, **shape)
    plan = full_plan()
    config = plan.configs()[0]  # bf16 d=128 non-causal
    assert plan.flops("fwd", config, 16384) == 4 * 16384**2 * 128 * 16 * 1


def test_repeats_and_budget_deadlines():
    assert repeats_for(10.0, target_ms=30, min_repeats=3, max_repeats=20) == 3
    assert repeats_for(0.1, target_ms=30, min_repeats=3, max_repeats=20) == 20
    now = [100.0]
    budget = Budget(60.0, clock=lambda: now[0])
    now[0] = 110.0
    assert budget.remaining() == 50.0
    assert budget.deadline(reserve_s=20.0).remaining() == 30.0   # end 160 - 20 = 140
    assert budget.deadline(reserve_s=20.0, cap_s=5.0).remaining() == 5.0
    late = budget.deadline(reserve_s=55.0)
    assert late.expired()


# -- the sweep, failing soft ---------------------------------------------------------------

class Exact(System):
    """A fagen stand-in: fp32 attention rounded to the input dtype."""

    def __init__(self, name="fagen_v2", is_fagen=True, scale=1.0):
        self.name, self.is_fagen, self.scale, self.calls = name, is_fagen, scale, 0

    def forward(self, q, k, v, causal):
        self.calls += 1
        return (torch_attention(q, k, v, causal, torch.float32) * self.scale).to(q.dtype)


class Raises(System):
    name = "sdpa_flash"

    def __init__(self):
        self.calls = 0

    def forward(self, q, k, v, causal):
        self.calls += 1
        raise RuntimeError("no kernel image is available for execution on the device")


class NoBackward(Exact):
    def forward(self, q, k, v, causal):
        return super().forward(q, k, v, causal).detach()


class OutOfMemoryAbove(Exact):
    def __init__(self, limit):
        super().__init__("sdpa_math", is_fagen=False)
        self.limit = limit

    def forward(self, q, k, v, causal):
        if q.shape[1] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return super().forward(q, k, v, causal)


class Unavailable(Exact):
    def __init__(self):
        super().__init__("flex", is_fagen=False)

    def unavailable_reason(self):
        return "triton is not installed"


def fake_timer(fn, **kwargs):
    fn()  # run the real code path once (autograd included)
    return Timing(median_ms=2.0, min_ms=1.9, max_ms=2.2, repeats=3, host_ms=0.1)


TINY = Plan(name="tiny", dtypes=("bf16",), head_dims=(16,), causal=(False,), seqlens=(32, 64, 128),
            tokens_per_batch=128, hidden_dim=32, sanity_shape=(1, 48, 2))


def sweep(systems, deadline=None):
    return run_speed_sweep(TINY, systems, deadline or Deadline(float("inf")), device="cpu",
                           timer=fake_timer, log=lambda line: None)


def cell(section, system, pass_, seqlen):
    point = next(p for p in section["points"] if p["pass"] == pass_ and p["seqlen"] == seqlen)
    return point["results"][system]


def test_a_peer_that_raises_is_recorded_as_skipped_with_its_reason():
    good, bad = Exact(), Raises()
    section = sweep([good, bad, NoBackward("fagen_v1"), OutOfMemoryAbove(64), Unavailable()])
    assert section["status"] == "ok"
    # Every cell of the good system ran and its rate is flops / 2 ms.
    for point in section["points"]:
        assert point["results"]["fagen_v2"]["tflops"] == pytest.approx(point["flops"] / 2e-3 / 1e12)
    first = cell(section, "sdpa_flash", "bwd", 32)["skipped"]
    assert first == "RuntimeError: no kernel image is available for execution on the device"
    # Sticky for the rest of the panel: the failing forward is not retried.
    assert cell(section, "sdpa_flash", "fwd", 128)["skipped"].endswith("(as at N=32)")
    assert bad.calls == 1
    # A system without autograd keeps its forward number and skips the rest.
    assert "tflops" in cell(section, "fagen_v1", "fwd", 64)
    assert "has no backward" in cell(section, "fagen_v1", "bwd", 64)["skipped"]
    # Out of memory at one length skips the longer ones.
    assert "tflops" in cell(section, "sdpa_math", "fwd_bwd", 64)
    assert cell(section, "sdpa_math", "fwd", 128)["skipped"] == "OOM"
    assert section["systems"]["flex"] == {"label": "FlexAttention", "available": False,
                                         "reason": "triton is not installed"}
    assert cell(section, "flex", "fwd", 32)["skipped"] == "not available: triton is not installed"


def test_sanity_flags_a_fast_but_wrong_fagen_kernel():
    section = sweep([Exact("fagen_v2"), Exact("fagen_v1", scale=1.05)])
    label = TINY.configs()[0].label
    right, wrong = section["sanity"]["fagen_v2"][label], section["sanity"]["fagen_v1"][label]
    assert right["ok"] and right["fwd_err"] <= right["fwd_torch_err"] * 2 + 1e-4 and "dq_err" in right
    assert not wrong["ok"]


def test_time_guard_stops_the_sweep_and_says_so():
    good = Exact()
    section = sweep([good], deadline=Deadline(0.0))
    assert good.calls == 0
    assert section["status"] == "partial" and "time guard" in section["note"]
    assert section["not_run"] == len(TINY.seqlens) * 3
    assert all(p["results"]["fagen_v2"]["skipped"] == GUARD_REASON for p in section["points"])


def test_a_system_too_slow_for_the_next_point_is_skipped():
    slow, fast = Exact("fagen_v1"), Exact("fagen_v2")

    def timer(fn, **kwargs):  # fagen_v1 takes 3 s per call, fagen_v2 2 ms
        fn()
        ms = 3000.0 if fn_owner[0] is slow else 2.0
        return Timing(median_ms=ms, min_ms=ms, max_ms=ms, repeats=3, host_ms=0.1)

    fn_owner = [None]
    original = slow.forward, fast.forward
    slow.forward = lambda *a: (fn_owner.__setitem__(0, slow), original[0](*a))[1]
    fast.forward = lambda *a: (fn_owner.__setitem__(0, fast), original[1](*a))[1]
    section = run_speed_sweep(TINY, [slow, fast], Deadline(float("inf")), device="cpu", timer=timer,
                              log=lambda line: None)
    assert "tflops" in cell(section, "fagen_v1", "fwd", 32)
    # Twice the flops at N=64: 6 s a call, times every warm-up and repeat of 3 passes > 20 s.
    assert cell(section, "fagen_v1", "fwd", 64)["skipped"].startswith("skipped: too slow (predicted 6.0 s")
    assert all("tflops" in cell(section, "fagen_v2", p, 128) for p in ("fwd", "bwd", "fwd_bwd"))


def test_failure_reason_is_one_line():
    assert failure_reason(torch.OutOfMemoryError("CUDA out of memory")) == "OOM"
    assert failure_reason(ValueError("a\n  b")) == "ValueError: a b"


# -- the report -------------------------------------------------------------------------------

def synthetic_results():
    rates = {"fagen_v2": 100.0, "fagen_v1": 50.0, "sdpa_flash": 200.0, "sdpa_cudnn": 250.0}
    points = []
    for causal in (False, True):
        for seqlen in (1024, 2048):
            for pass_ in ("fwd", "bwd", "fwd_bwd"):
                results = {name: {"ms": 1.0, "tflops": rate, "host_bound": False} for name, rate in rates.items()}
                results["sdpa_math"] = {"skipped": "OOM", "oom": True}
                results["flex"] = {"skipped": "not available: triton does not import"}
                points.append({"pass": pass_, "dtype": "bf16", "head_dim": 128, "causal": causal,
                               "seqlen": seqlen, "batch": 16384 // seqlen, "heads": 16, "flops": 1e12,
                               "results": results})
    return {
        "meta": {"device": "NVIDIA H200", "plan": "synthetic"},
        "sections": {"speed": {"status": "ok", "seconds": 12.0, "note": ""}},
        "peak": {"matmul": {"what": "torch.matmul 8192x8192x8192 bfloat16", "tflops": 790.0, "ms": 1.4},
                 "copy": {"what": "device copy of 2 GiB", "tb_per_s": 4.3, "ms": 1.0}},
        "correctness": {"status": "passed", "summary": "40 passed, 8 skipped in 30.0s", "failures": [],
                        "skips": {"no backward yet": 8}, "command": "pytest -m gpu"},
        "speed": {"status": "ok", "points": points, "systems": {}, "sanity": {}},
        "memory": {"config": {"dtype": "bf16", "head_dim": 128, "heads": 16, "batch": 1},
                   "points": [{"seqlen": n, "results": {
                       "fagen_v2": {"status": "ok", "fwd_bwd_peak_bytes": n * 1e5},
                       "sdpa_math": ({"status": "ok", "fwd_bwd_peak_bytes": n * n * 64.0} if n < 4096
                                     else {"status": "OOM"})}} for n in (1024, 2048, 4096)]},
    }


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
    assert "pass    N |   v2   v1 flsh cdnn math | v2/best" in table  # flex never ran: no column
    assert "fwd    1k |  100   50  200  250  oom | 0.40 cdnn" in table
    assert "f+b    2k |" in table
    # The full plan's table must fit in the 12,000 characters the device tool returns.
    plan = full_plan()
    points = [{"pass": p, "dtype": c.dtype, "head_dim": c.head_dim, "causal": c.causal, "seqlen": n,
               "batch": plan.batch(n), "heads": plan.heads(c.head_dim), "flops": 1.0,
               "results": {s: {"tflops": 555.5} for s in plan.systems}}
              for c in plan.configs() for n in plan.seqlens for p in plan.passes]
    big = report.short_table({"speed": {"points": points}, "meta": {"device": "NVIDIA H200"}})
    assert len(big) < 9_500


def test_summary_parsers():
    parsed = parse_pytest_summary("....F\n=== 1 failed, 10 passed, 2 skipped, 1 error in 3.21s ===\n")
    assert parsed["counts"]["failed"] == 1 and parsed["counts"]["passed"] == 10
    assert parsed["counts"]["skipped"] == 2 and parsed["counts"]["errors"] == 1
    assert parse_pytest_summary("no summary here")["summary"] == ""
    assert parse_sanitizer("memcheck", "========= ERROR SUMMARY: 0 errors")["errors"] == 0
    race = parse_sanitizer("racecheck", "RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)")
    assert (race["errors"], race["warnings"]) == (2, 1)


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
        "gpu_check._versions = lambda: time.sleep(60) or {}\n"
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


def test_a_kernel_fault_stops_the_sweep_with_a_note():
    class Faults(Exact):
        def forward(self, q, k, v, causal):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    after = Exact("sdpa_flash", is_fagen=False)
    section = sweep([Faults("fagen_v1", is_fagen=False), after])
    assert section["status"] == "error" and "CUDA context was lost at fagen v1" in section["note"]
    assert after.calls == 0  # nothing runs on a broken context


def test_sanitizer_runs_are_recorded_whatever_happens(tmp_path, monkeypatch):
    """With a stand-in compute-sanitizer that runs the script and prints a
    summary: on this GPU-less machine the script cannot finish, and the run is
    recorded as failed (not clean), with the summary parsed."""
    from fagen.bench.correctness import run_sanitizers

    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nshift 4\n\"$@\"\nstatus=$?\necho '========= ERROR SUMMARY: 0 errors'\nexit $status\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    section = run_sanitizers(REPO, timeout_s=60, tools=("memcheck",))
    run = section["runs"]["memcheck"]
    assert section["path"] == str(fake)
    assert run["summary"] == "ERROR SUMMARY: 0 errors" and run["errors"] == 0
    if torch.cuda.is_available():
        assert run["status"] == "clean"
    else:
        assert run["status"] == "failed" and not run["script_finished"]
        assert section["status"] == "problems"


def test_the_summary_names_the_driver_and_nvrtc():
    from fagen.bench import gpu_check, report

    meta = {"device": "NVIDIA H200", "capability": "sm_90", "cuda": "13.0",
            **gpu_check._toolchain_meta("sm_90")}
    assert meta["nvrtc_target"] == "sm_90" and meta["driver"]
    first = report.summary_lines({"meta": meta, "sections": {}})[0]
    assert first.startswith("toolchain: driver ") and f"NVRTC {meta['nvrtc']}" in first and "sm_90" in first
    assert "NVRTC" in gpu_check.toolchain_line(meta)
